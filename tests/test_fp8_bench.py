"""bench/fp8_error.py cannot rot: on the CPU, with the built-in tiny-qwen3.5 and a few real
ShareGPT conversations, it prints and writes every field of the BENCHMARKS.md table (the shape of
the output and e4m3's bounds; no timing is asserted)."""

from __future__ import annotations

import json

from jobfixtures import clean_env, run_python


def test_the_fp8_error_script_reports_bytes_and_errors_per_dflash_layer(tmp_path):
    out = tmp_path / "fp8.json"
    proc = run_python(["bench/fp8_error.py", "--limit", "6", "--max-length", "256", "--final", "postnorm", "--json", str(out)],
                      clean_env(cache_dir=tmp_path / "cache"), timeout_s=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["device"] == "cpu" and r["compute_dtype"] == "float32" and r["hidden_size"] == 64
    assert r["layer_ids"] == [1, 2, 3, 4, 5]  # DFlash's 5 ids on the tiny model's 8 layers
    assert r["samples"] > 0 and r["tokens"] > 100
    # 6 parts of H = 64: bf16 2 x 64 bytes each, fp8 64 + a 4-byte scale.
    assert r["bytes_per_token"] == {"bfloat16": 6 * 128, "fp8": 6 * 68, "fp8_over_bf16": round(68 / 128, 4)}
    assert [p["part"] for p in r["parts"]] == ["layer 1", "layer 2", "layer 3", "layer 4", "layer 5", "final_postnorm"]
    for p in r["parts"]:
        assert 0 < p["rel_frobenius"] < 2**-4 and 0 < p["mean_token_rel"] <= p["max_token_rel"] <= r["bound"]["token_max_rel_fp8_vs_bf16"]
        assert 0 < p["vs_exact"]["fp8"]["max_token_rel"] <= r["bound"]["token_max_rel_fp8_vs_exact"] + 1e-6
        assert 0 < p["vs_exact"]["bf16"]["max_token_rel"] <= 2**-8 + 1e-6
    assert r["bound_violations"] == 0
    assert r["all_parts"]["max_token_rel"] == max(p["max_token_rel"] for p in r["parts"])
    assert "bytes per token: bf16 768, fp8 408" in proc.stdout and "max tok rel" in proc.stdout
