"""What the CLI says in the small cases: counts in the singular, a model path that does not exist,
and the line ``run`` prints at once when it is stopped."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import pytest

from jobfixtures import clean_env, python_popen
from hsx.errors import BadConfig
from hsx.models import model_info, resolve_model_path
from producer.cli import _plan_table
from producer.run import stopping_line
from producer.statusview import progress_table
from producer.words import noun, plural


def _text(renderable) -> str:
    from rich.console import Console

    console = Console(width=200, record=True, file=open(os.devnull, "w"))
    console.print(renderable)
    return console.export_text()


def test_counts_are_plural_unless_one():
    assert [plural(n, "batch") for n in (0, 1, 2, 1500)] == ["0 batches", "1 batch", "2 batches", "1,500 batches"]
    assert plural(1, "sample") == "1 sample" and plural(3, "sample") == "3 samples"
    assert noun(1, "batch") == "batch" and noun(0, "batch") == "batches"


def test_the_run_table_of_a_one_batch_run_says_1_batch():
    report = {"run_id": "r", "address": "file:///r", "plan": {"batches": 1, "samples": 1},
              "batches_already_done": 1, "batches_enqueued": 1}
    text = _text(_plan_table("run", report))
    assert "1 batch " in text + " " and "1 batches" not in text


def test_the_run_table_names_the_entries_of_a_dataset_directory_it_did_not_read():
    """A README, a .csv or a subdirectory beside the data files is not read: the summary says so,
    naming the first five (a user wondered where the records of data.csv went)."""
    report = {"run_id": "r", "address": "file:///r", "plan": {"batches": 1, "samples": 1},
              "batches_already_done": 0, "batches_enqueued": 1, "dataset_ignored": ["README.md", "data.csv", "sub/"]}
    line = next(l for l in _text(_plan_table("run", report)).splitlines() if "not read" in l)
    assert "3 entries of the dataset directory" in line and "README.md, data.csv, sub/" in line
    report["dataset_ignored"] = [f"f{i}.csv" for i in range(8)]
    assert "f4.csv and 3 more" in _text(_plan_table("run", report))
    del report["dataset_ignored"]
    assert "not read" not in _text(_plan_table("run", report))


def test_the_run_table_shows_one_example_per_skip_reason_and_points_to_the_rest_only_when_there_are_more():
    """Every reason gets its line (a new user saw 6 of 9), and "(more in ...)" only when records were
    skipped that no line shows."""
    examples = {f"reason_{i}": [f"f.jsonl:{i}: why"] for i in range(9)}
    report = {"run_id": "r", "address": "file:///r", "batches_already_done": 0, "batches_enqueued": 1,
              "plan": {"batches": 1, "samples": 1, "skipped": {"counts": {k: 1 for k in examples}, "examples": examples}}}
    text = _text(_plan_table("run", report))
    assert all(f"reason_{i}: f.jsonl:{i}: why" in text for i in range(9)) and "more in" not in text
    report["plan"]["skipped"]["counts"]["reason_3"] = 4
    assert "(more in file:///r/plan/stats.json, skipped.examples)" in " ".join(_text(_plan_table("run", report)).split())


def test_the_run_table_says_every_repair_in_one_row_as_it_says_the_skips():
    report = {"run_id": "r", "address": "file:///r", "batches_already_done": 0, "batches_enqueued": 1,
              "plan": {"batches": 1, "samples": 1, "skipped": {"counts": {}, "fixes": {"b_fix": 2, "a_fix": 1}}}}
    rows = [line for line in _text(_plan_table("run", report)).splitlines() if "repaired" in line]
    assert len(rows) == 1 and "a_fix 1, b_fix 2" in rows[0], rows
    report["plan"]["skipped"]["fixes"] = {}
    assert "repaired" not in _text(_plan_table("run", report))


@pytest.mark.parametrize("width", [80, 100, 160])
def test_each_progress_line_fits_the_terminal_with_its_count_and_times_whole(width, monkeypatch):
    """At 80 columns a 40-wide bar had rich cut every column (``7…``, ``0:00:…``): the count, the
    elapsed time and the time left are whole at any width, one line per task; the info text is
    what gives way."""
    import io

    from rich.console import Console

    import producer.cli as cli

    monkeypatch.setattr(cli, "console", Console(file=io.StringIO(), width=width, force_terminal=True, color_system=None))
    progress = cli.progress_factory()
    tokenising = progress.add_task("tokenising", total=125_400_000, bytes=True)
    progress.update(tokenising, completed=15_700_000, info="9,812 records  2,431/s")
    extracting = progress.add_task("extracting", total=44)
    progress.update(extracting, completed=7, samples=252, tok_s=8484)
    cli.console.print(progress.make_tasks_table(progress.tasks))
    lines = cli.console.file.getvalue().splitlines()
    assert len(lines) == 2 and all(len(line) <= width for line in lines), lines
    assert "15.7 MB/125.4 MB" in lines[0] and " 7/44 " in lines[1], lines
    assert all(re.search(r"0:00:00 (eta )?-:--:--$", line) for line in lines), lines
    assert "8,484 tok/s now" in lines[1], lines


def test_the_status_bar_of_a_one_batch_run_says_batch():
    status = {"run_id": "r", "state": "running", "address": "file:///r", "model": "m", "planned": True,
              "batches_total": 1, "batches_done": 0, "samples_done": 0, "samples_total": 1, "samples_quarantined": 0,
              "tokens_done": 0, "tokens_total": 10, "samples_per_s": None, "tokens_per_s": None,
              "overall_tokens_per_s": None, "rate_window_s": 600.0, "eta_s": None, "skipped": {}, "broker": None,
              "batches_failed": 0}
    text = _text(progress_table(status))
    assert "0 / 1 batch (0.0%)" in text


@pytest.mark.parametrize("name", ["/nonexistent", "./no/such/checkpoint", "~/no-such-checkpoint-hsx"])
def test_a_model_path_that_does_not_exist_is_named_as_such(name, tmp_path):
    with pytest.raises(BadConfig, match="no such directory") as info:
        model_info(name, tmp_path)
    assert "Repo id" not in str(info.value) and "does not exist" in str(info.value)


def test_a_model_directory_without_config_json_says_so(tmp_path):
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(BadConfig, match="has no config.json"):
        model_info(str(tmp_path / "ckpt"), tmp_path)


def test_a_model_path_to_a_file_asks_for_the_checkpoint_directory(tmp_path):
    f = tmp_path / "config.json"
    f.write_text("{}")
    with pytest.raises(BadConfig, match="is a file; give the checkpoint's directory"):
        resolve_model_path(str(f), tmp_path)


def test_hub_ids_and_builtin_names_are_not_taken_for_paths(tiny_cache):
    assert resolve_model_path("Qwen/Qwen3-8B", tiny_cache) == "Qwen/Qwen3-8B"
    assert resolve_model_path("tiny-qwen3.5", tiny_cache).startswith(str(tiny_cache))


def test_stopping_line_names_what_is_stopped():
    assert stopping_line(True, True).startswith("stopping: the workers finish the batches they have taken")
    assert "embedded broker" in stopping_line(True, True) and "embedded broker" not in stopping_line(True, False)
    # the way to kill them now is the signal the user has: a supervisor's SIGTERM has no Ctrl-C
    assert "(Ctrl-C again to kill them now)" in stopping_line(True, True, signal.SIGINT)
    assert "(a second SIGTERM (or Ctrl-C) to kill them now)" in stopping_line(True, True, signal.SIGTERM)
    assert "Ctrl-C" not in stopping_line(True, True, signal.SIGHUP)


def test_the_stop_says_how_it_drains_while_the_workers_finish_their_batches(tmp_path):
    """While the workers finish the batches they hold (up to a minute), ``run`` says so every few
    seconds with the count, instead of a frozen bar (a new user saw nothing for 40-60 s)."""
    import subprocess
    import sys

    from producer.run import LocalWorkers

    workers = LocalWorkers.__new__(LocalWorkers)  # a stand-in process that takes 1.5 s to finish after SIGTERM
    workers.log_path = tmp_path / "w.log"
    workers._log = open(workers.log_path, "ab")
    workers.proc = subprocess.Popen([sys.executable, "-c", "import signal, time\n"
                                     "signal.signal(signal.SIGTERM, lambda *a: None)\nprint('up', flush=True)\ntime.sleep(1.5)"],
                                    stdout=subprocess.PIPE)
    workers.proc.stdout.readline()  # its handler is set
    said = []
    workers.stop(timeout_s=30, say=said.append, every_s=0.3)
    assert workers.proc.returncode == 0 and 2 <= len(said) <= 6 and said == sorted(said), said
    # one that does not finish in time is killed, and that is said first
    workers._log = open(workers.log_path, "ab")
    workers.proc = subprocess.Popen([sys.executable, "-c", "import signal, time\n"
                                     "signal.signal(signal.SIGTERM, lambda *a: None)\nprint('up', flush=True)\ntime.sleep(60)"],
                                    stdout=subprocess.PIPE, start_new_session=True)
    workers.proc.stdout.readline()
    killed = []
    workers.stop(timeout_s=1.0, every_s=0.3, on_kill=lambda: killed.append(workers.proc.poll()))
    assert killed == [None] and workers.proc.returncode == -9  # said while it still ran, then SIGKILLed


def test_a_stop_that_ends_with_every_batch_done_says_the_run_is_complete(tmp_path, tiny_cache, monkeypatch):
    """Ctrl-C, and the workers finish the last batches while stopping: not "run the same command
    again to resume" (a new user was told to resume a complete run), but that it is complete."""
    from jobfixtures import run_here

    def stopped_with_all_done(*args, **kwargs):
        exc = KeyboardInterrupt()
        exc.batches_done = lambda: (14, 14)
        raise exc

    monkeypatch.setattr("producer.run.run_job", stopped_with_all_done)
    env = clean_env(cache_dir=tiny_cache, state_dir=tmp_path / "state")
    proc = run_here(["run", "sharegpt", "--limit", "3", "--model", "tiny-qwen3.5", "--output", str(tmp_path / "out")], env)
    assert proc.returncode == 130, proc.stderr
    assert "interrupted, but the run is complete: 14/14 batches done; every batch has its marker" in proc.stderr, proc.stderr
    assert "to resume" not in proc.stderr


