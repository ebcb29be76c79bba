"""The streamed plan: tokenised on every core, written and handed over window by window, resumed
after a kill, and named by exactly the bytes it read (producer/planner.py, producer/sources.py)."""

from __future__ import annotations

import json

import pytest

from hsx.errors import BadConfig
from hsx.plan import plan_complete, read_batch, read_windows
from hsx.records import Planning, SampleRow
from producer.planner import PLAN_WINDOWS, plan_run, prepare_plan, window_samples
from producer.sources import BLOCK_BYTES, DatasetChanged
from plans import plan_options as _opts, plan_settings as _settings

#: Windows of 128 samples, then doubling up to 4,096 (the planner's start at 1,024): the tests that
#: need two windows of real records tokenise 300 of them, not 2,600.
SMALL_WINDOWS = (128, 4096)


@pytest.fixture
def small_windows(monkeypatch):
    from producer import planner

    monkeypatch.setattr(planner, "PLAN_WINDOWS", SMALL_WINDOWS)
    return SMALL_WINDOWS[0]


def _chats(n: int, words: int = 8, start: int = 0) -> str:
    return "".join(json.dumps({"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"question {i} " + "word " * words},
        {"from": "gpt", "value": f"answer {i} " + "reply " * (words + i % 7)}]}) + "\n" for i in range(start, start + n))


def test_window_sizes_start_small_and_double_up_to_the_largest():
    first, largest = PLAN_WINDOWS
    sizes = [window_samples(k) for k in range(12)]
    assert sizes[0] == first and sizes[1] == 2 * first and sizes[-1] == largest
    assert all(b in (2 * a, largest) for a, b in zip(sizes, sizes[1:]))


def test_each_window_is_handed_over_once_its_files_are_in_the_store_while_later_ones_are_tokenised(tmp_path, tiny_cache,
                                                                                                      small_windows):
    """on_window (enqueue's and run's hook) sees a window's batches only when their plan files exist,
    and before the plan is complete: the first batches reach the queue long before the last record is read."""
    seen = []

    def on_window(job, batches):
        store = job.run_store
        assert batches and not plan_complete(store)
        for b in batches:
            plan = read_batch(store, b.batch)  # MissingKey if the message could outrun its plan file
            assert plan.num_samples == b.num_samples and plan.num_tokens == b.num_tokens
        seen.append([b.batch for b in batches])

    planned = plan_run(_opts(tmp_path / "out", limit=300, num_proc=1), _settings(tiny_cache), on_window=on_window)
    assert len(seen) == 2 and [b for part in seen for b in part] == [b.batch for b in planned.batches]
    windows = read_windows(planned.run_store)
    first = small_windows
    assert [w.num_samples for w in windows] == [first, planned.stats["samples"] - first, 0][:len(windows)]
    assert windows[-1].last and not Planning.read(planned.run_store)
    # each window sorted longest first on its own; batches and samples follow each other
    for w in windows:
        lengths = [b.max_len for b in w.batches]
        assert lengths == sorted(lengths, reverse=True)
    rows = SampleRow.read_all(planned.run_store)
    assert [r.sample_index for r in rows] == list(range(planned.stats["samples"]))
    assert planned.stats["padding_waste"] < 0.05


def test_a_file_that_grows_while_it_is_planned_is_planned_as_it_was_when_the_plan_started(tmp_path, tiny_cache):
    """200 lines appended to a 2,800-line JSONL after planning started are not read: the run id names
    the 2,800 lines, its plan holds them only, and the same command on the original file reuses it."""
    data = tmp_path / "chats.jsonl"
    data.write_text(_chats(2800))
    original = data.read_bytes()
    job = prepare_plan(_opts(tmp_path / "out", data, num_proc=1), _settings(tiny_cache))
    with open(data, "a") as f:
        f.write(_chats(200, start=2800))
    planned = job.run()
    assert planned.stats["records_read"] == 2800 and planned.stats["samples"] == 2800
    assert {r.record_id for r in SampleRow.read_all(planned.run_store)} == {f"c{i}" for i in range(2800)}

    grown = prepare_plan(_opts(tmp_path / "out", data, num_proc=1), _settings(tiny_cache))
    assert grown.config.run_id != planned.config.run_id, "the grown file is another dataset"
    data.write_bytes(original)
    again = plan_run(_opts(tmp_path / "out", data, num_proc=1), _settings(tiny_cache))
    assert again.config.run_id == planned.config.run_id and again.reused


