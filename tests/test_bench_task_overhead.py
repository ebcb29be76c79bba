"""Smoke tests of the benchmark scripts: they run to the end on tiny inputs and write well-formed
JSON. Shape only: no figure is compared with a threshold (timings belong in BENCHMARKS.md).

Each script runs as a subprocess in a clean environment (no HSX_* / AWS_* of the machine), with
the session's tiny-model cache as HSX_CACHE_DIR. This one: bench/task_overhead.py.
"""

from __future__ import annotations

import json

from jobfixtures import BENCH_MACHINE_KEYS, run_bench


def test_task_overhead_bench_measures_exactly_the_tasks_asked_for_on_each_store_and_concurrency(tmp_path, tiny_cache):
    """bench/task_overhead.py --tasks 10 --concurrency 1,2 times ten tasks per store (local, and S3
    unless weed is missing) and per thread count."""
    out = tmp_path / "task-overhead.json"
    proc = run_bench("task_overhead.py", ["--tasks", "10", "--stores", "local,s3", "--concurrency", "1,2",
                                           "--json", str(out)], tiny_cache)
    report = json.loads(out.read_text())
    assert report["benchmark"] == "task_overhead"
    assert BENCH_MACHINE_KEYS <= report["machine"].keys()
    assert {r["store"] for r in report["results"]} == {"local", "s3"}
    measured = [r for r in report["results"] if "skipped" not in r]
    seen = {(r["store"], r["concurrency"]) for r in measured}
    assert {("local", 1), ("local", 2)} <= seen, f"the local store is always measured: {sorted(seen)}"
    assert len(seen) == len(measured), "one result per store and concurrency"
    for r in measured:
        assert r["tasks"] == 10, r
        for key in ("samples", "tokens", "wall_s", "tasks_per_s", "overhead_ms_per_task", "forward_ms_median",
                    "in_task_ms_median", "in_task_ms_p99", "shard_bytes_mean"):
            assert r[key] > 0, f"{r['store']}, {r['concurrency']} threads: {key} = {r[key]}"
        assert r["in_task_ms_p99"] >= r["in_task_ms_median"]
        assert (r["outside_task_ms_per_task"] is None) == (r["concurrency"] > 1)
        assert r["setup"]["worker_ready_s"] > 0
    assert "tasks/s" in proc.stdout, "the table is printed"
