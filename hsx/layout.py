"""The keys of a run: every object the run's store holds, named in one place.

A run is a store prefix (``<output>/<run_id>``, a directory or an S3 prefix); every key below is
relative to it. Modules name keys only through this module, so the layout is read here, once.

| key | written by | what (record class: ``hsx/records.py``) |
|---|---|---|
| ``run.json`` | the planner, once (conditional create) | the run config and identity (:class:`hsx.runconfig.RunConfig`) |
| ``plan/batches/<batch>.safetensors`` | the planner | one batch's samples (:class:`hsx.plan.BatchPlan`) |
| ``plan/samples/<window>.jsonl`` | the planner, one per window | one :class:`~hsx.records.SampleRow` a line, in ``sample_index`` order |
| ``plan/windows/<window>.json`` | the planner, after the window's batches and samples | :class:`~hsx.records.PlanWindow`: its presence means the window's batches may be enqueued |
| ``plan/samples.jsonl`` | the planner of runs made before the streamed plan | all the run's :class:`~hsx.records.SampleRow` (read, never written now) |
| ``plan/stats.json`` | the planner | :class:`~hsx.records.Stats` |
| ``plan/batches.json`` | the planner, **last** | the batch list (:class:`~hsx.records.BatchList`): its presence means the plan is complete |
| ``plan/planning.json`` | the planner, while it plans | :class:`~hsx.records.Planning`; removed when the plan is complete |
| ``shards/<batch>-<attempt>.safetensors`` | a worker | the hidden states of one attempt at a batch (``hsx/shard.py``) |
| ``markers/<batch>.json`` | a worker, **last**, conditional create | :class:`~hsx.records.Marker`: the batch is done |
| ``failures/<batch>.json`` | a worker whose task failed for good | :class:`~hsx.records.Failure` |
| ``workers/<host>-<pid>.json`` | every worker process, each heartbeat | :class:`~hsx.records.WorkerStatus` (and the leases it holds) |
| ``reclaims/<batch>-<tag>.<attempt>.json`` | the worker that re-enqueued an expired lease or a lost message (conditional create) | :class:`~hsx.records.Reclaim` |
| ``cancelled.json`` | ``producer cancel``; removed when the same run is run or enqueued again | :class:`~hsx.records.Cancelled`: workers start no batch of the run |

``<batch>`` is a batch name (``b000042``, :func:`hsx.plan.batch_id`); ``<window>`` a window name
(``w000003``, :func:`hsx.plan.window_id`); ``<attempt>`` 12 random hex
digits, so that racing duplicates never write the same shard key; ``<tag>`` a kombu delivery tag.
"""

from __future__ import annotations

RUN_JSON = "run.json"
CANCELLED_JSON = "cancelled.json"

PLAN_PREFIX = "plan/"
PLAN_BATCHES_PREFIX = "plan/batches/"
SAMPLES_JSONL = "plan/samples.jsonl"
PLAN_WINDOWS_PREFIX = "plan/windows/"
PLAN_SAMPLES_PREFIX = "plan/samples/"
STATS_JSON = "plan/stats.json"
BATCHES_JSON = "plan/batches.json"
PLANNING_JSON = "plan/planning.json"

SHARDS_PREFIX = "shards/"
MARKERS_PREFIX = "markers/"
FAILURES_PREFIX = "failures/"
WORKERS_PREFIX = "workers/"
RECLAIMS_PREFIX = "reclaims/"

_JSON = ".json"


def batch_plan_key(batch: str) -> str:
    """``plan/batches/<batch>.safetensors``: the planned samples of ``batch``."""
    return f"{PLAN_BATCHES_PREFIX}{batch}.safetensors"


def window_key(window: str) -> str:
    """``plan/windows/<window>.json``: the record of one window of the plan (``w000003``)."""
    return f"{PLAN_WINDOWS_PREFIX}{window}{_JSON}"


def window_samples_key(window: str) -> str:
    """``plan/samples/<window>.jsonl``: the sample rows of one window of the plan."""
    return f"{PLAN_SAMPLES_PREFIX}{window}.jsonl"


def shard_key(batch: str, attempt: str) -> str:
    """``shards/<batch>-<attempt>.safetensors``: one attempt's shard (the marker names the one that counts)."""
    return f"{SHARDS_PREFIX}{batch}-{attempt}.safetensors"


def marker_key(batch: str) -> str:
    """``markers/<batch>.json``: the completion marker of ``batch``."""
    return f"{MARKERS_PREFIX}{batch}{_JSON}"


def failure_key(batch: str) -> str:
    """``failures/<batch>.json``: why the last task of ``batch`` failed for good."""
    return f"{FAILURES_PREFIX}{batch}{_JSON}"


def worker_key(worker: str) -> str:
    """``workers/<host>-<pid>.json``: the status record of worker process ``worker`` (``<host>-<pid>``)."""
    return f"{WORKERS_PREFIX}{worker}{_JSON}"


def reclaim_prefix(batch: str, tag: str) -> str:
    """``reclaims/<batch>-<tag>.``: the reclaim records of one delivery of ``batch`` (every attempt)."""
    return f"{RECLAIMS_PREFIX}{batch}-{tag}."


def reclaim_key(batch: str, tag: str, attempt: int) -> str:
    """``reclaims/<batch>-<tag>.<attempt>.json``: attempt ``attempt`` at reclaiming delivery ``tag`` of ``batch``."""
    return f"{reclaim_prefix(batch, tag)}{attempt}{_JSON}"


def name_of(key: str, prefix: str) -> str | None:
    """The name a ``<prefix><name>.json`` key stands for (a batch, a worker), or None for another key.

    ``name_of("markers/b000003.json", MARKERS_PREFIX) == "b000003"``.
    """
    if not key.startswith(prefix) or not key.endswith(_JSON):
        return None
    name = key[len(prefix):-len(_JSON)]
    return name if name and "/" not in name else None


def names_under(keys: list[str], prefix: str) -> list[str]:
    """The names of the ``<prefix><name>.json`` keys among ``keys`` (a listing of ``prefix``), in order."""
    return [n for n in (name_of(k, prefix) for k in keys) if n is not None]
