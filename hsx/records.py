"""The run's JSON records as typed classes (pydantic v2): every record in the store is read and
written through one of them, so no caller parses a record itself.

Where each record lives is ``hsx/layout.py``. The run config (``run.json``) is
:class:`hsx.runconfig.RunConfig`, a dataclass with its own versioning (``identity_version``) and
its own rule for unknown keys (kept and written back, never hashed), because its bytes are hashed
into the run's identity; the shards are ``hsx/shard.py``.

| record | key | written by |
|---|---|---|
| :class:`Marker` (with :class:`ShardRef`, :class:`QuarantinedSample`, :class:`MarkerWorker`) | ``markers/<batch>.json`` | ``workers/extract.py``, last, conditional create |
| :class:`Failure` | ``failures/<batch>.json`` | ``workers/extract.py`` ``record_failure`` (``workers/tasks.py``, by cause: ``workers/causes.py``) |
| :class:`WorkerStatus` (with :class:`BatchLease`, :class:`SpoolStatus`) | ``workers/<host>-<pid>.json`` | ``workers/heartbeat.py``; ``workers/launcher.py`` marks a dead one ``stopped`` |
| :class:`Reclaim` | ``reclaims/<batch>-<tag>.<attempt>.json`` | ``workers/lease.py``, conditional create |
| :class:`Stats` (with :class:`SkipCounts`) | ``plan/stats.json`` | ``producer/planner.py`` |
| :class:`BatchSummary` (a JSON list of them) | ``plan/batches.json`` | ``producer/planner.py``, last |
| :class:`SampleRow` (one JSON object a line) | ``plan/samples/<window>.jsonl`` (``plan/samples.jsonl`` in runs made before windows) | ``producer/planner.py`` |
| :class:`PlanWindow` | ``plan/windows/<window>.json`` | ``producer/planner.py``, after the window's batch files and samples |
| :class:`Planning` | ``plan/planning.json`` | ``hsx/plan.py`` for the planner |

**Schema versions.** Every record class has a ``schema_version`` field, a ``Literal`` of the one
version this code reads and writes (:data:`SCHEMA_VERSIONS` lists them all). It goes up only for a
change an older reader would misread (a field renamed, a meaning changed): adding an optional
field does not change it. A record of another version is refused with
:class:`~hsx.errors.RecordFormatError` ("written by a newer hsx"). Records written before the
field existed (failure, reclaim, stats and planning records of older runs) read as version 1.
The two list files (``plan/batches.json``, ``plan/samples.jsonl``) keep their bare-list format:
their items are written without ``schema_version`` (it would repeat on every line) and read as
their class's version. ``run.json``'s own ``schema_version`` is another thing: the shard layout's
version (``hsx/shard.py``), part of the run's identity.

**Unknown fields are ignored on read** (pydantic ``extra="ignore"``): a record written by a newer
hsx that only added fields still reads here (forward compatibility), and an older record without
a newer optional field reads with its default. Rewriting a record through its class drops fields
this code does not know; only :class:`WorkerStatus` is ever rewritten by another process
(``workers/launcher.py``), and it is the writer's own record.

**Errors.** A record that is not JSON, misses a required field or holds a value of the wrong type
raises :class:`~hsx.errors.RecordFormatError` (a ``ValueError``) naming the key, the record class
and each bad field (``shard.key: Field required``); an absent key reads as None.
"""

from __future__ import annotations

import json
import socket
from concurrent.futures import ThreadPoolExecutor
from typing import ClassVar, Literal, TypeVar, get_args

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

from hsx import layout
from hsx.errors import RecordFormatError
from hsx.store import MissingKey, Store

R = TypeVar("R", bound="Record")

#: Worker states of a :class:`WorkerStatus` (``workers/heartbeat.py`` says what each means). ``refusing``
#: is read only: workers wrote it before they parked what they cannot serve (``hsx/fleet.py``); none
#: writes it now, and a worker process keeps no refusal of its own.
WorkerState = Literal["working", "paused", "idle", "refusing", "stopped"]


