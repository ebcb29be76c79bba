"""``hsx.live``: a reader that follows a run while it is extracted yields each batch once its marker
exists, in an order fixed by the seed and the set of finished batches, resumes from its
``state_dict`` without repeating or skipping a sample, and stops when the run is complete or idle.

The live runs here are the shared small run (``smallrun.py``, a real ``producer run``) written again,
batch by batch, into an empty store by :class:`Publisher` the way a worker writes it: run.json and
the plan first, then per batch the shard and, last, the marker with the store's conditional create.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import pytest
import torch

from jobfixtures import read_samples
from smallrun import copy_run, quarantine_first_sample

from hsx.errors import BadConfig, FidelityError, HsxError
from hsx.layout import marker_key
from hsx.live import LiveHiddenStatesDataset, order_key, rank_of
from hsx.store import MissingKey, exists, open_store, write_file

K, H = 3, 64  # EAGLE-3 layers of the 8-layer tiny model, hidden size 64
POLL_S = 0.05


class Publisher:
    """Writes a finished local run into an empty run store as its workers would, one batch at a time."""

    def __init__(self, source_dir: Path, store):
        self.source, self.store = Path(source_dir), store
        self.marker_bytes = {p.stem: p.read_bytes() for p in sorted((self.source / "markers").glob("*.json"))}
        self.batches = sorted(self.marker_bytes)

    def publish_plan(self) -> None:
        """run.json, then the plan (``plan/batches.json`` last, as the planner writes it)."""
        write_file(self.store, "run.json", self.source / "run.json")
        plan = sorted(p for p in (self.source / "plan").rglob("*") if p.is_file() and p.name != "batches.json")
        for path in plan:
            write_file(self.store, path.relative_to(self.source).as_posix(), path)
        write_file(self.store, "plan/batches.json", self.source / "plan" / "batches.json")

    def publish_window(self, window: str) -> list[str]:
        """run.json (if not yet), then one window of the plan as the streamed planner writes it: its
        batch files, its sample rows, its record last; returns its batches."""
        if not exists(self.store, "run.json"):
            write_file(self.store, "run.json", self.source / "run.json")
        record = json.loads((self.source / "plan" / "windows" / f"{window}.json").read_text())
        batches = [b["batch"] for b in record["batches"]]
        for batch in batches:
            write_file(self.store, f"plan/batches/{batch}.safetensors", self.source / "plan" / "batches" / f"{batch}.safetensors")
        write_file(self.store, f"plan/samples/{window}.jsonl", self.source / "plan" / "samples" / f"{window}.jsonl")
        write_file(self.store, f"plan/windows/{window}.json", self.source / "plan" / "windows" / f"{window}.json")
        return batches

    def shard_key(self, batch: str) -> str:
        return json.loads(self.marker_bytes[batch])["shard"]["key"]

    def publish(self, batch: str, *, marker_delay_s: float = 0.0) -> None:
        """The batch's shard, then (after ``marker_delay_s``) its marker, created only if absent."""
        key = self.shard_key(batch)
        write_file(self.store, key, self.source / key)
        time.sleep(marker_delay_s)
        assert self.store.create(marker_key(batch), self.marker_bytes[batch]), f"marker of {batch} existed"


def _published(small_run, tmp_path, batches=None) -> tuple[Publisher, object]:
    store = open_store(str(tmp_path / "live" / small_run["report"]["run_id"]))
    pub = Publisher(small_run["dir"], store)
    pub.publish_plan()
    for batch in pub.batches if batches is None else batches:
        pub.publish(batch)
    return pub, store


def _assert_equals_shard(item: dict, ref: dict) -> None:
    S = ref["input_ids"].shape[0]
    assert torch.equal(item["input_ids"], ref["input_ids"].to(torch.int64))
    assert torch.equal(item["loss_mask"], ref["loss_mask"].to(torch.int64))
    assert item["hidden_states"].dtype == torch.bfloat16 and item["hidden_states"].shape == (S, K * H)
    assert torch.equal(item["hidden_states"].view(S, K, H), ref["hidden_states"])
    assert item["batch"] == ref["batch"]


