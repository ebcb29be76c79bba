"""Completion markers: ``<run>/markers/<batch>.json``, written last, with a conditional create.

A batch is done if and only if its marker exists and its ``config_sha256`` equals the run's.
The marker names the shard object it certifies (key, bytes, sha256): shard keys carry an attempt
suffix (``shards/<batch>-<attempt>.safetensors``) so that two workers racing on the same batch
never overwrite each other's shard; the loser of the marker race deletes its own shard.

The marker's fields, their units and which are optional (older markers lack them) are documented
on :class:`hsx.records.Marker`, the one class that reads and writes it; its key is
:func:`hsx.layout.marker_key`. This module keeps the names other modules import.

A batch whose every sample is quarantined gets no shard and no marker: its task fails
(:class:`hsx.errors.FidelityError`) and ``failures/<batch>.json`` (:class:`hsx.records.Failure`)
says why.
"""

from __future__ import annotations

from hsx.layout import MARKERS_PREFIX, marker_key, shard_key
from hsx.records import Marker, done_batches
from hsx.store import Store

__all__ = ["MARKERS_PREFIX", "Marker", "done_batches", "marker_key", "read_marker", "shard_key", "write_marker"]


def write_marker(run_store: Store, marker: Marker) -> bool:
    """Create the marker; True if we wrote it, False if another worker finished the batch first."""
    return marker.create(run_store)


def read_marker(run_store: Store, batch: str) -> Marker | None:
    """The marker of ``batch``, or None if the batch is not done.

    Raises:
        hsx.errors.RecordFormatError: the stored marker is not a valid :class:`~hsx.records.Marker`.
    """
    return Marker.read(run_store, batch)
