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

from jobfixtures import ROOT, clean_env, read_samples

from hsx.store import open_store

PAUSE_S = 2.0
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
    run_dir = out / "live-example"  # a fixed run id: the example starts first and waits for the run
    run_dir.mkdir(parents=True)  # the example opens an existing store read-only
    log, checkpoint = tmp_path / "steps.jsonl", tmp_path / "head.pt"
    common = [str(run_dir), "--checkpoint", str(checkpoint), "--log-jsonl", str(log), "--samples-per-step", "2",
              "--poll-s", "0.2", "--seed", "1"]
    example_env = clean_env(cache_dir=tiny_cache)
    # Started before the run, so that its own start (torch, the head) does not race the extraction
    # on a loaded machine: it waits for run.json, then trains while batches are certified.
    trainer = subprocess.Popen([sys.executable, EXAMPLE, *common, "--max-steps", "2", "--wait-for-run-s", "120"],
                               cwd=ROOT, env=example_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    producer = subprocess.Popen([sys.executable, "-m", "producer", "run", *LIVE_JOB, "--run-id", "live-example",
                                 "--output", str(out), "--json"],
                                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        t_out, t_err = trainer.communicate(timeout=300)
        assert trainer.returncode == 0, f"exit {trainer.returncode}\nstdout:\n{t_out[-3000:]}\nstderr:\n{t_err[-3000:]}"
        first = [json.loads(line) for line in log.read_text().splitlines()]
        assert [s["step"] for s in first[:-1]] == [1, 2] and first[-1]["done"] and checkpoint.is_file()
        assert any(s["certified"] < s["planned"] for s in first[:-1]), f"the run was finished before training began: {first}"
        second = _example([*common, "--idle-timeout-s", "120"], example_env)
        assert "resumed at step 2" in second.stdout
        stdout, stderr = producer.communicate(timeout=300)
        assert producer.returncode == 0, stderr[-3000:]
        report = json.loads(stdout)
    finally:
        for proc in (trainer, producer):
            if proc.poll() is None:
                proc.terminate()
                proc.wait(60)
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
