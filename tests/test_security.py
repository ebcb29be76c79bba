"""Security properties: nothing on the read path unpickles (JSON task messages, safetensors weights
and shards), checkpoint code runs only when trusted, secrets never reach output, logs or the store,
and the embedded broker is reachable only by its owner. (The compose stack's passwords and bound
ports are checked in tests/test_compose.py.)"""

from __future__ import annotations

import io
import json
import os
import re
import stat
import shutil
import tempfile
from pathlib import Path

import pytest

from jobfixtures import ROOT, TcpBroker, WorkerProcess, clean_env, run_cli, wait_until

from hsx.broker import EmbeddedBroker, redis_client
from hsx.errors import BadConfig
from hsx.store import exists
from settings import Settings

pytestmark = pytest.mark.timeout(120)

#: code that would unpickle (or unmarshal) bytes: never on the read path.
UNPICKLING = [r"^\s*(import|from)\s+(pickle|cPickle|dill|cloudpickle|joblib|shelve)\b", r"\bpickle\.loads?\(",
              r"\btorch\.load\(", r"allow_pickle\s*=\s*True", r"\bmarshal\.loads?\(", r"\byaml\.load\(",
              r"\bnp\.load\(.*allow_pickle"]


def test_no_module_of_the_package_can_unpickle():
    """hsx/, producer/ and workers/ never import pickle (or dill, joblib...), call torch.load, or allow pickles in numpy."""
    files = [p for d in ("hsx", "producer", "workers") for p in (ROOT / d).rglob("*.py")]
    assert len(files) > 20, "the scan must see the package"
    hits = []
    for path in files:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if any(re.search(p, code) for p in UNPICKLING):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, "\n".join(hits)


def test_celery_sends_and_accepts_json_only():
    """Tasks and results are JSON; a worker accepts no other content type."""
    from hsx.queue import celery_config

    cfg = celery_config(Settings(_env_file=None), "redis://127.0.0.1:1/0")
    assert cfg["task_serializer"] == cfg["result_serializer"] == "json"
    assert cfg["accept_content"] == cfg["result_accept_content"] == ["json"]


class _Payload:
    """Unpickling this creates a directory: proof that a worker ran code from a message."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


def test_a_worker_refuses_a_pickled_task_message_without_unpickling_it(tmp_path):
    """A task sent with the pickle serializer reaches a real worker: refused as untrusted content; its payload never runs."""
    from hsx.queue import EXTRACT_TASK, make_celery

    state = Path(tempfile.mkdtemp(prefix="hsx-"))
    broker = EmbeddedBroker(state).start()
    worker = WorkerProcess(clean_env(broker_url=broker.url, cache_dir=tmp_path / "cache"), "guard", tmp_path / "guard.log")
    proof = tmp_path / "payload-ran"
    try:
        worker.wait_ready()
        app = make_celery(Settings(_env_file=None), broker.url, name="attacker")
        app.send_task(EXTRACT_TASK, args=[_Payload(str(proof)), "b000000"], queue="gpu", serializer="pickle")
        app.close()
        wait_until(lambda: "untrusted content" in worker.log() or "ContentDisallowed" in worker.log(), 30,
                   "the worker to refuse the pickled message")
        assert not proof.exists(), "the worker unpickled the message"
    finally:
        worker.kill()
        worker._log.close()
        broker.stop()
        shutil.rmtree(state, ignore_errors=True)


def _checkpoint(tmp_path: Path, tiny_cache: Path, weights: bytes) -> Path:
    """The tiny model's config and tokenizer with ``weights`` as its only (pickle) weight file."""
    from hsx.models import resolve_model_path

    src = Path(resolve_model_path("tiny-qwen3.5", tiny_cache))
    ckpt = tmp_path / "pickled-ckpt"
    ckpt.mkdir()
    for f in src.iterdir():
        if not f.name.endswith(".safetensors") and f.is_file():
            shutil.copy(f, ckpt / f.name)
    (ckpt / "pytorch_model.bin").write_bytes(weights)
    return ckpt