def _problem_lines(exc: ValidationError) -> list[str]:
    out = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(the whole record)"
        got = "" if err["type"] in ("missing", "json_invalid") else f" (got {str(err.get('input'))[:80]!r})"
        out.append(f"{where}: {err['msg']}{got}")
    return out


class Record(BaseModel):
    """Base of every JSON record in the store: parse and serialise, with the errors of the module doc."""

    model_config = ConfigDict(extra="ignore")

    #: The schema version the class reads and writes: the one value of its ``schema_version`` Literal.
    VERSION: ClassVar[int]
    #: What to do about a damaged record of this class (the fix of its error message).
    REPAIR: ClassVar[str] = "delete it: hsx writes it again"

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        (cls.VERSION,) = get_args(cls.model_fields["schema_version"].annotation)

    @classmethod
    def from_json(cls: type[R], data: bytes | str, key: str) -> R:
        """Parse the record stored under ``key``.

        Raises:
            RecordFormatError: not JSON, a missing or mistyped field, another schema version.
        """
        try:
            return cls.model_validate_json(data)
        except ValidationError as exc:
            raise cls._format_error(key, exc) from None

    @classmethod
    def from_obj(cls: type[R], obj, key: str) -> R:
        """Validate an already parsed JSON value (one line of a JSON-lines file, one list item)."""
        try:
            return cls.model_validate(obj)
        except ValidationError as exc:
            raise cls._format_error(key, exc) from None

    @classmethod
    def _format_error(cls, key: str, exc: ValidationError) -> RecordFormatError:
        lines = _problem_lines(exc)
        if any(e["loc"][:1] == ("schema_version",) for e in exc.errors()):
            fix = (f"This hsx reads {cls.__name__} schema_version {cls.VERSION}; the record was written by another "
                   "(newer) hsx: read the run with that version")
        else:
            fix = f"The record is damaged or was not written by hsx: {cls.REPAIR}"
        return RecordFormatError(f"{key}: not a valid {cls.__name__} record: {'; '.join(lines)}. {fix}", key=key,
                                 fields=[".".join(str(p) for p in e["loc"]) for e in exc.errors()])

    def to_json(self) -> bytes:
        """The record's JSON bytes (keys sorted, one-space indent: readable with ``cat``)."""
        return json.dumps(self.model_dump(mode="json"), indent=1, sort_keys=True).encode()

    @classmethod
    def _read(cls: type[R], store: Store, key: str) -> R | None:
        try:
            data = store.read(key)
        except MissingKey:
            return None
        return cls.from_json(data, key)


# --- markers ---------------------------------------------------------------------------------


class ShardRef(BaseModel):
    """The one shard a marker certifies: its key, size and content hash."""

    model_config = ConfigDict(extra="ignore")

    key: str
    """``shards/<batch>-<attempt>.safetensors`` (``hsx/layout.py``)."""
    bytes: int
    """Size of the shard object in bytes."""
    sha256: str
    """Hex sha256 of the shard's bytes (lower case)."""


class QuarantinedSample(BaseModel):
    """A planned sample left out of the shard, and why."""

    model_config = ConfigDict(extra="ignore")

    sample_index: int = Field(validation_alias=AliasChoices("sample_index", "sample"))
    """The sample's row in ``plan/samples.jsonl``."""
    reason: str = ""
    """E.g. ``nonfinite hidden states (layers 3, 4, final_postnorm)``: the captured parts that held NaN/Inf."""


class MarkerWorker(BaseModel):
    """The worker process that certified the batch."""

    model_config = ConfigDict(extra="ignore")

    host: str | None = None
    pid: int | None = None
    device: str | None = None
    """torch device of its model (``cpu``, ``cuda:0``...)."""


WritePath = Literal["direct", "spool", "memory"]


