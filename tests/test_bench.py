"""Smoke tests of the benchmark scripts: they run to the end on tiny inputs and write well-formed
JSON. Shape only: no figure is compared with a threshold (timings belong in BENCHMARKS.md).

Each script runs as a subprocess in a clean environment (no HSX_* / AWS_* of the machine), with
the session's tiny-model cache as HSX_CACHE_DIR. The scripts that start worker processes have files of their own
(test_bench_task_overhead.py, test_bench_soak.py), so that pytest-xdist runs them beside these.
"""

from __future__ import annotations

import json

from jobfixtures import BENCH_MACHINE_KEYS, run_bench


def test_planning_bench_measures_the_cli_against_its_ceiling(tmp_path, tiny_cache):
    """bench/planning.py --records 200: the real `producer enqueue` with 2 tokenising processes on an embedded
    broker (every batch lands in the queue), the 2-process ceiling over the same records, the padding of the plan
    against a whole-dataset sort, the single-core reference and a sampled profile of the CLI's own process."""
    out = tmp_path / "planning.json"
    proc = run_bench("planning.py", ["--records", "200", "--modes", "2", "--reference-records", "20",
                                     "--profile-records", "100", "--profile-procs", "1",
                                     "--workdir", str(tmp_path / "work"), "--json", str(out)], tiny_cache)
    report = json.loads(out.read_text())
    assert report["benchmark"] == "planning" and report["complete"]
    assert BENCH_MACHINE_KEYS <= report["machine"].keys()
    assert report["dataset"]["records"] == 200 and report["dataset"]["id_scheme"] == "<id>-r<k>"
    (mode,) = report["modes"]
    assert mode["num_proc"] == 2 and "mismatch" not in mode, mode.get("mismatch")
    ours, ceiling = mode["ours"], mode["ceiling"]
    assert ours["records_read"] == 200 and 0 < ours["samples"] <= 200
    assert ours["batches_enqueued"] == ours["batches"] == ours["queue_length_at_end"] > 0
    assert 0 < ours["first_batch_s"] <= ours["wall_s"]
    for key in ("samples_per_s", "tokens_per_s", "peak_rss_main_mib", "cpu_s_tree"):
        assert ours[key] > 0, f"ours: {key} = {ours[key]}"
    assert ours["peak_rss_tree_mib"] >= ours["peak_rss_main_mib"] and ours["peak_processes"] >= 3  # the CLI + 2
    padding = ours["padding"]
    assert padding["samples_in_rows"] == ours["samples"]
    assert padding["windowed_recomputed"] == padding["windowed_stats_json"]  # one window: the same sort
    assert padding["whole_dataset_sort"] == padding["windowed_stats_json"]
    assert ceiling["procs"] == 2 and ceiling["samples"] == ours["samples"] and ceiling["tokens"] == ours["tokens"]
    assert ceiling["samples_per_s"] > 0 and mode["ours_over_ceiling"] > 0
    assert report["reference_single_core"]["samples_per_s"] > 0
    profile = report["profile"]
    assert profile["samples"] > 0 and profile["threads"]["MainThread"]["samples"] > 0
    assert "ours/ceil" in proc.stdout, "the table is printed"


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
