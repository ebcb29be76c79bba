"""Completion markers: ``<run>/markers/<batch>.json``, written last, with a conditional create.

A batch is done if and only if its marker exists and its ``config_sha256`` equals the run's.
The marker names the shard object it certifies (key, bytes, sha256): shard keys carry an attempt
suffix (``shards/<batch>-<attempt>.safetensors``) so that two workers racing on the same batch
never overwrite each other's shard; the loser of the marker race deletes its own shard.

Marker fields (JSON, written by ``workers/extract.py``):

| field | meaning |
|---|---|
| ``schema_version``, ``run_id``, ``batch``, ``config_sha256`` | what the marker certifies, for which run config |
| ``shard`` | ``{key, bytes, sha256}`` of the one shard that counts |
| ``num_samples``, ``num_tokens``, ``supervised_tokens`` | what the shard holds (quarantined samples excluded) |
| ``planned_samples``, ``planned_tokens`` | what the plan's batch held |
| ``quarantined`` | ``[{"sample_index": i, "reason": "nonfinite hidden states (layers 3, 4, final_postnorm)"}]``: planned samples left out of the shard, with the captured parts that held NaN/Inf |
| ``num_quarantined`` | ``len(quarantined)`` |
| ``model_revision`` | the revision of the checkpoint the worker loaded and checked against ``run.json`` (``core/models.py``: a hash of its bytes for a local directory, the commit for a hub id) |
| ``worker``, ``seconds``, ``finished_at`` | who, how long the task took (seconds), when (UTC) |
| ``forwards`` | forwards the batch ran in (more than 1 when it exceeded the worker's padded-token limit, ``HSX_MAX_FORWARD_TOKENS`` or measured) |
| ``finished_unix`` | when the marker was made, Unix seconds with milliseconds (for rates over short windows) |
| ``forward_s``, ``launch_s``, ``write_s`` | seconds per phase: from taking the GPU lock to the states on the host (``launch_s`` of it holding the lock), and putting the shard in the store |
| ``write_path`` | how the shard reached the store: ``direct`` (from host memory in one pass, the normal path), ``spool`` (the store did not take it at once: through the overflow spool), ``memory`` (the overflow was full: retried from host memory). Markers of older runs have ``write_s``, ``store_s`` and ``verify_s`` for the spool path every shard took then |

A batch whose every sample is quarantined gets no shard and no marker: its task fails
(:class:`core.errors.FidelityError`) and ``failures/<batch>.json`` says why.
"""

from __future__ import annotations

import json

from core.store import Store

MARKERS_PREFIX = "markers/"


def marker_key(batch: str) -> str:
    return f"{MARKERS_PREFIX}{batch}.json"


def shard_key(batch: str, attempt: str) -> str:
    return f"shards/{batch}-{attempt}.safetensors"


def write_marker(run_store: Store, batch: str, marker: dict) -> bool:
    """Create the marker; True if we wrote it, False if another worker finished the batch first."""
    return run_store.create(marker_key(batch), json.dumps(marker, indent=1, sort_keys=True).encode())


def read_marker(run_store: Store, batch: str) -> dict | None:
    """The marker of ``batch``, or None if the batch is not done."""
    from core.store import MissingKey

    try:
        return json.loads(run_store.read(marker_key(batch)))
    except MissingKey:
        return None


def done_batches(run_store: Store) -> set[str]:
    """Names of batches that have a marker (one listing; does not read the markers)."""
    out = set()
    for key in run_store.list(MARKERS_PREFIX):
        name = key.rsplit("/", 1)[-1]
        if name.endswith(".json"):
            out.add(name[: -len(".json")])
    return out