class Marker(Record):
    """Completion marker ``markers/<batch>.json``: batch ``batch`` of run ``run_id`` is done.

    A batch is done if and only if its marker exists and its ``config_sha256`` equals the run's
    identity. The worker writes it last, with a conditional create (:meth:`create`). It names the
    shard object it certifies (key, bytes, sha256): shard keys carry an attempt suffix
    (``shards/<batch>-<attempt>.safetensors``, :func:`hsx.layout.shard_key`) so that two workers
    racing on the same batch never overwrite each other's shard; the loser of the marker race
    deletes its own shard. A batch whose every sample is quarantined gets no shard and no marker:
    its task fails (:class:`hsx.errors.FidelityError`) and ``failures/<batch>.json``
    (:class:`Failure`) says why.

    Fields before ``supervised_tokens``
    are required; every later one is optional, so markers of older runs (without them) still read.
    Markers of older runs also hold ``store_s`` and ``verify_s`` (the spool path every shard took
    then): ignored.
    """

    REPAIR: ClassVar[str] = ("`python -m producer verify` names the batches concerned; "
                             "`python -m producer reconcile --repair` redoes them")

    schema_version: Literal[1] = 1
    run_id: str
    batch: str
    config_sha256: str
    """sha256 of the run config's identity (:meth:`hsx.runconfig.RunConfig.identity_sha256`)."""
    shard: ShardRef
    num_samples: int
    """Samples the shard holds (quarantined samples excluded)."""
    num_tokens: int
    """Tokens the shard holds."""
    supervised_tokens: int | None = None
    """Tokens with ``loss_mask == 1`` in the shard."""
    planned_samples: int | None = None
    """Samples the plan's batch held."""
    planned_tokens: int | None = None
    """Tokens the plan's batch held."""
    quarantined: list[QuarantinedSample] = Field(default_factory=list)
    """Planned samples left out of the shard (NaN/Inf states), with the reason."""
    num_quarantined: int | None = None
    """``len(quarantined)``."""
    model_revision: str | None = None
    """Revision of the checkpoint the worker loaded and checked against ``run.json`` (``hsx/models.py``:
    a hash of its bytes for a local directory, the commit for a hub id)."""
    worker: MarkerWorker | None = None
    seconds: float | None = None
    """How long the task took (seconds)."""
    finished_at: str | None = None
    """When the marker was made (UTC ISO 8601, seconds)."""
    finished_unix: float | None = None
    """When the marker was made, Unix seconds with milliseconds (for rates over short windows)."""
    forwards: int | None = None
    """Forwards the batch ran in (more than 1 when it exceeded the worker's padded-token limit)."""
    forward_s: float | None = None
    """Seconds from taking the GPU lock to the states on the host."""
    launch_s: float | None = None
    """Seconds of ``forward_s`` the GPU lock was held."""
    write_s: float | None = None
    """Seconds putting the shard in the store."""
    write_path: WritePath | None = None
    """How the shard reached the store: ``direct`` (from host memory in one pass, the normal path),
    ``spool`` (the store did not take it at once: through the overflow spool), ``memory`` (the
    overflow was full: retried from host memory)."""

    @field_validator("quarantined", mode="before")
    @classmethod
    def _plain_ints(cls, value):
        # Entries may be plain sample indices: the reader does not depend on how the worker spells them.
        if isinstance(value, list):
            return [{"sample_index": v} if isinstance(v, int) and not isinstance(v, bool) else v for v in value]
        return value

    @property
    def key(self) -> str:
        return layout.marker_key(self.batch)

    @property
    def quarantined_ids(self) -> set[int]:
        """Sample indices listed as quarantined."""
        return {q.sample_index for q in self.quarantined}

    @classmethod
    def read(cls, store: Store, batch: str) -> "Marker | None":
        """The marker of ``batch``, or None when the batch is not done. Raises :class:`RecordFormatError`."""
        return cls._read(store, layout.marker_key(batch))

    def create(self, store: Store) -> bool:
        """Create the marker (conditional create); True if this call wrote it, False if one existed."""
        return store.create(self.key, self.to_json())


