"""Planning a run: dataset -> chat template -> token ids and loss masks -> batches -> the plan in the store.

Everything that can be refused is refused here, before any model weights are loaded or any GPU
work is queued: unknown model, layer ids out of range, a batch budget smaller than one sample,
an unreachable store, a run id that exists with another config.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from hsx.errors import BadConfig, BadDataset, BadRecord
from hsx.layers import layer_ids_from_draft_config, parse_layer_ids, select_layers
from hsx.layout import RUN_JSON
from hsx.models import load_tokenizer, model_info
from hsx.plan import (BatchPlan, batch_id, batch_key, fail_planning_record,
                       plan_complete, read_batch_list, start_planning_record)
from hsx.records import BatchSummary, Planning, SampleRow, Stats
from hsx.runconfig import RunConfig, check_run, check_run_id, claim_run
from hsx.shard import StoreDtype
from hsx.store import Store, exists, open_store
from producer.batching import cut_batches, padding_waste
from producer.datasets import SkipCounter, dataset_files, iter_conversations
from producer.masks import MIN_CONSECUTIVE_SUPERVISED, OVER_LENGTH_POLICIES, SPECIAL_TOKENS_IN_CONTENT, ChatTokeniser
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
    #: The command line that asked for the plan, recorded in plan/planning.json (status shows it when planning failed).
    command: str | None = None


@dataclass
class PlannedRun:
    """A planned run: where it is, its config, its batches and the planning stats."""

    run_store: Store
    root_store: Store
    config: RunConfig
    batches: list[dict]
    stats: dict
    reused: bool = False
    run_url: str = ""
    extras: dict = field(default_factory=dict)


def dataset_fingerprint(source: str) -> str:
    """sha256 over the dataset files' names, sizes and bytes (the run id changes if the data does)."""
    h = hashlib.sha256()
    for path in dataset_files(source):
        h.update(f"{path.name}:{path.stat().st_size};".encode())
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()


def _dataset_name(source: str) -> str:
    return source if source == "sharegpt" else Path(source).stem or "dataset"