def test_run_says_stopping_at_once_when_interrupted(tmp_path, tiny_cache):
    """SIGTERM (what Ctrl-C takes too) while a batch is held in the forward: the stopping line comes
    within a second, long before the workers have finished their batch and stopped; the exit code is
    the shell's for SIGTERM (143), so a scheduler sees a terminated job."""
    env = clean_env(cache_dir=tiny_cache, state_dir=tmp_path / "state", spool_dir=tmp_path / "spool",
                    faults="pause_forward=4")
    err = open(tmp_path / "stderr", "w+")
    proc = python_popen(["-m", "producer", "run", "sharegpt", "--limit", "4", "--model", "tiny-qwen3.5", "--max-length", "128",
                         "--batch-tokens", "128", "--output", str(tmp_path / "store")], env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 180
        while "fault injection: pausing" not in "".join(p.read_text(errors="replace") for p in (tmp_path / "logs").glob("*.log")):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr").read_text()
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        while "stopping:" not in (tmp_path / "stderr").read_text():
            assert time.monotonic() - sent < 1.5, "no stopping line 1.5 s after the signal:\n" + (tmp_path / "stderr").read_text()
            time.sleep(0.05)
        assert proc.poll() is None, "the stopping line comes before the workers have stopped"
        assert proc.wait(120) == 143  # 128 + SIGTERM
        stderr = (tmp_path / "stderr").read_text()
        assert stderr.index("stopping:") < stderr.index("interrupted")
        # and how far it got, counted once the workers had finished what they held (a helper found the bar's
        # last 22/36 under a stop line that said nothing, with 28 markers in the store)
        from hsx.store import open_store
        from producer.run import done_batches

        said = re.search(r"interrupted(?:: |, but the run is complete: )(\d+)/(\d+) batch(?:es)? done; "
                         r"(finished batches keep their markers|every batch has its marker)", stderr)
        assert said, stderr[-2000:]
        (run_dir,) = [p.parent for p in (tmp_path / "store").glob("*/run.json")]
        assert int(said.group(1)) == len(done_batches(open_store(str(run_dir), create=False))) >= 1
        assert (said.group(3) == "every batch has its marker") == (said.group(1) == said.group(2))  # complete: said so
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_an_output_directory_given_for_a_run_names_the_runs_inside_it(tmp_path):
    """``status ./out`` (the output directory, not a run in it): the error lists the runs there."""
    from hsx.store import LocalStore
    from producer.cli import _no_run_message

    for run in ("sharegpt-aaa", "sharegpt-bbb"):
        (tmp_path / run).mkdir()
        (tmp_path / run / "run.json").write_text("{}")
    (tmp_path / "not-a-run").mkdir()
    message = _no_run_message(str(tmp_path), LocalStore(tmp_path))
    assert message.endswith("Runs in this directory: sharegpt-aaa, sharegpt-bbb")
    assert _no_run_message(str(tmp_path / "empty"), LocalStore(tmp_path / "empty")).endswith("give <output>/<run_id>")


def _interrupt_tokenising(monkeypatch, after: int) -> None:
    """Ctrl-C once ``after`` records have been tokenised (``producer.masks.ChatTokeniser.encode_many``)."""
    from producer.masks import ChatTokeniser

    real = ChatTokeniser.encode_many

    def encode_many(self, records, **kwargs):
        for n, item in enumerate(real(self, records, **kwargs)):
            if n == after:
                raise KeyboardInterrupt
            yield item

    monkeypatch.setattr(ChatTokeniser, "encode_many", encode_many)


@pytest.mark.parametrize("command", ["run", "enqueue"])
def test_ctrl_c_while_tokenising_says_nothing_was_written(command, tmp_path, tiny_cache, monkeypatch):
    """Interrupted before the plan is written: no batches to speak of, and no bar drawn complete."""
    from jobfixtures import run_here

    _interrupt_tokenising(monkeypatch, after=2)
    env = clean_env(cache_dir=tiny_cache, state_dir=tmp_path / "state", broker_url="redis://127.0.0.1:1/0" if command == "enqueue" else None)
    if command == "enqueue":
        monkeypatch.setattr("hsx.broker.check_broker", lambda url: None)
        monkeypatch.setattr("producer.enqueue.check_output", lambda *a, **k: [])  # no broker to read presences from
    data = tmp_path / "chats.jsonl"  # no --limit: the bar has no total ("2/?")
    data.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": f"question {i}"},
                                                          {"from": "gpt", "value": f"answer {i}"}]}) + "\n" for i in range(6)))
    proc = run_here([command, str(data), "--model", "tiny-qwen3.5", "--max-length", "128", "--output", str(tmp_path / "out")], env)
    assert proc.returncode == 130, proc.stderr
    assert "interrupted while tokenising the dataset, before the plan's first window: nothing was written" in proc.stderr, proc.stderr
    assert "run the same command again to start over" in proc.stderr
    assert "finished batches keep their markers" not in proc.stderr
    tokenising = next(line for line in proc.stderr.splitlines() if line.startswith("tokenising"))
    assert "━━━━" not in tokenising, tokenising
    assert not list((tmp_path / "out").glob("*/run.json"))