def test_live_reader_yields_each_batch_once_its_marker_exists_and_stops_when_the_run_is_complete(small_run, store, tmp_path):
    """Local and S3: a batch is yielded only once its marker exists, and before the next batch is
    certified (the publisher waits for the reader); every stored sample once, equal to its shard;
    the reader stops by itself when every planned batch was read."""
    run_store = store.child(small_run["report"]["run_id"])
    pub = Publisher(small_run["dir"], run_store)
    pub.publish_plan()
    order = pub.batches[::-1]  # not in batch id order
    received = {b: threading.Event() for b in order}
    errors: list[BaseException] = []

    def extract() -> None:
        try:
            for batch in order:
                # The shard sits in the store for a while before its marker: the reader must not take it.
                pub.publish(batch, marker_delay_s=4 * POLL_S)
                assert received[batch].wait(30), f"the reader did not yield {batch} within 30 s of its marker"
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)

    (tmp_path / "dl").mkdir()
    writer = threading.Thread(target=extract, daemon=True)
    writer.start()
    reader = LiveHiddenStatesDataset(run_store, poll_s=POLL_S, idle_timeout_s=20, finals="none", tmp_dir=tmp_path / "dl")
    seen: dict[int, dict] = {}
    yielded_order: list[str] = []
    for sample in reader:
        batch = sample["batch"]
        assert exists(run_store, marker_key(batch)), f"{batch} yielded before its marker existed"
        if not yielded_order or yielded_order[-1] != batch:
            yielded_order.append(batch)
            # live: when a batch's first sample arrives, the batches after it are not certified yet
            assert [exists(run_store, marker_key(b)) for b in order] == [b in yielded_order for b in order]
        assert sample["sample_index"] not in seen
        seen[sample["sample_index"]] = sample
        received[batch].set()
    writer.join(30)
    assert not errors, errors
    assert reader.stop_reason == "complete"
    assert yielded_order == order and reader.progress() == {"yielded": len(order), "certified": len(order), "planned": len(order)}
    ref = read_samples(open_store(small_run["address"]))
    assert seen.keys() == ref.keys() and len(seen) == small_run["report"]["plan"]["samples"]
    for sample_index, item in seen.items():
        assert "final_postnorm" not in item
        _assert_equals_shard(item, ref[sample_index])
    if run_store.local_path("run.json") is None:
        assert list((tmp_path / "dl").iterdir()) == [], "downloaded shards must be deleted"


def test_batch_order_is_a_function_of_the_seed_and_the_finished_batches_and_later_windows_follow(small_run, tmp_path):
    """Readers with one seed on one set of finished batches schedule it alike: sorted by order_key,
    the restriction of the order of all batches; batches certified later form the next window."""
    first, rest = small_run_split(small_run)
    pub, store = _published(small_run, tmp_path, first)
    a = LiveHiddenStatesDataset(store, seed=5, poll_s=POLL_S)
    b = LiveHiddenStatesDataset(store, seed=5, poll_s=POLL_S)
    window = a.poll()
    assert window == b.poll() == sorted(first, key=lambda x: order_key(5, x))
    assert a.poll() == [], "a batch is scheduled once"
    for batch in rest:
        pub.publish(batch)
    assert a.poll() == sorted(rest, key=lambda x: order_key(5, x))
    assert a.schedule == window + sorted(rest, key=lambda x: order_key(5, x))
    # A reader started on the finished run: one window, whose restriction to `first` is the first window.
    c = LiveHiddenStatesDataset(store, seed=5, poll_s=POLL_S)
    assert c.poll() == sorted(pub.batches, key=lambda x: order_key(5, x))
    assert [x for x in c.schedule if x in first] == window
    orders = {tuple(LiveHiddenStatesDataset(store, seed=s, poll_s=POLL_S).poll()) for s in range(20)}
    assert len(orders) > 1, "the seed must change the order"
    # Iterating follows the schedule, each batch's samples in shard row order.
    got = [(s["batch"], s["sample_index"]) for s in a]
    assert [bt for i, (bt, _) in enumerate(got) if i == 0 or got[i - 1][0] != bt] == a.schedule
    ref = read_samples(open_store(small_run["address"]))
    assert [si for _, si in got] == [si for bt in a.schedule for si in ref if ref[si]["batch"] == bt]  # ref: row order


def small_run_split(small_run) -> tuple[list[str], list[str]]:
    """The shared run's batches split in two: all but the last, and the last."""
    batches = sorted(p.stem for p in (Path(small_run["dir"]) / "markers").glob("*.json"))
    assert len(batches) >= 3, batches
    return batches[:-1], batches[-1:]


