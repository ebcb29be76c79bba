"""The main job end to end, with real parts: the producer CLI, the session's shared worker (a
real Celery worker process on the embedded valkey broker) or a worker of its own on a valkey server
on a TCP port, a local store and a real S3 server, the built-in tiny-qwen3.5 target and real
ShareGPT records. The whole ``producer run`` process stack (embedded broker, launcher, warm
shutdown) is tested in test_run_lifecycle.py, test_cli_messages.py and test_monitoring.py.
"""

from __future__ import annotations

import json
from pathlib import Path
import threading

import numpy as np
import pytest
import torch

from jobfixtures import (TcpBroker, WorkerProcess, assert_matches_reference, clean_env, cli_json, plan_samples, read_samples,
                         run_here, wait_until)

from hsx.layout import marker_key
from hsx.records import done_batches
from hsx.runconfig import load_run
from hsx.store import open_store

JOB = ["sharegpt", "--model", "tiny-qwen3.5", "--limit", "24", "--max-length", "384", "--batch-tokens", "1536",
       "--store-dtype", "float32"]


@pytest.fixture(scope="module")
def local_run(tmp_path_factory, tiny_cache, shared_worker):
    """``producer run`` on 24 real ShareGPT records into a local store, on the shared worker."""
    tmp = tmp_path_factory.mktemp("local-run")
    env = clean_env(cache_dir=tiny_cache, state_dir=tmp / "state", spool_dir=tmp / "spool")
    report = cli_json(shared_worker.producer(["run", *JOB, "--output", str(tmp / "out"), "--json"], env))
    return {"tmp": tmp, "env": env, "report": report, "store": open_store(report["address"])}


def test_run_writes_every_batch_with_a_marker_and_reports_skips(local_run):
    """Every planned batch gets a marker; the report counts samples, tokens and skip reasons."""
    report = local_run["report"]
    assert report["batches_total"] > 1
    assert report["batches_done"] == report["batches_total"] == report["batches_enqueued"]
    assert report["plan"]["samples"] + report["plan"]["skipped"]["total"] >= 24
    assert set(report["plan"]["skipped"]) >= {"total", "counts"}
    assert report["plan"]["tokens"] > 0 and 0 <= report["plan"]["padding_waste"] < 0.25


def test_shards_equal_a_per_sample_reference_forward_for_every_layer(local_run, tiny_qwen35):
    """Batched, right-padded capture == per-sample output_hidden_states[id + 1] for every stored layer and the final post-norm state."""
    run_store = local_run["store"]
    config = load_run(run_store)
    samples = read_samples(run_store)
    assert len(samples) == local_run["report"]["plan"]["samples"]
    layer_ids = list(config.layers.layer_ids)
    assert layer_ids == [1, 3, 4]  # EAGLE-3 preset on 8 layers: [1, N//2-1, N-4]
    compared = assert_matches_reference(tiny_qwen35, samples, layer_ids, atol=1e-4, rtol=1e-4)
    assert compared > 100_000, "the check must have compared real values"


def test_shards_echo_the_plans_input_ids_and_loss_masks(local_run):
    """Stored input_ids and loss_mask equal the plan's, sample by sample; every mask supervises something."""
    run_store = local_run["store"]
    stored, planned = read_samples(run_store), plan_samples(run_store)
    assert stored.keys() == planned.keys()
    for sample, p in planned.items():
        np.testing.assert_array_equal(stored[sample]["input_ids"].numpy(), p["input_ids"].astype(np.int32))
        np.testing.assert_array_equal(stored[sample]["loss_mask"].numpy(), p["loss_mask"])
        assert p["loss_mask"].sum() >= 2


def test_shard_metadata_records_layer_ids_in_every_convention(local_run):
    """The shard header names the layer ids, their convention, and the HF and vLLM indices."""
    meta = next(iter(read_samples(local_run["store"]).values()))["meta"]
    assert json.loads(meta["layer_ids"]) == [1, 3, 4]
    assert json.loads(meta["hf_hidden_states_indices"]) == [2, 4, 5]
    assert json.loads(meta["vllm_ids"]) == [2, 4, 5]
    assert meta["final"] == "postnorm" and "output of decoder layer" in meta["layer_id_convention"]


def test_running_the_same_job_again_does_no_work(local_run, shared_worker):
    """A rerun finds the plan and every marker: nothing is enqueued and no worker is started."""
    before = sorted(local_run["store"].list("shards/"))
    jobs = shared_worker.jobs
    report = cli_json(shared_worker.producer(["run", *JOB, "--output", str(local_run["tmp"] / "out"), "--json"], local_run["env"]))
    assert shared_worker.jobs == jobs, "no worker is started"
    assert report["run_id"] == local_run["report"]["run_id"]
    assert report["plan_reused"] is True
    assert report["batches_enqueued"] == 0
    assert report["batches_already_done"] == report["batches_total"]
    assert sorted(local_run["store"].list("shards/")) == before


