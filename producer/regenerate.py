"""Regenerate runs (issue 23), the producer's side: the generation options, a regenerate run as a
dataset, its verification.

``python -m producer regenerate DATASET --model M --output STORE`` plans the dataset as an
extraction run (``producer/planner.py``: the same reading, checks, chat template and tokenisation,
token-budget batches in streamed windows) but sizes its batches for generation (a row costs its
prompt + ``--max-new-tokens``, within ``--regen-batch-tokens``: :class:`producer.planner.RegenPlanJob`), and
writes beside each batch its conversations as the planner normalised them
(``plan/regen/<batch>.jsonl``, ``hsx/regen.py``; :func:`producer.planner.prepare_regenerate`). The
run's ``regenerate`` (:class:`hsx.regen.RegenConfig`) is in run.json and its identity: other generation
options are another run. The batches go to the same queue as extraction batches and the same workers
answer them (``workers/generate.py``); the broker, the workers, the progress, Ctrl-C and resume are
``producer run``'s (``--enqueue``: the fleet form, ``producer enqueue``'s).

A regenerate run's address is a dataset (:class:`RegeneratedSource`): ``enqueue`` / ``run`` of it
extract the regenerated conversations, and ``--drop-unfinished`` skips those with an answer cut at
``--max-new-tokens``. ``python -m producer run DATASET --regenerate ...`` runs both stages, one after
the other, on this machine (:func:`producer.run.run_regenerated`); the commands are
``producer/cli.py``'s (``cmd_regenerate``, ``cmd_run_regenerated``).

This module sits below those that plan, open sources, run and parse commands: it imports none of
them (``producer/sources.py`` opens :class:`RegeneratedSource`, ``producer/cli.py`` adds the options,
``producer/reconcile.py`` and ``verify`` call :func:`verify_regenerated`).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Iterator

from hsx.errors import BadDataset, BadRecord
from hsx.layout import RUN_JSON
from hsx.plan import planned_batches
from hsx.records import read_markers
from hsx.regen import NO_END_OF_TURN, TURNS, RegenConfig, RegeneratedConversation, is_regenerate, parse_lines
from hsx.runconfig import RunConfig
from hsx.store import MissingKey, open_store
from producer.datasets import SUPERVISED_TURNS_KEY, UNFINISHED_TURNS_KEY, SkipCounter
from producer.sourcebase import DatasetChanged, RawItem, Source, SourceOptions


#: The generation options (``--seed`` is a plan option too: it also seeds --shuffle and --sample), by
#: their argparse dest.
GENERATION_OPTIONS = {"max_new_tokens": "--max-new-tokens", "temperature": "--temperature", "top_p": "--top-p",
                      "top_k": "--top-k", "stop": "--stop", "turns": "--turns"}
#: Options of a regenerate run that size its plan, not its answers (:class:`producer.planner.PlanOptions`
#: fields, not :class:`RegenConfig`'s): refused without --regenerate as the generation options are.
REGENERATE_PLAN_OPTIONS = {"regen_batch_tokens": "--regen-batch-tokens"}


def add_generation_options(p, *, in_run: bool = False, hidden: bool = False) -> None:
    """The generation options of ``regenerate`` (and of ``run --regenerate``) on parser ``p``. The
    plan options' ``--seed`` and ``--enable-thinking`` apply to the generation too. They default to
    None (:func:`generation_options` fills in :class:`RegenConfig`'s defaults), so that
    :func:`given_generation_options` tells those given. ``hidden``: on ``enqueue``, which takes them
    only to refuse them (:func:`given_generation_options`)."""
    def helped(text: str) -> str:
        import argparse

        return argparse.SUPPRESS if hidden else text

    if in_run:
        p.add_argument("--regenerate", action="store_true",
                       help="first answer the dataset's assistant turns with the target (a regenerate run), then extract "
                            "the regenerated conversations; takes the generation options below")
    p.add_argument("--max-new-tokens", type=int, help=helped("tokens an answer may have (default 512); an answer cut "
                                                               "there is marked unfinished (finish reason 'length')"))
    p.add_argument("--temperature", type=float, help=helped("sampling temperature (default 0: greedy decoding)"))
    p.add_argument("--top-p", type=float, help=helped("nucleus sampling: the smallest set of tokens reaching this "
                                                        "probability (default 1: all)"))
    p.add_argument("--top-k", type=int, help=helped("sample among the k most likely tokens (default 0: all)"))
    p.add_argument("--stop", action="append", metavar="TEXT",
                   help=helped("a string that ends an answer (cut before it); repeat for several"))
    p.add_argument("--turns", choices=TURNS,
                   help=helped("answer the last assistant turn of each conversation (default), or every one in order, "
                               "each prompt holding the answers before it"))
    p.add_argument("--regen-batch-tokens", type=int, metavar="N",
                   help=helped("token budget of a regenerate batch, rows x (longest prompt + --max-new-tokens): what one "
                               "generate call holds (default HSX_REGEN_BATCH_TOKENS, 262144; at most HSX_MAX_BATCH_SAMPLES "
                               "rows); --batch-tokens sizes the extraction's batches"))
    if in_run:
        p.add_argument("--drop-unfinished", action="store_true",
                       help="with --regenerate (or a regenerate run's address as DATASET): skip the conversations with an "
                            "answer cut at --max-new-tokens")


def generation_options(args) -> dict:
    """``run.json`` ``regenerate`` from parsed arguments (checked). Raises BadConfig. ``--seed``
    unset seeds the generation with 0."""
    given = {name: getattr(args, name) for name in GENERATION_OPTIONS if getattr(args, name, None) is not None}
    if "stop" in given:
        given["stop"] = tuple(given["stop"])
    regen = RegenConfig(**given, seed=args.seed if args.seed is not None else 0)
    return regen.check().model_dump(mode="json")


def given_generation_options(args) -> list[str]:
    """The generation options given on the command line (``--temperature``, ..., ``--regen-batch-tokens``), as typed."""
    return [flag for name, flag in {**GENERATION_OPTIONS, **REGENERATE_PLAN_OPTIONS}.items()
            if getattr(args, name, None) is not None]


# ------------------------------------------------------------------------------------------------
# A regenerate run as a dataset


def regenerated_source(source: str, options: SourceOptions) -> "RegeneratedSource | None":
    """The :class:`RegeneratedSource` of ``source`` when it is a regenerate run's address (a local
    directory, ``file://`` or ``s3://`` URL holding a ``run.json`` with ``regenerate``); None for
    anything else (a file, a directory of files, a hub id)."""
    local = source[len("file://"):] if source.startswith("file://") else None if "://" in source else source
    if local is not None and not os.path.isfile(os.path.join(local, RUN_JSON)):
        return None
    from settings import get_settings

    try:
        store = open_store(source, get_settings(), create=False)
        config = RunConfig.from_json(store.read(RUN_JSON))
    except MissingKey:
        return None
    if not is_regenerate(config):
        raise BadDataset(f"{source} is an extraction run, not a dataset: give a dataset, or a regenerate run's "
                         "address (<output>/<run_id> of `producer regenerate`)")
    return RegeneratedSource(source, store, config, options)


class RegeneratedSource(Source):
    """The conversations of a finished regenerate run, as a dataset: one record per answered
    conversation (:func:`extraction_record`), batch by batch in plan order,
    each batch's in its sample order. Its fingerprint is the sha256 over the run's identity, every
    marker's shard sha256 and ``drop_unfinished`` (the bytes that are read, checked against it as they
    are read), and says how the records are supervised (only the answers; a cut answer without its
    end-of-turn token), so that extractions made before either rule get other run ids.

    Raises BadDataset when the run is not finished (a batch without its marker)."""

    def __init__(self, address: str, store, config: RunConfig, options: SourceOptions):
        self.source, self.store, self.config, self.options = address, store, config, options
        self.name = config.run_id
        self.bytes_read = 0
        batches, complete = planned_batches(store)
        names = [b["batch"] if isinstance(b, dict) else b.batch for b in batches]  # dicts, or BatchSummary records
        markers = read_markers(store, names) if names else {}
        missing = [b for b in names if not hasattr(markers.get(b), "shard")]
        if not complete or missing or not names:
            raise BadDataset(f"regenerate run {config.run_id} at {address} is not finished ("
                             f"{len(names) - len(missing)} of {len(names)} planned batches done"
                             f"{'' if complete else ', its plan not complete'}): run its `producer regenerate` command "
                             "to the end first")
        identity = config.identity_sha256()
        stale = [b for b in names if markers[b].config_sha256 != identity]
        if stale:
            raise BadDataset(f"regenerate run {config.run_id}: the markers of {', '.join(stale[:5])} are not this run's "
                             "config (config_sha256); `producer verify` names them")
        self._shards = [(b, markers[b].shard) for b in names]
        self._total = sum(s.bytes for _, s in self._shards)

    def fingerprint(self) -> str:
        h = hashlib.sha256(json.dumps({"run": self.config.identity_sha256(), "drop_unfinished": self.options.drop_unfinished,
                                       "shards": [[b, s.sha256] for b, s in self._shards],
                                       "supervised": "regenerated_turns",
                                       "unfinished": "through_last_token:" + ",".join(sorted(NO_END_OF_TURN))},
                                      sort_keys=True).encode())
        return h.hexdigest()

    def describe(self) -> dict:
        return {"kind": "regenerate_run", "run_id": self.config.run_id, "address": self.source,
                "batches": len(self._shards), "bytes": self._total, "drop_unfinished": self.options.drop_unfinished}

    @property
    def total_bytes(self) -> int:
        return self._total

    def raw_records(self, skips: SkipCounter) -> Iterator[RawItem]:
        done = 0
        for batch, shard in self._shards:
            data = self.store.read(shard.key)
            if hashlib.sha256(data).hexdigest() != shard.sha256:
                raise DatasetChanged(f"regenerate run {self.config.run_id}: shard {shard.key} of batch {batch} is not the "
                                     "one its marker certifies (sha256 differs); `producer verify` the run")
            for conv in parse_lines(data, RegeneratedConversation, shard.key):
                yield extraction_record(conv, self.config.run_id, self.options.drop_unfinished)
            done += shard.bytes
            self.bytes_read = done


def extraction_record(conv: RegeneratedConversation, run_id: str, drop_unfinished: bool) -> RawItem:
    """One regenerated conversation as the extraction's record: ``{"id", "messages", "tools"}`` with its
    answered turns as ``hsx_supervised_turns`` (only the target's answers are supervised: the earlier
    turns of ``--turns last`` are the dataset's own answers, context for the draft model) and those
    whose end-of-turn token the target did not generate (:data:`hsx.regen.NO_END_OF_TURN`: cut at
    ``--max-new-tokens`` or before a ``--stop`` string) as ``hsx_unfinished_turns``, supervised through
    their last token only. A conversation with nothing answered, or a cut one with ``drop_unfinished``,
    is its :class:`BadRecord` (``not_regenerated``, ``unfinished_answer``): the planner counts it by reason."""
    fallback_id = f"{run_id}:{conv.sample_index}"
    if not any(a.finish_reason != "prompt_too_long" for a in conv.regenerated):
        return RawItem(fallback_id, BadRecord(conv.id, "not_regenerated", "no assistant turn's prompt fits "
                                              "in the regenerate run's max_length: nothing was answered"))
    if drop_unfinished and not conv.finished:
        reasons = ",".join(a.finish_reason for a in conv.regenerated)
        return RawItem(fallback_id, BadRecord(conv.id, "unfinished_answer", f"an answer was cut ({reasons}): --drop-unfinished"))
    answered = sorted(a.turn for a in conv.regenerated if a.finish_reason != "prompt_too_long")
    cut = sorted(a.turn for a in conv.regenerated if a.finish_reason in NO_END_OF_TURN)
    return RawItem(fallback_id, {"id": conv.id, "messages": conv.messages, SUPERVISED_TURNS_KEY: answered,
                                 **({UNFINISHED_TURNS_KEY: cut} if cut else {}),
                                 **({"tools": conv.tools} if conv.tools else {})})


# ------------------------------------------------------------------------------------------------
# verify


def verify_regenerated(run_store) -> dict | None:
    """``producer verify`` of a regenerate run; None when the run at ``run_store`` is not one.

    Checks, per planned batch: its marker exists (else ``not_done``) and holds this run's identity
    (``config_sha256``), its shard's bytes have the marker's size and sha256 (``shard_altered``) and
    parse as :class:`hsx.regen.RegeneratedConversation` lines (``shard_unreadable``), and the shard
    answers exactly the batch's planned samples, each once, under their record ids (``missing_samples``). The
    report has ``producer.verify.verify_run``'s keys (``ok``: no problem), and its problem kinds are
    verify's, so that ``reconcile --repair`` redoes the batches concerned (``producer/reconcile.py``).

    Raises hsx.store.MissingKey when there is no run.json."""
    import time

    from hsx.records import SampleRow, read_windows
    from hsx.regen import parse_lines
    from hsx.runconfig import load_run

    t0 = time.perf_counter()
    config = load_run(run_store)
    if not is_regenerate(config):
        return None
    identity = config.identity_sha256()
    batches, _complete = planned_batches(run_store)
    names = [b["batch"] if isinstance(b, dict) else b.batch for b in batches]
    planned: dict[str, dict[int, str]] = {name: {} for name in names}
    for window in read_windows(run_store):
        for row in SampleRow.read_window(run_store, window.name):
            planned.setdefault(row.batch, {})[int(row.sample_index)] = str(row.record_id)
    markers = read_markers(run_store, names) if names else {}
    problems, hashed, stored, done = [], 0, 0, 0
    for name in names:
        marker = markers.get(name)
        if not hasattr(marker, "shard"):
            problems.append({"batch": name, "kind": "not_done", "detail": f"no marker: the batch "
                             f"({len(planned[name])} samples) was not answered yet"})
            continue
        done += 1
        if marker.config_sha256 != identity:
            problems.append({"batch": name, "kind": "config_mismatch", "detail": "its marker's config_sha256 is not this "
                             "run's identity"})
            continue
        try:
            data = run_store.read(marker.shard.key)
        except MissingKey:
            problems.append({"batch": name, "kind": "shard_missing", "detail": f"{marker.shard.key} is not in the store"})
            continue
        hashed += len(data)
        if len(data) != marker.shard.bytes or hashlib.sha256(data).hexdigest() != marker.shard.sha256:
            problems.append({"batch": name, "kind": "shard_altered", "detail": f"{marker.shard.key}: {len(data)} bytes, "
                             f"not the {marker.shard.bytes} bytes and sha256 its marker certifies"})
            continue
        try:
            convs = parse_lines(data, RegeneratedConversation, marker.shard.key)
        except Exception as exc:  # BadPlan
            problems.append({"batch": name, "kind": "shard_unreadable", "detail": str(exc)[:300]})
            continue
        stored += len(convs)
        answered = [(c.sample_index, c.id) for c in convs]
        expected = sorted(planned[name].items())
        if sorted(answered) != expected:
            extra = sorted(set(answered) - set(expected))[:3]
            lost = sorted(set(expected) - set(answered))[:3]
            problems.append({"batch": name, "kind": "missing_samples", "detail": f"the shard answers {len(answered)} samples for "
                             f"{len(expected)} planned (each once): not planned {extra}, not answered {lost}"})
    return {"run_id": config.run_id, "address": run_store.url, "kind": "regenerate", "batches_planned": len(names),
            "batches_done": done, "markers": done, "samples_planned": sum(len(v) for v in planned.values()),
            "samples_stored": stored, "samples_quarantined": 0, "bytes_hashed": hashed,
            "hash_seconds": round(time.perf_counter() - t0, 2), "orphans": [], "problems": problems, "unverified": [],
            "ok": not problems, "seconds": round(time.perf_counter() - t0, 2)}