def done_batches(store: Store) -> set[str]:
    """Names of the batches that have a marker (one listing; reads no marker)."""
    return set(layout.names_under(store.list(layout.MARKERS_PREFIX), layout.MARKERS_PREFIX))


#: threads that read markers.
MARKER_READ_THREADS = 16


def read_markers(store: Store, batches: list[str] | None = None, record: type | None = None
                 ) -> dict[str, "Marker | Exception"]:
    """Every marker of the run (or those of ``batches``), keyed by the batch its key names, read as
    ``record`` (default :class:`Marker`; a regenerate run's :class:`hsx.regen.RegenMarker`).

    Values are the :class:`Marker`, or the exception reading it raised (a :class:`RecordFormatError`,
    a :class:`~hsx.errors.StoreError`, :class:`MissingKey` for one of ``batches`` that has none), so
    that ``verify`` reports an unreadable marker instead of stopping.
    """
    names = sorted(done_batches(store)) if batches is None else list(batches)

    def load(batch: str) -> Marker | Exception:
        try:
            return (record or Marker).from_json(store.read(layout.marker_key(batch)), layout.marker_key(batch))
        except Exception as exc:  # reported per marker by the caller
            return exc

    with ThreadPoolExecutor(MARKER_READ_THREADS) as pool:
        return dict(zip(names, pool.map(load, names)))


# --- failures --------------------------------------------------------------------------------


class Failure(Record):
    """``failures/<batch>.json``: why the last task of ``batch`` failed for good (a data error, or an
    unknown one after its retries: ``workers/causes.py``). Removed by ``producer reconcile`` when it
    enqueues the batch again; ignored once the batch has its marker."""

    schema_version: Literal[1] = 1
    batch: str
    error: str = ""
    """``<exception class>: <message>``, at most 2,000 characters."""
    host: str | None = None
    """The worker's host."""
    at: str | None = None
    """When (UTC ISO 8601, seconds)."""

    @classmethod
    def read(cls, store: Store, batch: str) -> "Failure | None":
        return cls._read(store, layout.failure_key(batch))

    def write(self, store: Store) -> None:
        store.write(layout.failure_key(self.batch), self.to_json())

    @staticmethod
    def delete(store: Store, batch: str) -> None:
        store.delete(layout.failure_key(batch))


def read_failures(store: Store, done: set[str]) -> dict[str, Failure]:
    """Failure records of batches that still have no marker, by batch; unreadable ones skipped."""
    out = {}
    for batch in layout.names_under(store.list(layout.FAILURES_PREFIX), layout.FAILURES_PREFIX):
        if batch in done:
            continue
        try:
            record = Failure.read(store, batch)
        except RecordFormatError:
            continue
        if record is not None:
            out[batch] = record
    return out


# --- workers' status records and their leases ----------------------------------------------


class BatchLease(BaseModel):
    """A batch a worker process works on; listing it is what holds its lease (``workers/lease.py``)."""

    model_config = ConfigDict(extra="ignore")

    batch: str
    phase: str | None = None
    """``claimed`` (the task started), ``paused``, ``waiting_gpu``, ``forward``, ``writing``,
    ``storing``, ``verifying`` or ``marker``."""
    since: str | None = None
    """When the batch entered the phase (UTC ISO 8601)."""


class SpoolStatus(BaseModel):
    """A worker's overflow spool (``workers/spool.py``), in bytes."""

    model_config = ConfigDict(extra="ignore")

    dir: str
    used_bytes: int
    total_bytes: int
    reserved_bytes: int = 0
    used_fraction: float
    uploads_pending: int = 0
    max_fraction: float | None = None
    """``HSX_SPOOL_MAX_FRACTION``."""
    max_pending_uploads: int | None = None
    """``HSX_MAX_PENDING_UPLOADS``."""