def test_ctrl_c_while_the_plan_is_written_says_to_plan_again(tmp_path, tiny_cache, monkeypatch):
    from jobfixtures import run_here

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("producer.planner.SampleRow.rows_bytes", interrupted)  # inside the first window's writing
    env = clean_env(cache_dir=tiny_cache, state_dir=tmp_path / "state")
    proc = run_here(["run", "sharegpt", "--limit", "3", "--model", "tiny-qwen3.5", "--max-length", "128",
                     "--output", str(tmp_path / "out")], env)
    assert proc.returncode == 130, proc.stderr
    assert "interrupted while writing the plan" in proc.stderr and "it plans the run from the start" in proc.stderr, proc.stderr


def test_a_second_ctrl_c_while_planning_keeps_the_first_ones_account(tmp_path, tiny_cache, monkeypatch):
    """Ctrl-C while the plan is written, then Ctrl-C again while the workers stop (which kills them): the
    run still says how far the planning got and how to resume, not a bare "interrupted" (a new user's
    double Ctrl-C printed no counts)."""
    from jobfixtures import run_here
    from producer import run as run_module

    said = ("interrupted while planning: 2 windows of the plan (40 samples in 3 batches) are in the store, its "
            "batches enqueued; run the same command again: it resumes after them")

    def planning(*args, **kwargs):
        raise run_module.PlanningInterrupted(said)

    def second_ctrl_c(local, broker, console, counted=None):
        raise KeyboardInterrupt  # what _stop_started raises when a Ctrl-C comes while the workers stop

    monkeypatch.setattr(run_module, "plan_or_interrupted", planning)
    monkeypatch.setattr(run_module, "_stop_started", second_ctrl_c)
    env = clean_env(cache_dir=tiny_cache, state_dir=tmp_path / "state")
    proc = run_here(["run", "sharegpt", "--limit", "3", "--model", "tiny-qwen3.5", "--max-length", "128",
                     "--output", str(tmp_path / "out")], env)
    assert proc.returncode == 130, proc.stderr
    assert said in " ".join(proc.stderr.split()), proc.stderr
    assert "finished batches keep their markers" not in proc.stderr, proc.stderr


