"""Training while extracting: follow a run that is still being written, one certified batch at a time.

:class:`LiveHiddenStatesDataset` polls the run's ``markers/`` listing (one prefix listing per poll:
cheap on S3 and on disk), reads each new marker once, and yields the samples of every batch once
its marker exists. A marker is created last, with a conditional create, after its shard was stored
and verified (:class:`hsx.records.Marker`), so a batch the reader sees is complete; the reader hashes the shard
against the marker's sha256 where :class:`hsx.reader.IterableHiddenStatesDataset` does (always
for shards it downloads from S3, local ones with ``verify=True``).

Order. Batches are scheduled in **windows**: each poll that finds newly certified batches appends
them to the schedule, sorted by ``order_key(seed, batch)`` (BLAKE2b of the seed and the batch id).
So:

- a reader started on a given set of finished batches yields exactly that set first, in an order
  that is a function of the seed and the set alone; it is the restriction of one seeded total order
  of batch ids, so one more finished batch slots in without reshuffling the others;
- batches certified later follow, window by window, each window in the same seeded order. Which
  window a batch falls into depends on when its marker appeared relative to the polls; the
  schedule is part of :meth:`~LiveHiddenStatesDataset.state_dict`, so a resumed reader keeps it;
- samples of a batch come in shard row order (the plan's order), quarantined ones left out.

On a finished run the first poll sees every batch: one window, a seeded shuffle of the batches.

Position. ``state_dict()`` (JSON-able) records the schedule, the batch being read and how many of
its shard rows were yielded; ``load_state_dict()`` on a new reader of the same run, seed, rank and
world size continues right after the last sample the trainer received: no sample repeated, none
skipped (the convention of torchdata's ``StatefulDataLoader``: a state taken after item n resumes
at item n + 1).

Plan. The plan is streamed (hsx/plan.py): while it is written, the planned batches are those of
the windows written so far, and their batches are extracted meanwhile, so the reader follows the
windows too. Each poll before the plan is complete reads the batches planned so far again
(:func:`hsx.plan.planned_batches`): ``planned`` grows window by window, and a marker is taken
only for a batch planned (one whose window appeared after the poll read the windows waits for
the next poll).

End. Iteration stops when the plan is complete (``plan/batches.json``, written last by the
planner) and every planned batch of this rank has been yielded (``stop_reason == "complete"``),
or when for ``idle_timeout_s`` seconds no new batch was certified and no new window planned
(``"idle_timeout"``: a batch that fails every time never gets a marker; the warning says how
many planned batches have a ``failures/`` record). If the planning failed (``plan/planning.json``),
the batches of the windows it wrote are still yielded as they are certified; once all of this
rank's are, iterating raises :class:`~hsx.errors.HsxError` (no batch will come until the
producer is run again). Iterating again continues from the position.

Ranks. With ``world_size`` W, batch b belongs to rank ``rank_of(b, W)`` (a hash of its id): every
rank decides alone, whatever it saw when, and the ranks' batches are disjoint and cover the run.
The reader runs in the process that iterates it: use it with a DataLoader of ``num_workers=0``
(more workers would each follow the whole run; they are refused).
"""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path
from typing import Iterator

from hsx.errors import BadConfig, FidelityError, HsxError
from hsx.layout import FAILURES_PREFIX, names_under
from hsx.plan import planned_batches, planning_failed, read_planning_record
from hsx.reader import (_IterableDataset, _final_names, _open_run, certified_rows, marker_problem, read_markers,
                         read_sample)
from hsx.records import Marker, done_batches
from hsx.runconfig import load_run
from hsx.store import MissingKey, Store

log = logging.getLogger(__name__)

#: format tag of :meth:`LiveHiddenStatesDataset.state_dict`; bump when its fields change meaning.
STATE_FORMAT = "hsx-live-reader/1"
#: seconds between polls of ``markers/`` while nothing new is certified.
DEFAULT_POLL_S = 5.0
#: seconds without a newly certified batch after which iteration stops (None: wait for ever).
DEFAULT_IDLE_TIMEOUT_S = 3600.0


def order_key(seed: int, batch: str) -> bytes:
    """The sort key of ``batch`` under ``seed``: 8 bytes of BLAKE2b over ``"<seed>:<batch>"``.

    A keyed hash rather than ``random.shuffle`` so that the order of any set of batches is the
    restriction of one total order (stable across Python versions and processes; no ``hash()``).
    """
    return hashlib.blake2b(f"{int(seed)}:{batch}".encode(), digest_size=8).digest()


