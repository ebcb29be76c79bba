"""``producer status`` from the store alone: quarantine, failures with reasons, heartbeat rows, the
terminal view. The live cases (a running job, Flower, gpu_stats) are in test_monitoring.py.
"""

from __future__ import annotations

import pytest

import json
import time
from datetime import datetime, timezone

from rich.console import Console

from deadclaims import age_claims, take_and_die
from jobfixtures import run_here
from smallrun import copy_run, quarantine_first_sample

from hsx.layout import WORKERS_PREFIX, marker_key
from hsx.records import done_batches
from hsx.plan import read_batch_list
from hsx.store import open_store
from producer.status import RunWatch
from producer.statusview import status_view


def _utc(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).isoformat(timespec="seconds")


def test_status_counts_quarantine_failures_and_paused_workers_from_the_store(small_run, tmp_path):
    """One batch quarantined a sample, one failed (no marker, a failure record), one worker paused by backpressure:
    status counts each, names the failure's reason, and reports the run failed since nothing is left to run."""
    run_dir = copy_run(small_run, tmp_path)
    store = open_store(str(run_dir))
    batches = read_batch_list(store)
    first, last = batches[0].batch, batches[-1].batch
    quarantine_first_sample(run_dir, first)
    store.delete(marker_key(last))
    store.write(f"failures/{last}.json", json.dumps({"batch": last, "error": "FidelityError: all 3 samples NaN",
                                                      "host": "node7", "at": _utc(time.time())}).encode())
    now = float(int(time.time()))  # records carry whole seconds
    store.write("workers/node7-41.json", json.dumps({
        "host": "node7", "pid": 41, "device": "NVIDIA H200", "state": "paused", "heartbeat_s": 5.0,
        "paused_reason": "spool 85% full (limit 80%, HSX_SPOOL_MAX_FRACTION)", "paused_since": _utc(now - 30),
        "batches": [{"batch": last, "phase": "paused", "since": _utc(now - 30)}], "updated_at": _utc(now - 2)}).encode())
    store.write("workers/node8-42.json", json.dumps({
        "host": "node8", "pid": 42, "device": "cpu", "state": "idle", "heartbeat_s": 5.0, "batches": [],
        "updated_at": _utc(now - 600)}).encode())

    status = RunWatch(store).poll(now=now)
    total_samples = sum(b.num_samples for b in batches)
    assert status["state"] == "failed"
    assert status["batches_done"] == len(batches) - 1 and status["batches_failed"] == 1
    assert status["samples_done"] == total_samples - batches[-1].num_samples
    assert status["samples_quarantined"] == 1
    assert status["samples_stored"] == status["samples_done"] - 1
    assert status["failures"][last]["error"].startswith("FidelityError")
    rows = {r["host"]: r for r in status["workers"]}
    assert rows["node7"]["paused"].startswith("spool 85% full") and rows["node7"]["online"] is True
    assert rows["node7"]["running"] == [f"{last} (paused)"] and rows["node7"]["heartbeat_age_s"] == 2.0
    assert rows["node8"]["online"] is None and rows["node8"]["state"] == "idle", \
        "an idle worker writes no more records: an old idle record is not known to be dead, and never 'stopped'"
    markers_rows = [r for r in status["workers"] if "markers" in r["sources"]]
    assert sum(r["batches_done"] for r in markers_rows) == len(batches) - 1

    out = Console(record=True, width=200)
    out.print(status_view(status))
    text = out.export_text()
    for expected in ("failed", f"{len(batches) - 1} / {len(batches)} batches", "1 quarantined", "spool 85% full",
                     "NVIDIA H200", "FidelityError: all 3 samples NaN", "paused, 2s ago"):
        assert expected in text, f"{expected!r} not in the view:\n{text}"


def _one_batch_left(small_run, tmp_path):
    """A copy of the small run with its last batch's marker removed and no worker record (the shared
    worker's own may still be fresh): ``(run_dir, store, that batch)``."""
    run_dir = copy_run(small_run, tmp_path)
    store = open_store(str(run_dir))
    last = read_batch_list(store)[-1].batch
    store.delete(marker_key(last))
    for key in store.list(WORKERS_PREFIX):
        store.delete(key)
    return run_dir, store, last


def test_a_run_whose_every_worker_went_quiet_is_stalled_not_running(small_run, tmp_path):
    """Batches left and no failure, but the only worker's heartbeat is stale (stopped, killed): state
    ``stalled``, no ETA; once a worker reports again it is ``running``."""
    run_dir, store, last = _one_batch_left(small_run, tmp_path)
    now = float(int(time.time()))
    record = {"host": "node9", "pid": 43, "device": "cpu", "state": "working", "heartbeat_s": 5.0,
              "batches": [{"batch": last, "phase": "forward", "since": _utc(now - 90)}], "updated_at": _utc(now - 80)}
    store.write("workers/node9-43.json", json.dumps(record).encode())
    status = RunWatch(store).poll(now=now)
    assert status["state"] == "stalled" and status["eta_s"] is None
    store.write("workers/node9-43.json", json.dumps({**record, "updated_at": _utc(now - 1)}).encode())
    assert RunWatch(store).poll(now=now)["state"] == "running"


def _stalled_run(small_run, tmp_path, *, idle: bool = False):
    """A copy of the small run with one batch left and its only worker quiet (or idle long ago)."""
    run_dir, store, last = _one_batch_left(small_run, tmp_path)
    now = float(int(time.time()))
    record = {"state": "idle" if idle else "working", "updated_at": _utc(now - 80)}
    store.write("workers/node9-43.json", json.dumps({"host": "node9", "pid": 43, "device": "cpu", "heartbeat_s": 5.0,
                                                     "batches": [], **record}).encode())
    return run_dir, store, now


