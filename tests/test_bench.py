"""Smoke tests of the benchmark scripts: they run to the end on tiny inputs and write well-formed
JSON. Shape only: no figure is compared with a threshold (timings belong in BENCHMARKS.md).

Each script runs as a subprocess in a clean environment (no HSX_* / AWS_* of the machine), with
the session's tiny-model cache as HSX_CACHE_DIR. The scripts that start worker processes have files of their own
(test_bench_task_overhead.py, test_bench_soak.py), so that pytest-xdist runs them beside these.
"""

from __future__ import annotations

import json

from jobfixtures import BENCH_MACHINE_KEYS, run_bench


def test_planning_bench_reports_every_stage_with_positive_rates(tmp_path, tiny_cache):
    """bench/planning.py --limit 50 writes stages a, b and c, each with samples, tokens and positive rates."""
    out = tmp_path / "planning.json"
    proc = run_bench("planning.py", ["--limit", "50", "--json", str(out)], tiny_cache)
    report = json.loads(out.read_text())
    assert report["benchmark"] == "planning"
    assert BENCH_MACHINE_KEYS <= report["machine"].keys()
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


def test_s3_host_cost_bench_sends_the_same_bytes_three_ways(tmp_path, tiny_cache):
    """bench/s3_host_cost.py on a small shard: ours (write_stream), plain upload_fileobj and the spool hop each
    report GB/s and CPU s per GB against a real loopback SeaweedFS."""
    out = tmp_path / "s3.json"
    run_bench("s3_host_cost.py", ["--tokens", "512", "--hidden", "256", "--repeats", "1", "--json", str(out)], tiny_cache,
               timeout_s=180)
    report = json.loads(out.read_text())
    assert report["shard_bytes"] > 512 * 5 * 256 * 2
    for way in ("ours", "plain", "spool_hop"):
        assert report[way]["gb_s_median"] > 0 and report[way]["cpu_s_per_gb"] >= 0, report[way]
    assert report["ours_over_plain"] > 0