def rank_of(batch: str, world_size: int) -> int:
    """The rank in ``[0, world_size)`` that reads ``batch`` (a hash of its id, independent of the seed)."""
    digest = hashlib.blake2b(f"rank:{batch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % world_size


class LiveHiddenStatesDataset(_IterableDataset):
    """Yields the samples of a run's batches as their markers appear, local or S3 (see the module docstring).

    Each sample is a dict as from :class:`hsx.reader.IterableHiddenStatesDataset` (``sample_index``
    int, ``input_ids`` / ``loss_mask`` int64 [S], ``hidden_states`` [S, K*H], the asked finals
    [S, H], dequantised to bf16 for fp8 runs) plus ``batch`` (str): the batch it came from.

    Args:
        run: the run's address (``<output>/<run_id>``, ``s3://bucket/prefix/<run_id>``) or its Store.
        seed: the order of batches within a window (``order_key``).
        finals, dequant_dtype, raw: as for :class:`hsx.reader.HiddenStatesDataset`.
        settings: :class:`settings.Settings` for S3 endpoint and credentials.
        poll_s: seconds between listings of ``markers/`` while waiting for a new batch.
        idle_timeout_s: stop after this many seconds without a newly certified batch (None: never).
        wait_for_run_s: seconds to wait for ``run.json`` to appear (a producer still tokenising
            writes nothing before its plan); 0: it must exist now.
        rank, world_size: read only the batches with ``rank_of(batch, world_size) == rank``.
        verify: hash each shard against its marker (default: downloaded copies only; True: local
            files too; False: never).
        tmp_dir: where downloaded shards live while they are read.

    Raises:
        hsx.store.MissingKey: no ``run.json`` at ``run`` (after ``wait_for_run_s``).
        BadConfig: a bad rank / world size / poll interval, or finals the run did not store.
    """

    def __init__(self, run: str | Path | Store, *, seed: int = 0, finals: str = "present", settings=None,
                 poll_s: float = DEFAULT_POLL_S, idle_timeout_s: float | None = DEFAULT_IDLE_TIMEOUT_S,
                 wait_for_run_s: float = 0.0, rank: int = 0, world_size: int = 1, verify: bool | None = None,
                 tmp_dir: Path | None = None, dequant_dtype=None, raw: bool = False):
        if not 0 <= rank < world_size:
            raise BadConfig(f"rank {rank} / world_size {world_size}: need 0 <= rank < world_size")
        if not poll_s > 0:
            raise BadConfig(f"poll_s={poll_s!r}: the seconds between polls must be > 0")
        self.store = _open_run(run, settings)
        self.config = self._wait_for_run(wait_for_run_s, poll_s)
        self.config_sha256 = self.config.identity_sha256()
        self.layer_ids: list[int] = list(self.config.layers.layer_ids)
        self.hidden_size = self.config.model.hidden_size
        self.finals = _final_names(self.config, finals)
        self.seed, self.rank, self.world_size = int(seed), rank, world_size
        self.poll_s, self.idle_timeout_s = poll_s, idle_timeout_s
        self.verify, self.tmp_dir = verify, tmp_dir
        self.dequant_dtype, self.raw = dequant_dtype, raw
        self.schedule: list[str] = []
        """Batch ids in the order they are (and will be) yielded: the windows so far, concatenated."""
        self.cursor = 0
        """Index in ``schedule`` of the batch being read (== len(schedule): waiting for a new one)."""
        self.offset = 0
        """Shard rows of ``schedule[cursor]`` already yielded (quarantined rows count as passed)."""
        self.planned: set[str] | None = None
        """This rank's batches planned so far: those of the windows written, or of the batch list once
        the plan is complete (None before the first poll)."""
        self.plan_complete = False
        """``plan/batches.json`` was read: ``planned`` is final."""
        self.plan_failed: str | None = None
        """Why the planning stopped before the plan was complete (``plan/planning.json``), or None."""
        self.stop_reason: str | None = None
        """Why the last iteration ended: ``complete`` or ``idle_timeout`` (None while it runs)."""
        self.certified: int | None = None
        """This rank's planned batches the run had certified (their markers listed) at the last look
        (:meth:`poll`, :meth:`load_state_dict`); None before one. The schedule may hold fewer: it
        takes new batches only when the reader needs them."""
        self._markers: dict[str, Marker] = {}
        self._warned: set[str] = set()

    def _wait_for_run(self, wait_s: float, poll_s: float):
        """run.json, polled every ``poll_s`` for up to ``wait_s`` seconds (MissingKey after that)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return load_run(self.store)
            except MissingKey:
                left_s = deadline - time.monotonic()
                if left_s <= 0:
                    raise MissingKey(
                        f"no run.json in {self.store.url} after waiting {wait_s:g} s (wait_for_run_s): give the run's "
                        "address, <output>/<run_id> as `producer run` prints it, and a longer wait_for_run_s if the "
                        "producer is still tokenising") from None
            time.sleep(min(poll_s, left_s))

    def _mine(self, batch: str) -> bool:
        return self.world_size == 1 or rank_of(batch, self.world_size) == self.rank

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("%s", message)

    # --- following the run -------------------------------------------------------------------

    def _read_plan(self) -> None:
        """``planned`` (and ``plan_complete``, ``plan_failed``): this rank's batches planned so far."""
        batches, complete = planned_batches(self.store)
        self.planned = {b.batch for b in batches if self._mine(b.batch)}
        self.plan_complete = complete
        self.plan_failed = None if complete else planning_failed(read_planning_record(self.store))

    def poll(self) -> list[str]:
        """One look at the run: the batches planned so far (until the plan is complete), then list
        ``markers/``, read the markers not seen before, and append the newly certified batches of
        this rank to ``schedule`` as one window (seeded order).

        Returns the window (empty when nothing new). Markers that do not certify this run's batch
        (unreadable, another config, a batch the complete plan does not hold) are skipped with one
        warning each; while the plan is written, a marker of a batch not planned yet waits for a
        later poll.

        Raises:
            hsx.errors.RecordFormatError: a damaged batch list or window record.
            hsx.errors.StoreError: the store cannot be listed or read.
        """
        if not self.plan_complete:
            self._read_plan()
        known = set(self.schedule)
        names = sorted(done_batches(self.store))
        self._count_certified(names)
        new = [b for b in names if b not in known and self._mine(b)
               and (self.plan_complete or b in self.planned)]  # its window read after ours: next poll
        if not new:
            return []
        window = []
        for batch, marker in read_markers(self.store, new).items():
            problem = marker_problem(batch, marker, self.config_sha256)
            if problem is None and batch not in self.planned:
                problem = f"marker of {batch}: the run's plan has no batch {batch}: skipped"
            if problem:
                self._warn_once(batch, problem)
                continue
            self._markers[batch] = marker
            window.append(batch)
        window.sort(key=lambda b: order_key(self.seed, b))
        self.schedule.extend(window)
        return window

    def complete(self) -> bool:
        """True when the plan is complete and every planned batch of this rank is in the schedule
        (the run is done for us)."""
        return self.plan_complete and self.planned is not None and self.planned.issubset(self.schedule)

    def _count_certified(self, names: list[str]) -> None:
        self.certified = sum(1 for b in names if self._mine(b) and (self.planned is None or b in self.planned))

    def progress(self) -> dict:
        """``{"yielded": batches fully or partly read, "certified": int, "planned": int | None}``: of this
        rank's batches, ``certified`` those the run had certified at the last look (:attr:`certified`;
        before any, the ones scheduled), ``planned`` those planned so far (``plan_complete`` says
        whether that is all; None before the plan was read)."""
        return {"yielded": self.cursor, "certified": len(self.schedule) if self.certified is None else self.certified,
                "planned": None if self.planned is None else len(self.planned)}

    def _next_batch(self) -> str | None:
        """The batch at ``cursor``, polling (and sleeping ``poll_s``) until one is certified; None
        when the run is complete for this rank or ``idle_timeout_s`` passed without a new batch or
        window. Raises :class:`HsxError` when the planning failed and every batch it planned for
        this rank was yielded."""
        last_new = time.monotonic()
        while True:
            if self.cursor < len(self.schedule):
                return self.schedule[self.cursor]
            if self.complete():
                self.stop_reason = "complete"
                return None
            planned_before = len(self.planned or ())
            if self.poll():
                last_new = time.monotonic()
                continue
            if self.complete():
                continue
            if self.plan_failed and self.planned.issubset(self.schedule):
                raise HsxError(f"run {self.config.run_id} in {self.store.url}: its planning failed ({self.plan_failed}) "
                               f"after {len(self.planned)} batches of this rank, all read; no more batch will be "
                               "certified. Fix the cause and run the producer again (it resumes the plan), then iterate again.")
            if len(self.planned) > planned_before:  # a new window: the run goes on
                last_new = time.monotonic()
            idle_s = time.monotonic() - last_new
            if self.idle_timeout_s is not None and idle_s >= self.idle_timeout_s:
                self.stop_reason = "idle_timeout"
                self._log_idle(idle_s)
                return None
            time.sleep(self.poll_s)

    def _log_idle(self, idle_s: float) -> None:
        missing = None if self.planned is None else sorted(self.planned.difference(self.schedule))
        failed = 0
        if missing:
            failures = set(names_under(self.store.list(FAILURES_PREFIX), FAILURES_PREFIX))
            failed = len(failures.intersection(missing))
        log.warning(
            "run %s: no new batch certified for %.0f s (idle_timeout_s=%s): stopping after %d batches; %s planned "
            "batches of this rank have no marker yet (%d with a failures/ record)%s. `python -m producer status %s` "
            "says why; iterate again to go on following the run",
            self.config.run_id, idle_s, self.idle_timeout_s, self.cursor,
            "?" if missing is None else len(missing), failed,
            "" if self.plan_complete else "; the plan is not complete (no new window either)", self.store.url)

    def _marker(self, batch: str) -> Marker:
        marker = self._markers.get(batch)
        if marker is None:  # a schedule loaded from a checkpoint: read its markers again
            found = read_markers(self.store, [batch])[batch]
            if isinstance(found, MissingKey):
                raise FidelityError(
                    f"batch {batch} of run {self.config.run_id} is in the checkpointed schedule but its marker is gone "
                    f"from {self.store.url} (removed by `producer reconcile --repair`?); let the batch be redone, "
                    "then resume")
            problem = marker_problem(batch, found, self.config_sha256)
            if problem:
                raise FidelityError(f"batch {batch} is in the checkpointed schedule but: {problem}")
            marker = self._markers[batch] = found
        return marker

    def _rows(self, batch: str, start: int) -> Iterator[tuple[int, bool, dict]]:
        """``(row, last, sample)`` for the shard rows of ``batch`` from ``start`` on (quarantined left out);
        ``last`` marks the batch's last returned row."""
        check = self.verify if self.verify is not None else self.store.location.is_s3
        with certified_rows(self.store, self._marker(batch), check=check, tmp_dir=self.tmp_dir, start=start) as (f, rows):
            for n, (j, sample, a, b) in enumerate(rows):
                sample_dict = read_sample(f, a, b, self.finals, dequant_dtype=self.dequant_dtype, raw=self.raw)
                yield j, n == len(rows) - 1, {"sample_index": sample, "batch": batch, **sample_dict}

    def __iter__(self) -> Iterator[dict]:
        import torch.utils.data

        info = torch.utils.data.get_worker_info()
        if info is not None and info.num_workers > 1:
            raise BadConfig(f"LiveHiddenStatesDataset in a DataLoader with num_workers={info.num_workers}: each worker "
                            "would follow the whole run; use num_workers=0 (shards are read in the loop's process)")
        self.stop_reason = None
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            emitted = False
            for row, last, sample in self._rows(batch, self.offset):
                # Position first, then yield: a state taken after this sample resumes after it.
                if last:
                    self.cursor, self.offset = self.cursor + 1, 0
                else:
                    self.offset = row + 1
                emitted = True
                yield sample
            if not emitted:  # every remaining row was quarantined or already yielded
                self.cursor, self.offset = self.cursor + 1, 0

    # --- checkpointing -----------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The reader's position, JSON-able: ``format``, ``run_id``, ``config_sha256``, ``seed``,
        ``rank``, ``world_size``, ``schedule`` (batch ids), ``cursor`` (index in it) and ``offset``
        (shard rows of ``schedule[cursor]`` already yielded)."""
        return {"format": STATE_FORMAT, "run_id": self.config.run_id, "config_sha256": self.config_sha256,
                "seed": self.seed, "rank": self.rank, "world_size": self.world_size,
                "schedule": list(self.schedule), "cursor": self.cursor, "offset": self.offset}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (from :meth:`state_dict` of a reader of the same run, seed, rank and
        world size): the next sample is the one after the last sample yielded before it was taken.

        Raises:
            BadConfig: ``state`` is not a live reader state, or was taken for another run, run
                config, seed, rank or world size (the schedule would not mean the same batches).
            hsx.errors.StoreError: the store cannot be read (one look at the plan and the markers).
        """
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise BadConfig(f"not a live reader state (format {state.get('format') if isinstance(state, dict) else state!r}, "
                            f"expected {STATE_FORMAT!r}): pass what LiveHiddenStatesDataset.state_dict() returned")
        mine = self.state_dict()
        for name in ("run_id", "config_sha256", "seed", "rank", "world_size"):
            if state.get(name) != mine[name]:
                raise BadConfig(f"the reader state was taken with {name}={state.get(name)!r}, this reader has "
                                f"{name}={mine[name]!r}; resume with the same run and the same {name}")
        schedule = [str(b) for b in state["schedule"]]
        cursor, offset = int(state["cursor"]), int(state["offset"])
        if not 0 <= cursor <= len(schedule) or offset < 0 or len(set(schedule)) != len(schedule):
            raise BadConfig(f"reader state: cursor {cursor}, offset {offset} over a schedule of {len(schedule)} batches "
                            "(with duplicates?) is not a position; pass an unmodified state_dict()")
        self.schedule, self.cursor, self.offset = schedule, cursor, offset
        self._markers = {b: m for b, m in self._markers.items() if b in set(schedule)}
        # One look at the plan and the markers, so that progress() tells the run as it is now (a
        # resumed reader yields from its schedule before it polls again); the schedule is unchanged.
        if not self.plan_complete:
            self._read_plan()
        self._count_certified(sorted(done_batches(self.store)))
