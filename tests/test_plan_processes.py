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
