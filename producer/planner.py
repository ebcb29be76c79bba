"""Planning a run: dataset -> chat template -> token ids and loss masks -> batches -> the plan in the store.

**The plan is streamed.** The dataset is read once, in order; its records are tokenised on every
core (``producer/tokenising.py``) and collected into windows of consecutive samples
(:data:`PLAN_WINDOWS`). Each window is sorted by length and cut into token-budget batches on its
own (``producer/batching.py``), written to the store (batch files, sample rows, then the window's
record: ``hsx/plan.py``) and handed to ``on_window``, which enqueues its batches, while the next
window is tokenised. The first batches reach the queue seconds after the start, whatever the
dataset's size, and the planner holds one window in memory. An interrupted plan resumes after the
last window written: the windows before are reused as they are, and the dataset is read on from
the record after them.

Everything that can be refused is refused here, before any model weights are loaded or any GPU
work is queued: unknown model, layer ids out of range, a batch budget smaller than one sample,
an unreachable store, a run id that exists with another config.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from itertools import islice
from pathlib import Path

import numpy as np

from hsx.errors import BadConfig, BadDataset, BadRecord
from hsx.layers import LayerSelection, layer_ids_from_draft_config, parse_layer_ids, select_layers
from hsx.layout import RUN_JSON, window_samples_key
from hsx.models import model_info
from hsx.plan import (BatchPlan, batch_id, batch_key, fail_planning_record, plan_complete, read_batch_list,
                      read_windows, start_planning_record)
from hsx.records import BatchSummary, Planning, PlanWindow, SampleRow, SkipCounts, Stats
from hsx.regen import PlannedConversation, RegenConfig, regen_plan_key
from hsx.runconfig import (DatasetOptions, LayersConfig, ModelConfig, RunConfig, SamplePolicy, TokenizerConfig, check_run,
                           check_run_id, claim_run)
from hsx.shard import Final, StoreDtype
from hsx.store import Store, exists, open_store
from producer.batching import cut_batches
from producer.datasets import (EXAMPLES_PER_REASON, Conversation, IdClaims, SkipCounter, _normalise, dataset_files,
                               id_scope, iter_conversations, parse_raw)
from producer.masks import (ADDED_TOKENS_IN_CONTENT, MIN_CONSECUTIVE_SUPERVISED, OVER_LENGTH_POLICIES,
                            SPECIAL_TOKENS_IN_CONTENT)
from producer.sources import Source, SourceOptions, open_source
from producer.tokenising import TokeniserSpec, Tokenisers, default_num_proc
from producer.words import plural
from settings import Settings


log = logging.getLogger(__name__)


@dataclass
class PlanOptions:
    """What the user asked for on the command line (None: take the settings' default)."""

    dataset: str
    model: str
    output: str | None = None
    layers: str | None = None
    preset: str | None = None
    final: str | None = None
    dflash_layers: int = 5
    draft_config: str | None = None
    draft_layer_convention: str = "output-of"
    max_length: int | None = None
    batch_tokens: int | None = None
    max_batch_samples: int | None = None
    limit: int | None = None
    run_id: str | None = None
    store_dtype: str = "bfloat16"
    #: Passed to the chat template when not None (Qwen3 reads it); None keeps the template's default.
    enable_thinking: bool | None = None
    #: Rows longer than max_length: "truncate" (cut, counted as truncated_samples) or "drop" (skipped too_long).
    over_length: str = "truncate"
    #: Plain-text records ({"text": ...}) become samples with every token supervised; else skipped text_not_allowed.
    allow_text: bool = False
    #: Special-token strings inside message content: "text" (plain text, the default) or "special"
    #: (special tokens, as runs before this option; for datasets that embed them on purpose).
    special_tokens_in_content: str = "text"
    #: Strings of added tokens that are not special (Qwen3's <think>) inside message content:
    #: "token" (their ids, as a serving engine tokenises the prompt; the default) or "text".
    added_tokens_in_content: str = "token"
    #: The command line that asked for the plan, recorded in plan/planning.json (status shows it when planning failed).
    command: str | None = None
    #: Of a Hugging Face dataset: the split and the subset (config name); None: its default.
    split: str | None = None
    subset: str | None = None
    #: Read the records in a seeded random order (needs seed).
    shuffle: bool = False
    seed: int | None = None
    #: A seeded random subset of this many records (needs seed).
    sample: int | None = None
    #: A Jinja chat template file that replaces the tokenizer's (SpecForge's --chat-template).
    chat_template: str | None = None
    #: Tokenising processes (None: HSX_PLAN_NUM_PROC, else the machine's cores). Does not change the plan.
    num_proc: int | None = None
    #: A regenerate run (``producer/regenerate.py``): the generation options (:class:`hsx.regen.RegenConfig`
    #: as a dict); None: an extraction run.
    regenerate: dict | None = None
    #: The dataset is a regenerate run: skip its answers cut at max_new_tokens.
    drop_unfinished: bool = False
    #: A regenerate run's batch budget, rows x (longest prompt + max_new_tokens) (``--regen-batch-tokens``;
    #: None: the settings' ``regen_batch_tokens``). ``batch_tokens`` stays the extraction's.
    regen_batch_tokens: int | None = None


@dataclass
class PlannedRun:
    """A planned run: where it is, its config, its batches and the planning stats."""

    run_store: Store
    root_store: Store
    config: RunConfig
    batches: list[BatchSummary]
    stats: dict
    reused: bool = False
    run_url: str = ""
    extras: dict = field(default_factory=dict)


#: Samples per window of the streamed plan, ``(first, largest)``: the first window is small, so the
#: first batches reach the queue seconds after the start; each next window is twice the one
#: before, up to the largest, where sorting within a window wastes about as little padding as
#: sorting the whole dataset (BENCHMARKS.md, "Planning"). Recorded (and hashed) in run.json.
PLAN_WINDOWS = (1024, 32768)
#: Below this many records (``--limit``, ``--sample``) or bytes of dataset, one process tokenises:
#: starting more (about 3 s each to import transformers and load the tokenizer) costs more than
#: they save. The plan is the same either way.
SMALL_PLAN_RECORDS = 2000
SMALL_PLAN_BYTES = 4 << 20
#: Threads that write a window's batch files.
WRITE_THREADS = 16
#: Seconds between two rewrites of ``plan/planning.json`` with the progress while a window fills.
PROGRESS_RECORD_S = 10.0
#: Seconds between two calls of ``on_window.tick(job)`` (when the hook has one: ``run``'s bars).
HOOK_TICK_S = 2.0


def window_samples(index: int, windows: tuple[int, int] | list[int] = PLAN_WINDOWS) -> int:
    """Samples in window ``index`` (0-based): ``first * 2**index``, at most ``largest``."""
    first, largest = int(windows[0]), int(windows[1])
    return min(largest, first << min(index, 40))


def build_config(opts: PlanOptions, settings: Settings, progress=None, *,
                 capture: bool = True) -> tuple[RunConfig, object, Source]:
    """Validate the request and build the run config; returns it with the loaded ChatTokeniser and the source.
    ``capture`` False (a regenerate run): no hidden states, so the layer options are neither checked
    nor recorded (``layers`` is the empty selection).

    The dataset is fingerprinted here (one read of its bytes, in parallel blocks:
    ``producer/sources.py``); nothing is written.

    Raises:
        BadConfig: any option is invalid (the message names it and says how to fix it).
        BadDataset: the dataset cannot be found or read.
    """
    # `is None`, not `or`: an explicit 0 must be refused below, not replaced by the default.
    max_length = settings.max_length if opts.max_length is None else opts.max_length
    batch_tokens = settings.batch_tokens if opts.batch_tokens is None else opts.batch_tokens
    max_batch_samples = settings.max_batch_samples if opts.max_batch_samples is None else opts.max_batch_samples
    if max_batch_samples < 1:
        raise BadConfig(f"max batch samples {max_batch_samples}: must be at least 1")
    if max_length < 8:
        raise BadConfig(f"--max-length {max_length}: must be at least 8 tokens")
    if batch_tokens < 1:
        raise BadConfig(f"--batch-tokens {batch_tokens}: must be a positive number of tokens per batch "
                        f"(rows x longest row, padding included; default {type(settings).model_fields['batch_tokens'].default:,})")
    if batch_tokens < max_length:
        raise BadConfig(
            f"--batch-tokens {batch_tokens} is smaller than --max-length {max_length}: a batch must hold at least one "
            f"full-length sample; raise --batch-tokens or lower --max-length"
        )
    if opts.store_dtype not in tuple(StoreDtype):  # fp8: float8 e4m3 + per-token float32 scales (hsx/fp8.py)
        raise BadConfig(f"--store-dtype {opts.store_dtype!r}: choose one of {', '.join(StoreDtype)}")
    if opts.limit is not None and opts.limit < 1:
        raise BadConfig(f"--limit {opts.limit}: must be a positive number of records")
    if opts.num_proc is not None and opts.num_proc < 1:
        raise BadConfig(f"--num-proc {opts.num_proc}: must be at least 1 process")
    if opts.over_length not in OVER_LENGTH_POLICIES:
        raise BadConfig(f"over_length {opts.over_length!r}: choose one of {', '.join(OVER_LENGTH_POLICIES)} "
                        "(--truncate or --drop-long)")
    if opts.special_tokens_in_content not in SPECIAL_TOKENS_IN_CONTENT:
        raise BadConfig(f"--special-tokens-in-content {opts.special_tokens_in_content!r}: choose one of "
                        f"{', '.join(SPECIAL_TOKENS_IN_CONTENT)}")
    if opts.added_tokens_in_content not in ADDED_TOKENS_IN_CONTENT:
        raise BadConfig(f"--added-tokens-in-content {opts.added_tokens_in_content!r}: choose one of "
                        f"{', '.join(ADDED_TOKENS_IN_CONTENT)}")
    if opts.run_id is not None:
        try:
            check_run_id(opts.run_id)
        except ValueError as exc:
            raise BadConfig(f"--run-id: {exc}") from None
    template_text = _chat_template_text(opts.chat_template)
    options = SourceOptions(split=opts.split, subset=opts.subset, shuffle=opts.shuffle, seed=opts.seed,
                            sample=opts.sample, drop_unfinished=opts.drop_unfinished)
    source = open_source(opts.dataset, options, cache_dir=settings.cache_dir)  # BadDataset early, before a model config
    info = model_info(opts.model, settings.cache_dir, trust_remote_code=settings.trust_remote_code)
    # A regenerate run captures nothing: its layers are none, whatever the layer options say (the
    # extraction chained after it checks them: check_extraction_layers), so no model is refused for them.
    layers = _layers(opts, info.num_layers) if capture else LayersConfig.model_validate(
        {**LayerSelection((), Final.NONE, None, info.num_layers).as_dict(),
         "notes": ["a regenerate run captures no hidden states: the extraction of its conversations has the layers"]})
    spec = TokeniserSpec(model=opts.model, cache_dir=str(settings.cache_dir), trust_remote_code=settings.trust_remote_code,
                         max_length=max_length, enable_thinking=opts.enable_thinking, over_length=opts.over_length,
                         special_tokens_in_content=opts.special_tokens_in_content, allow_text=opts.allow_text,
                         chat_template=template_text, added_tokens_in_content=opts.added_tokens_in_content)
    try:
        tokenizer, chat = spec.build()
    except BadRecord as exc:  # the template fails on the probe conversation (producer/masks.py)
        where = f"--chat-template {opts.chat_template!r}" if opts.chat_template else f"the chat template of {opts.model!r}"
        raise BadConfig(f"{where} cannot render a conversation ({exc.detail}): fix the template") from None
    config = RunConfig(
        model=ModelConfig.of(info),
        model_name=opts.model,
        layers=layers,
        max_length=max_length,
        batch_tokens=batch_tokens,
        max_batch_samples=max_batch_samples,
        store_dtype=StoreDtype(opts.store_dtype).value,
        tokenizer=TokenizerConfig(
            tokenizer_class=type(tokenizer).__name__,
            vocab_size=len(tokenizer),
            chat_template_sha256=chat.template_sha256,
            end_of_turn_ids=sorted(int(i) for i in chat.end_of_turn_ids),
            enable_thinking=opts.enable_thinking,
        ),
        sample_policy=SamplePolicy(over_length=opts.over_length, allow_text=opts.allow_text,
                                   min_consecutive_supervised=MIN_CONSECUTIVE_SUPERVISED),
        special_tokens_in_content=opts.special_tokens_in_content,
        added_tokens_in_content=opts.added_tokens_in_content,
        plan_windows=list(PLAN_WINDOWS),
        dataset_options=DatasetOptions(**options.identity()),
        dataset_fingerprint=source.fingerprint(),
        dataset_source=source.location(),
        dataset=source.describe(),
        chat_template_file=str(Path(opts.chat_template).resolve()) if opts.chat_template else None,
        limit=opts.limit,
    )
    config.run_id = opts.run_id or config.default_run_id(source.name)
    config.created_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return config, (spec, chat), source


def _layers(opts: PlanOptions, num_layers: int) -> LayersConfig:
    """The layers an extraction of ``opts`` captures on a model of ``num_layers`` decoder layers
    (``--layers`` / ``--preset`` / ``--draft-config`` / ``--final``). Raises BadConfig."""
    layer_ids = parse_layer_ids(opts.layers) if opts.layers is not None else None
    layer_source = None
    if opts.draft_config:
        if layer_ids is not None or opts.preset:
            raise BadConfig("--draft-config gives the layer ids: do not combine it with --layers or --preset")
        layer_ids, layer_source = layer_ids_from_draft_config(opts.draft_config, convention=opts.draft_layer_convention)
    final = opts.final
    if final is None and layer_source and "aux_hidden_state_layer_ids" in layer_source.rsplit(": ", 1)[-1]:
        final = "postnorm"  # an EAGLE-3 draft's ids: it trains on the final state too (the eagle3 preset's default)
    try:
        selection = select_layers(num_layers, layer_ids=layer_ids, preset=opts.preset, final=final,
                                  dflash_layers=opts.dflash_layers)
    except BadConfig as exc:
        if layer_source:  # say where the ids came from
            raise BadConfig(f"{exc} (ids read from {layer_source})") from None
        raise
    return LayersConfig.of(selection, source=layer_source)


def check_extraction_layers(opts: PlanOptions, settings: Settings) -> LayersConfig:
    """The layers the extraction of ``opts`` would capture, checked against the model's config
    (reads the model's config only): ``run DATASET --regenerate`` calls it before its regenerate
    stage, so that layer options the model cannot take are refused before any GPU work. Raises BadConfig."""
    info = model_info(opts.model, settings.cache_dir, trust_remote_code=settings.trust_remote_code)
    return _layers(opts, info.num_layers)


def _chat_template_text(path: str | None) -> str | None:
    """The text of a ``--chat-template`` file. Raises BadConfig for a missing or empty file."""
    if path is None:
        return None
    p = Path(path).expanduser()
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise BadConfig(f"--chat-template {path!r}: cannot read it ({exc}); give a Jinja chat template file") from None
    if not text.strip():
        raise BadConfig(f"--chat-template {path!r} is empty: give a Jinja chat template file")
    try:
        try:  # compiled as transformers renders chat templates ({% break %}, {% generation %}; unknown filters fail)
            from transformers.utils.chat_template_utils import _compile_jinja_template as compile_template
        except ImportError:
            from jinja2 import Environment

            compile_template = Environment(extensions=["jinja2.ext.loopcontrols"]).from_string
        compile_template(text)
    except Exception as exc:  # jinja2.TemplateSyntaxError, TemplateAssertionError
        raise BadConfig(f"--chat-template {path!r} is not a valid Jinja template: {exc}") from None
    return text


def _num_proc(opts: PlanOptions, settings: Settings, source: Source) -> int:
    """Tokenising processes: --num-proc, else HSX_PLAN_NUM_PROC, else the machine's cores; one for a small plan."""
    asked = opts.num_proc or settings.plan_num_proc
    if asked:
        return asked
    small = min(n for n in (opts.limit, opts.sample, source.total_records, 10**12) if n is not None)
    small_bytes = source.total_bytes is not None and source.total_bytes < SMALL_PLAN_BYTES
    return 1 if small < SMALL_PLAN_RECORDS or small_bytes else default_num_proc()


def tokenise_dataset(opts: PlanOptions, chat, skips: SkipCounter, progress=None):
    """Tokenise a whole dataset in this process (tests and benches; the planner streams it in windows).

    Returns (record ids, input ids, loss masks, truncated flags) of the samples, in dataset order;
    skipped records are counted in ``skips``.
    """
    record_ids, ids, masks, truncated = [], [], [], []
    for item in chat.encode_many(iter_conversations(opts.dataset, skips, limit=opts.limit, allow_text=opts.allow_text)):
        if isinstance(item, BadRecord):
            skips.add(item)
        else:
            record_ids.append(item.record_id)
            ids.append(item.input_ids)
            masks.append(item.loss_mask)
            truncated.append(item.truncated)
    return record_ids, ids, masks, truncated


def plan_run(opts: PlanOptions, settings: Settings, progress=None, on_window=None) -> PlannedRun:
    """Plan (or resume, or find the finished plan of) a run, streamed into the store one window at a time.

    ``on_window(job, batches)`` is called with each window's batch summaries (dicts) once they are
    in the store, in order, while later windows are tokenised: ``enqueue`` and ``run`` send them
    to the workers there. A resumed plan first calls it with the batches of the windows already
    written; a finished plan, once with all its batches.

    Same dataset and config, same run id (the run id names the dataset's bytes and the config:
    ``hsx/runconfig.py``). Nothing is written until the first window is tokenised: a dataset with
    no usable record, or a Ctrl-C before, leaves no run. Then ``run.json`` is claimed and
    ``plan/planning.json`` says who plans the run and how far it got. A failure from there on
    (Ctrl-C, a store error, the dataset changing) is recorded in ``plan/planning.json``; the same
    command later resumes after the last window written. ``plan/batches.json`` is written last.

    Raises:
        BadConfig, BadDataset: invalid request (nothing written).
        producer.sources.DatasetChanged: the dataset's bytes changed while they were planned.
        hsx.errors.RunConflict: the run id exists with another config (nothing written).
        hsx.errors.StoreError: the store is unreachable.
    """
    return prepare_plan(opts, settings, progress).run(progress, on_window)


def prepare_plan(opts: PlanOptions, settings: Settings, progress=None) -> "PlanJob":
    """Check the request, fingerprint the dataset and find the run; writes nothing.

    Raises what :func:`plan_run` raises before anything is written.
    """
    if opts.regenerate is not None:  # a regenerate run: the same plan, its batches answered (prepare_regenerate)
        return prepare_regenerate(opts, settings, progress)
    url = opts.output or settings.store_url
    made_root = _new_local_dir(url)
    root = open_store(url, settings)
    try:
        if exists(root, RUN_JSON):
            # --output takes the store root that holds runs; README examples write runs as ./out/<run_id>.
            raise BadConfig(f"--output {opts.output or settings.store_url!r} is a run (it holds run.json), not the store "
                            "root that runs are written under; a run here would be nested inside that one. Fix: give its "
                            "parent directory (e.g. --output ./out)")
        config, (spec, chat), source = build_config(opts, settings, progress)
        run_store = root.child(config.run_id)
        check_run(run_store, config)  # RunConflict before any work
    except BaseException:  # a refused request leaves no empty --output directory behind
        if made_root is not None:
            _remove_empty_dirs(made_root)
        raise
    job = PlanJob(opts, settings, root, run_store, config, spec, chat, source)
    job.made_root = made_root
    return job


def _remove_empty_dirs(top: Path) -> None:
    """Remove ``top`` and the directories under it if none of them holds a file (else leave all)."""
    import os

    try:
        if any(files for _, _, files in os.walk(top)):
            return
        for dirpath, _, _ in sorted(os.walk(top), key=lambda d: -len(d[0])):
            os.rmdir(dirpath)
    except OSError:
        pass


def _new_local_dir(url: str) -> Path | None:
    """The directory of a local store ``url`` that does not exist yet (opening the store makes it,
    and a plan that fails before writing anything removes it again: no empty output folder is
    left); None for S3 or an existing directory."""
    from hsx.storeurl import parse_store_url

    try:
        where = parse_store_url(url)
    except Exception:  # refused with its reason by open_store
        return None
    return Path(where.path) if where.is_local and not Path(where.path).exists() else None


@dataclass
class _Window:
    """Samples of the window being filled (the planner's memory: one window at a time)."""

    index: int
    first_sample: int
    first_batch: int
    record_ids: list = field(default_factory=list)
    ids: list = field(default_factory=list)
    masks: list = field(default_factory=list)
    truncated: list = field(default_factory=list)
    claimed_ids: list = field(default_factory=list)
    #: the scope (:func:`producer.datasets.id_scope`) of each of ``record_ids`` and ``claimed_ids``
    scopes: list = field(default_factory=list)
    claimed_scopes: list = field(default_factory=list)
    skips: SkipCounter = field(default_factory=SkipCounter)
    #: ``(fallback id, raw record)`` of each sample, when the job keeps them (:attr:`PlanJob.keep_records`).
    raws: list = field(default_factory=list)


class PlanJob:
    """One run being planned: :func:`prepare_plan` makes it, :meth:`run` streams the windows."""

    #: Keep each sample's raw record in its window, for :meth:`write_window_extra` (a regenerate plan
    #: stores the conversations themselves: :class:`RegenPlanJob`).
    keep_records = False

    def write_window_extra(self, store, window: "_Window", plans: list[BatchPlan]) -> None:
        """More files of a window, written after its batch files and before its record (so before any
        of its batches is enqueued). Nothing here; a regenerate plan writes its conversations."""

    def batch_costs(self, window: "_Window") -> np.ndarray | None:
        """What each sample of ``window`` costs in a batch's ``batch_tokens`` (int64 [N]); None: its
        length (an extraction batch's rows x longest row). A regenerate plan counts prompt + answer."""
        return None

    def __init__(self, opts, settings, root, run_store, config, spec, chat, source):
        self.opts, self.settings, self.root, self.run_store = opts, settings, root, run_store
        self.config, self.spec, self.chat, self.source = config, spec, chat, source
        self.run_url = run_store.url
        self.num_proc = _num_proc(opts, settings, source)
        self.windows: list[PlanWindow] = []
        self.written = 0  # how many of self.windows are in the store
        self.reused = False  # the whole plan was in the store already (run's bar: not "while planning")
        self._record: Planning | None = None
        self.claimed_run = False
        #: the local output directory this plan's store made (prepare_plan); removed if the plan fails
        #: with nothing written in it
        self.made_root: Path | None = None

    # ------------------------------------------------------------------------------------------

    def discard(self) -> None:
        """Remove the output directory :func:`prepare_plan` made for this job while nothing is in it
        (a run refused after its request was checked: the refusal leaves nothing behind)."""
        if self.made_root is not None:
            _remove_empty_dirs(self.made_root)

    def run(self, progress=None, on_window=None) -> PlannedRun:
        t0 = time.perf_counter()
        store = self.run_store
        if plan_complete(store):
            planned = self._reuse()
            self.reused = True
            if on_window is not None:
                on_window(self, planned.batches)
            return planned
        self.windows = read_windows(store)
        self.claimed_run = bool(self.windows)  # windows are written after run.json
        self.written = len(self.windows)
        self._started_unix = time.time() - (time.perf_counter() - t0)
        if self.windows:  # a resumed plan: status says at once that this process plans it now
            self._record = start_planning_record(store, self.opts.command)
            self._write_progress(self.windows[-1].records_read)
        if self.windows and on_window is not None:
            on_window(self, [b for w in self.windows for b in w.batches])
        try:
            if not (self.windows and self.windows[-1].last):
                self._stream(progress, on_window, t0)
            return self._finish(t0)
        except BaseException as exc:
            if self._record is not None:  # our plan is half written: say why it is not complete
                fail_planning_record(store, self._record, _describe(exc))
            elif self.made_root is not None and not self.claimed_run:
                _remove_empty_dirs(self.made_root)
            raise

    def _stream(self, progress, on_window, t0: float) -> None:
        """Read the dataset after the windows already written, tokenise, publish each window."""
        store, config = self.run_store, self.config
        done = self.windows
        seen = IdClaims()
        for w in done:  # rebuild the duplicate-id check of one pass over the dataset
            for r in SampleRow.read_window(store, w.name):
                seen.note(str(r.record_id), r.scope)
            for rid, scope in zip(w.claimed_ids, w.claimed_scopes or [None] * len(w.claimed_ids)):  # none: older plans
                seen.note(rid, scope)
        records_read = done[-1].records_read if done else 0
        source_skips = SkipCounter()  # what the readers note about whole files (a truncated JSON array)
        raw = self.source.raw_records(source_skips)
        items = ((item.fallback_id, item.raw) for item in islice(raw, records_read, None))
        window = self._new_window(len(done))
        task = None
        if progress is not None:
            # --limit: usable records out of the limit; else the dataset's bytes (records when unknown)
            total = self.opts.limit if self.opts.limit is not None else self.source.total_bytes
            task = progress.add_task("tokenising", total=total,
                                     bytes=self.opts.limit is None and self.source.total_bytes is not None)
        writer = ThreadPoolExecutor(1, thread_name_prefix="plan-writer")
        pending = None
        limit = self.opts.limit
        last_tick = last_record = last_hook = 0.0
        if limit is not None and len(seen) >= limit:
            items = iter(())  # a resumed plan that had reached --limit: only its last window is missing
        try:
            with Tokenisers(self.spec, self.num_proc, chat=self.chat) as pool:
                for (_fid, _raw), outcome in pool.map(items):
                    records_read += 1
                    rid, scope = None, id_scope(_fid)
                    if outcome.claimed is None:
                        window.skips.add(outcome.skip)
                    else:
                        try:  # its line, as every other skip's example has (a JSON-lines record's)
                            rid = seen.claim(outcome.claimed, scope, getattr(_raw, "lineno", None),
                                             generated=outcome.claimed == _fid)
                        except BadRecord as dup:
                            window.skips.add(dup)
                        else:
                            if rid != outcome.claimed:
                                window.skips.fix(IdClaims.SCOPED_FIX)
                            for name in outcome.fixes:
                                window.skips.fix(name)
                    if rid is not None:
                        if outcome.sample is None:
                            window.skips.add(outcome.skip)
                            window.claimed_ids.append(rid)
                            window.claimed_scopes.append(scope)
                        else:
                            ids_S, mask_S, truncated = outcome.sample
                            window.record_ids.append(rid)
                            window.scopes.append(scope)
                            window.ids.append(ids_S)
                            window.masks.append(mask_S)
                            window.truncated.append(truncated)
                            if self.keep_records:
                                window.raws.append((_fid, _raw))
                    stop = limit is not None and len(seen) >= limit
                    if len(window.ids) >= window_samples(window.index, config.plan_windows) or stop:
                        pending = self._publish(writer, pending, window, records_read, False, on_window, t0)
                        window = self._new_window(window.index + 1)
                    if time.monotonic() - last_tick > 0.2:
                        last_tick = time.monotonic()
                        if pending is not None and pending.done():
                            pending.result()  # a window that failed to be written or enqueued stops the plan now
                        if task is not None:
                            self._tick(progress, task, records_read, len(seen))
                        if last_tick - last_record > PROGRESS_RECORD_S and self._record is not None:
                            last_record = last_tick  # status's progress between windows (the largest take minutes)
                            writer.submit(self._write_progress, records_read)
                        if last_tick - last_hook > HOOK_TICK_S and hasattr(on_window, "tick"):
                            last_hook = last_tick
                            on_window.tick(self)
                    if stop:
                        break
            window.skips.truncated_bytes.update(source_skips.truncated_bytes)
            pending = self._publish(writer, pending, window, records_read, True, on_window, t0)
            if pending is not None:
                pending.result()
            if task is not None:
                self._tick(progress, task, records_read, len(seen), final=True)
        except BaseException:
            writer.shutdown(wait=True, cancel_futures=True)
            if task is not None:  # after a Ctrl-C the bar says the windows that are in the store, as the lines below it do
                self._tick(progress, task, records_read, len(seen), windows=self.windows[:self.written], info_only=True)
            raise
        finally:
            writer.shutdown(wait=True, cancel_futures=True)

    def _tick(self, progress, task, records_read: int, claimed: int, final: bool = False, windows=None,
              info_only: bool = False) -> None:
        """The tokenising bar: its count (records claimed, bytes read or records read) and its words (records
        read, the samples and batches of ``windows``, default every published one). ``info_only``: the words
        alone (an interrupted plan: the bytes read ahead are not the records tokenised)."""
        windows = self.windows if windows is None else windows
        samples = sum(w.num_samples for w in windows)
        batches = sum(len(w.batches) for w in windows)
        info = f"{plural(records_read, 'record')} read, {plural(samples, 'sample')} in {plural(batches, 'batch')} planned"
        if info_only:
            progress.update(task, info=info)
            return
        if self.opts.limit is not None:
            progress.update(task, completed=claimed, info=info, **({"total": claimed} if final else {}))
        elif self.source.total_bytes is not None:
            progress.update(task, completed=self.source.total_bytes if final else self.source.bytes_read, info=info)
        else:
            progress.update(task, completed=records_read, info=info, **({"total": records_read} if final else {}))

    def _new_window(self, index: int) -> _Window:
        prev = self.windows[-1] if self.windows else None
        return _Window(index=index, first_sample=prev.first_sample + prev.num_samples if prev else 0,
                       first_batch=prev.first_batch + len(prev.batches) if prev else 0)

    def _publish(self, writer, pending, window: _Window, records_read: int, last: bool, on_window, t0: float):
        """Cut the window into batches and hand its writing to the writer thread (one window in flight).

        The window's record is computed here, so that the next window's numbering follows at once;
        ``self.windows`` gets it only once it is in the store.
        """
        if pending is not None:
            pending.result()  # the previous window is in the store (or its error is raised here)
        if not window.ids and not last:
            return None
        if not window.ids and not self.windows and not self.claimed_run:
            raise BadDataset(no_usable_record_message(self.opts.dataset, window.skips))
        if not self.claimed_run:
            claim_run(self.run_store, self.config)
            self.claimed_run = True
        if self._record is None:
            self._record = start_planning_record(self.run_store, self.opts.command)
        record, plans, rows = _cut_window(window, self.config, records_read, last,
                                          self.batch_costs(window) if window.ids else None)
        bytes_read = self.source.bytes_read or None  # read ahead of the window: progress only
        self.windows.append(record)  # numbering of the next window; written below before anyone reads it

        def write() -> None:
            store = self.run_store
            with ThreadPoolExecutor(WRITE_THREADS) as pool:
                list(pool.map(lambda p: store.write(batch_key(p.batch), p.to_bytes()), plans))
            store.write(window_samples_key(record.name), SampleRow.rows_bytes(rows))
            self.write_window_extra(store, window, plans)
            record.write(store)  # last: the window's batches may now be enqueued
            self.written = record.window + 1
            self._write_progress(records_read, bytes_read)
            if on_window is not None and record.batches:
                on_window(self, list(record.batches))

        return writer.submit(write)

    def _write_progress(self, records_read: int, bytes_read: int | None = None) -> None:
        """Rewrite ``plan/planning.json`` with the progress so far (the windows written, the records
        read); best effort: status falls back to the windows. Called on the writer thread."""
        written = self.windows[:self.written]
        now = time.time()
        last = written[-1] if written else None
        record = self._record.model_copy(update={
            "records_read": records_read, "samples": last.first_sample + last.num_samples if last else 0,
            "windows": len(written), "batches": last.first_batch + len(last.batches) if last else 0,
            "bytes_read": bytes_read if bytes_read is not None else (self.source.bytes_read or None),
            "bytes_total": self.source.total_bytes,
            "records_total": self.source.total_records or self.opts.limit, "num_proc": self.num_proc,
            "updated_unix": now, "updated_at": datetime.fromtimestamp(now, timezone.utc).isoformat(timespec="seconds"),
            "started_unix": self._started_unix,
            "started_at": datetime.fromtimestamp(self._started_unix, timezone.utc).isoformat(timespec="seconds")})
        try:
            record.write(self.run_store)
            self._record = record  # a failure is recorded with the progress so far
        except Exception:
            pass

    def _finish(self, t0: float) -> PlannedRun:
        """Stats and the batch list (last: the plan is complete) from the windows."""
        store, windows = self.run_store, self.windows
        batches = [b for w in windows for b in w.batches]
        skipped = _merge_skips(w.skipped for w in windows)
        tokens = sum(w.tokens for w in windows)
        padded = sum(w.padded_tokens for w in windows)
        stats = Stats(
            samples=sum(w.num_samples for w in windows), tokens=tokens,
            supervised_tokens=sum(w.supervised_tokens for w in windows),
            truncated_samples=sum(w.truncated_samples for w in windows), batches=len(batches),
            padding_waste=round(1.0 - tokens / padded, 4) if padded else 0.0, skipped=skipped,
            plan_seconds=round(time.perf_counter() - t0, 2), windows=len(windows),
            records_read=windows[-1].records_read if windows else 0,
            bytes_read=self.source.bytes_read or None, num_proc=self.num_proc, command=self.opts.command,
        )
        stats.write(store)
        BatchSummary.write_list(store, [b for w in windows for b in w.batches])  # last: the plan is complete
        try:
            Planning.delete(store)
        except Exception:  # only a record: status ignores it once batches.json exists
            pass
        out = stats.model_dump(exclude={"schema_version"})
        # One line for the whole plan: skipped records are counted per reason, never logged one by one.
        log.info("plan %s", json.dumps({"run": self.config.run_id, "samples": out["samples"], "tokens": out["tokens"],
                                        "batches": out["batches"], "windows": out["windows"],
                                        "skipped": out["skipped"]["counts"], "repaired": out["skipped"]["fixes"],
                                        "truncated": out["truncated_samples"]}))
        return PlannedRun(store, self.root, self.config, batches, out, reused=False, run_url=self.run_url)

    def _reuse(self) -> PlannedRun:
        batches = read_batch_list(self.run_store)
        stats = Stats.read(self.run_store)
        stats = {} if stats is None else stats.model_dump(exclude={"schema_version"})
        return PlannedRun(self.run_store, self.root, self.config, batches, stats, reused=True, run_url=self.run_url)


# ------------------------------------------------------------------------------------------------
# A regenerate run's plan (the rest of a regenerate run: ``producer/regenerate.py``)


class RegenPlanJob(PlanJob):
    """A regenerate run being planned: a :class:`PlanJob` keeping each sample's raw
    record so that its window's conversations are stored beside its batches (``plan/regen/``),
    and whose batches are sized for generation (:meth:`batch_costs`): run.json's ``batch_tokens``
    is then the budget of one generate call (``--regen-batch-tokens``), ``max_batch_samples`` its rows."""

    keep_records = True

    def batch_costs(self, window) -> np.ndarray:
        """Per sample, the tokens its answer's generate call holds: its prompt's length plus
        ``max_new_tokens`` (the KV cache and activations of one row of a generate call). The prompt
        is the conversation's tokens before its last supervised run: the last assistant turn the
        planner kept within ``max_length``, the one ``--turns last`` answers (the worker's prompt to
        within the few tokens that a template renders differently with the generation prompt;
        ``--turns all``'s last round, with the dataset's answers for the earlier ones). A function of the
        plan's tokens and of identity fields only (``max_new_tokens``, ``max_length``): the same
        dataset and options give the same batches, and a resumed plan cuts its next windows as before."""
        new = int(RegenConfig.of(self.config).max_new_tokens)
        return np.array([prompt_tokens(m) + new for m in window.masks], dtype=np.int64)

    def write_window_extra(self, store, window, plans) -> None:
        """Write ``plan/regen/<batch>.jsonl`` for each batch of the window: its samples' conversations,
        normalised as the planner normalised them, in the batch's sample order.

        Raises BadDataset for a pre-tokenised record (there is no conversation to answer)."""
        for plan in plans:
            lines = []
            for sample_index in plan.sample_index_N.tolist():
                fallback_id, raw = window.raws[int(sample_index) - window.first_sample]
                record = _normalise(parse_raw(raw), fallback_id, SkipCounter())
                # the id the plan gave it (another file's record may have had its own id: IdClaims)
                record = dataclasses.replace(record, record_id=window.record_ids[int(sample_index) - window.first_sample])
                if not isinstance(record, Conversation):
                    raise BadDataset(f"record {record.record_id}: a pre-tokenised record has no conversation to answer "
                                     "again; regenerate a dataset of conversations (ShareGPT / OpenAI messages)")
                lines.append(PlannedConversation(sample_index=int(sample_index), record_id=record.record_id,
                                                 messages=list(record.messages),
                                                 tools=list(record.tools) if record.tools else None).model_dump_json())
            store.write(regen_plan_key(plan.batch), ("\n".join(lines) + "\n").encode())


def prompt_tokens(mask_S: np.ndarray) -> int:
    """Tokens of a sample before its last supervised run (the prompt of its last kept assistant
    turn); the whole sample when nothing is supervised. ``mask_S``: uint8 [S]."""
    starts = np.flatnonzero(np.diff(np.asarray(mask_S, dtype=np.int8), prepend=np.int8(0)) == 1)
    return int(starts[-1]) if len(starts) else int(len(mask_S))


def prepare_regenerate(opts: PlanOptions, settings: Settings, progress=None) -> RegenPlanJob:
    """:func:`prepare_plan` for a regenerate run (``opts.regenerate`` set): the same
    checks and config, with ``regenerate`` in run.json and its identity, and a run id
    ``<dataset>-regen-<hash>``; its batches sized for generation (:class:`RegenPlanJob`): ``batch_tokens``
    is ``--regen-batch-tokens`` (``opts.batch_tokens``, the extraction's, is not used). Writes nothing.

    Raises BadConfig (an option, ``--allow-text``, ``--output`` a run, a budget below one prompt and
    its answer), BadDataset, RunConflict, as prepare_plan."""
    regen = RegenConfig.model_validate(opts.regenerate).check()
    budget = settings.regen_batch_tokens if opts.regen_batch_tokens is None else opts.regen_batch_tokens
    max_length = settings.max_length if opts.max_length is None else opts.max_length
    if budget < max_length + regen.max_new_tokens:
        raise BadConfig(f"--regen-batch-tokens {budget} is smaller than --max-length {max_length} + --max-new-tokens "
                        f"{regen.max_new_tokens}: a regenerate batch must hold one prompt of up to --max-length tokens "
                        "and its answer; raise --regen-batch-tokens (HSX_REGEN_BATCH_TOKENS) or lower the others")
    if opts.allow_text:
        raise BadConfig("--allow-text: a plain-text record has no assistant turn to answer; regenerate conversations")
    if opts.chat_template:  # the workers render the prompts with it: its text travels in run.json
        regen = regen.model_copy(update={"chat_template": _chat_template_text(opts.chat_template)})
    root = open_store(opts.output or settings.store_url, settings)
    if exists(root, RUN_JSON):
        raise BadConfig(f"--output {opts.output or settings.store_url!r} is a run (it holds run.json), not the store root "
                        "that runs are written under. Fix: give its parent directory (e.g. --output ./out)")
    config, (spec, chat), source = build_config(dataclasses.replace(opts, regenerate=None, batch_tokens=budget), settings,
                                                progress, capture=False)
    config.regenerate = regen.model_dump(mode="json")
    config.run_id = opts.run_id or config.default_run_id(f"{source.name}-regen")
    run_store = root.child(config.run_id)
    check_run(run_store, config)
    return RegenPlanJob(opts, settings, root, run_store, config, spec, chat, source)


def _cut_window(window: _Window, config: RunConfig, records_read: int, last: bool,
                costs_N: np.ndarray | None = None) -> tuple[PlanWindow, list[BatchPlan], list[SampleRow]]:
    """The window's batches (its samples sorted by length, ``producer/batching.py``), sample rows and
    record. ``costs_N``: what a sample costs in a batch's budget (int64 [N]; None: its length)."""
    lengths_N = np.array([len(x) for x in window.ids], dtype=np.int64)
    costs_N = lengths_N if costs_N is None else costs_N
    groups = cut_batches(costs_N, batch_tokens=config.batch_tokens, max_batch_samples=config.max_batch_samples) \
        if len(lengths_N) else []
    batch_of = np.empty(len(lengths_N), dtype=np.int64)
    plans = []
    for b, members in enumerate(groups):
        batch_of[members] = window.first_batch + b
        cu = np.zeros(len(members) + 1, dtype=np.int64)
        cu[1:] = np.cumsum(lengths_N[members])
        plans.append(BatchPlan(batch_id(window.first_batch + b),
                               np.concatenate([window.ids[i] for i in members]).astype(np.int32),
                               np.concatenate([window.masks[i] for i in members]).astype(np.uint8),
                               cu, (members + window.first_sample).astype(np.int64)))
    supervised = [int(m.sum()) for m in window.masks]
    rows = [SampleRow(sample_index=window.first_sample + i, record_id=window.record_ids[i], num_tokens=int(lengths_N[i]),
                      supervised_tokens=supervised[i], truncated=bool(window.truncated[i]),
                      batch=batch_id(int(batch_of[i])), scope=window.scopes[i])
            for i in range(len(lengths_N))]
    record = PlanWindow(
        window=window.index, first_sample=window.first_sample, num_samples=len(lengths_N),
        first_batch=window.first_batch, batches=[p.summary() for p in plans],
        tokens=int(lengths_N.sum()), supervised_tokens=sum(supervised), truncated_samples=int(sum(window.truncated)),
        padded_tokens=sum(int(lengths_N[g].max()) * len(g) for g in groups), records_read=records_read,
        skipped=SkipCounts(**window.skips.as_dict()), claimed_ids=window.claimed_ids,
        claimed_scopes=window.claimed_scopes, last=last,
    )
    return record, plans, rows


def _merge_skips(parts) -> SkipCounts:
    """The skip counts of the whole plan from its windows' (examples: the first few of each reason)."""
    total = SkipCounter()
    for part in parts:
        for reason, n in part.counts.items():
            total.counts[reason] = total.counts.get(reason, 0) + n
        for reason, items in part.examples.items():
            have = total.examples.setdefault(reason, [])
            have.extend(items[:max(0, EXAMPLES_PER_REASON - len(have))])
        for name, n in part.fixes.items():
            total.fixes[name] = total.fixes.get(name, 0) + n
        total.truncated_bytes.update(part.truncated_bytes)
    return SkipCounts(**total.as_dict())


def no_usable_record_message(dataset: str, skips: SkipCounter) -> str:
    """One line: the dataset, and why no record became a sample."""
    if not skips.total:
        try:
            empty = all(path.stat().st_size == 0 for path in dataset_files(dataset))
        except (OSError, BadDataset):
            empty = False
        files = 1 if dataset == "sharegpt" or not Path(dataset).is_dir() else 2
        why = ("the file is empty (0 bytes)" if files == 1 else "its files are empty") if empty else "it holds no record"
        return f"{dataset}: no usable record: {why}"
    reasons = ", ".join(f"{reason} {n:,}" for reason, n in sorted(skips.counts.items(), key=lambda kv: -kv[1]))
    example = next(iter(ex for exs in skips.examples.values() for ex in exs), "")
    what = "its only record was skipped" if skips.total == 1 else f"all {skips.total:,} records were skipped"
    return (f"{dataset}: no usable record: {what} ({reasons})"
            + (f"; e.g. {example[:200]}" if example else ""))


def _describe(exc: BaseException) -> str:
    from hsx.errors import StoreFull

    if isinstance(exc, KeyboardInterrupt):
        return "interrupted (Ctrl-C or SIGTERM) while planning; the same command resumes after the last window written"
    if isinstance(exc, StoreFull):  # what to do, as status says it
        return (f"{exc.__class__.__name__}: {str(exc)[:500]}; free space on the store, then run the same command: "
                "the plan resumes after the last window written")
    return f"{exc.__class__.__name__}: {str(exc)[:500]}"