def test_a_stalled_run_on_the_embedded_broker_is_restarted_by_running_it_again(small_run, tmp_path):
    """``producer run``'s own broker is gone with it: the advice is that command, no broker URL and nothing
    parked to fix first; ``status`` finds the run's workers log on this machine."""
    run_dir, store, now = _stalled_run(small_run, tmp_path)
    status = RunWatch(store, broker="embedded").poll(now=now)
    assert status["state"] == "stalled"
    assert status["restart"].startswith("run the same `python -m producer run` command again: it enqueues every batch "
                                        "without a marker; it was: `python -m producer run sharegpt "), status["restart"]
    quiet = RunWatch(store, broker="redis://:***@head:6379/0").poll(now=now)["restart"]
    assert quiet.startswith("start workers on the run's broker: `HSX_BROKER_URL=redis://:***@head:6379/0 python -m workers`")
    assert "parked" not in quiet and "parked" not in RunWatch(store).poll(now=now)["restart"]

    state = tmp_path / "state"
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / f"workers-{status['run_id']}.log").write_text("")
    proc = run_here(["status", str(run_dir), "--json", "--no-broker"], {**small_run["env"], "HSX_STATE_DIR": str(state)})
    assert json.loads(proc.stdout)["restart"] == status["restart"], proc.stderr


def test_status_without_a_broker_calls_an_idle_worker_idle_not_stopped(small_run, tmp_path):
    """Issue 19 item 8: an idle worker writes one record and no more for the run, so its record grows old while it
    lives. ``status --no-broker`` says ``idle`` (online not known) and says so in the stall, never "stopped"."""
    run_dir, store, now = _stalled_run(small_run, tmp_path, idle=True)
    status = RunWatch(store, broker="embedded").poll(now=now)
    (row,) = [r for r in status["workers"] if r["host"] == "node9"]
    assert row["state"] == "idle" and row["online"] is None, row
    assert status["state"] == "stalled" and "1 idle" in status["stalled_reason"], status["stalled_reason"]
    assert "stopped" not in status["stalled_reason"], status["stalled_reason"]
    proc = run_here(["status", str(run_dir), "--no-broker"], small_run["env"])
    said = " ".join(proc.stdout.split())
    assert proc.returncode == 0 and "idle, 1m" in said and "stopped" not in said, said