def test_a_checkpoint_of_pickle_weights_is_refused_before_it_is_opened(tmp_path, tiny_cache):
    """Only pytorch_model.bin: the worker refuses with the fix (HSX_ALLOW_PICKLE_CHECKPOINTS), and the file is never unpickled."""
    import pickle

    from workers.target import load_target

    proof = tmp_path / "payload-ran"
    ckpt = _checkpoint(tmp_path, tiny_cache, pickle.dumps(_Payload(str(proof))))
    settings = Settings(_env_file=None, cache_dir=tiny_cache, device="cpu")
    with pytest.raises(BadConfig, match="HSX_ALLOW_PICKLE_CHECKPOINTS"):
        load_target(str(ckpt), settings)
    assert not proof.exists()


def test_pickle_weights_load_only_when_explicitly_allowed(tmp_path, tiny_cache):
    """HSX_ALLOW_PICKLE_CHECKPOINTS=true: a .bin checkpoint of the tiny model loads and equals the safetensors one."""
    import torch
    from safetensors.torch import load_file

    from hsx.models import resolve_model_path
    from workers.target import load_target

    src = Path(resolve_model_path("tiny-qwen3.5", tiny_cache))
    state = {}
    for f in sorted(src.glob("*.safetensors")):
        state.update(load_file(f))
    buf = io.BytesIO()
    torch.save(state, buf)
    ckpt = _checkpoint(tmp_path, tiny_cache, buf.getvalue())
    target = load_target(str(ckpt), Settings(_env_file=None, cache_dir=tiny_cache, device="cpu", allow_pickle_checkpoints=True))
    name, value = next(iter(state.items()))
    assert torch.equal(target.model.state_dict()[name].float(), value.float())


def test_checkpoint_code_runs_only_when_trusted(tmp_path, tiny_cache):
    """A config that needs its own Python code (auto_map): refused with trust_remote_code off, and that code never runs."""
    from hsx.models import model_info

    ckpt = tmp_path / "custom-code"
    ckpt.mkdir()
    proof = tmp_path / "code-ran"
    (ckpt / "config.json").write_text(json.dumps({"model_type": "hsx_custom", "num_hidden_layers": 2, "hidden_size": 8,
                                                  "auto_map": {"AutoConfig": "configuration_custom.CustomConfig"}}))
    (ckpt / "configuration_custom.py").write_text(
        f"import pathlib\npathlib.Path({str(proof)!r}).touch()\n"
        "from transformers import PretrainedConfig\nclass CustomConfig(PretrainedConfig):\n    model_type = 'hsx_custom'\n")
    assert Settings(_env_file=None).trust_remote_code is False
    with pytest.raises(BadConfig, match="trust_remote_code"):
        model_info(str(ckpt), tiny_cache)
    assert not proof.exists()


def test_the_embedded_broker_listens_only_on_an_owner_only_unix_socket():
    """No TCP port; the socket and its state directory are accessible to their owner alone."""
    import redis

    state = Path(tempfile.mkdtemp(prefix="hsx-")) / "state"
    broker = EmbeddedBroker(state).start()
    try:
        mode = os.stat(broker.socket_path).st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) & 0o077 == 0, oct(mode)
        assert stat.S_IMODE(state.stat().st_mode) & 0o077 == 0, oct(state.stat().st_mode)
        client = redis.Redis(unix_socket_path=str(broker.socket_path))
        assert client.config_get("port")["port"] == "0"
        assert broker.url.startswith("redis+socket://")
    finally:
        broker.stop()
        shutil.rmtree(state.parent, ignore_errors=True)


