"""A plan killed between windows resumes after them (producer/planner.py)."""

from __future__ import annotations

import os

from jobfixtures import clean_env, run_python
from hsx.plan import plan_complete, read_batch, read_windows
from hsx.records import Planning, SampleRow
from hsx.store import open_store
from producer.planner import plan_run
from plans import plan_files as _plan_files, plan_options as _opts, plan_settings as _settings


#: Windows of 128 samples, then 4,096 (the planner's are 1,024 then 32,768): two windows from 400
#: records, not 1,800 to tokenise three times.
SMALL_WINDOWS = (128, 4096)

_KILL_AFTER_WINDOWS = f"""
import os, signal, sys
from producer import planner
from producer.planner import PlanOptions, plan_run
from settings import Settings
planner.PLAN_WINDOWS = {SMALL_WINDOWS!r}
seen = []
def on_window(job, batches):
    seen.append(1)
    if len(seen) == int(sys.argv[3]):
        os.kill(os.getpid(), signal.SIGKILL)  # between two windows: no Python cleanup runs
plan_run(PlanOptions(dataset="sharegpt", model="tiny-qwen3.5", output=sys.argv[1], limit=400, max_length=256,
                     num_proc=1), Settings(_env_file=None, cache_dir=sys.argv[2]), on_window=on_window)
"""


def test_a_plan_killed_between_windows_resumes_after_them_and_plans_every_sample_once(tmp_path, tiny_cache, monkeypatch):
    """SIGKILL after the first window: the same plan later resumes with that window as it is
    (handed over first, for enqueue to send what is missing) and ends with the plan of one uninterrupted pass."""
    from producer import planner

    monkeypatch.setattr(planner, "PLAN_WINDOWS", SMALL_WINDOWS)  # as the killed planner's
    out = tmp_path / "killed"
    proc = run_python(["-c", _KILL_AFTER_WINDOWS, str(out), str(tiny_cache), "1"], clean_env(), timeout_s=300)
    assert proc.returncode == -9, proc.stderr
    (run_dir,) = [p.parent for p in out.glob("*/run.json")]
    store = open_store(str(run_dir))
    assert [w.name for w in read_windows(store)] == ["w000000"] and not plan_complete(store)
    assert Planning.read(store).state == "planning"  # the planner died without a word: status sees its pid gone

    handed, records = [], []

    def on_window(job, batches):
        handed.append([b.batch for b in batches])
        records.append(Planning.read(store))

    resumed = plan_run(_opts(out, limit=400, num_proc=1, max_length=256), _settings(tiny_cache), on_window=on_window)
    assert records[0].state == "planning" and records[0].pid == os.getpid(), "status sees the resume at once"
    before = [b.batch for b in read_windows(store)[0].batches]
    assert handed[0] == before, "the windows already written are handed over first, as they are"
    assert resumed.config.run_id == run_dir.name and plan_complete(store)

    whole = plan_run(_opts(tmp_path / "whole", limit=400, num_proc=1, max_length=256), _settings(tiny_cache))
    assert whole.config.run_id == resumed.config.run_id
    assert _plan_files(run_dir) == _plan_files(tmp_path / "whole" / whole.config.run_id)
    ids = [r.record_id for r in SampleRow.read_all(store)]
    assert len(ids) == len(set(ids)) == resumed.stats["samples"]
    in_batches = sorted(int(i) for b in resumed.batches for i in read_batch(store, b.batch).sample_index_N)
    assert in_batches == list(range(resumed.stats["samples"]))
