"""``python -m producer verify``: a run as the job wrote it passes (and so does recomputing samples
on the reference path); every kind of damage fails with exit 1 and a report that names the batch.

Damaged runs are copies of one real run (tests/smallrun.py).
"""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

from jobfixtures import run_here
from smallrun import copy_run, quarantine_first_sample, upload_run

from hsx.errors import BadConfig
from hsx.layout import marker_key
from hsx.plan import batch_key, read_batch
from hsx.records import Marker
from hsx.runconfig import load_run
from hsx.store import open_store
from producer.verify import problem_batches, recompute_samples, verify_run


def _kinds(report: dict) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for p in report["problems"]:
        out.setdefault(p["kind"], []).append(p["batch"])
    return out


def _marker(run_dir, batch: str) -> dict:
    return json.loads((run_dir / marker_key(batch)).read_text())


def test_verify_passes_on_the_jobs_output_and_recomputed_samples_match(small_run):
    """The CLI exits 0 on an untouched run: every marker, shard, count and token echoes; 3 random
    samples recomputed per sample in fp32 are within the bf16 tolerance."""
    proc = run_here(["verify", small_run["address"], "--recompute", "3", "--json"], small_run["env"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["ok"] and report["problems"] == []
    plan = small_run["report"]["plan"]
    assert report["batches_done"] == report["batches_planned"] == plan["batches"]
    assert report["samples_stored"] == report["samples_planned"] == plan["samples"]
    assert report["bytes_hashed"] > 0 and report["orphans"] == []
    rec = report["recompute"]
    assert len(rec["samples"]) == 3 and rec["rtol"] == 1e-2
    assert rec["values_compared"] > 3 * 64 * 5 * 50, "the recompute must have compared real values"
    assert 0 < rec["worst_ratio"] <= 1.0, rec


def test_a_recompute_whose_fp32_model_does_not_fit_is_refused_before_it_loads(small_run, monkeypatch):
    """``--recompute`` runs the target in fp32: a 27B is 108 GB, more than an H200 holds. Where the fp32 model
    does not fit the device's free memory the recompute is refused before loading, naming both sizes and what
    to do (it loaded the whole model into host memory, then ran out on the GPU)."""
    import transformers

    from producer import verify
    from settings import Settings

    loads = []
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        classmethod(lambda cls, *a, **k: loads.append(a) or pytest.fail("loaded")))
    monkeypatch.setattr(verify, "available_bytes", lambda device: 100_000)  # 100 kB free
    with pytest.raises(BadConfig, match=r"runs the target in fp32 .*: [0-9.]+ MB for .*has 0.1 MB free.*leave out --recompute"):
        verify_run(open_store(small_run["address"]), recompute=1, settings=Settings(_env_file=None,
                                                                                   cache_dir=small_run["cache"]))
    assert loads == []


def test_recompute_catches_an_off_by_one_layer_id(small_run):
    """Guard against a vacuous recompute: reading the stored layers as ids + 1 must fail on every sample."""
    run_store = open_store(small_run["address"])
    config = load_run(run_store)
    shifted = dataclasses.replace(config, layers=config.layers.model_copy(
        update={"layer_ids": tuple(i + 1 for i in config.layers.layer_ids)}))
    from settings import Settings

    marker = Marker.read(run_store, "b000000")
    plan = read_batch(run_store, "b000000")
    picks = [("b000000", marker, int(plan.sample_index_N[0]), int(plan.cu_seqlens_N1[0]), int(plan.cu_seqlens_N1[1]))]
    summary, problems = recompute_samples(run_store, shifted, picks, Settings(_env_file=None, cache_dir=small_run["cache"]))
    assert [p.kind for p in problems] == ["recompute_mismatch"] and problems[0].batch == "b000000"
    assert summary["worst_ratio"] > 10, summary


def test_an_altered_shard_fails_with_exit_1_naming_its_batch(small_run, tmp_path):
    """One flipped byte inside a shard's tensor data: exit 1, the report names that batch and the sha256."""
    run_dir = copy_run(small_run, tmp_path)
    victim = "b000001"
    shard = run_dir / _marker(run_dir, victim)["shard"]["key"]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40
    shard.write_bytes(bytes(data))
    proc = run_here(["verify", str(run_dir)], small_run["env"])
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "verify FAILED" in proc.stdout and victim in proc.stdout and "shard_altered" in proc.stdout
    assert "Traceback" not in proc.stderr
    said = " ".join(proc.stdout.split())
    assert "fix: `python -m producer reconcile " in said and " --repair` (drops the bad batches' markers" in said, said
    # plain reconcile does not hash shards: it says so, and where they are checked
    plain = run_here(["reconcile", str(run_dir)], small_run["env"])
    assert "shards are not hashed without --repair" in " ".join(plain.stdout.split()), plain.stdout


def test_a_removed_shard_is_named(small_run, tmp_path):
    """Delete one shard: the batch is reported as shard_missing; its samples are not double-reported missing."""
    run_dir = copy_run(small_run, tmp_path)
    victim = "b000002"
    (run_dir / _marker(run_dir, victim)["shard"]["key"]).unlink()
    report = verify_run(open_store(str(run_dir)))
    assert not report["ok"]
    assert _kinds(report) == {"shard_missing": [victim]}, report["problems"]


def test_a_duplicated_sample_is_named_with_both_batches(small_run, tmp_path):
    """A second marker (under another batch name) certifying the same shard: the samples are
    reported stored twice, naming both batches, and the stray marker is reported as such."""
    run_dir = copy_run(small_run, tmp_path)
    (run_dir / marker_key("b000099")).write_text((run_dir / marker_key("b000001")).read_text())
    report = verify_run(open_store(str(run_dir)))
    kinds = _kinds(report)
    assert kinds["duplicate"] == ["b000001, b000099"], report["problems"]
    assert kinds["marker_mismatch"] == ["b000099"] and kinds["not_planned"] == ["b000099"]
    assert problem_batches(report) == ["b000001", "b000099"]


def test_a_second_shard_claiming_another_batchs_samples_is_caught(small_run, tmp_path):
    """Batch b000002's marker re-pointed at a (hash-valid) copy of b000001's shard: metadata,
    unplanned samples, missing samples and duplicates are all reported against b000002."""
    run_dir = copy_run(small_run, tmp_path)
    src = _marker(run_dir, "b000001")
    marker = _marker(run_dir, "b000002")
    copy_key = "shards/b000002-copyofb1.safetensors"
    (run_dir / copy_key).write_bytes((run_dir / src["shard"]["key"]).read_bytes())
    (run_dir / marker["shard"]["key"]).unlink()
    marker["shard"] = {**src["shard"], "key": copy_key}
    (run_dir / marker_key("b000002")).write_text(json.dumps(marker))
    report = verify_run(open_store(str(run_dir)))
    kinds = _kinds(report)
    assert kinds.get("schema") == ["b000002"], report["problems"]  # header says batch b000001
    assert "b000002" in problem_batches(report)


def test_changed_plan_input_ids_fail_the_token_echo(small_run, tmp_path):
    """One token id changed in the plan: token_echo names the batch and the sample."""
    run_dir = copy_run(small_run, tmp_path)
    run_store = open_store(str(run_dir))
    plan = read_batch(run_store, "b000000")
    plan.input_ids_T[7] += 1
    run_store.write(batch_key("b000000"), plan.to_bytes())
    report = verify_run(run_store)
    assert _kinds(report) == {"token_echo": ["b000000"]}, report["problems"]
    assert f"sample {int(plan.sample_index_N[0])}" in report["problems"][0]["detail"]


def test_a_marker_of_another_config_and_a_missing_marker_fail(small_run, tmp_path):
    """A marker whose config_sha256 is not run.json's identity is reported; so is a planned batch with no marker."""
    run_dir = copy_run(small_run, tmp_path)
    marker = _marker(run_dir, "b000000")
    marker["config_sha256"] = "0" * 64
    (run_dir / marker_key("b000000")).write_text(json.dumps(marker))
    (run_dir / marker_key("b000002")).unlink()
    report = verify_run(open_store(str(run_dir)))
    kinds = _kinds(report)
    assert kinds == {"config_mismatch": ["b000000"], "not_done": ["b000002"]}, report["problems"]
    assert report["batches_done"] == report["batches_planned"] - 2


def test_a_batch_with_a_recorded_failure_is_reported_failed_with_its_reason_not_as_not_done(small_run, tmp_path):
    """Issue 19 item 8: a batch a worker gave up on (no marker, ``failures/<batch>.json``) is ``failed`` with the
    recorded error and the command that redoes it; a batch with no marker and no record is still ``not_done``."""
    run_dir = copy_run(small_run, tmp_path)
    (run_dir / marker_key("b000001")).unlink()
    (run_dir / marker_key("b000002")).unlink()
    (run_dir / "failures").mkdir(exist_ok=True)
    (run_dir / "failures" / "b000001.json").write_text(json.dumps({
        "batch": "b000001", "error": "BadPlan: plan/batches/b000001.safetensors: cu_seqlens ends at 90, input_ids has 95",
        "host": "node3", "at": "2026-12-01T10:00:00+00:00"}))
    proc = run_here(["verify", str(run_dir), "--json"], small_run["env"])
    assert proc.returncode == 1, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert _kinds(report) == {"failed": ["b000001"], "not_done": ["b000002"]}, report["problems"]
    (failed,) = [p for p in report["problems"] if p["kind"] == "failed"]
    assert "BadPlan: plan/batches/b000001.safetensors" in failed["detail"] and "node3" in failed["detail"], failed
    assert "not extracted yet" not in failed["detail"] and "producer reconcile" in failed["detail"], failed
    text = run_here(["verify", str(run_dir)], small_run["env"]).stdout
    assert "bad b000001 failed: no marker: the batch failed (BadPlan" in " ".join(text.split()), text


def test_quarantined_samples_count_as_accounted_for_and_orphans_are_not_errors(small_run, tmp_path):
    """A shard without a quarantined sample (listed in its marker) passes; a stray shard is listed as an orphan only."""
    run_dir = copy_run(small_run, tmp_path)
    sample = quarantine_first_sample(run_dir, "b000001")
    (run_dir / "shards" / "b000001-orphan.safetensors").write_bytes(b"left by an interrupted upload")
    report = verify_run(open_store(str(run_dir)))
    assert report["ok"], report["problems"]
    assert report["samples_quarantined"] == 1 and report["samples_stored"] == report["samples_planned"] - 1
    assert report["orphans"] == ["shards/b000001-orphan.safetensors"]
    assert sample >= 0


def test_verify_on_s3_passes_and_fails_like_local(small_run, s3_bucket, tmp_path):
    """The same checks over S3 (ranged header reads, streamed hashes, a thread pool): clean passes,
    an altered object fails naming its batch."""
    store = open_store(s3_bucket.url, s3_bucket.settings).child(small_run["report"]["run_id"])
    upload_run(small_run["dir"], store)
    assert verify_run(store)["ok"]
    key = json.loads(store.read(marker_key("b000000")))["shard"]["key"]
    data = bytearray(store.read(key))
    data[-10] ^= 1
    store.write(key, bytes(data))
    report = verify_run(store)
    assert _kinds(report) == {"shard_altered": ["b000000"]}, report["problems"]


def test_a_truncated_shard_fails(small_run, tmp_path):
    """A shard cut short (an interrupted copy) fails on its size and hash."""
    run_dir = copy_run(small_run, tmp_path)
    shard = run_dir / _marker(run_dir, "b000000")["shard"]["key"]
    shard.write_bytes(shard.read_bytes()[:-1000])
    report = verify_run(open_store(str(run_dir)))
    assert _kinds(report) == {"shard_altered": ["b000000"]}, report["problems"]


def _shard_gets(method: str, path: str, _headers: dict) -> bool:
    return method == "GET" and "/shards/" in path


def test_a_store_that_resets_shard_reads_leaves_them_unverified_and_repair_keeps_marker_and_shard(small_run, s3_bucket):
    """Every GET of a shard is cut off (tests/faultproxy.py in front of the real S3 server): verify reports each batch
    `unverified` (never `shard_unreadable`), and reconcile's repair deletes nothing; once the store answers, verify passes."""
    from faultproxy import FaultProxy, Rule, proxied_settings

    from producer.reconcile import repair_bad_batches

    run_id = small_run["report"]["run_id"]
    direct = open_store(s3_bucket.url, s3_bucket.settings).child(run_id)
    upload_run(small_run["dir"], direct)
    before = sorted(direct.list(""))
    proxy = FaultProxy(s3_bucket.settings.s3_endpoint_url, [Rule(_shard_gets, ("reset",))]).start()
    try:
        store = open_store(f"{s3_bucket.url}/{run_id}", proxied_settings(s3_bucket, proxy))
        batches = sorted(json.loads(direct.read("plan/batches.json")), key=lambda b: b["batch"])
        report = verify_run(store, retry_s=0.5)
        assert _kinds(report) == {"unverified": [b["batch"] for b in batches]}, report["problems"]
        assert report["unverified"] == [b["batch"] for b in batches]
        assert "could not be read" in report["problems"][0]["detail"]

        import producer.verify as verify_module

        verify_module.VERIFY_RETRY_S, saved = 0.5, verify_module.VERIFY_RETRY_S
        try:
            assert repair_bad_batches(store, s3_bucket.settings) == {}
        finally:
            verify_module.VERIFY_RETRY_S = saved
        assert sorted(direct.list("")) == before, "repair deleted objects of a run it could not read"

        proxy.rules.clear()
        assert verify_run(store)["ok"]
    finally:
        proxy.stop()


def test_shard_reads_cut_off_a_few_times_are_retried_through_the_store_and_pass(small_run, s3_bucket):
    """Six resets of shard GETs (more than botocore's own attempts of one call): verify retries through the store's
    interface (hsx/store/retry.py) and passes."""
    from faultproxy import FaultProxy, Rule, proxied_settings

    run_id = small_run["report"]["run_id"]
    upload_run(small_run["dir"], open_store(s3_bucket.url, s3_bucket.settings).child(run_id))
    proxy = FaultProxy(s3_bucket.settings.s3_endpoint_url, [Rule(_shard_gets, ("reset",), times=6)]).start()
    try:
        report = verify_run(open_store(f"{s3_bucket.url}/{run_id}", proxied_settings(s3_bucket, proxy)), retry_s=60)
        assert report["ok"], report["problems"]
        assert proxy.rules[0].hits == 6
    finally:
        proxy.stop()


def test_verify_reports_the_hashing_time_apart_from_the_recompute(small_run, monkeypatch):
    """``--recompute``'s model load and forwards are not counted as hashing time; they are reported on their own."""
    import re

    def slow_recompute(run_store, config, picks, settings, *, rtol=None, progress=None):
        time.sleep(1.5)
        return {"samples": [{"sample_index": 0}], "rtol": 0.01, "values_compared": 1, "worst_ratio": 0.1,
                "load_s": 1.2, "seconds": 1.5}, []

    monkeypatch.setattr("producer.verify.recompute_samples", slow_recompute)
    proc = run_here(["verify", small_run["address"], "--recompute", "1"], small_run["env"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    hashed = re.search(r"hashed\W+[\d.,]+ [MG]B in ([\d.]+) s", proc.stdout)
    assert hashed and float(hashed.group(1)) < 1.0, proc.stdout
    assert "worst 0.10x the tolerance (rtol 0.01) in 1.5 s (model load 1.2 s)" in proc.stdout, proc.stdout


def test_verify_says_the_batches_not_extracted_yet_in_one_line(small_run, tmp_path):
    """A partial run: its batches without a marker are one ``not_done`` line naming them, not a line each
    (a new user's partial run printed 50 identical lines); other problems keep a line each."""
    run_dir = copy_run(small_run, tmp_path)
    store = open_store(str(run_dir))
    names = sorted(b["batch"] for b in json.loads(store.read("plan/batches.json")))
    for batch in names[1:]:
        store.delete(marker_key(batch))
    proc = run_here(["verify", str(run_dir)], small_run["env"])
    said = proc.stdout
    assert proc.returncode == 1, said
    lines = [line for line in said.splitlines() if "not_done" in line]
    assert len(lines) == 1 and f"not_done: {len(names) - 1} batches without a marker, not extracted yet: " in \
        " ".join(said.split()), said
    assert all(b in " ".join(said.split()) for b in names[1:4])
