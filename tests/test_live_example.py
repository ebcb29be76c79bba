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

from jobfixtures import ROOT, clean_env, python_popen, read_samples, run_python, wait_until
from smallrun import copy_run

from hsx.layout import marker_key
from hsx.plan import read_batch_list
from hsx.store import open_store

PAUSE_S = 2.0
LIVE_JOB = ["sharegpt", "--model", "tiny-qwen3.5", "--limit", "16", "--max-length", "256", "--batch-tokens", "512"]
EXAMPLE = str(ROOT / "examples" / "train_while_extracting.py")


def _example(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    proc = run_python([EXAMPLE, *args], env, timeout_s=300)
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
    trainer = python_popen([EXAMPLE, *common, "--max-steps", "2", "--wait-for-run-s", "120"], example_env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    producer = python_popen(["-m", "producer", "run", *LIVE_JOB, "--run-id", "live-example", "--output", str(out), "--json"],
                            env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
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
    proc = run_python([EXAMPLE, str(tmp_path), "--wait-for-run-s", "0"], clean_env(), timeout_s=120)
    assert proc.returncode == 2 and proc.stderr.startswith("error: no run.json in") and "Traceback" not in proc.stderr, proc.stderr


def test_ctrl_c_saves_the_last_step_says_so_and_the_resumed_example_counts_what_the_run_certified(small_run, tmp_path):
    """Issue 22 item 5. A run with half its batches certified: the example trains on every certified sample
    (one per step, no periodic checkpoint) and waits for more; Ctrl-C then saves a checkpoint at that step,
    says so in one line, no traceback, exit 130. With the other markers back, the same command resumes at
    that step, its first line counts the run's certified batches (all, of all planned: not ``?``), and
    across both every stored sample is trained on once."""
    import signal

    import torch

    run_dir = copy_run(small_run, tmp_path)
    store = open_store(str(run_dir))
    batches = read_batch_list(store)
    held = {b.batch: (run_dir / marker_key(b.batch)).read_bytes() for b in batches[len(batches) // 2:]}
    for batch in held:
        (run_dir / marker_key(batch)).unlink()
    certified = len(batches) - len(held)
    samples_certified = sum(b.num_samples for b in batches[:certified])
    log, checkpoint = tmp_path / "steps.jsonl", tmp_path / "head.pt"
    common = [str(run_dir), "--checkpoint", str(checkpoint), "--log-jsonl", str(log), "--samples-per-step", "1",
              "--save-every", "1000", "--poll-s", "0.2"]
    env = clean_env(cache_dir=small_run["cache"])
    trainer = python_popen([EXAMPLE, *common, "--idle-timeout-s", "300"], env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        steps = lambda: [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []  # noqa: E731
        wait_until(lambda: len(steps()) == samples_certified or trainer.poll() is not None, 240,
                   "the example trained on every certified sample")
        assert trainer.poll() is None, trainer.communicate()
        trainer.send_signal(signal.SIGINT)
        out, err = trainer.communicate(timeout=120)
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait(30)
    assert trainer.returncode == 130 and "Traceback" not in err, f"exit {trainer.returncode}\n{out[-2000:]}\n{err[-3000:]}"
    assert f"interrupted at step {samples_certified}: saved {checkpoint}" in out, out
    assert torch.load(checkpoint, weights_only=True)["step"] == samples_certified
    assert steps()[-1] == {"done": True, "interrupted": True, "steps": samples_certified, "yielded": certified,
                           "certified": certified, "planned": len(batches)}

    for batch, marker in held.items():
        (run_dir / marker_key(batch)).write_bytes(marker)
    second = _example([*common, "--idle-timeout-s", "60"], env)
    assert f"resumed at step {samples_certified}" in second.stdout, second.stdout
    lines = steps()
    resumed = lines[samples_certified + 1]
    assert resumed["step"] == samples_certified + 1
    assert (resumed["certified"], resumed["planned"]) == (len(batches), len(batches)), resumed
    assert f"run: {len(batches)}/{len(batches)} batches certified" in second.stdout
    trained = [i for line in lines if "step" in line for i in line["samples"]]
    assert sorted(trained) == sorted(read_samples(store)) and len(trained) == len(set(trained))
