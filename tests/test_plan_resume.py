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


_KILL_DIR_AFTER_WINDOWS = _KILL_AFTER_WINDOWS.replace(
    'dataset="sharegpt", model="tiny-qwen3.5", output=sys.argv[1], limit=400,',
    'dataset=sys.argv[4], model="tiny-qwen3.5", output=sys.argv[1],')


def _numbered_shards(root) -> None:
    """Three JSON-lines files that each number their records from 0 (a sharded export): a.jsonl 0-59,
    b.jsonl 0-119 with id 3 again at its end, c.jsonl 0-79."""
    import json

    root.mkdir()
    for name, n in (("a", 60), ("b", 120), ("c", 80)):
        ids = list(range(n)) + ([3] if name == "b" else [])
        lines = [json.dumps({"id": i, "messages": [{"role": "user", "content": f"{name} question {k} of {n}"},
                                                   {"role": "assistant", "content": f"answer {k} from file {name}"}]})
                 for k, i in enumerate(ids)]
        (root / f"{name}.jsonl").write_text("\n".join(lines) + "\n")


def test_a_directory_whose_files_number_their_records_from_0_keeps_every_file_through_a_resume(tmp_path, tiny_cache,
                                                                                               monkeypatch):
    """Ids are unique within a file, not across a directory's files: a record whose id another file's record
    has is named ``<file>/<id>`` (repair ``id_scoped_by_file``), a repeat within one file is a duplicate_id
    naming the file. A plan killed after its first window (which ends inside b.jsonl) resumes to the plan of
    one uninterrupted pass: the ids each file claimed before the kill are known as that file's."""
    from producer import planner

    monkeypatch.setattr(planner, "PLAN_WINDOWS", SMALL_WINDOWS)
    data = tmp_path / "shards"
    _numbered_shards(data)
    out = tmp_path / "killed"
    proc = run_python(["-c", _KILL_DIR_AFTER_WINDOWS, str(out), str(tiny_cache), "1", str(data)], clean_env(),
                      timeout_s=300)
    assert proc.returncode == -9, proc.stderr
    (run_dir,) = [p.parent for p in out.glob("*/run.json")]
    assert [w.name for w in read_windows(open_store(str(run_dir)))] == ["w000000"]
    resumed = plan_run(_opts(out, data, num_proc=1), _settings(tiny_cache))
    whole = plan_run(_opts(tmp_path / "whole", data, num_proc=1), _settings(tiny_cache))
    assert _plan_files(run_dir) == _plan_files(tmp_path / "whole" / whole.config.run_id)

    ids = [str(r.record_id) for r in SampleRow.read_all(open_store(str(run_dir)))]
    assert len(ids) == len(set(ids)) == 60 + 120 + 80 == whole.stats["samples"]
    assert ids[:3] == ["0", "1", "2"] and ids[60:63] == ["b.jsonl/0", "b.jsonl/1", "b.jsonl/2"]
    assert ids[120:122] == ["60", "61"] and ids[180:182] == ["c.jsonl/0", "c.jsonl/1"]
    skipped = whole.stats["skipped"]
    assert skipped["counts"] == {"duplicate_id": 1} and skipped["fixes"]["id_scoped_by_file"] == 60 + 80
    (example,) = skipped["examples"]["duplicate_id"]
    assert example == "3 (line 121): id '3' belongs to an earlier usable record of this file (b.jsonl; named " \
                      "'b.jsonl/3': another file has a record with id '3' too)", example