class WorkerStatus(Record):
    """``workers/<host>-<pid>.json``: one worker process's status in one run (``workers/heartbeat.py``
    writes it every ``HSX_HEARTBEAT_S``; stale after 3 intervals)."""

    schema_version: Literal[1] = 1
    host: str
    pid: int
    pid_ns: str | None = None
    """The process's PID namespace (``hsx.processes.pid_namespace``): ``status`` on the same host and
    namespace tells a dead process at once, from its missing pid."""
    worker: str | None = None
    """``<host>-<pid>``, the key's name."""
    device: str | None = None
    """torch device of its model (``cpu``, ``NVIDIA H200``...), None before one is loaded."""
    state: WorkerState
    paused_reason: str | None = None
    """Why extraction waits (spool backpressure), None when not paused."""
    paused_since: str | None = None
    batches: list[BatchLease] = Field(default_factory=list)
    """The batches whose lease the process holds."""
    batches_done: int = 0
    """Batches of this run the process certified since it started."""
    spool: SpoolStatus | None = None
    started_at: str | None = None
    updated_at: str | None = None
    """The last heartbeat (UTC ISO 8601)."""
    heartbeat_s: float | None = None
    """The writing interval (seconds)."""
    exit: str | None = None
    """Set by ``python -m workers`` for a process it found dead: how it ended (``killed by SIGKILL``)."""
    exited_at: str | None = None
    abandoned: list[str] = Field(default_factory=list)
    """Set with ``exit``: the batches the dead process listed; ``python -m workers`` puts their
    claims back on the queue at once instead of waiting out their lease (``workers/lease.py``)."""

    @property
    def name(self) -> str:
        """``<host>-<pid>``."""
        return self.worker or f"{self.host}-{self.pid}"

    @classmethod
    def read(cls, store: Store, worker: str) -> "WorkerStatus | None":
        """The record of worker process ``worker`` (``<host>-<pid>``), None if it wrote none."""
        return cls._read(store, layout.worker_key(worker))

    def write(self, store: Store) -> None:
        store.write(layout.worker_key(self.name), self.to_json())


def read_heartbeats(store: Store) -> list[WorkerStatus]:
    """Every worker status record of the run; unreadable ones (half written, another format) skipped."""
    names = layout.names_under(store.list(layout.WORKERS_PREFIX), layout.WORKERS_PREFIX)

    def read(name: str) -> WorkerStatus | None:
        try:
            return WorkerStatus.read(store, name)
        except RecordFormatError:
            return None

    with ThreadPoolExecutor(8) as pool:
        return [h for h in pool.map(read, names) if h is not None]


# --- reclaims --------------------------------------------------------------------------------


class Reclaim(Record):
    """``reclaims/<batch>-<tag>.<attempt>.json``: a worker found the lease of delivery ``delivery_tag``
    of ``batch`` expired, or ``python -m workers`` saw the worker running it die, and the batch goes
    back on the queue (``workers/lease.py``); created with a conditional create, so of all the
    workers exactly one does it."""

    schema_version: Literal[1] = 1
    batch: str
    delivery_tag: str
    """kombu's delivery tag of the stale message."""
    task_id: str | None = None
    attempt: int
    """1, or the next after a winner that did not finish."""
    claimed_at: str | None = None
    """When the message was delivered (or due), UTC ISO 8601."""
    by: str
    """The reclaiming process, ``<host>-<pid>`` (a worker, or the launcher of the one that died)."""
    why: str = "lease expired"
    """``lease expired`` or ``its worker died``."""
    host: str = Field(default_factory=socket.gethostname)
    at_unix: float
    """When, Unix seconds."""
    at: str | None = None
    """When, UTC ISO 8601."""

    @property
    def key(self) -> str:
        return layout.reclaim_key(self.batch, self.delivery_tag, self.attempt)

    @classmethod
    def read(cls, store: Store, batch: str, tag: str, attempt: int) -> "Reclaim | None":
        return cls._read(store, layout.reclaim_key(batch, tag, attempt))

    def create(self, store: Store) -> bool:
        """Create the record (conditional create); True if this call won the reclaim."""
        return store.create(self.key, self.to_json())


