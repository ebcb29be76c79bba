"""What reads a run whose plan is still being written: ``producer status``, ``verify``, ``reconcile``
and the live reader, on real streamed plans (tests/streamplan.py: ShareGPT records, the tiny
target, windows of 256 samples and then the rest).

The plan is streamed: ``plan/windows/w000000.json`` (after its batch files and sample rows), then
the next window..., ``plan/batches.json`` last (hsx/plan.py). A planner process paused between two
windows (``python tests/streamplan.py ... --pause-after 0``) stands for a long planning; one
stopped by Ctrl-C in ``on_window`` (``plan_run(..., on_window=...)`` raising KeyboardInterrupt) or
by SIGKILL leaves a plan that stays incomplete until the same command runs again. Batches are
extracted by the session's shared worker; the live reader reads one rank of eight
(``world_size=8``), so that only that rank's few batches need extracting.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console

from jobfixtures import ROOT, clean_env, python_popen, run_here, wait_until
from streamplan import FIRST_WINDOW, plan_options, plan_settings, small_windows

from hsx.errors import HsxError
from hsx.layout import window_key, window_samples_key
from hsx.live import LiveHiddenStatesDataset, rank_of
from hsx.plan import read_batch, read_batch_list
from hsx.records import Planning, PlanWindow, done_batches
from hsx.runconfig import load_run
from hsx.store import open_store
from producer.planner import plan_run
from producer.status import PLANNING_STALL_GRACE_S, RunWatch, planning_progress
from producer.statusview import status_view
from producer.verify import verify_run

LIMIT = 600
WORLD = 8
POLL_S = 0.1
PLAN_KINDS = {"plan_mismatch", "plan_unreadable", "plan_missing", "plan_incomplete"}


def _kinds(report: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for p in report["problems"]:
        out.setdefault(p["kind"], []).append(p)
    return out


def _render(status: dict) -> str:
    console = Console(width=250, record=True, file=open(os.devnull, "w"))
    console.print(status_view(status))
    return console.export_text()


def _enqueue(shared_worker, run_store, names: list[str]) -> None:
    """Send these batches of the run to the shared worker, as ``enqueue`` does (from the windows so far)."""
    from producer.reconcile import _enqueue
    from hsx.plan import planned_batches

    by_name = {b.batch: b for b in planned_batches(run_store)[0]}
    _enqueue(run_store, run_store.url, load_run(run_store), [by_name[n] for n in names], shared_worker.settings,
             shared_worker.broker.url)


def _rank_with_batches(first: list[str], later: list[str]) -> int:
    """A rank of WORLD with batches in the first window and among the next ones."""
    for rank in range(WORLD):
        if any(rank_of(b, WORLD) == rank for b in first) and any(rank_of(b, WORLD) == rank for b in later):
            return rank
    raise AssertionError("no rank has batches in both windows")


class PausedPlanner:
    """``python tests/streamplan.py`` in its own process (forked from the fork server: ``python_popen``),
    paused after window ``pause_after`` until released. Its JSON lines go to a file, read as they come."""

    def __init__(self, cache: Path, out: Path, tmp: Path, pause_after: int = 0):
        self.release_file = tmp / "release"
        self.lines: list[dict] = []
        self.log = tmp / "planner.log"
        self._out = tmp / "planner.out"
        with open(self._out, "w") as stdout, open(self.log, "w") as stderr:
            self.proc = python_popen(
                [str(ROOT / "tests" / "streamplan.py"), str(cache), str(out), str(LIMIT),
                 "--pause-after", str(pause_after), "--release", str(self.release_file)],
                clean_env(cache_dir=cache), stdout=stdout, stderr=stderr)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        with open(self._out) as f:
            pending, exited = "", False
            while True:
                chunk = f.readline()
                if not chunk:
                    if exited:  # read once more after the exit: every line it wrote is in
                        return
                    exited = self.proc.poll() is not None
                    time.sleep(0.02)
                    continue
                pending += chunk
                if pending.endswith("\n"):
                    self.lines.append(json.loads(pending))
                    pending = ""

    def wait(self, what, timeout_s: float = 120) -> dict:
        def found():
            assert self.proc.poll() is None or any(what(x) for x in self.lines), (
                f"the planner exited ({self.proc.returncode}):\n{self.log.read_text()[-3000:]}")
            return next((x for x in self.lines if what(x)), None)

        return wait_until(found, timeout_s, "the planner's line")

    def release(self) -> None:
        self.release_file.touch()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


@pytest.fixture(scope="module", autouse=True)
def _small_windows():
    """Every plan of this file (here and in tests/streamplan.py's process) has windows of 256 samples."""
    from producer import planner

    before = small_windows()
    yield
    planner.PLAN_WINDOWS = before


@pytest.fixture(scope="module")
def complete_plan(tmp_path_factory, tiny_cache) -> Path:
    """A complete streamed plan (three windows: 256 samples, the rest, the empty last one); no extraction."""
    out = tmp_path_factory.mktemp("complete-plan")
    planned = plan_run(plan_options(out, LIMIT), plan_settings(tiny_cache))
    assert planned.stats["windows"] == 3 and planned.stats["batches"] == len(planned.batches) > 15, planned.stats
    return out / planned.config.run_id


def test_status_verify_reconcile_and_the_live_reader_follow_a_plan_while_it_is_written(shared_worker, tiny_cache, tmp_path):
    """A planner paused after its first window: ``status`` says ``planning`` with that window's batches and the
    planning's progress; ``verify`` says ``plan_incomplete`` and finds the window sound; ``reconcile --dry-run``
    leaves the window a live planner just wrote to it; the live reader yields the window's certified batches and
    goes on waiting. Released, the plan completes, and the reader ends once the later windows' batches are read."""
    planner = PausedPlanner(tiny_cache, tmp_path / "out", tmp_path)
    env = clean_env(cache_dir=tiny_cache, state_dir=tmp_path / "state")
    try:
        first = planner.wait(lambda x: x.get("window") == 0)
        run_store = open_store(first["address"])
        run_dir = run_store.local_path("run.json").parent

        proc = run_here(["status", str(run_dir), "--json", "--no-broker"], env)
        assert proc.returncode == 0, proc.stderr
        status = json.loads(proc.stdout)
        assert status["state"] == "planning" and not status["plan_complete"] and not status["planned"]
        assert status["plan_error"] is None and status["planner"]["pid"] == planner.proc.pid == first["pid"]
        p = status["planning"]
        assert p["windows"] == 1 and p["batches"] == p["batches_enqueued"] == status["batches_total"] == len(first["batches"])
        assert p["samples"] == status["samples_total"] == FIRST_WINDOW and p["tokens"] == status["tokens_total"] > 0
        assert p["records_total"] == LIMIT and FIRST_WINDOW <= p["records_read"] < LIMIT
        assert 0 < p["percent"] < 100 and p["records_per_s"] > 0 and p["num_proc"] == 1
        assert p["eta_s"] is not None and p["tokens_estimated"] > p["tokens"]
        assert status["eta_s"] is None, "no extraction rate yet: no ETA"
        text = _render(status)
        for expected in ("planning", f"1 window written: {FIRST_WINDOW} samples in", f"/ {LIMIT:,} records", "planning eta",
                         f"0 / {len(first['batches'])} batches planned so far", f"pid {planner.proc.pid}"):
            assert expected in text, f"{expected!r} not in the view:\n{text}"

        report = verify_run(run_store)
        kinds = _kinds(report)
        assert set(kinds) == {"plan_incomplete", "not_done"}, report["problems"]
        assert f"1 window written so far ({FIRST_WINDOW} samples" in kinds["plan_incomplete"][0]["detail"]
        assert "still writing it" in kinds["plan_incomplete"][0]["detail"]
        assert not report["plan_complete"] and report["windows"] == 1 and report["batches_planned"] == len(first["batches"])

        proc = run_here(["reconcile", str(run_dir), "--dry-run", "--json"], {**env, "HSX_BROKER_URL": shared_worker.broker.url})
        assert proc.returncode == 0, proc.stderr
        rec = json.loads(proc.stdout)
        assert not rec["plan_complete"] and rec["windows"] == 1 and "still writing it" in rec["plan_note"]
        assert rec["batches_total"] == len(first["batches"])
        assert rec["just_planned"] == sorted(first["batches"]) and rec["lost"] == [], "the planner enqueues its newest window"
        assert rec["enqueued"] == []

        # the live reader, one rank of eight, follows the windows
        later = [f"b{len(first['batches']) + i:06d}" for i in range(10)]
        rank = _rank_with_batches(first["batches"], later)
        mine_first = [b for b in first["batches"] if rank_of(b, WORLD) == rank]
        reader = LiveHiddenStatesDataset(run_store, rank=rank, world_size=WORLD, poll_s=POLL_S, idle_timeout_s=120,
                                         finals="none", seed=2)
        got: list[dict] = []
        errors: list[BaseException] = []

        def follow():
            try:
                for sample in reader:
                    got.append({"batch": sample["batch"], "sample_index": sample["sample_index"],
                                "tokens": int(sample["input_ids"].shape[0])})
            except BaseException as exc:  # reported by the test thread
                errors.append(exc)

        follower = threading.Thread(target=follow, daemon=True)
        follower.start()
        _enqueue(shared_worker, run_store, mine_first)
        wait_until(lambda: {g["batch"] for g in got} == set(mine_first) or errors, 120, "the reader to yield window 0's batches")
        time.sleep(3 * POLL_S)
        assert not errors, errors
        assert follower.is_alive() and reader.stop_reason is None and not reader.plan_complete
        assert reader.planned == set(mine_first) and reader.progress()["planned"] == len(mine_first)

        watch = RunWatch(run_store)
        record = Planning.read(run_store)
        soon = watch.poll(now=record.updated_unix + 1)
        assert soon["state"] == "planning" and soon["batches_done"] == len(mine_first) < soon["batches_total"]
        assert soon["samples_done"] > 0 and soon["workers"], "the shared worker's heartbeat and markers are shown"
        if soon["tokens_per_s"]:
            extract_s = (soon["planning"]["tokens_estimated"] - soon["tokens_done"]) / soon["tokens_per_s"]
            assert soon["eta_s"] == round(max(extract_s, soon["planning"]["eta_s"]), 1)
        # No window for longer than the grace, batches left and no worker on them: stalled, though still planning.
        later_poll = watch.poll(now=record.updated_unix + PLANNING_STALL_GRACE_S + 120)
        assert later_poll["state"] == "stalled" and "the planner still writes the plan" in later_poll["stalled_reason"]
        assert later_poll["planning"]["windows"] == 1

        planner.release()
        done_line = planner.wait(lambda x: x.get("done"))
        batches = read_batch_list(run_store)
        assert done_line["batches"] == len(batches) > len(first["batches"])
        mine = [b.batch for b in batches if rank_of(b.batch, WORLD) == rank]
        assert set(mine) > set(mine_first)
        _enqueue(shared_worker, run_store, [b for b in mine if b not in mine_first])
        follower.join(120)
        assert not follower.is_alive() and not errors, errors
        assert reader.stop_reason == "complete" and reader.plan_complete and reader.planned == set(mine)
        expected = {}
        for b in mine:
            plan = read_batch(run_store, b)
            for j, s in enumerate(plan.sample_index_N.tolist()):
                expected[s] = (b, int(plan.lengths_N[j]))
        assert sorted(g["sample_index"] for g in got) == sorted(expected), "each sample of the rank's batches once"
        assert all(expected[g["sample_index"]] == (g["batch"], g["tokens"]) for g in got)

        final = RunWatch(run_store).poll()
        assert final["plan_complete"] and final["planning"] is None and final["planner"] is None
        assert final["batches_total"] == len(batches) and final["batches_done"] == len(mine)
        report = verify_run(run_store)
        assert set(_kinds(report)) == {"not_done"}, [p for p in report["problems"] if p["kind"] != "not_done"]
        assert report["plan_complete"] and report["windows"] == 3 and report["batches_done"] == len(mine)
    finally:
        planner.kill()


def test_a_plan_stopped_after_its_first_window_is_plan_failed_and_its_batches_are_still_read(shared_worker, tiny_cache, tmp_path,
                                                                                                caplog):
    """Ctrl-C in the planner after window 0 (``on_window`` raises KeyboardInterrupt): status ``plan_failed`` with
    that window; verify ``plan_incomplete`` naming the stop; ``reconcile --dry-run`` would enqueue the window's
    batches (nobody did); the live reader yields its rank's certified batches, then raises: no more will come.
    The same plan run again resumes after the window and completes."""
    out = tmp_path / "out"
    windows: list[list[dict]] = []

    def stop_after_the_first(job, batches):
        windows.append(batches)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        plan_run(plan_options(out, LIMIT), plan_settings(tiny_cache), on_window=stop_after_the_first)
    (run_dir,) = [p for p in out.iterdir() if (p / "run.json").exists()]
    run_store = open_store(str(run_dir))
    first = [b.batch for b in windows[0]]
    assert [w.name for w in _windows(run_store)] == ["w000000"]

    env = clean_env(cache_dir=tiny_cache, state_dir=tmp_path / "state")
    status = json.loads(run_here(["status", str(run_dir), "--json", "--no-broker"], env).stdout)
    assert status["state"] == "plan_failed" and "interrupted" in status["plan_error"]
    assert status["planning"]["windows"] == 1 and status["planning"]["samples"] == FIRST_WINDOW
    assert status["batches_total"] == len(first) and status["eta_s"] is None
    text = _render(status)
    assert "1 window written before it stopped" in text and "it resumes after the 1 window written" in text, text
    assert "plan_failed (stopped by you: resumable)" in text, "a Ctrl-C is said as a stop, not as an error"

    report = verify_run(run_store)
    (incomplete,) = _kinds(report)["plan_incomplete"]
    assert "1 window written so far" in incomplete["detail"] and "interrupted" in incomplete["detail"]
    assert not PLAN_KINDS - {"plan_incomplete"} & set(_kinds(report))

    with caplog.at_level("WARNING", logger="producer.reconcile"):
        proc = run_here(["reconcile", str(run_dir), "--dry-run", "--json"], {**env, "HSX_BROKER_URL": shared_worker.broker.url})
    rec = json.loads(proc.stdout)
    assert not rec["plan_complete"] and "its planning stopped" in rec["plan_note"] and rec["windows"] == 1
    assert sorted(x["batch"] for x in rec["lost"]) == sorted(first) and rec["just_planned"] == [] and rec["enqueued"] == []
    assert rec["plan_note"] in caplog.text, "the text output says it too (a warning)"

    rank = next(r for r in range(WORLD) if any(rank_of(b, WORLD) == r for b in first))
    mine = [b for b in first if rank_of(b, WORLD) == rank]
    _enqueue(shared_worker, run_store, mine)
    wait_until(lambda: set(mine) <= done_batches(run_store), 120, "the rank's batches to be certified")
    reader = LiveHiddenStatesDataset(run_store, rank=rank, world_size=WORLD, poll_s=POLL_S, idle_timeout_s=30, finals="none")
    got = []
    with pytest.raises(HsxError, match=r"planning failed \(interrupted.*all read"):
        for sample in reader:
            got.append(sample["batch"])
    assert set(got) == set(mine) and reader.planned == set(mine) and not reader.plan_complete

    resumed = plan_run(plan_options(out, LIMIT), plan_settings(tiny_cache))
    assert resumed.config.run_id == run_dir.name and resumed.stats["windows"] == 3
    assert [b.batch for b in resumed.batches][:len(first)] == first
    report = verify_run(run_store)
    assert not PLAN_KINDS & set(_kinds(report)), report["problems"][:5]
    assert {b.batch for b in resumed.batches} - set(mine) == {p["batch"] for p in report["problems"]}
    assert RunWatch(run_store).poll()["state"] in ("running", "stalled"), "nothing queues the other batches: stalled soon"


def test_a_planner_killed_between_windows_is_plan_failed_with_its_progress(tiny_cache, tmp_path):
    """SIGKILL leaves the planning record of a live planner: status sees its process gone (this host) and reports
    ``plan_failed`` with the windows written and the progress the planner last recorded."""
    planner = PausedPlanner(tiny_cache, tmp_path / "out", tmp_path)
    try:
        first = planner.wait(lambda x: x.get("window") == 0)
        run_store = open_store(first["address"])
        assert RunWatch(run_store).poll()["state"] == "planning"
    finally:
        planner.kill()
    status = RunWatch(run_store).poll()
    assert status["state"] == "plan_failed" and f"pid {first['pid']}" in status["plan_error"]
    assert "exited without finishing" in status["plan_error"]
    p = status["planning"]
    assert p["windows"] == 1 and p["batches"] == len(first["batches"]) and p["records_total"] == LIMIT
    assert p["eta_s"] is None and status["eta_s"] is None and p["percent"] > 0
    proc = run_here(["verify", first["address"], "--json"], clean_env(cache_dir=tiny_cache))
    assert proc.returncode == 1 and "exited without finishing" in json.loads(proc.stdout)["problems"][0]["detail"]


def _windows(run_store) -> list[PlanWindow]:
    from hsx.records import read_windows

    return read_windows(run_store)


def _copy(plan_dir: Path, tmp_path: Path) -> tuple[Path, object]:
    dest = tmp_path / plan_dir.name
    shutil.copytree(plan_dir, dest)
    return dest, open_store(str(dest))


def test_a_complete_streamed_plan_passes_verify_and_every_tampering_is_named(complete_plan, tmp_path):
    """The complete plan: no problem of the plan (only its batches not extracted). A sample row moved to another
    batch, a window record deleted, a window's samples shifted, stats that do not count the windows: each is a
    ``plan_mismatch`` naming the batches or the window."""
    store = open_store(str(complete_plan))
    report = verify_run(store)
    assert set(_kinds(report)) == {"not_done"}, [p for p in report["problems"] if p["kind"] != "not_done"][:5]
    assert report["plan_complete"] and report["windows"] == 3
    assert report["samples_planned"] == sum(w.num_samples for w in _windows(store))

    # a row of window 1 names another batch of the window
    run_dir, copy = _copy(complete_plan, tmp_path / "moved")
    key = window_samples_key("w000001")
    lines = (run_dir / key).read_text().splitlines()
    row = json.loads(lines[3])
    w1 = PlanWindow.read(copy, "w000001")
    other = next(b.batch for b in w1.batches if b.batch != row["batch"])
    moved_from = row["batch"]
    lines[3] = json.dumps({**row, "batch": other})
    (run_dir / key).write_text("\n".join(lines) + "\n")
    kinds = _kinds(verify_run(copy))
    assert set(kinds) == {"not_done", "plan_mismatch"}
    named = {p["batch"]: p for p in kinds["plan_mismatch"]}
    assert set(named) == {moved_from, other} and {p["window"] for p in named.values()} == {"w000001"}
    assert f"samples [{row['sample_index']}] are in the file but their rows name another batch" in named[moved_from]["detail"]
    assert f"samples [{row['sample_index']}] are named but not in the file" in named[other]["detail"]

    # window 1's record deleted: a gap, batches of the list in no window, the stats differ
    run_dir, copy = _copy(complete_plan, tmp_path / "gap")
    (run_dir / window_key("w000001")).unlink()
    kinds = _kinds(verify_run(copy))
    details = " | ".join(p["detail"] for p in kinds["plan_mismatch"])
    assert "window w000001 is missing: the windows after it (w000002)" in details, details
    assert f"{len(w1.batches)} batches of plan/batches.json ({w1.batches[0].batch}" in details, details
    assert "plan/stats.json differs from the windows: samples" in details and "is not marked last" in details, details
    assert "w000001" in {p["window"] for p in kinds["plan_mismatch"]}

    # window 1 says it starts one sample late; its rows no longer fit its range
    run_dir, copy = _copy(complete_plan, tmp_path / "shifted")
    record = json.loads((run_dir / window_key("w000001")).read_text())
    (run_dir / window_key("w000001")).write_text(json.dumps({**record, "first_sample": record["first_sample"] + 1}))
    kinds = _kinds(verify_run(copy))
    details = [p["detail"] for p in kinds["plan_mismatch"] if p["window"] == "w000001"]
    assert any(f"starts at sample {FIRST_WINDOW + 1}, the windows before end at sample {FIRST_WINDOW}" in d for d in details), details
    assert any(window_samples_key("w000001") in d and "outside the window" in d for d in details), details
    assert any("starts at sample" in p["detail"] for p in kinds["plan_mismatch"] if p["window"] == "w000002")

    # a sample file lost
    run_dir, copy = _copy(complete_plan, tmp_path / "rows")
    (run_dir / window_samples_key("w000000")).unlink()
    (p,) = _kinds(verify_run(copy))["plan_mismatch"]
    assert p["window"] == "w000000" and "have no rows" in p["detail"]


def test_planning_progress_and_its_eta(tmp_path):
    """The planning's numbers from a window and the planner's record: the percent of the records when their total
    is known (else of the bytes), the rate since the start, the planning ETA less the time since the last window,
    the tokens extrapolated; the run's ETA is the larger of the planning's and the extraction's."""
    from hsx.records import BatchSummary

    window = PlanWindow(window=0, first_sample=0, num_samples=100, first_batch=0, tokens=50_000, supervised_tokens=40_000,
                        padded_tokens=52_000, records_read=250,
                        batches=[BatchSummary(batch=f"b{i:06d}", num_samples=50, num_tokens=25_000) for i in range(2)])
    record = Planning(state="planning", started_unix=1000.0, updated_unix=1100.0, records_read=250, bytes_read=2_000_000,
                      bytes_total=8_000_000, num_proc=4)
    p = planning_progress([window], record, now=1110.0)
    assert p["percent"] == 25.0 and p["bytes_per_s"] == 20_000.0 and p["records_per_s"] == 2.5
    assert p["eta_s"] == 300.0 - 10.0 and p["tokens_estimated"] == 200_000 and p["updated_age_s"] == 10.0
    by_records = planning_progress([window], record.model_copy(update={"records_total": 1000}), now=1100.0)
    assert by_records["percent"] == 25.0 and by_records["eta_s"] == 300.0
    assert planning_progress([window], record, now=2000.0)["eta_s"] == 0.0, "late: not negative"
    failed = planning_progress([window], Planning(state="failed"), now=1100.0, failed=True)
    assert failed["eta_s"] is None and failed["records_read"] == 250 and failed["batches"] == 2 and failed["percent"] is None
    assert RunWatch._planning_eta(p, tokens_done=40_000, tokens_per_s=400.0) == 400.0  # extraction is the longer
    assert RunWatch._planning_eta(p, tokens_done=190_000, tokens_per_s=400.0) == 290.0  # the planning is
    assert RunWatch._planning_eta(p, tokens_done=0, tokens_per_s=None) is None