@pytest.mark.timeout(180)
def test_secrets_never_appear_in_output_logs_or_the_store(tmp_path, tiny_cache, s3_bucket):
    """Broker password and S3 secret: absent from every command's output, the worker's log and every object the run stores."""
    broker = TcpBroker(tmp_path / "broker", password="broker-pw-never-shown")
    st = s3_bucket.settings
    env = clean_env(broker_url=broker.url, cache_dir=tiny_cache, spool_dir=tmp_path / "spool", s3_endpoint_url=st.s3_endpoint_url,
                    s3_region=st.s3_region, s3_access_key_id=st.s3_access_key_id, s3_secret_access_key=st.s3_secret_access_key,
                    model="tiny-qwen3.5", heartbeat_s=1, store_url=s3_bucket.url)
    secrets = [broker.password, st.s3_secret_access_key]
    worker = WorkerProcess(env, "discreet", tmp_path / "worker.log")
    outputs = []
    try:
        proc = run_cli("producer", ["enqueue", "sharegpt", "--model", "tiny-qwen3.5", "--limit", "4", "--max-length", "128",
                                    "--batch-tokens", "512", "--output", s3_bucket.url, "--json"], env, timeout_s=120)
        outputs.append(proc.stdout + proc.stderr)
        assert proc.returncode == 0, proc.stderr[-2000:]
        address = json.loads(proc.stdout)["address"]
        from hsx.records import done_batches
        from hsx.store import open_store

        run_store = open_store(address, st)
        total = len(json.loads(run_store.read("plan/batches.json")))
        wait_until(lambda: len(done_batches(run_store)) == total, 90, "every batch done")
        for args in (["reconcile", address], ["status", address, "--json"], ["verify", address],
                     ["status", address.replace("s3://", "s3://nobucket-") + "x"]):
            proc = run_cli("producer", args, env, timeout_s=60)
            outputs.append(proc.stdout + proc.stderr)
    finally:
        worker.stop()
        broker.stop()
    outputs.append(worker.log())
    assert "ready." in worker.log()
    keys = run_store.list("")
    assert "run.json" in keys and any(k.startswith("workers/") for k in keys) and any(k.startswith("markers/") for k in keys)
    blobs = {key: run_store.read(key) for key in keys}
    for secret in secrets:
        for text in outputs:
            assert secret not in text, f"secret printed:\n{text[-1500:]}"
        for key, data in blobs.items():
            assert secret.encode() not in data, f"secret stored in {key}"


# --- what a worker serves, and read-only commands ------------------------------------------------


def test_the_allow_list_compares_resolved_roots_by_whole_segments(tmp_path):
    """/data/out serves /data/out/run, not /data/out2 or a link inside it that points outside; S3 by bucket and prefix
    segments; every refusal names the value, the rule and the fix."""
    from hsx.access import Refused, check_run_allowed

    root, outside = tmp_path / "out", tmp_path / "elsewhere"
    root.mkdir()
    outside.mkdir()
    (root / "link").symlink_to(outside)
    settings = Settings(_env_file=None, store_url=str(root), allowed_stores="s3://bkt/runs, file:///srv/extra")
    for ok in (root / "run1", f"{root}/a/../run2", "s3://bkt/runs/r1", "s3://bkt/runs", "/srv/extra/r"):
        check_run_allowed(str(ok), settings)
    for bad in (f"{root}2/run", str(outside / "r"), str(root / "link" / "r"), f"{root}/../elsewhere/r", "s3://bkt/runs2/r",
                "s3://other/runs/r", "s3://bkt/runs/../x", "s3://bkt", "relative/run", "http://host/x"):
        with pytest.raises(Refused) as info:
            check_run_allowed(bad, settings)
        msg = str(info.value)
        assert "refused" in msg and str(root) in msg and "s3://bkt/runs" in msg, msg
        if "://" not in bad or bad.startswith("s3://bkt") or bad.startswith("s3://other"):
            assert "HSX_ALLOWED_STORES" in msg, msg


@pytest.mark.parametrize("command", [["status", "--no-broker"], ["verify"], ["reconcile", "--dry-run"], ["vocab-counts"],
                                     ["export", "--format", "speculators", "OUT"]])
@pytest.mark.parametrize("address", ["s3:/bad", "missing/run"])
def test_read_only_commands_create_nothing_for_an_address_that_is_not_a_run(tmp_path, monkeypatch, command, address):
    """status, verify, reconcile, vocab-counts and export on a typo or a missing directory: exit 2, and the working
    directory stays empty (they used to make ./s3:/bad)."""
    from producer.cli import main

    monkeypatch.chdir(tmp_path)
    args = [command[0], address, *[a for a in command[1:] if a != "OUT"]]
    if "OUT" in command:
        args.insert(2, str(tmp_path.parent / f"{tmp_path.name}-export"))
    assert main(args) == 2
    assert list(tmp_path.iterdir()) == []