def test_status_watch_json_prints_one_line_per_refresh_and_stops_when_the_run_is_done(small_run):
    """``status --watch --json`` on a finished run prints one JSON line, state done, and exits 0; it needs no broker."""
    proc = run_here(["status", small_run["address"], "--watch", "--json", "--interval", "0.2"], small_run["env"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1
    status = json.loads(lines[0])
    assert status["state"] == "done" and status["broker"] is None
    assert status["batches_done"] == len(done_batches(open_store(small_run["address"]))) == small_run["report"]["batches_total"]


def test_status_view_shows_gpu_readings_and_eta_of_a_running_run():
    """The view of a running run shows the bar, rate, ETA and each GPU worker's utilisation, memory, temperature and power."""
    status = {
        "run_id": "r1", "address": "s3://b/r1", "model": "Qwen/Qwen3.6-27B", "state": "running", "planned": True,
        "batches_total": 200, "batches_done": 50, "batches_failed": 0, "samples_total": 4000, "samples_done": 1000,
        "samples_stored": 1000, "samples_quarantined": 0, "tokens_total": 8_000_000, "tokens_done": 2_000_000,
        "skipped": {"too_long": 3}, "samples_skipped": 3, "tokens_per_s": 9000.0, "samples_per_s": 4.5,
        "overall_tokens_per_s": 8800.0, "rate_window_s": 600.0, "eta_s": 667.0,
        "broker": {"url": "redis://:***@head:6379/0", "queue_name": "gpu", "queue": {"waiting": 148, "claimed": 2}},
        "failures": {},
        "workers": [{"name": "gpu0@node1", "host": "node1", "pid": 7, "device": "cuda:0", "state": "working",
                     "gpu": {"name": "NVIDIA H200", "utilization_pct": 97, "memory_used_bytes": 100 * 2**30,
                             "memory_total_bytes": 141 * 2**30, "temperature_c": 61, "power_w": 650.0},
                     "running": ["b000051 (forward)"], "tokens_per_s": 9000.0, "batches_done": 50,
                     "heartbeat_age_s": 1.0, "paused": None, "online": True}],
    }
    out = Console(record=True, width=200)
    out.print(status_view(status))
    text = out.export_text()
    for expected in ("50 / 200 batches (25.0%)", "9,000 tok/s", "eta", "11m07s", "gpu0@node1", "NVIDIA H200", "97%",
                     "107.4 GB / 151.4 GB", "61C 650W", "b000051 (forward)", "148 waiting", "too_long 3"):
        assert expected in text, f"{expected!r} not in the view:\n{text}"


def test_the_rate_on_screen_is_the_recent_one_not_an_average_that_counts_the_warm_up():
    """A run that spent 300 s loading and warming up, then certified a 30,000-token batch every 4 s:
    the rate is 7,500 tok/s (the steady one), while tokens over time since the start would say ~2,800."""
    from producer.status import recent_rate

    arrivals = [(300.0 + 4 * i, 30_000) for i in range(50)]  # markers at 300, 304, ..., 496 s
    now = 497.0
    assert recent_rate(arrivals, now) == pytest.approx(7_500, rel=0.03)
    assert sum(n for _, n in arrivals) / now < 3_100
    # A stall shows: no marker for 60 s after the last one, the rate falls.
    assert recent_rate(arrivals, 556.0) < 0.7 * recent_rate(arrivals, now)
    # One marker is not a rate.
    assert recent_rate(arrivals[:1], 301.0) is None and recent_rate([], 1.0) is None


def test_the_overall_rate_leaves_out_a_stop_and_a_stopped_run_shows_no_current_rate():
    """A run that ran 10 minutes, was stopped for a night and resumed for 10 more: its overall rate is
    the rate it ran at, not one diluted by the night; short waits between batches (a worker loading)
    count. A stalled run's screen says no rate now instead of a recent rate that decays as the stop ages."""
    from producer.status import STOPPED_GAP_S, busy_span

    first = [{"start": 10.0 * i, "end": 10.0 * i + 10} for i in range(60)]  # 0 .. 600 s, back to back
    night = 8 * 3600.0
    second = [{"start": night + 10.0 * i, "end": night + 10.0 * i + 10} for i in range(60)]
    assert busy_span(first + second) == pytest.approx(1200.0)
    waits = [{"start": 0.0, "end": 10.0}, {"start": 10.0 + STOPPED_GAP_S - 1, "end": STOPPED_GAP_S + 19}]
    assert busy_span(waits) == pytest.approx(STOPPED_GAP_S + 19)  # a wait shorter than a stop counts
    overlapping = [{"start": 0.0, "end": 100.0}, {"start": 50.0, "end": 60.0}, {"start": 90.0, "end": 120.0}]
    assert busy_span(overlapping) == pytest.approx(120.0)
    status = {"run_id": "r", "address": "file:///r", "model": "m", "state": "stalled", "planned": True, "batches_total": 4,
              "batches_done": 2, "batches_failed": 0, "samples_total": 8, "samples_done": 4, "samples_stored": 4, "samples_quarantined": 0, "samples_skipped": 0, "tokens_total": 400,
              "tokens_done": 200, "tokens_per_s": 3.0, "samples_per_s": 0.1, "overall_tokens_per_s": 50.0,
              "rate_window_s": 7200.0, "eta_s": None, "skipped": {}, "broker": None, "failures": {}, "workers": [],
              "stalled_reason": "stopped", "restart": "run it again"}
    out = Console(record=True, width=200)
    out.print(status_view(status))
    text = out.export_text()
    assert "none now (nothing runs it), 50 tok/s overall" in " ".join(text.split()), text
    assert "over the last" not in text and "samples/s" not in text, "no decaying recent rate of samples either"


def test_a_worker_of_this_host_whose_process_is_gone_is_lost_at_once_and_runs_nothing(small_run, tmp_path):
    """A fresh record (heartbeat 1 s ago) of a process of this host and PID namespace that no longer exists:
    ``lost`` now, not three heartbeats later. It runs nothing: the batches it listed are ``held_at_death``, the one
    certified since marked ``done since``, and the undone one comes back when its lease ends (``reclaim_in_s``,
    said in the stall). The same record from another PID namespace (a container on the host's network) stays online."""
    import socket
    import subprocess
    import sys

    run_dir = copy_run(small_run, tmp_path)
    store = open_store(str(run_dir))
    for key in store.list(WORKERS_PREFIX):
        store.delete(key)
    batches = [b.batch for b in read_batch_list(store)]
    done, undone = batches[0], batches[-1]
    store.delete(marker_key(undone))
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # its pid is now free: the process is gone
    now = float(int(time.time()))
    from hsx.processes import pid_namespace

    store.write(f"workers/{socket.gethostname()}-{child.pid}.json", json.dumps({
        "host": socket.gethostname(), "pid": child.pid, "pid_ns": pid_namespace(), "device": "cpu", "state": "working",
        "heartbeat_s": 5.0,
        "batches": [{"batch": done, "phase": "forward", "since": _utc(now - 3)},
                    {"batch": undone, "phase": "waiting_gpu", "since": _utc(now - 3)}],
        "updated_at": _utc(now - 1)}).encode())
    status = RunWatch(store).poll(now=now)
    (row,) = [r for r in status["workers"] if r["pid"] == child.pid]
    assert row["state"] == "lost" and row["online"] is False, row
    assert row["running"] == [] and row["held_at_death"] == [f"{done} (forward; done since)",
                                                              f"{undone} (waiting_gpu)"], row
    assert 0 < row["reclaim_in_s"] <= 120 + 30, row  # the default lease, and the looks that confirm it
    assert status["state"] == "stalled", status["state"]  # no live worker is there to put it back
    assert "its 1 batch comes back by itself when its lease ends, in about" in status["stalled_reason"]
    store.write(f"workers/{socket.gethostname()}-{child.pid}.json", json.dumps({
        **json.loads(store.read(f"workers/{socket.gethostname()}-{child.pid}.json")), "pid_ns": "pid:[1]"}).encode())
    (row,) = [r for r in RunWatch(store).poll(now=now)["workers"] if r["pid"] == child.pid]
    assert row["state"] == "working" and row["online"] is True, row


def test_the_rate_window_is_the_time_the_markers_cover_not_the_full_window(small_run, tmp_path):
    """22 s into a run, the rate is not "over the last 2m00s": it is over the time since the first
    marker it counts."""
    from producer.status import RATE_WINDOW_S, recent_window

    assert recent_window([(10.0, 100), (14.0, 100), (18.0, 100)], now=22.0) == (200 / 12.0, 12.0)
    assert recent_window([(10.0, 100)], now=22.0) == (None, None)
    run_dir = copy_run(small_run, tmp_path)
    store = open_store(str(run_dir))
    store.delete(marker_key(read_batch_list(store)[-1].batch))
    watch = RunWatch(store)
    first = watch.poll()
    ends = sorted(m["end"] for m in watch.markers.values())
    status = watch.poll(now=ends[-1] + 10)
    assert status["rate_window_s"] == round(ends[-1] + 10 - ends[0], 1) < RATE_WINDOW_S, (first, ends)
    out = Console(record=True, width=200)
    out.print(status_view({**status, "state": "running"}))
    assert f"over the last {round(status['rate_window_s'])}s" in out.export_text()


# --- no worker ever took a batch (issue 22, item 4) ---------------------------------------------


def _untaken_run(small_run, tmp_path):
    """A copy of the small run as it is before any worker took a batch: planned, no marker, no worker record."""
    run_dir = copy_run(small_run, tmp_path)
    store = open_store(str(run_dir))
    for b in read_batch_list(store):
        store.delete(marker_key(b.batch))
    for key in store.list(WORKERS_PREFIX):
        store.delete(key)
    return run_dir, store


def test_a_run_no_worker_has_taken_is_queued_with_the_command_that_starts_workers_for_it(small_run, tmp_path):
    """A cluster queue no worker has taken from is not ``running``: ``queued``, no ETA, and the command
    that starts workers on the run's broker serving its store root (or, broker not known, both ways)."""
    run_dir, store = _untaken_run(small_run, tmp_path)
    root = store.url.rsplit("/", 1)[0]
    status = RunWatch(store, broker="redis://:***@head:6379/0").poll()
    assert status["state"] == "queued" and status["eta_s"] is None
    assert status["stalled_reason"].startswith("queued: no worker has taken a batch of the run yet")
    assert status["restart"] == ("start workers on the run's broker that serve its store: "
                                 f"`HSX_BROKER_URL=redis://:***@head:6379/0 HSX_STORE_URL={root} HSX_MODEL=tiny-qwen3.5 "
                                 "python -m workers`")
    unknown = RunWatch(store).poll()
    assert unknown["state"] == "queued" and "HSX_BROKER_URL=redis://... " in unknown["restart"]
    out = Console(record=True, width=200)
    out.print(status_view(status))
    text = out.export_text()
    assert "queued" in text and "to start" in text and "to restart" not in text, text


def test_a_producer_run_stopped_before_its_workers_took_a_batch_is_stalled_and_says_to_run_it_again(small_run, tmp_path):
    """Ctrl-C while a ``producer run``'s workers start: its embedded broker is gone, so ``status`` (which
    finds the run's workers log on this machine and no live embedded broker) says ``stalled`` with that
    command, never ``running``; while that broker answers, ``queued`` (its workers are starting). The
    empty workers table does not tell the user to set HSX_BROKER_URL: the embedded broker needs none."""
    run_dir, store = _untaken_run(small_run, tmp_path)
    watch = RunWatch(store, broker="embedded")
    watch.embedded_live = True
    starting = watch.poll()
    assert starting["state"] == "queued" and "is starting its workers" in starting["stalled_reason"]
    watch.embedded_live = False
    gone = watch.poll()
    assert gone["state"] == "stalled" and "is not running on this machine" in gone["stalled_reason"]
    assert gone["restart"].startswith("run the same `python -m producer run` command again: it enqueues every batch "
                                        "without a marker; it was: `python -m producer run sharegpt "), gone["restart"]

    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / f"workers-{gone['run_id']}.log").write_text("")
    env = {**small_run["env"], "HSX_STATE_DIR": str(tmp_path / "state")}
    env.pop("HSX_BROKER_URL", None)
    proc = run_here(["status", str(run_dir), "--json"], env)
    said = json.loads(proc.stdout)
    assert said["state"] == "stalled" and said["restart"] == gone["restart"], proc.stderr
    view = " ".join(run_here(["status", str(run_dir)], env).stdout.split())
    assert "stalled" in view and "no workers seen yet" in view and "set HSX_BROKER_URL" not in view, view


# --- the rough spots of issue 22, item 7 ----------------------------------------------------------


def test_a_finished_runs_rate_and_its_window_do_not_change_as_it_ages(small_run):
    """The recent rate of a done run is measured up to its last marker: an hour later it is the same."""
    store = open_store(str(small_run["dir"]))
    now = time.time()
    soon, later = RunWatch(store).poll(now=now), RunWatch(store).poll(now=now + 3600)
    assert soon["state"] == later["state"] == "done"
    assert soon["rate_window_s"] is not None and soon["rate_window_s"] == later["rate_window_s"]
    assert soon["tokens_per_s"] == later["tokens_per_s"]


def test_the_last_frame_of_a_finished_producer_run_does_not_show_its_stopped_brokers_error(small_run):
    """``status --watch`` next to a ``producer run``: the run ends, stops its embedded broker, and the
    last poll fails to reach it. A done run's view leaves that out; a running one shows it."""
    status = RunWatch(open_store(str(small_run["dir"]))).poll()
    gone = {"url": "redis+socket:///tmp/hsx/broker.sock", "error": "ConnectionError: Error 2 connecting to unix socket"}
    out = Console(record=True, width=200)
    out.print(status_view({**status, "broker": gone}))
    assert status["state"] == "done" and "ConnectionError" not in out.export_text()
    out = Console(record=True, width=200)
    out.print(status_view({**status, "state": "running", "broker": gone}))
    assert "ConnectionError" in out.export_text()


@pytest.mark.parametrize("watch", [[], ["--watch"]], ids=["once", "watch"])
def test_status_json_into_a_closed_pipe_exits_quietly(small_run, watch):
    """``status --json | head`` where the reader is gone: no BrokenPipeError traceback, exit 1 (as rich's
    own writes do), also for ``--watch --json``'s lines."""
    import os
    import subprocess
    import sys

    from jobfixtures import ROOT

    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader left before anything was written: the first write fails with EPIPE
    try:
        proc = subprocess.run([sys.executable, "-m", "producer", "status", str(small_run["dir"]), "--json", "--no-broker", *watch],
                              cwd=ROOT, env=small_run["env"], stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr


def test_the_workers_table_is_readable_at_80_columns(small_run, tmp_path):
    """The default terminal width: every header is whole (not ``work…`` / ``dev…``), no cell ends in an
    ellipsis, nothing is wider than the terminal, and a paused or dead worker's note is there in full
    (it had a zero-width column). The small run's own worker and two records as workers/heartbeat.py and
    ``python -m workers`` write them: one paused by its spool, one found dead while loading."""
    import socket

    run_dir = copy_run(small_run, tmp_path)
    store = open_store(str(run_dir))
    batches = [b.batch for b in read_batch_list(store)]
    now = float(int(time.time()))
    reason = "spool 85% full (limit 80%, HSX_SPOOL_MAX_FRACTION)"
    store.write("workers/gpu-node-17.example.org-41.json", json.dumps({
        "host": "gpu-node-17.example.org", "pid": 41, "device": "NVIDIA H200", "state": "paused", "heartbeat_s": 5.0,
        "paused_reason": reason, "paused_since": _utc(now - 30),
        "batches": [{"batch": b, "phase": "waiting_gpu", "since": _utc(now - 30)} for b in batches],
        "updated_at": _utc(now - 2)}).encode())
    death = ("killed by SIGKILL while loading the model: the checkpoint (52.1 GB) is larger than the host's "
             "available memory (31.0 GB, /proc/meminfo MemAvailable): likely the kernel's OOM killer")
    store.write(f"workers/{socket.gethostname()}-42.json", json.dumps({
        "host": socket.gethostname(), "pid": 42, "device": "cuda:3", "state": "stopped", "heartbeat_s": 5.0,
        "batches": [], "exit": death, "exited_at": _utc(now - 5), "updated_at": _utc(now - 5)}).encode())
    status = RunWatch(store).poll(now=now)
    assert len(status["workers"]) >= 3, status["workers"]

    out = Console(record=True, width=80)
    out.print(status_view(status))
    text = out.export_text()
    assert "…" not in text, text
    assert max(len(line) for line in text.splitlines()) <= 80, text
    header = next(line for line in text.splitlines() if "worker" in line and "batch" in line)
    for name in ("worker", "device", "batch", "tok/s", "batches", "heartbeat"):
        assert f" {name} " in header, f"{name!r} not whole in the header {header!r}:\n{text}"
    said = " ".join(text.split())
    for whole in (f"paused: {reason}", death, "NVIDIA H200", "cuda:3", *batches):
        assert whole in said, f"{whole!r} not in the view:\n{text}"
    assert f"file://{run_dir}" in "".join(text.split()), f"the address is folded whole onto lines, not cut:\n{text}"


def _run_left_with_its_workers_stopped(small_run, tmp_path, *, done: int | None):
    """A copy of the run with only its first ``done`` batches' markers (None: half), and every worker record
    ``stopped`` with no batch (what a warm shutdown writes, and what a killed worker leaves once its
    launcher saw it exit): its store."""
    store = open_store(str(copy_run(small_run, tmp_path)))
    batches = read_batch_list(store)
    for b in batches[len(batches) // 2 if done is None else done:]:
        store.delete(marker_key(b.batch))
    for key in store.list(WORKERS_PREFIX):
        record = json.loads(store.read(key))
        store.write(key, json.dumps({**record, "state": "stopped", "batches": []}).encode())
    return store


def _embedded_watch(store, *, live: bool | None) -> RunWatch:
    """``status``'s watch of a run on the embedded broker whose ``producer run`` is (not) running here."""
    watch = RunWatch(store, broker="embedded")
    watch.embedded_live = live
    return watch


def test_a_producer_run_stopped_midway_says_so_in_its_stall(small_run, tmp_path):
    """Ctrl-C of a ``producer run`` after some batches: its workers stopped with it and its embedded broker is gone;
    ``status`` calls the run ``stalled`` (batches are left, nothing runs them) and says first why, in the user's
    terms (that command is not running; the finished batches are kept), with the command that resumes it."""
    watch = _embedded_watch(_run_left_with_its_workers_stopped(small_run, tmp_path, done=None), live=False)
    status = watch.poll()
    assert status["state"] == "stalled", status
    assert status["stalled_reason"].startswith("the `python -m producer run` that ran it is not running on this machine "
                                               "(stopped by a Ctrl-C, or it failed): its finished batches keep their markers; "
                                               "no worker is working on the run: 1 worker stopped (the process exited)"
                                               ), status["stalled_reason"]
    assert status["restart"].startswith("run the same `python -m producer run` command again: it enqueues every batch "
                                        "without a marker; it was: `python -m producer run sharegpt "), status["restart"]
    watch.embedded_live = None  # not known (--no-broker): nothing said of the command
    assert not watch.poll()["stalled_reason"].startswith("the `python -m producer run`")


def test_a_producer_run_whose_worker_died_says_it_restarts_it_not_to_run_it_again(small_run, tmp_path):
    """A worker of a live ``producer run`` killed mid-run (SIGKILL): until its launcher has started
    the new one, no worker works on the run, so ``status`` says ``stalled``; the reason opens with
    ``restarting``: the command still runs and restarts its workers (no ``reconcile`` advice: a new user
    was told to reconcile a run whose worker was being restarted), and the advice is not to run the command again
    (which would be refused: the embedded broker is that command's)."""
    status = _embedded_watch(_run_left_with_its_workers_stopped(small_run, tmp_path, done=1), live=True).poll()
    assert status["state"] == "stalled", status
    assert status["stalled_reason"].startswith("restarting: the `python -m producer run` on this machine still runs "
                                               "and restarts its workers that died (up to its restart limit, then it "
                                               "stops and says why); meanwhile no worker is working on the run"
                                               ), status["stalled_reason"]
    assert "reconcile" not in status["stalled_reason"]  # that command enqueues its batches itself
    assert status["restart"].startswith("nothing while that command runs: it restarts its workers"), status["restart"]
    assert "run the same" not in status["restart"]


def test_a_producer_run_killed_with_sigkill_is_not_said_to_be_restarting_its_workers(small_run, tmp_path):
    """``kill -9`` of ``producer run`` leaves its embedded valkey-server answering (the next ``run`` stops
    it): ``status`` must not take the answering broker for the command (a new user was told
    "restarting: ... still runs" a minute after killing it). The lock file's pid decides: a live
    process that holds it is the command; once it is gone the stall says the command is not running."""
    import os
    import signal
    import subprocess
    import sys

    from hsx.broker import EmbeddedBroker
    from jobfixtures import ROOT

    store = _run_left_with_its_workers_stopped(small_run, tmp_path, done=1)
    state = tmp_path / "state"
    assert EmbeddedBroker.holder_alive(state) is None  # no lock file: not known
    # a stand-in for `producer run` (its command line names it), holding the embedded broker
    owner = subprocess.Popen([sys.executable, "-c",
                              "import sys, time; from hsx.broker import EmbeddedBroker; "
                              "b = EmbeddedBroker(sys.argv[1]).start(); print(b.proc.pid, flush=True); time.sleep(600)",
                              str(state), "producer-run-stand-in"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    server_pid = int(owner.stdout.readline())
    try:
        env = {**small_run["env"], "HSX_STATE_DIR": str(state)}
        assert EmbeddedBroker.holder_alive(state) is True
        live = json.loads(run_here(["status", store.url, "--json"], env).stdout)
        assert live["stalled_reason"].startswith("restarting: the `python -m producer run` on this machine still runs")
        os.kill(owner.pid, signal.SIGKILL)  # as `kill -9` of `producer run`: its broker keeps answering
        owner.wait(30)
        assert EmbeddedBroker.holder_alive(state) is False
        gone = json.loads(run_here(["status", store.url, "--json"], env).stdout)
        assert gone["state"] == "stalled" and gone["stalled_reason"].startswith(
            "the `python -m producer run` that ran it is not running on this machine"), gone["stalled_reason"]
        assert gone["restart"].startswith("run the same `python -m producer run` command again"), gone["restart"]
    finally:
        if owner.poll() is None:
            owner.kill()
        try:
            os.kill(server_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# --- what a new user's multi-node run with faults showed (a lost node, a broker restart) -------------

QUEUE = "gpu"


def _settings(broker_url: str):
    from settings import Settings

    return Settings(_env_file=None, broker_url=broker_url, queue=QUEUE, inspect_timeout_s=0.2)


def _claims_nobody_lists(broker_url: str, run_url: str, batches: list[str], age_s: float = 60.0) -> list[str]:
    """Send ``batches`` of ``run_url`` with Celery, and have a consumer die holding them, ``age_s`` seconds ago
    (``deadclaims.age_claims``); their task ids."""
    from hsx.queue import send_batches
    from hsx.records import BatchSummary

    send_batches(_settings(broker_url), broker_url, run_url, run_url.rsplit("/", 1)[-1],
                 [BatchSummary(batch=b, num_samples=1, num_tokens=8) for b in batches])
    ids = take_and_die(broker_url, QUEUE, len(batches))
    age_claims(broker_url, age_s)
    return ids


def _probed(store, broker_url: str) -> RunWatch:
    """``status``'s watch of the run with the broker asked (presences, claims, parked messages)."""
    from hsx.store import mask_url
    from producer.status import BrokerProbe

    return RunWatch(store, BrokerProbe(_settings(broker_url), broker_url), broker=mask_url(broker_url))


def _view(status: dict, width: int = 200) -> str:
    out = Console(record=True, width=width)
    out.print(status_view(status))
    return " ".join(out.export_text().split())


def _presence(client, stamp_age_s: float = 0.0, **fields):
    """Write a presence as its worker would, stamped ``stamp_age_s`` seconds ago by the broker's clock."""
    from hsx.fleet import Presence, broker_time, workers_key

    p = Presence(**fields)
    p = p.model_copy(update={"stamp": broker_time(client) - stamp_age_s, "started": broker_time(client) - 600})
    client.hset(workers_key(QUEUE), p.worker, p.model_dump_json())
    return p


@pytest.mark.parametrize("end", ["failed", "cancelled"])
def test_a_failed_or_cancelled_run_has_no_eta_and_no_current_rate(small_run, tmp_path, end):
    """A new user's failed run showed ``eta 5m47s`` and ``rate 2 tok/s over the last 16m54s``: nothing runs a
    failed or cancelled run, so ``eta_s``, ``tokens_per_s``, ``samples_per_s`` and ``rate_window_s`` are null and
    the view says no rate now and gives no ETA; the overall rate (the one it ran at) stays."""
    run_dir, store, last = _one_batch_left(small_run, tmp_path)
    if end == "failed":
        store.write(f"failures/{last}.json", json.dumps({"batch": last, "error": "FidelityError: all NaN",
                                                          "host": "node7", "at": _utc(time.time())}).encode())
    else:
        store.write("cancelled.json", json.dumps({"schema_version": 1, "by": "me@here", "at": _utc(time.time())}).encode())
    watch = RunWatch(store)
    watch.poll()
    late = max(m["end"] for m in watch.markers.values()) + 1000  # 16 min after its last batch
    status = watch.poll(now=late)
    assert status["state"] == end, status["state"]
    for key in ("eta_s", "tokens_per_s", "samples_per_s", "rate_window_s"):
        assert status[key] is None, (key, status[key])
    assert status["overall_tokens_per_s"] > 0
    text = _view(status)
    assert "none now (nothing runs it)" in text and "over the last" not in text, text
    assert " eta " not in f" {text} ", text


def test_a_parked_reason_is_shown_whole_and_live_workers_are_not_told_to_be_started(small_run, tmp_path, client, broker):
    """A run whose last batch two live workers (serving its root) parked as unreadable: the reason is given
    whole, not cut mid-word at 400 characters, and ``to restart`` gives the fix and says the live workers serve
    the run, instead of "start workers on the broker" (a new user had 2 live workers there)."""
    from hsx.fleet import Parked, park

    run_dir, store, last = _one_batch_left(small_run, tmp_path)
    for n in (1, 3):
        _presence(client, worker=f"node{n}-{n}", host=f"node{n}", pid=n, node=f"cpu0@node{n}", roots=[str(tmp_path)])
    reason = ("RunFormatError: run.json of " + store.url + " cannot be read by this worker: " + "it names a format "
              "this hsx does not know; " * 20 + "update hsx on the workers and restart them; nothing was written")
    assert len(reason) > 600
    park(client, QUEUE, Parked(run_url=store.url, batch=last, reason=reason, cause="unreadable",
                               refused_by=["node1-1", "node3-3"]))
    status = _probed(store, broker.url).poll()
    assert status["state"] == "stalled", status
    assert status["restart"].startswith("for the parked batches: fix what the reason names on the workers"), \
        status["restart"]
    assert "2 live workers serve the run: start no other" in status["restart"], status["restart"]
    assert "start workers on" not in status["restart"], status["restart"]
    assert reason in _view(status), "the reason whole"


def test_a_lost_workers_batches_wait_for_its_lease_without_a_stall_or_reconcile_advice(small_run, tmp_path, client, broker):
    """A node lost (launcher and worker killed) while it held the run's last batch; another worker lives, idle.
    Until the lost worker's lease ends the batch comes back by itself: the run is ``running`` (not ``stalled``
    with reconcile advice), ``lease_wait`` and the view say when; the lost row runs nothing and shows what it held
    when it died (``done since`` for the batch certified since). Both workers are named alike, Celery node and
    pid, in every row and message. Once the lease and its looks have passed and the batch is still not back,
    the run is stalled, the lost worker's lease said ended, and with a live worker there the advice is
    reconcile, not to start workers."""
    run_dir = copy_run(small_run, tmp_path)
    store = open_store(str(run_dir))
    batches = [b.batch for b in read_batch_list(store)]
    done, last = batches[0], batches[-1]
    store.delete(marker_key(last))
    for key in store.list(WORKERS_PREFIX):
        store.delete(key)

    def lost_for(age_s: float) -> dict:
        from hsx.fleet import HeldTask

        store.write("workers/nodeB-2.json", json.dumps({
            "host": "nodeB", "pid": 2, "device": "cpu", "state": "working", "heartbeat_s": 5.0,
            "batches": [{"batch": done, "phase": "writing", "since": _utc(time.time() - age_s - 5)},
                        {"batch": last, "phase": "forward", "since": _utc(time.time() - age_s - 5)}],
            "updated_at": _utc(time.time() - age_s)}).encode())
        _presence(client, stamp_age_s=age_s, worker="nodeB-2", host="nodeB", pid=2, node="cpu0@nodeB",
                  roots=[str(tmp_path)], state="working",
                  tasks=[HeldTask(task_id="t-last", run_url=store.url, batch=last, phase="forward")])
        _presence(client, worker="nodeA-1", host="nodeA", pid=1, node="cpu0@nodeA", roots=[str(tmp_path)])
        return _probed(store, broker.url).poll()

    status = lost_for(30)
    assert status["state"] == "running" and status["stalled_reason"] is None, status["stalled_reason"]
    (wait,) = status["lease_wait"]
    assert wait["worker"] == "cpu0@nodeB pid 2" and wait["batches"] == [last], wait
    assert 100 <= wait["back_in_s"] <= 125, wait  # lease 120 s + looks 30 s, less the 30 s since its last stamp
    rows = {r["pid"]: r for r in status["workers"]}
    assert rows[2]["state"] == "lost" and rows[2]["running"] == [], rows[2]
    assert rows[2]["held_at_death"] == [f"{done} (writing; done since)", f"{last} (forward)"], rows[2]
    assert {rows[1]["label"], rows[2]["label"]} == {"cpu0@nodeA pid 1", "cpu0@nodeB pid 2"}
    text = _view(status)
    for said in ("cpu0@nodeB pid 2 (lost) held 1 batch of the run: a live worker puts them back on the queue when "
                 "its lease (HSX_LEASE_S) ends, in about", "nothing to do", "when it died:",
                 f"{done} (writing; done since)", "cpu0@nodeA pid 1"):
        assert said in text, f"{said!r} not in the view: {text}"
    assert "reconcile" not in text and "stalled" not in text, text

    expired = lost_for(300)
    assert expired["state"] == "stalled" and expired["lease_wait"] is None, expired
    assert "1 lost (no heartbeat): cpu0@nodeB pid 2 (its lease ended" in expired["stalled_reason"], \
        expired["stalled_reason"]
    assert expired["restart"].startswith("1 live worker serves the run: start no other; `python -m producer "
                                         f"reconcile {store.url}`"), expired["restart"]


def test_claims_no_live_worker_holds_are_said_with_what_returns_them_and_that_their_batches_are_done(
        small_run, tmp_path, client, broker):
    """After a broker's kill -9 and restart, a done run's view said ``0 waiting, 12 claimed`` with every run's
    ``held`` 0: deliveries whose acks were lost. ``status`` of the run says how many of its claims no live worker
    holds, that their batches are already done (nothing is redone), what puts them back (a live worker's lease
    check, else the broker's visibility timeout, at a time it names). Real claims: Celery sent the messages and a
    kombu consumer died holding them."""
    run_dir = copy_run(small_run, tmp_path)
    store = open_store(str(run_dir))
    batches = [b.batch for b in read_batch_list(store)][:3]
    _claims_nobody_lists(broker.url, store.url, batches)
    status = _probed(store, broker.url).poll()
    assert status["state"] == "done"
    nh = status["broker"]["not_held"]
    assert nh["count"] == nh["unlisted"] == nh["done"] == 3 and nh["lost_workers"] == [], nh
    assert sorted(b for _, b in nh["batches"]) == sorted(batches) and nh["visibility_at"].endswith("Z"), nh
    text = _view(status)
    for said in ("3 claimed on 'gpu'", "of this run, 3 claimed by no live worker: 3 listed by no worker",
                 "3 of them are of batches already done: nothing is redone",
                 f"returns them to the queue at {nh['visibility_at'][:13]}"):
        assert said in text, f"{said!r} not in the view: {text}"


def test_a_claim_delivered_seconds_ago_that_no_worker_lists_yet_is_no_alarm(small_run, tmp_path, broker):
    """A live worker lists a delivery in its presence a second or so after taking it (later on a busy host): a
    healthy run showed ``1 claimed by no live worker ... visibility timeout returns them at ...`` in 5 of 5 looks.
    A claim no presence lists counts only once it is older than ``UNLISTED_GRACE_S`` (10 s)."""
    run_dir = copy_run(small_run, tmp_path)
    store = open_store(str(run_dir))
    batches = [b.batch for b in read_batch_list(store)][:2]
    _claims_nobody_lists(broker.url, store.url, batches, age_s=0.0)
    assert _probed(store, broker.url).poll()["broker"]["not_held"]["count"] == 0
    age_claims(broker.url, 30.0)
    assert _probed(store, broker.url).poll()["broker"]["not_held"]["count"] == 2


def test_the_start_command_of_a_queued_run_on_s3_has_its_s3_settings_and_model_and_no_secret(small_run, tmp_path,
                                                                                              s3_bucket):
    """A queued run on S3: the command ``status`` gives to start workers names the broker (masked), the store root,
    the S3 endpoint and region status itself uses, placeholders for the keys, and the run's model as
    ``HSX_MODEL``; neither key is printed."""
    import shutil

    from smallrun import upload_run

    run_dir, _local = _untaken_run(small_run, tmp_path)
    shutil.rmtree(run_dir / "shards", ignore_errors=True)
    store = open_store(f"{s3_bucket.url}/runs/{run_dir.name}", s3_bucket.settings)
    upload_run(run_dir, store)
    server = s3_bucket.server
    env = {**small_run["env"], "HSX_BROKER_URL": "redis://:brokerpw@head:6391/0",
           "HSX_S3_ENDPOINT_URL": server.endpoint_url, "HSX_S3_REGION": server.region,
           "HSX_S3_ACCESS_KEY_ID": server.access_key, "HSX_S3_SECRET_ACCESS_KEY": server.secret_key}
    proc = run_here(["status", store.url, "--json", "--no-broker"], env)
    status = json.loads(proc.stdout)
    assert status["state"] == "queued", status
    assert (f"`HSX_BROKER_URL=redis://:***@head:6391/0 HSX_STORE_URL={s3_bucket.url}/runs "
            f"HSX_S3_ENDPOINT_URL={server.endpoint_url} HSX_S3_REGION={server.region} "
            "HSX_S3_ACCESS_KEY_ID=<access key id> HSX_S3_SECRET_ACCESS_KEY=<secret access key> "
            "HSX_MODEL=tiny-qwen3.5 python -m workers`") in status["restart"], status["restart"]
    said = proc.stdout + proc.stderr + run_here(["status", store.url, "--no-broker"], env).stdout
    assert server.secret_key not in said and "brokerpw" not in said
    if server.access_key != server.secret_key:
        assert server.access_key not in said


def test_the_failures_table_shows_a_short_error_whole_and_says_where_it_cut_a_long_one():
    """A failed batch's error is shown whole up to 300 characters; a longer one ends in a note that it was
    cut and that ``--json`` has it whole (cut silently, it read as the whole error)."""
    from producer.statusview import FAILURE_CHARS, failures_table

    long_error = "RuntimeError: " + "x" * 1000 + " END"
    table = failures_table({"failures": {"b000001": {"host": "h", "at": "t", "error": "ValueError: short"},
                                         "b000002": {"host": "h", "at": "t", "error": long_error}}})
    console = Console(width=4000, record=True)
    console.print(table)
    said = console.export_text()
    assert "ValueError: short" in said and "short ..." not in said
    assert long_error[:FAILURE_CHARS] + " ... (cut; --json has it whole)" in said and " END" not in said


def test_a_marker_that_does_not_parse_is_named_as_damaged_with_the_commands_that_repair_it(small_run, tmp_path):
    """A cut or emptied marker file: its batch is still counted done (workers skip it: its marker exists), but
    status names it, says its shard is not certified, and gives verify, then reconcile --repair."""
    run_dir = copy_run(small_run, tmp_path)
    store = open_store(str(run_dir))
    batches = [b.batch for b in read_batch_list(store)]
    store.write(marker_key(batches[0]), b'{"batch": "b0000')
    store.write(marker_key(batches[-1]), b"")
    status = RunWatch(store).poll()
    assert status["markers_unreadable"] == [batches[0], batches[-1]]
    assert status["batches_done"] == len(batches)
    out = Console(record=True, width=300)
    out.print(status_view(status))
    text = " ".join(out.export_text().split())
    assert f"2 markers that do not parse ({batches[0]}, {batches[-1]})" in text, text
    assert f"python -m producer verify {status['address']}, then python -m producer reconcile" in text, text
    store.write(marker_key(batches[0]), store.read(marker_key(batches[1])).replace(
        batches[1].encode(), batches[0].encode()))  # rewritten whole (any parseable marker): no longer named
    assert RunWatch(store).poll()["markers_unreadable"] == [batches[-1]]


def test_a_lost_worker_of_a_producer_run_that_is_gone_is_not_said_to_give_its_batches_back_by_its_lease(small_run,
                                                                                                       tmp_path):
    """A double Ctrl-C: the `producer run`, its broker and its workers are gone. The lost worker's batch waits
    for that command again, not for a lease no live worker will act on."""
    run_dir, store, last = _one_batch_left(small_run, tmp_path)
    now = float(int(time.time()))
    store.write("workers/node9-43.json", json.dumps({
        "host": "node9", "pid": 43, "device": "cpu", "state": "working", "heartbeat_s": 5.0,
        "batches": [{"batch": last, "phase": "forward", "since": _utc(now - 20)}],
        "updated_at": _utc(now - 40)}).encode())  # stale (lost), its lease (120 s) not ended
    watch = RunWatch(store, broker="embedded")
    said = watch.poll(now=now)["stalled_reason"]
    assert "when its lease ends" in said, said  # as far as status knows, that command may still run
    watch.embedded_live = False
    said = watch.poll(now=now)["stalled_reason"]
    assert "it held 1 batch: the same `python -m producer run` command again enqueues it" in said, said
    assert "lease" not in said, said


def test_a_run_whose_every_live_worker_is_paused_has_no_eta(small_run, tmp_path):
    """The store full: the only live worker waits with the batch in hand. The recent rate says nothing of
    when the rest is done, so no ETA (the pause itself is said); once it works again, an ETA."""
    run_dir, store, last = _one_batch_left(small_run, tmp_path)
    now = float(int(time.time()))
    record = {"host": "node7", "pid": 41, "device": "cpu", "state": "paused", "heartbeat_s": 5.0,
              "paused_reason": "store full at /data (2 MiB free)", "paused_since": _utc(now - 30),
              "batches": [{"batch": last, "phase": "paused", "since": _utc(now - 30)}], "updated_at": _utc(now - 1)}
    store.write("workers/node7-41.json", json.dumps(record).encode())
    status = RunWatch(store).poll(now=now)
    assert status["state"] == "running" and status["eta_s"] is None, (status["state"], status["eta_s"])
    assert status["workers"][0]["paused"].startswith("store full")
    working = {**record, "state": "working", "paused_reason": None, "paused_since": None,
               "batches": [{"batch": last, "phase": "forward", "since": _utc(now - 1)}]}
    store.write("workers/node7-41.json", json.dumps(working).encode())
    assert RunWatch(store).poll(now=now)["eta_s"] is not None
