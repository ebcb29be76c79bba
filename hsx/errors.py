"""Errors grouped by cause. Each message gives the thing, the value, the rule and the fix.

Expected outcomes (a marker already present, a record skipped) are not errors: they are logged
at INFO and counted. These classes are for what stops a record, a config, a batch or a run.
"""

from __future__ import annotations


class HsxError(Exception):
    """Base class of every error this project raises on purpose."""


class BadRecord(HsxError):
    """One dataset record cannot become a training sample; it is skipped and counted.

    ``reason`` is a short stable code (``no_turns``, ``unknown_role``, ``no_supervised_tokens``...)
    used as the key of the skip counters; ``detail`` is for humans. ``line``: the record's 1-based
    line in a JSON-lines file, when known (a record's positional id ``file:N`` counts records from 0
    and leaves blank lines out, so it is not its line).
    """

    def __init__(self, record_id: str, reason: str, detail: str = "", line: int | None = None):
        self.record_id = record_id
        self.reason = reason
        self.detail = detail
        self.line = line
        where = f" (line {line})" if line else ""
        super().__init__(f"record {record_id}{where}: {reason}" + (f" ({detail})" if detail else ""))

    def at_line(self, line: int | None) -> "BadRecord":
        """This error with its record's ``line`` (itself when the line is known already or ``line`` is None)."""
        return self if self.line or not line else BadRecord(self.record_id, self.reason, self.detail, line)

    def __reduce__(self):  # picklable: the planner's tokenising processes send them back
        return (BadRecord, (self.record_id, self.reason, self.detail, self.line))


class BadConfig(HsxError):
    """A setting or option is invalid; raised before any model or GPU work starts."""


class BadSettings(BadConfig):
    """One or more ``HSX_*`` settings break their rule (``settings.py``); raised when they are loaded.

    ``problems`` holds one dict per bad value: ``field``, ``variable`` (``HSX_...``), ``value`` (as
    printed: secrets hidden, URL passwords masked), ``rule`` and ``source`` (environment or .env).
    """

    def __init__(self, message: str, problems: list[dict]):
        super().__init__(message)
        self.problems = problems


class BadDataset(HsxError):
    """The dataset as a whole cannot be read (missing path, unknown format, no usable record)."""


class StoreError(HsxError):
    """The store cannot be reached or refused an operation (credentials, bucket, disk).

    ``transient`` is True when trying again later may succeed (connection refused or reset,
    timeouts, throttling, HTTP 5xx); False for what a retry cannot fix (credentials refused, no
    such bucket, a local disk error).
    """

    def __init__(self, message: str, *, transient: bool = False):
        super().__init__(message)
        self.transient = transient


class SpoolFull(StoreError):
    """The worker's spool cannot hold a shard: the disk is full, or the shard is bigger than the spool
    may ever hold (``HSX_SPOOL_MAX_FRACTION`` of its filesystem). The batch fails without a marker
    and is done again later (redelivery or ``producer reconcile``)."""


class RunConflict(HsxError):
    """A run id already exists in the store with another config; nothing was written."""


class RunFormatError(HsxError):
    """A run's ``run.json`` cannot be read: not a run config, or written by a newer hsx (an
    ``identity_version`` this code does not know)."""


class RecordFormatError(HsxError, ValueError):
    """A JSON record in a run's store (a marker, a failure, a worker status...; ``hsx/records.py``)
    is not JSON, misses a required field, holds a value of the wrong type, or has a
    ``schema_version`` this code does not read. ``key`` is the record's store key and ``fields``
    the bad fields (dotted paths, ``shard.key``). A ``ValueError``, as unparsable JSON was before."""

    def __init__(self, message: str, *, key: str = "", fields: list[str] | None = None):
        super().__init__(message)
        self.key = key
        self.fields = list(fields or [])


class FidelityError(HsxError):
    """Data would be wrong if we went on (shard does not match its marker, ids do not echo the plan)."""


class NonFiniteBatch(FidelityError):
    """Every sample of a batch has NaN or Inf hidden states: nothing to write, no shard, no marker.

    A data error of that batch (the worker and its store are fine): the batch is failed, and the
    worker goes on (``workers/causes.py``)."""


class BadPlan(HsxError):
    """A batch's plan file is not a valid plan: not safetensors, a tensor missing, or its shapes do
    not agree (``cu_seqlens`` not ``0 ... len(input_ids)``, non-decreasing, one more than the
    samples). A data error of that batch: it is tried a few times, then failed (``workers/causes.py``)."""


class RunGone(HsxError):
    """A task names a run address that holds no run (no ``run.json``: the run was deleted, or never
    planned there). The message is acknowledged; nothing is written (``workers/causes.py``)."""


class RunCancelled(HsxError):
    """A task's run was cancelled (``cancelled.json``, ``producer cancel``): the batch is not started,
    or (``--now``) stopped before its shard; the message is acknowledged."""


class StoreFull(StoreError):
    """The store has no room for a shard: its disk is full (ENOSPC, EDQUOT), or S3 answered with a
    quota error. The worker pauses and waits for space (``workers/extract.py``); never raised out of a task."""


class GroupBroken(HsxError):
    """A worker of K GPUs (``HSX_GPUS_PER_WORKER``) lost its tensor-parallel group: a follower rank
    died, or a forward failed on the leader and left the ranks' collectives unmatched
    (``workers/group.py``). Transient: the batch goes back to the queue, and the worker process
    exits so that the launcher restarts the whole group (``workers/causes.py``)."""
