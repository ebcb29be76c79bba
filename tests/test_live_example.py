"""``examples/train_while_extracting.py`` trains a tiny EAGLE-3-style head from a real ``producer run``
that is still extracting, and a second invocation resumes from its checkpoint: across both, every
stored sample is trained on exactly once.

The run's worker holds each batch for ``PAUSE_S`` before its marker (``HSX_FAULTS=pause_marker``,
one task thread), so batches are certified one at a time over several seconds and the example
meets the run mid-way, as a trainer next to a long extraction would.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

from jobfixtures import ROOT, clean_env, read_samples, wait_until

from hsx.store import open_store

PAUSE_S = 3.0  # 8 batches over ~24 s: the example (torch import, model) starts well inside it even on a loaded machine
LIVE_JOB = ["sharegpt", "--model", "tiny-qwen3.5", "--limit", "16", "--max-length", "256", "--batch-tokens", "512"]
EXAMPLE = str(ROOT / "examples" / "train_while_extracting.py")


def _example(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, EXAMPLE, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    return proc


def test_the_example_trains_a_head_from_a_run_still_being_extracted_and_resumes_from_its_checkpoint(tiny_cache, tmp_path):
    """First invocation: 2 steps while the run is extracting (certified < planned at a step), then
    stops and checkpoints. Second: resumes at step 3 and trains to the end of the run (stop_reason
    complete). Losses are finite, and the samples trained on are the stored ones, each once."""
    env = clean_env(cache_dir=tiny_cache, state_dir=tmp_path / "state", spool_dir=tmp_path / "spool",
                    faults=f"pause_marker={PAUSE_S}", worker_concurrency=1)
    out = tmp_path / "out"
    producer = subprocess.Popen([sys.executable, "-m", "producer", "run", *LIVE_JOB, "--output", str(out), "--json"],
                                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        run_dir = wait_until(lambda: next((p.parent for p in out.glob("*/run.json")), None), 120, "the run's run.json")
        log, checkpoint = tmp_path / "steps.jsonl", tmp_path / "head.pt"
        common = [str(run_dir), "--checkpoint", str(checkpoint), "--log-jsonl", str(log), "--samples-per-step", "2",
                  "--poll-s", "0.2", "--seed", "1"]
        example_env = clean_env(cache_dir=tiny_cache)
        _example([*common, "--max-steps", "2"], example_env)
        first = [json.loads(line) for line in log.read_text().splitlines()]
        assert [s["step"] for s in first[:-1]] == [1, 2] and first[-1]["done"] and checkpoint.is_file()
        assert any(s["certified"] < s["planned"] for s in first[:-1]), f"the run was finished before training began: {first}"
        second = _example([*common, "--idle-timeout-s", "120"], example_env)
        assert "resumed at step 2" in second.stdout
        stdout, stderr = producer.communicate(timeout=300)
        assert producer.returncode == 0, stderr[-3000:]
        report = json.loads(stdout)
    finally:
        if producer.poll() is None:
            producer.terminate()
            producer.wait(60)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [s for s in lines if "step" in s]
    assert lines[-1] == {"done": True, "steps": len(steps), "stop_reason": "complete",
                         "yielded": report["batches_total"], "certified": report["batches_total"],
                         "planned": report["batches_total"]}
    assert [s["step"] for s in steps] == list(range(1, len(steps) + 1))
    assert all(math.isfinite(s["loss"]) for s in steps) and sum(s["tokens"] for s in steps) > 0
    trained = [i for s in steps for i in s["samples"]]
    stored = read_samples(open_store(str(run_dir)))
    assert len(trained) == len(set(trained)) and sorted(trained) == sorted(stored)
    assert len(stored) == report["plan"]["samples"]


def test_the_example_says_what_is_wrong_without_a_traceback(tmp_path):
    """No run at the address: one ``error:`` line naming the address and the fix, exit 2, no traceback."""
    proc = subprocess.run([sys.executable, EXAMPLE, str(tmp_path), "--wait-for-run-s", "0"], cwd=ROOT, env=clean_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("error: no run.json in") and "Traceback" not in proc.stderr, proc.stderr
