"""Smoke tests of the benchmark scripts: they run to the end on tiny inputs and write well-formed
JSON. Shape only: no figure is compared with a threshold (timings belong in BENCHMARKS.md).

Each script runs as a subprocess in a clean environment (no HSX_* / AWS_* of the machine), with
the session's tiny-model cache as HSX_CACHE_DIR.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from jobfixtures import clean_env

ROOT = Path(__file__).resolve().parents[1]
MACHINE_KEYS = {"date_utc", "cpus", "cpu_model", "ram_gib", "python", "torch", "transformers", "git_commit"}


def _run_bench(script: str, args: list[str], cache: Path, timeout_s: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, f"bench/{script}", *args], cwd=ROOT, env=clean_env(cache_dir=cache),
                          capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    return proc


def test_planning_bench_reports_every_stage_with_positive_rates(tmp_path, tiny_cache):
    """bench/planning.py --limit 50 writes stages a, b and c, each with samples, tokens and positive rates."""
    out = tmp_path / "planning.json"
    proc = _run_bench("planning.py", ["--limit", "50", "--json", str(out)], tiny_cache)
    report = json.loads(out.read_text())
    assert report["benchmark"] == "planning"
    assert MACHINE_KEYS <= report["machine"].keys()
    assert report["params"]["limit"] == 50
    stages = {s["stage"]: s for s in report["stages"]}
    assert {"a_stream", "b_encode", "c_plan_run"} <= stages.keys(), sorted(stages)
    for name, s in stages.items():
        assert "mismatch" not in s, s["mismatch"]
        for key in ("samples", "tokens", "wall_s", "samples_per_s", "tokens_per_s"):
            assert s[key] > 0, f"stage {name}: {key} = {s[key]}"
    assert 0 < stages["b_encode"]["samples"] <= 50
    assert stages["c_plan_run"]["batches"] > 0
    assert set(report["fixed"]) >= {"dataset_fingerprint_s", "tokenizer_load_s"}
    assert "c_plan_run" in proc.stdout, "the table is printed"


def test_task_overhead_bench_measures_exactly_the_tasks_asked_for_on_each_store_and_concurrency(tmp_path, tiny_cache):
    """bench/task_overhead.py --tasks 10 --concurrency 1,2 times ten tasks per store (local, and S3
    unless weed is missing) and per thread count."""
    out = tmp_path / "task-overhead.json"
    proc = _run_bench("task_overhead.py", ["--tasks", "10", "--stores", "local,s3", "--concurrency", "1,2",
                                           "--json", str(out)], tiny_cache)
    report = json.loads(out.read_text())
    assert report["benchmark"] == "task_overhead"
    assert MACHINE_KEYS <= report["machine"].keys()
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


def test_soak_bench_runs_tasks_over_several_workers_and_finds_the_output_exactly_once(tmp_path, tiny_cache):
    """bench/soak.py --tasks 20 --workers 2 --store local: twenty timed tasks over two worker processes; verify passes, no orphan, no duplicate."""
    out = tmp_path / "soak.json"
    proc = _run_bench("soak.py", ["--tasks", "20", "--workers", "2", "--store", "local", "--json", str(out)], tiny_cache)
    report = json.loads(out.read_text())
    assert report["benchmark"] == "soak" and MACHINE_KEYS <= report["machine"].keys()
    r = report["result"]
    assert r["tasks"] == 20 and r["workers"] == 2
    for key in ("tasks_per_s", "overhead_ms_per_task", "in_task_ms_median", "in_task_ms_p99", "forward_ms_median"):
        assert r[key] > 0, f"{key} = {r[key]}"
    assert r["in_task_ms_p99"] >= r["in_task_ms_median"]
    once = r["exactly_once"]
    assert once["verify_ok"] and once["orphan_shards"] == 0, once
    assert once["samples_stored"] + once["samples_quarantined"] == once["samples_planned"]
    assert "exactly once" in proc.stdout


def test_s3_host_cost_bench_sends_the_same_bytes_three_ways(tmp_path, tiny_cache):
    """bench/s3_host_cost.py on a small shard: ours (write_stream), plain upload_fileobj and the spool hop each
    report GB/s and CPU s per GB against a real loopback SeaweedFS."""
    out = tmp_path / "s3.json"
    _run_bench("s3_host_cost.py", ["--tokens", "512", "--hidden", "256", "--repeats", "1", "--json", str(out)], tiny_cache,
               timeout_s=180)
    report = json.loads(out.read_text())
    assert report["shard_bytes"] > 512 * 5 * 256 * 2
    for way in ("ours", "plain", "spool_hop"):
        assert report[way]["gb_s_median"] > 0 and report[way]["cpu_s_per_gb"] >= 0, report[way]
    assert report["ours_over_plain"] > 0
