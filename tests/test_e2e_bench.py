"""The benchmark of the path users run (bench/e2e_throughput.py) works end to end on the CPU: a tiny
checkpoint directory, ``python -m producer run`` as a subprocess on real ShareGPT records, a local
store, and every field of its JSON row. No timing is asserted (CI machines differ); the GPU numbers
are in BENCHMARKS.md."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from jobfixtures import clean_env, run_python

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ("model", "gpu", "store", "path", "layers_run", "ceiling_same_layers_tok_s", "ceiling_all_layers_tok_s",
          "store_write_gb_s", "steady_tok_s", "whole_run_tok_s", "steady_over_ceiling", "gpu_busy", "shard_gb_s",
          "bytes_crossings", "cold_start_s", "warm_start_s", "steady_after_last_compile")


@pytest.mark.timeout(300)
def test_the_e2e_bench_runs_producer_run_and_reports_every_field(tmp_path):
    out = tmp_path / "e2e.json"
    proc = run_python(["bench/e2e_throughput.py", "--tiny", "--workdir", str(tmp_path / "w"), "--json", str(out),
                       "--plan-ceiling-after-run", "--trace-worker", "--trace-skip", "1", "--trace-batches", "2"], clean_env(),
                      timeout_s=280)
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
    # the diagnostics: the plain forward over the steady window's own batches (the model loaded again from the
    # checkpoint once the run's workers exited: a target that fits the GPU once), and the worker's trace beside the row
    plan = row["ceiling_plan_batches"]
    assert plan["batches"] >= 1 and plan["tok_s"] > 0 and plan["padded_over_valid"] >= 1
    assert plan["model_reloaded_after_run"] is True
    assert row["steady_over_plan_batches_forward"] == pytest.approx(row["steady_tok_s"] / plan["tok_s"], abs=0.01)
    trace = json.loads((tmp_path / "e2e-disk-trace-summary.json").read_text())
    assert sorted(s["n"] for s in trace["forward_steps"]) == [2, 3], "the 2nd and 3rd forward steps, as asked"
    assert "forward_step" in trace["python_stacks"], "the stacks of the threads in the forward step were sampled"


def test_arrivals_from_worker_log_reads_extraction_and_regenerate_batch_lines(tmp_path):
    """A worker that served both kinds: an extraction batch's line gives its tokens and shard bytes as
    before; a regenerate batch's (``completion_tokens``, no ``tokens`` / ``bytes``) its generated tokens and 0 bytes."""
    sys.path.insert(0, str(ROOT / "bench"))
    from e2e_throughput import arrivals_from_worker_log

    log = tmp_path / "workers.log"
    extract = {"run": "r", "batch": "b000000", "samples": 3, "tokens": 900, "quarantined": 0, "seconds": 0.5,
               "tok_s": 1800, "bytes": 123456, "write_path": "direct"}
    regen = {"run": "q", "batch": "b000001", "kind": "regenerate", "engine": "generate", "samples": 4,
             "completion_tokens": 32, "unfinished": 4, "seconds": 1.0, "tok_s": 40}
    log.write_text(f"[2026-01-02 03:04:05,250: INFO/MainProcess] batch done {json.dumps(extract)}\n"
                   "[2026-01-02 03:04:05,500: INFO/MainProcess] something else\n"
                   f"[2026-01-02 03:04:06,750: INFO/MainProcess] batch done {json.dumps(regen)}\n")
    (t0, tokens0, bytes0), (t1, tokens1, bytes1) = arrivals_from_worker_log(log)
    assert (tokens0, bytes0) == (900, 123456) and (tokens1, bytes1) == (32, 0)
    assert t1 - t0 == pytest.approx(1.5)