def build_config(opts: PlanOptions, settings: Settings, progress=None) -> tuple[RunConfig, object]:
    """Validate the request and build the run config; returns it with the loaded tokenizer.

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
    if batch_tokens < max_length:
        raise BadConfig(
            f"--batch-tokens {batch_tokens} is smaller than --max-length {max_length}: a batch must hold at least one "
            f"full-length sample; raise --batch-tokens or lower --max-length"
        )
    if opts.store_dtype not in tuple(StoreDtype):  # fp8: float8 e4m3 + per-token float32 scales (hsx/fp8.py)
        raise BadConfig(f"--store-dtype {opts.store_dtype!r}: choose one of {', '.join(StoreDtype)}")
    if opts.limit is not None and opts.limit < 1:
        raise BadConfig(f"--limit {opts.limit}: must be a positive number of records")
    if opts.over_length not in OVER_LENGTH_POLICIES:
        raise BadConfig(f"over_length {opts.over_length!r}: choose one of {', '.join(OVER_LENGTH_POLICIES)} "
                        "(--truncate or --drop-long)")
    if opts.special_tokens_in_content not in SPECIAL_TOKENS_IN_CONTENT:
        raise BadConfig(f"--special-tokens-in-content {opts.special_tokens_in_content!r}: choose one of "
                        f"{', '.join(SPECIAL_TOKENS_IN_CONTENT)}")
    if opts.run_id is not None:
        try:
            check_run_id(opts.run_id)
        except ValueError as exc:
            raise BadConfig(f"--run-id: {exc}") from None
    files = dataset_files(opts.dataset)  # BadDataset early, before loading a model config
    info = model_info(opts.model, settings.cache_dir, trust_remote_code=settings.trust_remote_code)
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
        selection = select_layers(info.num_layers, layer_ids=layer_ids, preset=opts.preset, final=final,
                                  dflash_layers=opts.dflash_layers)
    except BadConfig as exc:
        if layer_source:  # say where the ids came from
            raise BadConfig(f"{exc} (ids read from {layer_source})") from None
        raise
    layers = selection.as_dict()
    if layer_source:
        layers["source"] = layer_source
    tokenizer = load_tokenizer(opts.model, settings.cache_dir, trust_remote_code=settings.trust_remote_code)
    chat = ChatTokeniser(tokenizer, max_length=max_length, enable_thinking=opts.enable_thinking,
                         over_length=opts.over_length, special_tokens_in_content=opts.special_tokens_in_content)
    config = RunConfig(
        model=info.as_dict(),
        model_name=opts.model,
        layers=layers,
        max_length=max_length,
        batch_tokens=batch_tokens,
        max_batch_samples=max_batch_samples,
        store_dtype=StoreDtype(opts.store_dtype).value,
        tokenizer={
            "class": type(tokenizer).__name__,
            "vocab_size": len(tokenizer),
            "chat_template_sha256": chat.template_sha256,
            "end_of_turn_ids": sorted(int(i) for i in chat.end_of_turn_ids),
            "enable_thinking": opts.enable_thinking,
        },
        sample_policy={"over_length": opts.over_length, "allow_text": opts.allow_text,
                       "min_consecutive_supervised": MIN_CONSECUTIVE_SUPERVISED},
        special_tokens_in_content=opts.special_tokens_in_content,
        dataset_fingerprint=dataset_fingerprint(opts.dataset),
        dataset_source=opts.dataset if opts.dataset == "sharegpt" else str(Path(opts.dataset).resolve()),
        limit=opts.limit,
    )
    config.run_id = opts.run_id or config.default_run_id(_dataset_name(opts.dataset))
    config.created_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    del files
    return config, chat


def tokenise_dataset(opts: PlanOptions, chat: ChatTokeniser, skips: SkipCounter, progress=None):
    """Stream the dataset through the chat template. Returns (record ids, input ids, loss masks, truncated flags)."""
    record_ids, ids, masks, truncated = [], [], [], []
    task = progress.add_task("tokenising", total=opts.limit) if progress else None
    for item in chat.encode_many(iter_conversations(opts.dataset, skips, limit=opts.limit, allow_text=opts.allow_text)):
        if isinstance(item, BadRecord):
            skips.add(item)
        else:
            record_ids.append(item.record_id)
            ids.append(item.input_ids)
            masks.append(item.loss_mask)
            truncated.append(item.truncated)
        if progress:
            progress.advance(task)
    if progress:
        progress.update(task, completed=progress.tasks[task].completed, total=progress.tasks[task].completed)
    return record_ids, ids, masks, truncated


def plan_run(opts: PlanOptions, settings: Settings, progress=None) -> PlannedRun:
    """Plan (or find the existing plan of) a run and write it to the store.

    The same dataset and config give the same run id; when that run's plan is already complete
    in the store it is reused as is (no tokenisation).

    Nothing is written until the dataset is tokenised: a dataset with no usable record, or a
    Ctrl-C while tokenising, leaves no run behind. Then ``run.json`` is claimed and the plan is
    written with ``plan/planning.json`` saying who writes it; ``plan/batches.json`` last. A failure
    from there on (Ctrl-C, a store error) is recorded in ``plan/planning.json``, so ``status``
    says the planning did not finish; running the same command again plans the run from the start.

    Raises:
        BadConfig, BadDataset: invalid request (nothing written).
        hsx.errors.RunConflict: the run id exists with another config (nothing written).
        hsx.errors.StoreError: the store is unreachable.
    """
    t0 = time.perf_counter()
    root = open_store(opts.output or settings.store_url, settings)
    if exists(root, RUN_JSON):
        # --output takes the store root that holds runs; README examples write runs as ./out/<run_id>.
        raise BadConfig(f"--output {opts.output or settings.store_url!r} is a run (it holds run.json), not the store root "
                        "that runs are written under; a run here would be nested inside that one. Fix: give its parent "
                        "directory (e.g. --output ./out)")
    config, chat = build_config(opts, settings, progress)
    run_store = root.child(config.run_id)
    run_url = run_store.url
    existed = check_run(run_store, config) is not None  # RunConflict before any work
    if existed and plan_complete(run_store):
        return _reuse(run_store, root, config, run_url)

    record = None
    try:
        skips = SkipCounter()
        record_ids, ids, masks, truncated = tokenise_dataset(opts, chat, skips, progress)
        if not ids:
            raise BadDataset(no_usable_record_message(opts.dataset, skips))
        claim_run(run_store, config)
        if plan_complete(run_store):  # another planner of the same run finished meanwhile
            return _reuse(run_store, root, config, run_url)
        record = start_planning_record(run_store, opts.command)
        planned = _write_plan(run_store, root, config, run_url, record_ids, ids, masks, truncated, skips, progress, t0)
    except BaseException as exc:
        if record is not None:  # our plan is half written: say why it is not complete
            fail_planning_record(run_store, record, _describe(exc))
        raise
    try:
        Planning.delete(run_store)
    except Exception:  # only a record: status ignores it once batches.json exists
        pass
    return planned


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
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted (Ctrl-C or SIGTERM) while writing the plan"
    return f"{exc.__class__.__name__}: {str(exc)[:500]}"


def _reuse(run_store: Store, root: Store, config: RunConfig, run_url: str) -> PlannedRun:
    batches = read_batch_list(run_store)
    stats = Stats.read(run_store)
    stats = {} if stats is None else stats.model_dump(exclude={"schema_version"})
    return PlannedRun(run_store, root, config, batches, stats, reused=True, run_url=run_url)


def _write_plan(run_store: Store, root: Store, config: RunConfig, run_url: str, record_ids, ids, masks, truncated,
                skips: SkipCounter, progress, t0: float) -> PlannedRun:
    """Cut the tokenised samples into batches and write the plan; ``plan/batches.json`` last."""
    lengths_N = np.array([len(x) for x in ids], dtype=np.int64)
    groups = cut_batches(lengths_N, batch_tokens=config.batch_tokens, max_batch_samples=config.max_batch_samples)

    batch_of = np.empty(len(ids), dtype=np.int64)
    plans = []
    for b, members in enumerate(groups):
        batch_of[members] = b
        cu = np.zeros(len(members) + 1, dtype=np.int64)
        cu[1:] = np.cumsum(lengths_N[members])
        plans.append(
            BatchPlan(
                batch_id(b),
                np.concatenate([ids[i] for i in members]).astype(np.int32),
                np.concatenate([masks[i] for i in members]).astype(np.uint8),
                cu,
                members.astype(np.int64),
            )
        )
    task = progress.add_task("writing plan", total=len(plans)) if progress else None

    def put(plan: BatchPlan) -> dict:
        run_store.write(batch_key(plan.batch), plan.to_bytes())
        if progress:
            progress.advance(task)
        return plan.summary()

    with ThreadPoolExecutor(16) as pool:
        batches = list(pool.map(put, plans))
    SampleRow.write_all(run_store, (
        SampleRow(sample_index=i, record_id=record_ids[i], num_tokens=int(lengths_N[i]),
                  supervised_tokens=int(masks[i].sum()), truncated=bool(truncated[i]), batch=batch_id(int(batch_of[i])))
        for i in range(len(ids))
    ))
    record = Stats(
        samples=len(ids), tokens=int(lengths_N.sum()), supervised_tokens=int(sum(int(m.sum()) for m in masks)),
        truncated_samples=int(sum(truncated)), batches=len(batches),
        padding_waste=round(padding_waste(lengths_N, groups), 4), skipped=skips.as_dict(),
        plan_seconds=round(time.perf_counter() - t0, 2),
    )
    record.write(run_store)
    BatchSummary.write_list(run_store, [BatchSummary(**b) for b in batches])  # last: the plan is complete
    stats = record.model_dump(exclude={"schema_version"})
    # One line for the whole plan: skipped records are counted per reason, never logged one by one.
    log.info("plan %s", json.dumps({"run": config.run_id, "samples": stats["samples"], "tokens": stats["tokens"],
                                    "batches": stats["batches"], "skipped": stats["skipped"]["counts"],
                                    "repaired": stats["skipped"]["fixes"], "truncated": stats["truncated_samples"]}))
    return PlannedRun(run_store, root, config, batches, stats, reused=False, run_url=run_url)