def test_a_worker_refuses_runs_outside_its_roots_and_runs_for_another_model_without_touching_them(tmp_path, tiny_cache):
    """A real worker (HSX_STORE_URL=<tmp>/allowed, HSX_MODEL=tiny-qwen3.5): a bad batch name is dropped; a task naming
    a path outside or a sibling prefix is parked on the broker with the roots and the fix, and nothing is created
    there; a run in its root planned for another checkpoint is parked the same way, both models named, no marker,
    no status record; the worker goes on serving throughout."""
    from hsx.fleet import read_parked
    from hsx.queue import EXTRACT_TASK, make_celery

    allowed = tmp_path / "allowed"
    allowed.mkdir()
    state = Path(tempfile.mkdtemp(prefix="hsx-"))
    broker = EmbeddedBroker(state).start()
    env = clean_env(broker_url=broker.url, cache_dir=tiny_cache, store_url=allowed, model="tiny-qwen3.5", device="cpu",
                    spool_dir=tmp_path / "spool")
    worker = WorkerProcess(env, "guarded", tmp_path / "guarded.log")
    try:
        # a run planned for another checkpoint: the planner's own run.json, its model identity changed
        from producer.planner import PlanOptions, plan_run

        settings = Settings(_env_file=None, cache_dir=tiny_cache)
        planned = plan_run(PlanOptions(dataset="sharegpt", model="tiny-qwen3.5", output=str(allowed), limit=2,
                                       max_length=64, batch_tokens=256), settings)
        config = json.loads(planned.run_store.read("run.json"))
        config["model"]["revision"] = "sha256:" + "0" * 64
        config["model"]["name"] = config["model_name"] = "someone/else"
        planned.run_store.write("run.json", json.dumps(config).encode())
        batch = planned.batches[0].batch
        worker.wait_ready()
        app = make_celery(Settings(_env_file=None), broker.url, name="attacker")
        client = redis_client(broker.url)
        victims = [tmp_path / "outside" / "run", Path(f"{allowed}2") / "run"]
        try:
            # A message at fault (a bad batch name): dropped, and the worker goes on.
            app.send_task(EXTRACT_TASK, args=[planned.run_url, "../../escape"], queue="gpu")
            wait_until(lambda: "task batch '../../escape' refused" in worker.log(), 60, "the bad batch name refused")
            # Runs outside its roots: not this worker's to serve. Each message is parked with the reason and the fix,
            # for a worker that serves it; this worker goes on with the next message.
            for victim in victims:
                app.send_task(EXTRACT_TASK, args=[str(victim), "b000000"], queue="gpu")
            wait_until(lambda: len(read_parked(client, "gpu")) == 2, 60, "both outside tasks parked")
            for entry, victim in zip(read_parked(client, "gpu"), sorted(victims, key=str)):
                assert entry.cause == "not_served" and "HSX_ALLOWED_STORES" in entry.reason, entry
            assert client.llen("gpu") == 0
            assert not (tmp_path / "outside").exists() and not Path(f"{allowed}2").exists()
            # A run in its root planned for another checkpoint than HSX_MODEL: parked the same way, both models named.
            app.send_task(EXTRACT_TASK, args=[planned.run_url, batch], queue="gpu")
            wait_until(lambda: read_parked(client, "gpu", planned.run_url), 60, "the other model's task parked")
            (entry,) = read_parked(client, "gpu", planned.run_url)
            assert entry.cause == "model", entry
            assert "was planned for model 'someone/else'" in entry.reason and "HSX_MODEL='tiny-qwen3.5'" in entry.reason
            assert not exists(planned.run_store, f"markers/{batch}.json")
            assert not planned.run_store.list("workers/"), "a refused message must write no status record"
            assert "refuses tasks" not in worker.log()
        finally:
            app.close()
    finally:
        worker.kill()
        worker._log.close()
        broker.stop()
        shutil.rmtree(state, ignore_errors=True)
