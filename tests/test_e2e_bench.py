"""The benchmark of the path users run (bench/e2e_throughput.py) works end to end on the CPU: a tiny
checkpoint directory, ``python -m producer run`` as a subprocess on real ShareGPT records, a local
store, and every field of its JSON row. No timing is asserted (CI machines differ); the GPU numbers
are in BENCHMARKS.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ("model", "gpu", "store", "path", "layers_run", "ceiling_same_layers_tok_s", "ceiling_all_layers_tok_s",
          "store_write_gb_s", "steady_tok_s", "whole_run_tok_s", "steady_over_ceiling", "gpu_busy", "shard_gb_s",
          "bytes_crossings", "cold_start_s", "warm_start_s")


@pytest.mark.timeout(300)
def test_the_e2e_bench_runs_producer_run_and_reports_every_field(tmp_path):
    out = tmp_path / "e2e.json"
    proc = subprocess.run([sys.executable, "bench/e2e_throughput.py", "--tiny", "--workdir", str(tmp_path / "w"),
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert not [f for f in FIELDS if f not in row]
    assert row["path"] == "producer run" and row["returncode"] == 0
    assert row["run_report"]["batches_done"] == row["run_report"]["batches_total"] == row["batches"] > 0
    assert row["layers_run"] == max(row["layer_ids"]) + 1 < row["num_layers"], "DFlash stops after its deepest layer"
    assert row["write_paths"] == {"direct": row["batches"]} and row["bytes_crossings"] == {"direct": 1}
    assert row["kept_shards_hash_ok"] is True, "the shards kept are the bytes their markers certify"
    assert row["ceiling_tok_s"] == min(row["ceiling_same_layers_tok_s"], row["store_limit_tok_s"])
    assert row["valid_tokens"] > 0 and row["steady_tok_s"] > 0 and (row["cold_start_s"] or row["warm_start_s"]) > 0