class Cancelled(Record):
    """``cancelled.json``: ``producer cancel`` stopped the run. Workers start no batch of a cancelled
    run (each such message is acknowledged and left undone); ``producer run`` / ``enqueue`` of the
    same run removes the record and resumes it."""

    schema_version: Literal[1] = 1
    by: str = ""
    """Who cancelled: ``<user>@<host>``."""
    at: str | None = None
    """When, UTC ISO 8601."""
    now: bool = False
    """``--now``: running batches were told to stop too."""

    @classmethod
    def read(cls, store: Store) -> "Cancelled | None":
        return cls._read(store, layout.CANCELLED_JSON)

    def write(self, store: Store) -> None:
        store.write(layout.CANCELLED_JSON, self.to_json())

    @staticmethod
    def delete(store: Store) -> None:
        store.delete(layout.CANCELLED_JSON)


# --- the plan --------------------------------------------------------------------------------


class SkipCounts(BaseModel):
    """Dataset records that did not become samples (``producer/datasets.py`` ``SkipCounter``)."""

    model_config = ConfigDict(extra="ignore")

    total: int = 0
    counts: dict[str, int] = Field(default_factory=dict)
    """Records skipped, by reason (``no_turns``, ``unknown_role``...)."""
    examples: dict[str, list[str]] = Field(default_factory=dict)
    fixes: dict[str, int] = Field(default_factory=dict)
    """Records repaired and kept, by repair."""
    truncated_bytes: dict[str, int] = Field(default_factory=dict)


class Stats(Record):
    """``plan/stats.json``: what the plan holds (``producer/planner.py``)."""

    REPAIR: ClassVar[str] = "plan the run again into a new --output (the plan is written once)"

    schema_version: Literal[1] = 1
    samples: int
    tokens: int
    supervised_tokens: int
    truncated_samples: int = 0
    batches: int
    padding_waste: float | None = None
    """Fraction of a padded layout's tokens that would be padding (``producer/batching.py``)."""
    skipped: SkipCounts = Field(default_factory=SkipCounts)
    plan_seconds: float | None = None
    windows: int | None = None
    """Windows of the streamed plan (None: a run planned before windows, sorted as a whole)."""
    records_read: int | None = None
    """Records of the dataset read, skipped ones included."""
    bytes_read: int | None = None
    num_proc: int | None = None
    """Tokenising processes the plan was made with (it does not change the plan)."""
    command: str | None = None
    """The command line that planned it (``python -m producer run ...``): the same command resumes the
    run; one with other options plans another run id (``status`` and ``cancel`` show it)."""

    @classmethod
    def read(cls, store: Store) -> "Stats | None":
        return cls._read(store, layout.STATS_JSON)

    def write(self, store: Store) -> None:
        store.write(layout.STATS_JSON, self.to_json())


class BatchSummary(Record):
    """One entry of ``plan/batches.json`` (:meth:`hsx.plan.BatchPlan.summary`)."""

    REPAIR: ClassVar[str] = Stats.REPAIR

    schema_version: Literal[1] = 1
    batch: str
    num_samples: int
    num_tokens: int
    max_len: int | None = None
    supervised_tokens: int | None = None

    @staticmethod
    def read_list(store: Store) -> list["BatchSummary"]:
        """``plan/batches.json``. Raises :class:`MissingKey` while the plan is not complete."""
        data = store.read(layout.BATCHES_JSON)
        try:
            return _BATCH_LIST.validate_json(data)
        except ValidationError as exc:
            raise BatchSummary._format_error(layout.BATCHES_JSON, exc) from None

    @staticmethod
    def write_list(store: Store, batches: list["BatchSummary"]) -> None:
        """Write ``plan/batches.json`` (last: its presence means the plan is complete)."""
        store.write(layout.BATCHES_JSON, _BATCH_LIST.dump_json(batches, exclude={"__all__": {"schema_version"}}))