def test_the_window_after_the_last_compile_starts_at_the_first_marker_after_it(tmp_path):
    """``steady_after_last_compile``: the newest entry of the worker's Triton cache is the last compile; the window
    runs from the first marker after it to the last but two, and counts the tokens of the markers after its start."""
    import os

    sys.path.insert(0, str(ROOT / "bench"))
    from e2e_throughput import last_compile_unix, window_after

    assert last_compile_unix(None) is None and last_compile_unix(str(tmp_path / "none")) is None
    assert last_compile_unix(str(tmp_path)) is None, "an empty cache: nothing compiled"
    for name, t in (("k1", 100.0), ("k2", 250.0), ("k3", 180.0)):
        (tmp_path / name).mkdir()
        os.utime(tmp_path / name, (t, t))
    assert last_compile_unix(str(tmp_path)) == 250.0
    arrivals = [(float(t), 1000 + t, 0) for t in range(200, 320, 10)]  # markers every 10 s, 200..310
    t0, t1, tokens = window_after(arrivals, 250.0)
    assert (t0, t1) == (260.0, 290.0) and tokens == (1270 + 1280 + 1290), "260 opens it; 300 and 310 are the tail"
    assert window_after(arrivals, 305.0) == (0.0, 0.0, 0), "one marker after the compile: no window"


def test_the_kernels_compiled_after_the_first_marker_are_named_from_the_triton_cache(tmp_path):
    """Entries of the worker's Triton cache newer than the first marker, counted by the kernel each
    entry's ``<kernel>.json`` names (a grouping ``__grp__`` file does not name it)."""
    import os

    sys.path.insert(0, str(ROOT / "bench"))
    from e2e_throughput import kernels_compiled_after

    for entry, kernel, t in (("a1", "l2norm_fwd_kernel", 300.0), ("a2", "l2norm_fwd_kernel", 310.0),
                             ("b1", "chunk_fwd_kernel_o", 320.0), ("c1", "l2norm_fwd_kernel", 100.0)):
        (tmp_path / entry).mkdir()
        (tmp_path / entry / f"{kernel}.json").write_text("{}")
        (tmp_path / entry / f"__grp__{kernel}.json").write_text("{}")
        os.utime(tmp_path / entry, (t, t))
    assert kernels_compiled_after(str(tmp_path), 200.0) == {"l2norm_fwd_kernel": 2, "chunk_fwd_kernel_o": 1}
    assert kernels_compiled_after(str(tmp_path), 400.0) == {}
    assert kernels_compiled_after(None, 200.0) == {} and kernels_compiled_after(str(tmp_path), None) == {}


def test_under_a_deadline_the_same_work_ceiling_covers_the_first_batches_that_fit_and_ours_is_recounted_over_them():
    """``--plan-ceiling`` with ``--deadline-s``: the plain forward runs two passes over the window's
    first batches whose time at the 16 x 2048 rate fits what the deadline leaves; ours is then
    counted over exactly those batches, from the window's start to the last one's marker."""
    import time
    from types import SimpleNamespace

    sys.path.insert(0, str(ROOT / "bench"))
    from e2e_throughput import fit_to_deadline, w_tokens_over

    markers = [SimpleNamespace(finished_unix=1000.0 + i, num_tokens=10_000, batch=f"b{i:06d}") for i in range(10, 0, -1)]
    now = time.monotonic()
    no_deadline = SimpleNamespace(deadline_s=None)
    assert [m.finished_unix for m in fit_to_deadline(markers, 10_000, no_deadline, now)] == [1000.0 + i for i in range(1, 11)]
    # 100 s left after the 45 s margin; 2.2 s of plain forward per batch of 10,000 tokens at 10,000 tok/s: 45 fit
    left_100 = SimpleNamespace(deadline_s=145.0)
    assert len(fit_to_deadline(markers, 10_000, left_100, now)) == 10
    left_5 = SimpleNamespace(deadline_s=50.0)  # 5 s left: two batches (4.4 s), the third would pass it
    fitted = fit_to_deadline(markers, 10_000, left_5, now)
    assert [m.finished_unix for m in fitted] == [1001.0, 1002.0]
    assert len(fit_to_deadline(markers, 10_000, SimpleNamespace(deadline_s=1.0), now)) == 2, "at least two"
    assert w_tokens_over(fitted, 1000.0) == {"batches": 2, "window_s": 2.0, "tok_s": 10_000}