def test_a_rerun_with_every_batch_done_says_so_without_a_done_in_line(small_run):
    """Nothing was enqueued: no "N/N batches done in X s" line, which reads as if work ran."""
    from jobfixtures import run_here
    from smallrun import SMALL_JOB

    proc = run_here(["run", *SMALL_JOB, "--output", str(small_run["dir"].parent)], small_run["env"])
    assert proc.returncode == 0, proc.stderr
    total = small_run["report"]["batches_total"]
    assert f"nothing to do: all {total} batches were already done (every batch has its marker); shards and markers under" in proc.stdout
    assert " done in " not in proc.stdout, proc.stdout


def test_sizes_are_decimal_with_one_decimal_and_never_read_as_zero():
    from producer.words import fmt_bytes

    assert [fmt_bytes(n) for n in (None, 0, 12_345, 400_000, 687_600_000, 999_999_999, 1_600_000_000, 3.2e12)] == [
        "-", "0 bytes", "12,345 bytes", "0.4 MB", "687.6 MB", "1.0 GB", "1.6 GB", "3.2 TB"]


def test_status_verify_and_export_print_the_same_size_for_the_same_shards(small_run, tmp_path):
    """One convention for sizes: the stored bytes read the same in status, verify and export (decimal MB,
    no MiB), and a small run's shards are not "0 MiB"."""
    import re

    from jobfixtures import run_here
    from producer.words import fmt_bytes

    env = small_run["env"]
    status = run_here(["status", small_run["address"], "--no-broker"], env).stdout
    verify = run_here(["verify", small_run["address"]], env).stdout
    export = run_here(["export", small_run["address"], "--format", "specforge-eagle3", str(tmp_path / "x")], env).stdout
    stored = json.loads(run_here(["status", small_run["address"], "--no-broker", "--json"], env).stdout)["bytes_stored"]
    assert re.search(rf"stored\W+{re.escape(fmt_bytes(stored))} in shards", status), status
    assert re.search(rf"hashed\W+{re.escape(fmt_bytes(stored))} in ", verify), verify
    assert re.search(r"written\W+[\d.]+ MB in ", export), export
    assert not any(unit in text for text in (status, verify, export) for unit in ("MiB", "GiB", " 0 MB"))


