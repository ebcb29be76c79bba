"""The run format's records (hsx/records.py) and keys (hsx/layout.py), as a specification.

Every record goes through its class: what is written reads back equal, a record of an older run
(without the newer optional fields) still reads, fields a newer hsx added are ignored, and a
damaged record fails with an error that names its key and the bad field.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from hsx import layout
from hsx.errors import RecordFormatError
from hsx.records import (SCHEMA_VERSIONS, BatchLease, BatchSummary, Failure, Marker, MarkerWorker, Planning, PlanWindow,
                          QuarantinedSample, Reclaim, SampleRow, ShardRef, SkipCounts, SpoolStatus, Stats, WorkerStatus,
                          done_batches, read_failures, read_heartbeats, read_markers, read_windows)
from hsx.store import LocalStore

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.fixture
def run_store(tmp_path) -> LocalStore:
    return LocalStore(tmp_path / "run")


def _marker(batch: str = "b000003", **over) -> Marker:
    fields = dict(
        run_id="demo-0123456789ab", batch=batch, config_sha256="c" * 64,
        shard=ShardRef(key=layout.shard_key(batch, "a1b2c3d4e5f6"), bytes=123_456, sha256="ab" * 32),
        num_samples=3, num_tokens=900, supervised_tokens=400, planned_samples=4, planned_tokens=1000,
        quarantined=[QuarantinedSample(sample_index=17, reason="nonfinite hidden states (layers 3)")], num_quarantined=1,
        model_revision="sha256:" + "e" * 64, worker=MarkerWorker(host="node1", pid=4242, device="cuda:0"),
        seconds=1.25, finished_at="2026-12-01T12:00:00+00:00", finished_unix=1796126400.123, forwards=1,
        forward_s=0.9, launch_s=0.1, write_s=0.2, write_path="direct",
    )
    fields.update(over)
    return Marker(**fields)


def _status(**over) -> WorkerStatus:
    fields = dict(host="node1", pid=4242, worker="node1-4242", device="cuda:0", state="working",
                  batches=[BatchLease(batch="b000003", phase="forward", since="2026-12-01T12:00:00+00:00")],
                  batches_done=2, spool=SpoolStatus(dir="/dev/shm/hsx-spool", used_bytes=10, total_bytes=100,
                                                    reserved_bytes=0, used_fraction=0.1, uploads_pending=0,
                                                    max_fraction=0.8, max_pending_uploads=2),
                  started_at="2026-12-01T11:00:00+00:00", updated_at="2026-12-01T12:00:05+00:00", heartbeat_s=5.0)
    fields.update(over)
    return WorkerStatus(**fields)


# --- round trips -----------------------------------------------------------------------------


def test_a_marker_created_in_the_store_reads_back_equal_under_its_key(run_store):
    """Marker.create writes markers/<batch>.json once (a second create is refused); Marker.read gives it back."""
    marker = _marker()
    assert marker.create(run_store) is True
    assert run_store.size("markers/b000003.json") is not None
    assert marker.create(run_store) is False, "the conditional create must refuse a second marker"
    assert Marker.read(run_store, "b000003") == marker
    assert Marker.read(run_store, "b000004") is None
    assert done_batches(run_store) == {"b000003"}
    assert read_markers(run_store) == {"b000003": marker}


def test_the_markers_json_on_disk_keeps_the_field_names_readers_of_older_versions_use(run_store):
    """The JSON is the documented one (README's reading example takes marker['shard']['key'])."""
    _marker().create(run_store)
    raw = json.loads(run_store.read("markers/b000003.json"))
    assert raw["shard"] == {"key": "shards/b000003-a1b2c3d4e5f6.safetensors", "bytes": 123_456, "sha256": "ab" * 32}
    assert raw["schema_version"] == 1 and raw["quarantined"] == [{"sample_index": 17, "reason": "nonfinite hidden states (layers 3)"}]
    assert raw["worker"] == {"host": "node1", "pid": 4242, "device": "cuda:0"} and raw["write_path"] == "direct"


@pytest.mark.parametrize("record, read", [
    (Failure(batch="b000007", error="NonFiniteBatch: all 4 samples have NaN/Inf hidden states", host="node1",
             at="2026-12-01T12:00:00+00:00"), lambda s: Failure.read(s, "b000007")),
    (_status(), lambda s: WorkerStatus.read(s, "node1-4242")),
    (Stats(samples=10, tokens=5000, supervised_tokens=2000, truncated_samples=1, batches=2, padding_waste=0.125,
           skipped=SkipCounts(total=1, counts={"no_turns": 1}, examples={"no_turns": ["r9: empty"]}), plan_seconds=0.5),
     Stats.read),
    (Planning(state="failed", host="node1", pid=77, started_at="2026-12-01T12:00:00+00:00", command="producer run x",
              error="KeyboardInterrupt", failed_at="2026-12-01T12:01:00+00:00"), Planning.read),
], ids=["failure", "worker_status", "stats", "planning"])
def test_each_written_record_reads_back_equal(run_store, record, read):
    """write then read through the class gives an equal record (every field survives the JSON)."""
    record.write(run_store)
    assert read(run_store) == record


def test_a_reclaim_is_created_once_under_its_delivery_and_attempt(run_store):
    """reclaims/<batch>-<tag>.<attempt>.json: the first create wins, the second is refused; it reads back equal."""
    reclaim = Reclaim(batch="b000001", delivery_tag="3f2a-tag", task_id="t-1", attempt=2, by="node2-99",
                      host="node2", at_unix=1796126400.5, at="2026-12-01T12:00:00+00:00")
    assert reclaim.create(run_store) and not reclaim.create(run_store)
    assert run_store.size("reclaims/b000001-3f2a-tag.2.json") is not None
    assert Reclaim.read(run_store, "b000001", "3f2a-tag", 2) == reclaim


def test_the_plans_list_files_round_trip_and_keep_their_bare_list_format(run_store):
    """plan/batches.json is a JSON list, a window's plan/samples/<window>.jsonl one object a line; neither
    repeats schema_version. Sample rows are read from the windows in window order."""
    batches = [BatchSummary(batch="b000000", num_samples=2, num_tokens=30, max_len=20, supervised_tokens=12),
               BatchSummary(batch="b000001", num_samples=1, num_tokens=9, max_len=9, supervised_tokens=4)]
    BatchSummary.write_list(run_store, batches)
    assert BatchSummary.read_list(run_store) == batches
    assert json.loads(run_store.read("plan/batches.json"))[0] == {"batch": "b000000", "num_samples": 2, "num_tokens": 30,
                                                                "max_len": 20, "supervised_tokens": 12}
    rows = [SampleRow(sample_index=0, record_id="conv-1", num_tokens=20, supervised_tokens=8, truncated=False, batch="b000000"),
            SampleRow(sample_index=1, record_id=42, num_tokens=10, supervised_tokens=4, truncated=True, batch="b000000")]
    SampleRow.write_window(run_store, "w000000", rows)
    later = [SampleRow(sample_index=2, record_id="conv-3", num_tokens=9, supervised_tokens=4, batch="b000001")]
    SampleRow.write_window(run_store, "w000001", later)
    for index, (first, part, batch) in enumerate([(0, rows, batches[:1]), (2, later, batches[1:])]):
        PlanWindow(window=index, first_sample=first, num_samples=len(part), first_batch=index, batches=batch,
                   tokens=sum(r.num_tokens for r in part), supervised_tokens=sum(r.supervised_tokens for r in part),
                   padded_tokens=40, records_read=first + len(part)).write(run_store)
    assert SampleRow.read_all(run_store) == rows + later
    lines = run_store.read("plan/samples/w000000.jsonl").decode().splitlines()
    assert len(lines) == 2 and "schema_version" not in lines[0] and json.loads(lines[1])["record_id"] == 42


def test_a_window_counts_only_when_every_earlier_window_is_in_the_store(run_store):
    """read_windows stops at the first gap: w000002 without w000001 is not part of the plan yet."""
    def window(index):
        return PlanWindow(window=index, first_sample=index, num_samples=1, first_batch=index,
                          batches=[BatchSummary(batch=f"b{index:06d}", num_samples=1, num_tokens=5)], tokens=5,
                          supervised_tokens=2, padded_tokens=5, records_read=index + 1)
    window(0).write(run_store)
    window(2).write(run_store)
    assert [w.name for w in read_windows(run_store)] == ["w000000"]
    window(1).write(run_store)
    assert [w.name for w in read_windows(run_store)] == ["w000000", "w000001", "w000002"]


def test_failures_of_batches_that_are_done_are_left_out_and_damaged_ones_skipped(run_store):
    """read_failures: by batch, only batches without a marker; a half-written record does not stop status."""
    for batch in ("b000001", "b000002"):
        Failure(batch=batch, error="boom").write(run_store)
    run_store.write("failures/b000003.json", b'{"batch": "b0000')
    assert set(read_failures(run_store, done={"b000002"})) == {"b000001"}
    assert read_failures(run_store, done=set())["b000001"].error == "boom"


def test_heartbeats_are_read_as_typed_records_and_a_damaged_one_is_skipped(run_store):
    _status().write(run_store)
    _status(host="node2", pid=7, worker="node2-7", state="idle", batches=[]).write(run_store)
    run_store.write("workers/node3-1.json", b"not json")
    records = sorted(read_heartbeats(run_store), key=lambda r: r.name)
    assert [r.name for r in records] == ["node1-4242", "node2-7"]
    assert records[0].batches[0].phase == "forward" and records[1].state == "idle"


# --- compatibility ---------------------------------------------------------------------------


def test_a_marker_of_an_older_run_without_the_newer_optional_fields_still_reads(run_store):
    """Only what certifies the batch is required; timings, quarantine, worker and write path came later.
    Older markers' spool timings (store_s, verify_s) are ignored."""
    old = {"schema_version": 1, "run_id": "old-run", "batch": "b000000", "config_sha256": "d" * 64,
           "shard": {"key": "shards/b000000-aaaaaaaaaaaa.safetensors", "bytes": 10, "sha256": "0" * 64},
           "num_samples": 2, "num_tokens": 50, "store_s": 0.3, "verify_s": 0.1}
    run_store.write("markers/b000000.json", json.dumps(old).encode())
    marker = Marker.read(run_store, "b000000")
    assert marker.shard.key == "shards/b000000-aaaaaaaaaaaa.safetensors" and marker.num_tokens == 50
    assert marker.quarantined == [] and marker.write_path is None and marker.planned_tokens is None
    assert marker.finished_unix is None and marker.worker is None


def test_quarantined_entries_written_as_plain_indices_or_as_sample_read_the_same():
    data = _marker().model_dump(mode="json")
    data["quarantined"] = [5, {"sample": 6, "reason": "x"}, {"sample_index": 7}]
    assert Marker.from_json(json.dumps(data), "markers/b000003.json").quarantined_ids == {5, 6, 7}


def test_fields_a_newer_hsx_added_are_ignored_on_read(run_store):
    """Forward compatibility: an unknown field is not an error, and is not carried."""
    data = _marker().model_dump(mode="json")
    data["gpu_energy_j"] = 12.5
    data["shard"]["etag"] = "abc"
    run_store.write("markers/b000003.json", json.dumps(data).encode())
    assert Marker.read(run_store, "b000003") == _marker()


def test_old_failure_records_without_schema_version_read_as_version_1(run_store):
    run_store.write("failures/b000009.json", json.dumps({"batch": "b000009", "error": "E: x", "host": "h", "at": "t"}).encode())
    assert Failure.read(run_store, "b000009").schema_version == 1


def test_every_record_class_has_one_schema_version_listed():
    assert SCHEMA_VERSIONS == {"Marker": 1, "Failure": 1, "WorkerStatus": 1, "Reclaim": 1, "Stats": 1,
                               "BatchSummary": 1, "SampleRow": 1, "PlanWindow": 1, "Planning": 1}


# --- errors ----------------------------------------------------------------------------------


def test_a_marker_without_its_shard_key_fails_naming_the_key_and_the_field(run_store):
    data = _marker().model_dump(mode="json")
    del data["shard"]["key"]
    run_store.write("markers/b000003.json", json.dumps(data).encode())
    with pytest.raises(RecordFormatError) as err:
        Marker.read(run_store, "b000003")
    assert err.value.key == "markers/b000003.json" and err.value.fields == ["shard.key"]
    assert "markers/b000003.json" in str(err.value) and "shard.key: Field required" in str(err.value)
    assert "producer verify" in str(err.value), "the message must say what to do"
    assert isinstance(err.value, ValueError), "callers that caught a JSON ValueError still catch it"


def test_a_mistyped_field_is_named_with_the_value_found(run_store):
    _status().write(run_store)
    data = json.loads(run_store.read("workers/node1-4242.json"))
    data["pid"] = "not-a-pid"
    run_store.write("workers/node1-4242.json", json.dumps(data).encode())
    with pytest.raises(RecordFormatError, match=r"workers/node1-4242\.json: not a valid WorkerStatus record: pid: .*'not-a-pid'"):
        WorkerStatus.read(run_store, "node1-4242")


def test_a_record_that_is_not_json_fails_naming_its_key(run_store):
    run_store.write("plan/stats.json", b"{truncated")
    with pytest.raises(RecordFormatError, match=r"plan/stats\.json: not a valid Stats record: \(the whole record\): Invalid JSON"):
        Stats.read(run_store)


def test_a_record_of_a_newer_schema_version_is_refused_saying_so(run_store):
    data = _marker().model_dump(mode="json")
    data["schema_version"] = 2
    run_store.write("markers/b000003.json", json.dumps(data).encode())
    with pytest.raises(RecordFormatError, match="reads Marker schema_version 1.*newer") as err:
        Marker.read(run_store, "b000003")
    assert err.value.fields == ["schema_version"]


def test_read_markers_reports_a_damaged_marker_as_its_error_and_reads_the_others(run_store):
    _marker("b000001").create(run_store)
    run_store.write("markers/b000002.json", b"[]")
    found = read_markers(run_store)
    assert isinstance(found["b000001"], Marker) and isinstance(found["b000002"], RecordFormatError)


def test_a_damaged_line_of_samples_jsonl_is_named_by_its_number(run_store):
    run_store.write("plan/samples.jsonl", b'{"sample_index": 0, "record_id": "a", "num_tokens": 1, "supervised_tokens": 1, '
                                          b'"batch": "b000000"}\n{"sample_index": 1}\n')
    with pytest.raises(RecordFormatError, match=r"plan/samples\.jsonl line 2: .*record_id: Field required"):
        SampleRow.read_all(run_store)


# --- layout ----------------------------------------------------------------------------------


def test_the_layout_is_the_one_the_readme_documents():
    """Every key of the README's run layout block is one layout names, and none is missing from it;
    the worker status and reclaim keys are the ones the README's recovery sections name."""
    text = README.read_text()
    documented = set(re.findall(r"^<output>/<run_id>/(\S+)", text, flags=re.M))
    assert documented, "the README's layout block was not found"
    assert documented == {
        layout.RUN_JSON, layout.BATCHES_JSON, layout.PLANNING_JSON, layout.batch_plan_key("<batch>"),
        layout.window_key("<window>"), layout.window_samples_key("<window>"), layout.STATS_JSON, layout.shard_key("<batch>", "<attempt>"), layout.marker_key("<batch>"),
        layout.failure_key("<batch>"),
    }
    assert f"<run>/{layout.worker_key('<host>-<pid>')}" in text
    assert f"<run>/{layout.reclaim_key('<batch>', '<tag>', '<n>')}" in text


def test_names_are_read_back_from_keys_only_for_their_own_prefix():
    assert layout.name_of(layout.marker_key("b000042"), layout.MARKERS_PREFIX) == "b000042"
    assert layout.name_of("markers/.hsx-tmp-x", layout.MARKERS_PREFIX) is None
    assert layout.name_of("markers/sub/b1.json", layout.MARKERS_PREFIX) is None
    assert layout.name_of(layout.failure_key("b1"), layout.MARKERS_PREFIX) is None
    assert layout.reclaim_key("b1", "tag", 3).startswith(layout.reclaim_prefix("b1", "tag"))