_BATCH_LIST = TypeAdapter(list[BatchSummary])


class SampleRow(Record):
    """One line of a window's ``plan/samples/<window>.jsonl`` (lines in ``sample_index`` order);
    runs made before the streamed plan hold them all in ``plan/samples.jsonl``."""

    REPAIR: ClassVar[str] = Stats.REPAIR

    schema_version: Literal[1] = 1
    sample_index: int
    record_id: str | int
    """The dataset record the sample came from: its own ``id`` (a str or an int) or ``<file>:<index>``."""
    num_tokens: int
    supervised_tokens: int
    truncated: bool = False
    batch: str
    scope: str | None = None
    """The file (``<split>`` of a Hugging Face dataset) the record was read from, within which its id is
    unique (``producer.datasets.IdClaims``); None in plans made before it was recorded."""

    @staticmethod
    def read_all(store: Store) -> list["SampleRow"]:
        """Every sample row of the plan, in ``sample_index`` order: the windows' files (those written
        so far while the plan is streamed), or ``plan/samples.jsonl`` of a run made before windows.

        Raises :class:`RecordFormatError` naming the file and line.
        """
        try:
            return SampleRow._parse(store.read(layout.SAMPLES_JSONL), layout.SAMPLES_JSONL)
        except MissingKey:
            pass
        windows = read_windows(store)
        with ThreadPoolExecutor(8) as pool:
            parts = list(pool.map(lambda w: SampleRow.read_window(store, w.name), windows))
        return [row for part in parts for row in part]

    @staticmethod
    def read_window(store: Store, window: str) -> list["SampleRow"]:
        """The rows of one window (``plan/samples/<window>.jsonl``). Raises :class:`MissingKey` if absent."""
        key = layout.window_samples_key(window)
        return SampleRow._parse(store.read(key), key)

    @staticmethod
    def _parse(data: bytes, key: str) -> list["SampleRow"]:
        out = []
        for n, line in enumerate(data.decode().splitlines(), start=1):
            if line.strip():
                out.append(SampleRow.from_json(line, f"{key} line {n}"))
        return out

    @staticmethod
    def rows_bytes(rows) -> bytes:
        """The JSON-lines bytes of ``rows`` (what :meth:`write_window` stores)."""
        lines = [json.dumps(r.model_dump(mode="json", exclude={"schema_version"})) for r in rows]
        return ("\n".join(lines) + "\n").encode() if lines else b""

    @staticmethod
    def write_window(store: Store, window: str, rows) -> None:
        """Write ``plan/samples/<window>.jsonl`` from an iterable of rows."""
        store.write(layout.window_samples_key(window), SampleRow.rows_bytes(rows))