def test_piped_output_is_wide_so_addresses_and_the_workers_table_are_not_cut(small_run):
    """stdout a pipe, no COLUMNS: not rich's 80 columns (the address cut with "…", headers "dev…")."""
    from jobfixtures import run_cli

    env = {k: v for k, v in small_run["env"].items() if k != "COLUMNS"}
    proc = run_cli("producer", ["status", small_run["address"], "--no-broker"], env)
    assert proc.returncode == 0, proc.stderr
    assert f"file://{small_run['address']}" in proc.stdout and "…" not in proc.stdout, proc.stdout
    assert "device" in proc.stdout and "heartbeat" in proc.stdout, proc.stdout


def test_commands_to_copy_are_never_broken_across_lines(shared_worker, tmp_path, tiny_cache):
    """On a narrow console the "follow it" command of ``run`` stays on one line (soft wrap)."""
    env = clean_env(cache_dir=tiny_cache, state_dir=tmp_path / "state", spool_dir=tmp_path / "spool")
    proc = shared_worker.producer(["run", "sharegpt", "--limit", "2", "--model", "tiny-qwen3.5", "--max-length", "128",
                                   "--batch-tokens", "256", "--output", str(tmp_path / "out")], {**env, "COLUMNS": "60"})
    assert proc.returncode == 0, proc.stderr
    follow = next(line for line in proc.stderr.splitlines() if line.startswith("follow it from another terminal"))
    assert follow.endswith("--watch (or python -m producer flower)") and str(tmp_path / "out") in follow, proc.stderr
    assert "follow it with" not in proc.stdout


