"""Smoke tests of the benchmark scripts: they run to the end on tiny inputs and write well-formed
JSON. Shape only: no figure is compared with a threshold (timings belong in BENCHMARKS.md).

Each script runs as a subprocess in a clean environment (no HSX_* / AWS_* of the machine), with
the session's tiny-model cache as HSX_CACHE_DIR. This one: bench/soak.py.
"""

from __future__ import annotations

import json

from jobfixtures import BENCH_MACHINE_KEYS, run_bench


def test_soak_bench_runs_tasks_over_several_workers_and_finds_the_output_exactly_once(tmp_path, tiny_cache):
    """bench/soak.py --tasks 20 --workers 2 --store local: twenty timed tasks over two worker processes; verify passes, no orphan, no duplicate."""
    out = tmp_path / "soak.json"
    proc = run_bench("soak.py", ["--tasks", "20", "--workers", "2", "--store", "local", "--json", str(out)], tiny_cache)
    report = json.loads(out.read_text())
    assert report["benchmark"] == "soak" and BENCH_MACHINE_KEYS <= report["machine"].keys()
    r = report["result"]
    assert r["tasks"] == 20 and r["workers"] == 2
    for key in ("tasks_per_s", "overhead_ms_per_task", "in_task_ms_median", "in_task_ms_p99", "forward_ms_median"):
        assert r[key] > 0, f"{key} = {r[key]}"
    assert r["in_task_ms_p99"] >= r["in_task_ms_median"]
    once = r["exactly_once"]
    assert once["verify_ok"] and once["orphan_shards"] == 0, once
    assert once["samples_stored"] + once["samples_quarantined"] == once["samples_planned"]
    assert "exactly once" in proc.stdout
