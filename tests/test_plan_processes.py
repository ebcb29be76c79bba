"""The plan does not depend on how many processes tokenise it (producer/tokenising.py)."""

from __future__ import annotations

from plans import plan_files as _plan_files, plan_options as _opts, plan_settings as _settings
from producer import planner
from producer.planner import plan_run


def test_the_plan_is_byte_identical_with_one_and_with_two_tokenising_processes(tmp_path, tiny_cache, monkeypatch):
    """Same dataset and config: the same run id and the same plan files, whatever --num-proc is.
    Windows of 128 samples (not 1,024) so that 300 records cross one: the same rule, less to tokenise."""
    monkeypatch.setattr(planner, "PLAN_WINDOWS", (128, 4096))
    one = plan_run(_opts(tmp_path / "one", limit=300, num_proc=1, max_length=256), _settings(tiny_cache))
    two = plan_run(_opts(tmp_path / "two", limit=300, num_proc=2, max_length=256), _settings(tiny_cache))
    assert one.config.run_id == two.config.run_id and one.config.plan_windows == [128, 4096]
    assert one.stats["num_proc"] == 1 and two.stats["num_proc"] == 2
    assert one.stats["windows"] == two.stats["windows"] == 3  # 128 samples, the rest to --limit, the empty last
    files_one = _plan_files(tmp_path / "one" / one.config.run_id)
    files_two = _plan_files(tmp_path / "two" / two.config.run_id)
    assert files_one.keys() == files_two.keys() and len(files_one) > 8
    assert [k for k in files_one if files_one[k] != files_two[k]] == []


def test_tokenising_processes_end_when_their_planner_is_killed(tmp_path, tiny_cache):
    """``kill -9`` of a planner (``producer run`` during its planning) runs none of its shutdown: its
    tokenising processes must still end, not keep a core busy for minutes (a new user found two left
    running, children of init). Only the planner is killed here, not its process group."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    from jobfixtures import ROOT, wait_until

    script = (
        "import os, sys, time\n"
        "from producer.tokenising import TokeniserSpec, Tokenisers\n"
        "spec = TokeniserSpec(model='tiny-qwen3.5', cache_dir=sys.argv[1], trust_remote_code=False, max_length=128,\n"
        "                     enable_thinking=None, over_length='truncate', special_tokens_in_content='text', allow_text=False)\n"
        "with Tokenisers(spec, 2) as t:\n"
        "    assert len({t._pool.submit(os.getpid).result() for _ in range(8)}) >= 1\n"
        "    print(' '.join(str(p) for p in t._pool._processes), flush=True)\n"
        "    time.sleep(600)\n")
    planner = subprocess.Popen([sys.executable, "-c", script, str(tiny_cache)], cwd=ROOT, stdout=subprocess.PIPE,
                               text=True, start_new_session=True)
    try:
        pids = [int(p) for p in planner.stdout.readline().split()]
        assert pids and all(psutil.pid_exists(p) for p in pids), pids  # started on demand: one or two
        os.kill(planner.pid, signal.SIGKILL)
        planner.wait(30)

        def gone() -> bool:
            return not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)

        t0 = time.monotonic()
        wait_until(gone, 20, "the tokenising processes to end after their planner")
        assert time.monotonic() - t0 < 10
    finally:
        try:
            os.killpg(planner.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
