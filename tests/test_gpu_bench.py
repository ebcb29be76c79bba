"""bench/gpu_throughput.py cannot rot: its --tiny mode runs on the CPU and prints every field the
H200 table needs (shape of the output only; no timing is asserted)."""

from __future__ import annotations

import json

from jobfixtures import clean_env, run_python


def test_the_gpu_throughput_script_produces_one_row_per_shape_with_the_ratios(tmp_path):
    out = tmp_path / "gpu.json"
    proc = run_python(["bench/gpu_throughput.py", "--tiny", "--models", "qwen3.5-27b,qwen3-8b", "--json", str(out)],
                      clean_env(cache_dir=tmp_path / "cache"), timeout_s=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [r["model"] for r in rows] == ["qwen3.5-27b", "qwen3-8b"]
    for r in rows:
        for key in ("gpu", "ceiling_tok_s", "ours_tok_s", "naive_tok_s", "ours_over_ceiling", "ours_over_naive", "host_rss_gib", "shard_mb_s"):
            assert key in r, key
        assert r["ours_tok_s"] > 0 and r["ceiling_tok_s"] > 0 and r["naive_tok_s"] > 0
        assert abs(r["ours_over_ceiling"] - r["ours_tok_s"] / r["ceiling_tok_s"]) < 0.01
        assert r["layer_ids"] == [1, 2, 3, 4, 5]  # DFlash's 5 ids on the 8-layer tiny shape
        assert set(r["phase_time_over_wall"]) >= {"launch_s", "forward_s", "write_s", "verify_s"}
        assert r["plain_same_batches_tok_s"] > 0 and abs(r["ours_over_plain"] - r["ours_tok_s"] / r["plain_same_batches_tok_s"]) < 0.01
        # three samples of very different lengths in one padded batch == each sample alone (fp32 on the CPU)
        assert len(set(r["fidelity"]["sample_lengths"])) == 3 and r["fidelity"]["max_rel_fro"] < 1e-4
        assert r["host_io"]["sha256_gb_s"] > 0 and r["host_io"]["spool_write_gb_s"] > 0
    assert "ours/ceil" in proc.stdout