def test_a_reader_resumed_from_its_state_dict_neither_repeats_nor_skips_a_sample(small_run, tmp_path):
    """Finished run: stopped after any number j of samples and resumed from a JSON copy of its state
    in a new reader, the samples are those of one uninterrupted pass. Live run: a reader stopped
    mid-run and resumed after more batches were certified reads every sample exactly once."""
    _, store = _published(small_run, tmp_path / "finished")
    full = [s["sample_index"] for s in LiveHiddenStatesDataset(store, seed=3, poll_s=POLL_S)]
    assert len(full) == small_run["report"]["plan"]["samples"]
    for j in range(len(full) + 1):
        before = LiveHiddenStatesDataset(store, seed=3, poll_s=POLL_S)
        it = iter(before)
        head = [next(it)["sample_index"] for _ in range(j)]
        state = json.loads(json.dumps(before.state_dict()))
        after = LiveHiddenStatesDataset(store, seed=3, poll_s=POLL_S)
        after.load_state_dict(state)
        assert head + [s["sample_index"] for s in after] == full, f"resumed after {j} samples"
        assert after.stop_reason == "complete"

    first, rest = small_run_split(small_run)
    pub, live = _published(small_run, tmp_path / "live", first)
    trainer = LiveHiddenStatesDataset(live, seed=3, poll_s=POLL_S, idle_timeout_s=0.3)
    it = iter(trainer)
    in_first = sum(json.loads(pub.marker_bytes[b])["num_samples"] for b in first)
    got = [next(it)["sample_index"] for _ in range(in_first // 2 + 1)]
    state = trainer.state_dict()
    assert 0 < state["offset"] or state["cursor"] > 0
    del it, trainer  # the trainer stops (a crash, a preemption)
    for batch in rest:
        pub.publish(batch)
    restarted = LiveHiddenStatesDataset(live, seed=3, poll_s=POLL_S, idle_timeout_s=5)
    restarted.load_state_dict(state)
    got += [s["sample_index"] for s in restarted]
    assert sorted(got) == sorted(full) and len(got) == len(set(got))
    assert restarted.schedule[:len(state["schedule"])] == state["schedule"]
    assert restarted.stop_reason == "complete"
    with pytest.raises(BadConfig, match="seed=3.*seed=4"):
        LiveHiddenStatesDataset(live, seed=4).load_state_dict(state)
    with pytest.raises(BadConfig, match="not a live reader state"):
        LiveHiddenStatesDataset(live, seed=3).load_state_dict({"cursor": 0})


def test_a_reader_stops_after_the_idle_timeout_naming_failed_batches_and_goes_on_when_iterated_again(small_run, tmp_path, caplog):
    """A batch that never gets a marker: the reader yields the others, stops after idle_timeout_s
    with stop_reason idle_timeout and says how many missing batches have a failure record; once the
    batch is certified, iterating the same reader again yields only that batch."""
    first, rest = small_run_split(small_run)
    pub, store = _published(small_run, tmp_path, first)
    store.write(f"failures/{rest[0]}.json", json.dumps({"batch": rest[0], "error": "FidelityError: test"}).encode())
    reader = LiveHiddenStatesDataset(store, poll_s=POLL_S, idle_timeout_s=0.3)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="hsx.live"):
        got = [s["batch"] for s in reader]
    assert reader.stop_reason == "idle_timeout" and time.monotonic() - t0 >= 0.3
    assert set(got) == set(first)
    assert "1 planned batches of this rank have no marker yet (1 with a failures/ record)" in caplog.text
    pub.publish(rest[0])
    assert {s["batch"] for s in reader} == set(rest)
    assert reader.stop_reason == "complete"


def test_ranks_follow_disjoint_batches_that_cover_the_run(small_run, tmp_path):
    """world_size 2: each rank reads the batches rank_of assigns it, and stops when those are read."""
    pub, store = _published(small_run, tmp_path)
    per_rank = []
    for rank in range(2):
        reader = LiveHiddenStatesDataset(store, rank=rank, world_size=2, poll_s=POLL_S, idle_timeout_s=5)
        batches = {s["batch"] for s in reader}
        assert reader.stop_reason == "complete"
        assert batches == {b for b in pub.batches if rank_of(b, 2) == rank}
        per_rank.append(batches)
    assert not per_rank[0] & per_rank[1] and per_rank[0] | per_rank[1] == set(pub.batches)
    with pytest.raises(BadConfig, match="rank 2 / world_size 2"):
        LiveHiddenStatesDataset(store, rank=2, world_size=2)


def test_shards_are_checked_against_their_markers_and_quarantined_samples_left_out(small_run, store, tmp_path):
    """A shard whose bytes differ from its marker's sha256 is refused before any sample of it is
    yielded (downloaded copies always, local files with verify=True); a quarantined sample is never yielded."""
    run_dir = copy_run(small_run, tmp_path / "copy")
    quarantined = quarantine_first_sample(run_dir, "b000000")
    run_store = store.child(small_run["report"]["run_id"])
    pub = Publisher(run_dir, run_store)
    pub.publish_plan()
    (tmp_path / "dl").mkdir()
    verify = True if run_store.local_path("run.json") is not None else None
    reader = LiveHiddenStatesDataset(run_store, poll_s=POLL_S, verify=verify, tmp_dir=tmp_path / "dl")
    pub.publish("b000000")
    assert reader.poll() == ["b000000"]
    pub.publish("b000001")
    key = pub.shard_key("b000001")
    data = bytearray(run_store.read(key))
    data[-1] ^= 1
    run_store.write(key, bytes(data))
    got = []
    with pytest.raises(FidelityError, match="sha256"):
        for sample in reader:
            got.append(sample)
    assert {s["batch"] for s in got} == {"b000000"} and quarantined not in [s["sample_index"] for s in got]
    assert len(got) == json.loads(pub.marker_bytes["b000000"])["num_samples"]


def test_a_reader_waits_for_the_run_to_appear_and_raises_when_its_planning_failed(small_run, tmp_path):
    """Started before the producer wrote run.json, the reader waits wait_for_run_s for it; a run whose
    plan failed raises at the first poll instead of waiting for batches that will never come."""
    store = open_store(str(tmp_path / "run"))
    with pytest.raises(MissingKey, match="no run.json in .* after waiting 0.2 s"):
        LiveHiddenStatesDataset(store, wait_for_run_s=0.2, poll_s=POLL_S)
    timer = threading.Timer(0.3, lambda: write_file(store, "run.json", Path(small_run["dir"]) / "run.json"))
    timer.start()
    reader = LiveHiddenStatesDataset(store, wait_for_run_s=10, poll_s=POLL_S)
    assert reader.config.run_id == small_run["report"]["run_id"]
    assert reader.poll() == [] and reader.planned == set() and not reader.plan_complete and not reader.complete()
    store.write("plan/planning.json", json.dumps({"state": "failed", "error": "BadDataset: no usable record"}).encode())
    with pytest.raises(HsxError, match="planning failed.*no usable record"):
        next(iter(reader))


def test_a_dataloader_reads_it_in_the_loop_process_and_refuses_several_workers(small_run, tmp_path):
    """num_workers=0: every sample once through a DataLoader; num_workers=2 would follow the run
    twice, so it is refused with the fix."""
    _, store = _published(small_run, tmp_path)
    ds = LiveHiddenStatesDataset(store, poll_s=POLL_S)
    got = [s["sample_index"] for s in torch.utils.data.DataLoader(ds, batch_size=None, num_workers=0)]
    assert sorted(got) == sorted(read_samples(open_store(small_run["address"])))
    loader = torch.utils.data.DataLoader(LiveHiddenStatesDataset(store, poll_s=POLL_S), batch_size=None, num_workers=2)
    with pytest.raises(BadConfig, match="num_workers=2.*use num_workers=0"):
        next(iter(loader))


def test_a_reader_follows_a_plan_still_being_written_and_ends_only_once_it_is_complete(small_run, tmp_path):
    """The plan is streamed (hsx/plan.py): with its first window written and no batch list yet, the reader takes
    that window's batches as they are certified, and once it has them all it waits, the plan not complete;
    when the last window and ``plan/batches.json`` are written it ends, complete."""
    windows = sorted(p.stem for p in (Path(small_run["dir"]) / "plan" / "windows").glob("*.json"))
    assert len(windows) >= 2, windows  # the small run: its samples' window, then the empty last one
    store = open_store(str(tmp_path / "live" / small_run["report"]["run_id"]))
    pub = Publisher(small_run["dir"], store)
    first = pub.publish_window(windows[0])
    reader = LiveHiddenStatesDataset(store, poll_s=POLL_S, idle_timeout_s=60, finals="none")
    assert reader.poll() == [] and reader.planned == set(first) and not reader.plan_complete
    got: list[str] = []
    errors: list[BaseException] = []

    def follow() -> None:
        try:
            got.extend(s["batch"] for s in reader)
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)

    follower = threading.Thread(target=follow, daemon=True)
    follower.start()
    for batch in first:
        pub.publish(batch)
    deadline = time.monotonic() + 30
    while reader.cursor < len(first) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    time.sleep(5 * POLL_S)
    assert not errors, errors
    assert reader.cursor == len(first) and follower.is_alive() and reader.stop_reason is None, "it waits for the plan"
    for window in windows[1:]:
        pub.publish_window(window)
    time.sleep(3 * POLL_S)
    assert follower.is_alive() and not reader.plan_complete, "windows alone do not complete the plan"
    write_file(store, "plan/stats.json", Path(small_run["dir"]) / "plan" / "stats.json")
    write_file(store, "plan/batches.json", Path(small_run["dir"]) / "plan" / "batches.json")  # last: complete
    follower.join(30)
    assert not follower.is_alive() and not errors, errors
    assert reader.stop_reason == "complete" and reader.plan_complete and set(got) == set(first) == set(pub.batches)