class PlanWindow(Record):
    """``plan/windows/<window>.json``: one window of the streamed plan (``producer/planner.py``).

    The planner reads the dataset in order and cuts it into windows of consecutive samples; each
    window's samples are sorted by length and cut into batches on their own, so its batches can be
    enqueued while later windows are still tokenised. The record is written after the window's
    batch files and sample rows: its presence means those are in the store. Windows are numbered
    from 0 without gaps; their samples and batches follow each other (window k's first sample is
    window k-1's ``first_sample + num_samples``, the same for batches).
    """

    REPAIR: ClassVar[str] = Stats.REPAIR

    schema_version: Literal[1] = 1
    window: int
    """0-based index; the record's name is ``w<window:06d>``."""
    first_sample: int
    num_samples: int
    first_batch: int
    """The index of its first batch (``b<first_batch:06d>``)."""
    batches: list[BatchSummary]
    tokens: int
    supervised_tokens: int
    truncated_samples: int = 0
    padded_tokens: int
    """Sum over its batches of rows x longest row: the padding waste is ``1 - tokens / padded_tokens``."""
    records_read: int
    """Records of the dataset read through the end of this window (counted from the start of the
    dataset, skipped ones included): a resumed plan starts reading after them."""
    skipped: SkipCounts = Field(default_factory=SkipCounts)
    """The records of this window that became no sample (this window's only, not cumulative)."""
    claimed_ids: list[str] = Field(default_factory=list)
    """Ids that records of this window claimed (they passed the record checks) but that became no
    sample (too long, no supervised tokens, template error): with the samples' ids, what a resumed
    plan needs to skip a later record with the same id as ``duplicate_id``, as one pass would."""
    claimed_scopes: list[str | None] = Field(default_factory=list)
    """The scope (file) of each of ``claimed_ids`` (empty in plans made before it was recorded)."""
    last: bool = False
    """The dataset ended (or ``--limit`` was reached) in this window."""

    @property
    def name(self) -> str:
        return f"w{self.window:06d}"

    @classmethod
    def read(cls, store: Store, window: str) -> "PlanWindow | None":
        return cls._read(store, layout.window_key(window))

    def write(self, store: Store) -> None:
        store.write(layout.window_key(self.name), self.to_json())


def read_windows(store: Store) -> list[PlanWindow]:
    """The plan's windows written so far, in order: ``w000000``, ``w000001``... up to the first gap.

    A window after a gap (written by a planner that raced ahead, if ever) is not returned: a window
    counts only when every earlier one is in the store. Raises :class:`RecordFormatError` for a
    damaged window record.
    """
    names = sorted(layout.names_under(store.list(layout.PLAN_WINDOWS_PREFIX), layout.PLAN_WINDOWS_PREFIX))
    with ThreadPoolExecutor(8) as pool:
        windows = [w for w in pool.map(lambda n: PlanWindow.read(store, n), names) if w is not None]
    out = []
    for w in sorted(windows, key=lambda w: w.window):
        if w.window != len(out):
            break
        out.append(w)
    return out


class Planning(Record):
    """``plan/planning.json``: who plans the run and how far it got, while the plan is written; and
    why planning failed. Removed when the plan is complete; ignored once ``plan/batches.json`` exists.

    The progress fields are rewritten after each window of the plan (``producer/planner.py``), so
    ``status`` shows a run that is still planning: records read, samples, windows and batches so far,
    and the dataset's bytes read out of its total (the planning's ETA).
    """

    schema_version: Literal[1] = 1
    state: Literal["planning", "failed"]
    host: str | None = None
    pid: int | None = None
    started_at: str | None = None
    command: str | None = None
    """The command line that plans it."""
    error: str | None = None
    failed_at: str | None = None
    records_read: int | None = None
    samples: int | None = None
    windows: int | None = None
    batches: int | None = None
    bytes_read: int | None = None
    bytes_total: int | None = None
    """The dataset's size in bytes (None: not known, e.g. a hub dataset streamed)."""
    records_total: int | None = None
    """Records the plan reads in all, when known before reading (``--limit``, ``--sample``)."""
    updated_at: str | None = None
    updated_unix: float | None = None
    started_unix: float | None = None
    num_proc: int | None = None
    """Tokenising processes."""

    @classmethod
    def read(cls, store: Store) -> "Planning | None":
        return cls._read(store, layout.PLANNING_JSON)

    def write(self, store: Store) -> None:
        store.write(layout.PLANNING_JSON, self.to_json())

    @staticmethod
    def delete(store: Store) -> None:
        store.delete(layout.PLANNING_JSON)


#: Every record class and the schema version it reads and writes (the module doc says when it changes).
SCHEMA_VERSIONS: dict[str, int] = {c.__name__: c.VERSION for c in
                                   (Marker, Failure, WorkerStatus, Reclaim, Stats, BatchSummary, SampleRow, PlanWindow,
                                    Planning)}
