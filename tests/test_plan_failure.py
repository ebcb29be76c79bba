"""A plan that does not finish: what is left in the store, what ``status`` says, and that running
the same command again completes it.

Planning writes nothing until the dataset is tokenised, so a dataset with no usable record leaves
no run behind. Once ``run.json`` is claimed, the planner keeps ``plan/planning.json``; a failure
while the plan is written (Ctrl-C, a store error) is recorded there, and ``status`` reports
``plan_failed`` with the error and the command to run again instead of ``planning`` forever.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from jobfixtures import clean_env, run_here
from hsx.errors import BadDataset, StoreError
from hsx.plan import BATCHES_JSON, PLANNING_JSON, BatchPlan, plan_complete
from hsx.store import exists, open_store
from producer.planner import PlanOptions, plan_run
from producer.status import run_status
from producer.statusview import status_view
from settings import Settings

DATASET = Path(__file__).resolve().parent / "data" / "legacy-runs" / "chats.jsonl"
COMMAND = "python -m producer run chats.jsonl --model tiny-qwen3.5"


def _opts(output: Path, dataset: Path = DATASET) -> PlanOptions:
    return PlanOptions(dataset=str(dataset), model="tiny-qwen3.5", output=str(output), max_length=64,
                       batch_tokens=128, command=COMMAND)


@pytest.fixture
def settings(tiny_cache, tmp_path):
    return Settings(_env_file=None, cache_dir=tiny_cache, spool_dir=tmp_path / "spool", device="cpu")


def _render(status: dict) -> str:
    from rich.console import Console

    console = Console(width=200, record=True, file=open(os.devnull, "w"))
    console.print(status_view(status))
    return console.export_text()


def _fail_on_second_batch(monkeypatch, exc: BaseException) -> None:
    real = BatchPlan.to_bytes

    def to_bytes(self):
        if self.batch == "b000001":
            raise exc
        return real(self)

    monkeypatch.setattr(BatchPlan, "to_bytes", to_bytes)


@pytest.mark.parametrize("exc,said", [
    (KeyboardInterrupt(), "interrupted"),
    (StoreError("disk full: /data"), "StoreError: disk full"),
])
def test_a_plan_that_fails_while_written_is_reported_by_status_and_the_same_command_completes_it(
        tmp_path, settings, monkeypatch, exc, said):
    _fail_on_second_batch(monkeypatch, exc)
    with pytest.raises(type(exc)):
        plan_run(_opts(tmp_path), settings)
    (run_dir,) = [p for p in tmp_path.iterdir() if (p / "run.json").exists()]
    run_store = open_store(str(run_dir))
    assert not plan_complete(run_store)

    status = run_status(run_store)
    assert status["state"] == "plan_failed"
    assert said in status["plan_error"]
    assert status["planner"]["command"] == COMMAND
    text = _render(status)
    assert "did not finish" in text and said in text
    assert text.count("progress") <= 1, text  # the batches' bar only; the stop has a row of its own
    assert status["tokens_per_s"] is None and status["eta_s"] is None and "over the last" not in text, text
    assert f"run {COMMAND} again" in text
    # a Ctrl-C is a stop the same command resumes; an error stays an error
    assert ("stopped by you: resumable" in text) == isinstance(exc, KeyboardInterrupt)

    monkeypatch.undo()
    planned = plan_run(_opts(tmp_path), settings)
    assert planned.config.run_id == run_dir.name and not planned.reused
    assert plan_complete(run_store) and not exists(run_store, PLANNING_JSON)
    status = run_status(run_store)
    assert status["state"] == "queued" and status["plan_error"] is None  # no worker took a batch yet
    assert status["batches_total"] == len(planned.batches) == 2


def test_while_the_planner_runs_status_says_planning_with_who_plans(tmp_path, settings, monkeypatch):
    seen = {}

    def to_bytes(self, real=BatchPlan.to_bytes):
        if "status" not in seen:
            run_store = open_store(str(next(p for p in tmp_path.iterdir() if (p / "run.json").exists())))
            seen["status"] = run_status(run_store)
        return real(self)

    monkeypatch.setattr(BatchPlan, "to_bytes", to_bytes)
    plan_run(_opts(tmp_path), settings)
    status = seen["status"]
    assert status["state"] == "planning" and status["plan_error"] is None
    assert status["planner"]["pid"] == os.getpid() and status["planner"]["host"] == socket.gethostname()
    assert f"pid {os.getpid()}" in _render(status)


def test_a_planner_killed_on_this_host_is_reported_as_gone(tmp_path, settings, monkeypatch):
    """SIGKILL leaves no failure record: status sees that the planner's process is gone."""
    _fail_on_second_batch(monkeypatch, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        plan_run(_opts(tmp_path), settings)
    (run_dir,) = [p for p in tmp_path.iterdir() if (p / "run.json").exists()]
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    record = {"state": "planning", "host": socket.gethostname(), "pid": int(dead.stdout), "started_at": "2030-01-01T00:00:00+00:00",
              "command": COMMAND}
    (run_dir / PLANNING_JSON).write_text(json.dumps(record))
    status = run_status(open_store(str(run_dir)))
    assert status["state"] == "plan_failed"
    assert f"pid {record['pid']}" in status["plan_error"] and "exited without finishing" in status["plan_error"]


def test_a_dataset_with_no_usable_record_leaves_no_run_behind(tmp_path, settings):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x", "conversations": []}\nnot json\n')
    out = tmp_path / "store"
    with pytest.raises(BadDataset) as info:
        plan_run(_opts(out, bad), settings)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{bad}: no usable record: all 2 records were skipped")
    assert "no_turns 1" in message and "malformed_json 1" in message
    assert not out.exists(), "the output folder this plan made is removed again (nothing was written in it)"
    out.mkdir()
    with pytest.raises(BadDataset):
        plan_run(_opts(out, bad), settings)
    assert out.is_dir(), "a folder that was there before is left as it was"


def test_an_empty_dataset_file_is_one_line_naming_the_file(tmp_path, tiny_cache):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    env = clean_env(cache_dir=tiny_cache, state_dir=tmp_path / "state")
    proc = run_here(["run", str(empty), "--model", "tiny-qwen3.5", "--output", str(tmp_path / "store")], env)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip() and "tokenising" not in line]
    text = "".join(line.strip() for line in lines)  # rich wraps long lines (and a long path) at the terminal width
    assert text.replace(" ", "") == f"error: {empty}: no usable record: the file is empty (0 bytes)".replace(" ", ""), proc.stderr
    assert len(lines) <= 3, "one message, wrapped at most"
    assert not (tmp_path / "store").exists()


def test_status_watch_stops_on_a_failed_plan(tmp_path, settings, monkeypatch, tiny_cache):
    _fail_on_second_batch(monkeypatch, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        plan_run(_opts(tmp_path / "store"), settings)
    (run_dir,) = [p for p in (tmp_path / "store").iterdir()]
    env = clean_env(cache_dir=tiny_cache)
    proc = run_here(["status", str(run_dir), "--watch", "--json", "--no-broker", "--interval", "0.2"], env)
    assert proc.returncode == 0, proc.stderr
    (line,) = proc.stdout.splitlines()
    assert json.loads(line)["state"] == "plan_failed"
    assert not (run_dir / BATCHES_JSON).exists()