def test_a_file_changed_in_place_while_it_is_planned_stops_before_any_record_of_the_changed_bytes(tmp_path, tiny_cache):
    """Bytes of the second fingerprint block rewritten after planning started: the reading pass finds
    them before it parses a record of them, the plan stops with DatasetChanged naming the file and the
    offsets, planning.json says why, and the window written before holds only unchanged records."""
    data = tmp_path / "chats.jsonl"
    padding = "".join(f"not json {i:06d} " + "x" * 1000 + "\n" for i in range(9000))  # skipped cheaply: malformed_json
    data.write_text(_chats(1100) + padding + _chats(10, start=1100))
    assert data.stat().st_size > BLOCK_BYTES + 100_000
    job = prepare_plan(_opts(tmp_path / "out", data, num_proc=1, max_length=128), _settings(tiny_cache))
    with open(data, "r+b") as f:  # same size, other bytes, inside block 1
        f.seek(BLOCK_BYTES + 50_000)
        f.write(b"not json, changed")
    with pytest.raises(DatasetChanged, match=r"chats\.jsonl changed while it was planned: the bytes at offset 8,388,608"):
        job.run()
    store = job.run_store
    (window,) = read_windows(store)
    assert window.num_samples == 1024 and window.records_read == 1024
    failed = Planning.read(store)
    assert failed.state == "failed" and "DatasetChanged" in failed.error and "changed while it was planned" in failed.error


def test_bad_plan_options_are_refused_before_anything_is_read(tmp_path, tiny_cache):
    with pytest.raises(BadConfig, match="--num-proc 0"):
        prepare_plan(_opts(tmp_path / "out", num_proc=0), _settings(tiny_cache))
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


def test_enqueue_sends_each_windows_batches_while_later_windows_are_tokenised(cluster, tmp_path, small_windows):
    """Through the real broker: after the first window the queue holds exactly its batches and the
    plan is not complete; after the plan, every batch once; the same command again sends nothing
    (every batch is queued already)."""
    from hsx.broker import redis_client
    from hsx.brokerlayout import waiting
    from producer.enqueue import WindowSender

    client = redis_client(cluster.broker.url)

    def queued() -> int:
        return waiting(client, cluster.settings.queue)

    sender = WindowSender(cluster.settings, cluster.broker.url)
    looks = []

    def on_window(job, batches):
        sender(job, batches)
        looks.append((queued(), len(sender.result.enqueued), plan_complete(job.run_store)))

    planned = plan_run(_opts(tmp_path / "out", limit=300, num_proc=1, max_length=128), cluster.settings,
                       on_window=on_window)
    first_window = len(read_windows(planned.run_store)[0].batches)
    assert looks[0] == (first_window, first_window, False)
    assert queued() == len(sender.result.enqueued) == len(planned.batches)

    again = WindowSender(cluster.settings, cluster.broker.url)
    plan_run(_opts(tmp_path / "out", limit=300, num_proc=1, max_length=128), cluster.settings, on_window=again)
    assert again.result.enqueued == [] and len(again.result.in_flight) == len(planned.batches)
    assert queued() == len(planned.batches)
    client.close()


def test_a_ctrl_c_while_planning_leaves_the_bar_saying_the_windows_in_the_store(tmp_path, tiny_cache, small_windows):
    """A Ctrl-C once the first window is in the store: the tokenising bar's last words are that window's samples and
    batches (what `run` then says is in the store), not the counts of its last 0.2-s tick (a user saw '0 samples in
    0 batches planned' above 'interrupted while planning: 1 window of the plan (1,024 samples in 45 batches)')."""

    class Bar:
        def __init__(self):
            self.info = {}

        def add_task(self, description, **_kw):
            return description

        def update(self, task, info=None, **_kw):
            if info is not None:
                self.info[task] = info

    def ctrl_c(job, batches):
        raise KeyboardInterrupt

    bar = Bar()
    with pytest.raises(KeyboardInterrupt):
        plan_run(_opts(tmp_path / "out", limit=300, num_proc=1), _settings(tiny_cache), progress=bar, on_window=ctrl_c)
    from hsx.store import open_store
    from producer.words import plural

    (run_dir,) = (tmp_path / "out").iterdir()
    (window,) = read_windows(open_store(str(run_dir)))
    said = bar.info["tokenising"]
    assert said.endswith(f"{plural(window.num_samples, 'sample')} in {plural(len(window.batches), 'batch')} planned"), said
    assert window.num_samples == small_windows