def test_a_regenerate_run_whose_batches_were_all_done_says_so_not_zero_done():
    """``run --regenerate`` run again after both stages finished: its closing line says every batch of
    each stage was already done (a new user saw "0/4 regenerate batches done in 0.3 s"); a stage
    that ran says how many of its batches are done and in how long."""
    from producer.cli import _stage_done

    assert _stage_done({"batches_total": 4, "batches_already_done": 4}, "regenerate") == \
        "all 4 regenerate batches were already done"
    assert _stage_done({"batches_total": 1, "batches_already_done": 1, "batches_done": 1}, "extraction") == \
        "its 1 extraction batch was already done"
    assert _stage_done({"batches_total": 3, "batches_already_done": 1, "batches_done": 3, "seconds": 2.04},
                       "extraction") == "3/3 extraction batches done in 2.0 s"


def test_progress_into_a_log_file_says_a_plain_line_per_task_every_minute(monkeypatch):
    """Output sent to a file (an overnight run under nohup): rich draws the bars only at the end, so each task
    also says a plain ``progress HH:MM:SS: <task> done/total, info, elapsed`` line at its first update and then at
    most every LOG_EVERY_S seconds; on a terminal, no such line (the live bars say it)."""
    import io

    from rich.console import Console

    import producer.cli as cli

    clock = [1000.0]
    monkeypatch.setattr(cli._Progress, "clock", staticmethod(lambda: clock[0]))
    for terminal in (False, True):
        buf = io.StringIO()
        progress = cli._Progress(*cli._progress().columns, console=Console(file=buf, force_terminal=terminal, width=200))
        task = progress.add_task("extracting", total=44)
        progress.update(task, completed=3, samples=70, tok_s=13135.0)
        clock[0] += 30
        progress.update(task, completed=9, samples=200, tok_s=13000.0)  # within the minute: no line
        clock[0] += 31
        progress.update(task, completed=20, samples=450, tok_s=12500.0)
        lines = [x for x in buf.getvalue().splitlines() if x.startswith("progress ")]
        if terminal:
            assert lines == [], lines
            continue
        assert len(lines) == 2, lines
        assert re.fullmatch(r"progress \d\d:\d\d:\d\d: extracting 3/44, 70 samples  13,135 tok/s now, \d+ s elapsed", lines[0]), lines
        assert ": extracting 20/44, 450 samples  12,500 tok/s now, " in lines[1], lines