def test_deleting_one_marker_reruns_exactly_that_batch(local_run, shared_worker):
    """Remove one marker: the next run enqueues that batch alone and certifies it again."""
    run_store = local_run["store"]
    victim = sorted(done_batches(run_store))[1]
    run_store.delete(marker_key(victim))
    report = cli_json(shared_worker.producer(["run", *JOB, "--output", str(local_run["tmp"] / "out"), "--json"], local_run["env"]))
    assert report["batches_enqueued"] == 1
    assert report["batches_already_done"] == report["batches_total"] - 1
    assert victim in done_batches(run_store)
    read_samples(run_store)  # every marker still matches its shard


def test_a_different_config_into_the_same_run_id_is_refused(local_run):
    """Same --run-id, other --max-length: refused with the differing field named; nothing written."""
    run_id = local_run["report"]["run_id"]
    args = [a if a != "384" else "256" for a in JOB]
    proc = run_here(["run", *args, "--output", str(local_run["tmp"] / "out"), "--run-id", run_id], local_run["env"])
    assert proc.returncode == 2
    assert "already exists" in proc.stderr and "max_length" in proc.stderr


def test_the_shared_worker_refuses_a_job_whose_worker_settings_differ(tmp_path, tiny_cache, shared_worker):
    """A job with HSX_FAULTS set (a worker-side setting) is not run on the shared worker: the test is
    told to give it a worker of its own, before anything is enqueued."""
    env = clean_env(cache_dir=tiny_cache, state_dir=tmp_path / "state", faults="pause_forward=1")
    jobs = shared_worker.jobs
    with pytest.raises(AssertionError, match="faults"):
        shared_worker.producer(["run", "sharegpt", "--model", "tiny-qwen3.5", "--limit", "2", "--max-length", "128",
                                "--batch-tokens", "128", "--output", str(tmp_path / "out")], env)
    assert shared_worker.jobs == jobs


@pytest.fixture
def tcp_broker(tmp_path):
    broker = TcpBroker(tmp_path / "broker")
    yield broker
    broker.stop()


def test_enqueue_with_a_redis_url_and_a_separate_worker_on_s3_gives_the_same_shards(local_run, tcp_broker, s3_bucket, tmp_path):
    """celery -A workers worker + producer enqueue against a Redis URL and an S3 store == the local run, tensor for tensor."""
    env = clean_env(
        cache_dir=local_run["env"]["HSX_CACHE_DIR"], broker_url=tcp_broker.url, spool_dir=tmp_path / "spool",
        s3_endpoint_url=s3_bucket.settings.s3_endpoint_url, s3_access_key_id=s3_bucket.settings.s3_access_key_id,
        s3_secret_access_key=s3_bucket.settings.s3_secret_access_key, s3_region="us-east-1", store_url=s3_bucket.url,
    )
    worker = WorkerProcess(env, "gpu0", tmp_path / "worker.log")
    try:
        report = cli_json(run_here(["enqueue", *JOB, "--output", s3_bucket.url, "--json"], env))
        assert report["run_id"] == local_run["report"]["run_id"], "same dataset + config must give the same run id"
        assert tcp_broker.password not in json.dumps(report)
        s3_run = open_store(report["address"], s3_bucket.settings)
        total = len(json.loads(s3_run.read("plan/batches.json")))
        wait_until(lambda: len(done_batches(s3_run)) == total, 180, "every S3 batch to get its marker")
    finally:
        worker.stop()
    remote, local = read_samples(s3_run), read_samples(local_run["store"])
    assert remote.keys() == local.keys()
    for sample in local:
        for name in ("input_ids", "loss_mask", "hidden_states", "final_postnorm"):
            assert torch.equal(remote[sample][name], local[sample][name]), f"sample {sample} {name} differs"


def test_the_same_task_delivered_twice_at_once_leaves_one_marker_and_a_valid_shard(local_run, tmp_path):
    """Two concurrent deliveries of one batch: exactly one marker, its shard verifies, the loser's shard is gone."""
    from settings import Settings
    from workers.extract import extract_batch

    run_store = local_run["store"]
    victim = sorted(done_batches(run_store))[0]
    run_store.delete(marker_key(victim))
    for key in run_store.list("shards/"):
        if key.rsplit("/", 1)[-1].startswith(victim + "-"):
            run_store.delete(key)
    settings = Settings(cache_dir=local_run["env"]["HSX_CACHE_DIR"], spool_dir=tmp_path / "spool", device="cpu",
                        store_url=str(local_run["store"].root.parent))
    barrier = threading.Barrier(2)
    results = []

    def deliver():
        barrier.wait()
        results.append(extract_batch(local_run["report"]["address"], victim, settings))

    threads = [threading.Thread(target=deliver) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    statuses = sorted(r["status"] for r in results)
    assert statuses in (["already_done", "done"], ["done", "lost_race"]), statuses
    shards = [k for k in run_store.list("shards/") if k.rsplit("/", 1)[-1].startswith(victim + "-")]
    assert len(shards) == 1, shards
    marker = json.loads(run_store.read(marker_key(victim)))
    assert marker["shard"]["key"] == shards[0]
    read_samples(run_store)