def test_a_run_started_with_sigint_ignored_says_how_to_stop_it(tmp_path):
    """A background job of a script inherits SIGINT ignored, and Python leaves it so: Ctrl-C and
    ``kill -INT`` never reach the run. It says so at its start, with the command that does (SIGTERM);
    started normally it says nothing of the kind."""
    import sys

    env = clean_env(state_dir=tmp_path / "state", spool_dir=tmp_path / "spool")
    cmd = [sys.executable, "-m", "producer", "run", str(tmp_path / "no-such.jsonl"), "--model", "tiny-qwen3.5",
           "--output", str(tmp_path / "out")]
    ignored = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    said = " ".join(ignored.stderr.split())
    assert re.search(r"this process ignores SIGINT \(started as a background job\): stop it with kill \d+ \(SIGTERM\)", said), said
    assert ignored.returncode == 2 and "no-such.jsonl" in said  # and the request is refused as before
    normal = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert "ignores SIGINT" not in normal.stderr and normal.returncode == 2


@pytest.mark.parametrize("args, said", [
    (["run", "sharegpt", "--workers", "0"], "argument --workers: 0: must be at least 1"),
    (["run", "sharegpt", "--model", "m", "--preset", "foo"], "argument --preset: invalid choice: 'foo'"),
])
def test_an_option_argparse_refuses_is_one_line_and_a_pointer_to_help_not_the_usage_block(args, said, capsys):
    from producer.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(args)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "usage:" not in err
    assert err.splitlines() == [f"python -m producer run: error: {err.splitlines()[0].split('error: ', 1)[1]}",
                                "(`python -m producer run --help` lists every option)"] and said in err


def test_reconcile_says_which_unnamed_shard_it_keeps_for_the_grace_period_and_removes_it_after(small_run, tmp_path):
    """A shard no marker names (a dead attempt's, or one still being written): ``reconcile`` keeps it while
    it is younger than ``--grace`` and says so with the shard and how to remove it now, instead of "nothing
    to do" (a new user could not tell why the README's abandoned shard was still there); with ``--grace 0``
    it is removed and said."""
    import shutil

    from jobfixtures import run_here
    from smallrun import copy_run

    run_dir = copy_run(small_run, tmp_path)
    some = sorted((run_dir / "shards").glob("*.safetensors"))[0]
    orphan = some.with_name(some.name.split("-")[0] + "-deadbeef0000.safetensors")
    shutil.copyfile(some, orphan)
    env = clean_env(cache_dir=small_run["env"]["HSX_CACHE_DIR"], state_dir=tmp_path / "state")
    kept = run_here(["reconcile", str(run_dir)], env)
    said = " ".join((kept.stdout + kept.stderr).split())
    assert kept.returncode == 0 and "nothing to do" not in said, said
    assert (f"kept 1 shard no marker names, younger than --grace 3600 s (an attempt may still be writing it): "
            f"shards/{orphan.name}; a later reconcile removes it (`--grace 0`: now)") in said, said
    assert orphan.exists()
    removed = run_here(["reconcile", str(run_dir), "--grace", "0"], env)
    assert f"removed shards/{orphan.name} (no marker names it)" in removed.stdout, removed.stdout + removed.stderr
    assert not orphan.exists()
