"""A cluster of one test for the recovery and lease tests: an embedded broker (AOF on), real
``celery -A workers worker`` processes started with faults and short leases, and the checks that end
each scenario (``verify`` passes, every planned sample stored exactly once). The fixtures that build
them (``template``, ``cluster``, ``s3_cluster``) are in conftest.py."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from jobfixtures import WorkerProcess, clean_env, plan_samples, read_samples, wait_until

from hsx.broker import EmbeddedBroker
from hsx.records import BatchSummary, done_batches
from hsx.runconfig import load_run
from hsx.store import open_store
from settings import Settings

#: how long a fault holds a batch (seconds): far longer than the test needs to act.
HOLD_S = 60


def copy_plan(template, root_url: str, settings: Settings):
    """The template's run.json and plan, copied under ``root_url``; returns the new run's store."""
    dest = open_store(root_url, settings).child(template.config.run_id)
    for key in template.run_store.list(""):
        if key == "run.json" or key.startswith("plan/"):
            dest.write(key, template.run_store.read(key))
    return dest


class Cluster:
    """An embedded broker (short socket path, AOF) and the environment for workers of one test."""

    def __init__(self, tmp: Path, cache: Path, s3=None):
        self.tmp = tmp
        self.state = Path(tempfile.mkdtemp(prefix="hsx-"))
        self.broker = EmbeddedBroker(self.state).start()
        self.settings = Settings(_env_file=None, broker_url=self.broker.url, cache_dir=cache,
                                 **(_s3_fields(s3) if s3 else {}))
        self.s3 = s3
        self.workers: list[WorkerProcess] = []
        self.cache = cache

    def env(self, **extra) -> dict[str, str]:
        s3 = self.s3
        return clean_env(broker_url=self.broker.url, cache_dir=self.cache, spool_dir=self.tmp / "spool", model="tiny-qwen3.5",
                         device="cpu", heartbeat_s=1, store_url=s3.url if s3 else self.tmp / "out",
                         **(_s3_fields(s3) if s3 else {}), **extra)

    def worker(self, name: str, concurrency: int = 1, wait: bool = True, os_env: dict[str, str] | None = None,
               **extra) -> WorkerProcess:
        """Start a worker process (its model loaded at start); ``wait``: until it is ready and its presence
        is on the broker (what ``enqueue`` reads to see who serves which store: written by its heartbeat
        thread, which can come after Celery's ``ready.`` on a loaded machine). ``os_env``: variables set
        as given (not ``HSX_``-prefixed), after the cluster's own."""
        from hsx.broker import redis_client
        from hsx.fleet import read_presences

        env = self.env(**extra)
        env.update(os_env or {})
        w = WorkerProcess(env, name, self.tmp / f"{name}.log", concurrency=concurrency)
        self.workers.append(w)
        if wait:
            w.wait_ready()
            client = redis_client(self.broker.url)
            try:
                wait_until(lambda: any((p.node or "").startswith(f"{name}@") and p.pid == w.proc.pid
                                       for p in read_presences(client, self.settings.queue)), 30, f"{name}'s presence")
            finally:
                client.close()
        return w

    def enqueue(self, run_store, batches: list[BatchSummary]) -> None:
        """Send one task per batch, as ``enqueue`` does."""
        from producer.reconcile import _enqueue

        _enqueue(run_store, run_store.url, load_run(run_store), batches, self.settings, self.broker.url)

    def enqueue_all(self, run_store) -> None:
        self.enqueue(run_store, BatchSummary.read_list(run_store))

    def reconcile(self, run_store, **kw) -> dict:
        from producer.reconcile import reconcile_run

        return reconcile_run(run_store, self.settings, self.broker.url, **kw)

    def close(self) -> None:
        for w in self.workers:
            w.kill()
            w._log.close()
        self.broker.stop()
        shutil.rmtree(self.state, ignore_errors=True)


def _s3_fields(s3) -> dict:
    st = s3.settings
    return {"s3_endpoint_url": st.s3_endpoint_url, "s3_region": st.s3_region, "s3_access_key_id": st.s3_access_key_id,
            "s3_secret_access_key": st.s3_secret_access_key}


def wait_log(worker: WorkerProcess, needle: str, timeout_s: float = 60) -> str:
    """Wait for ``needle`` in the worker's log; returns the line."""
    def find():
        for line in worker.log().splitlines():
            if needle in line:
                return line
        assert worker.proc.poll() is None, f"worker exited:\n{worker.log()[-3000:]}"
        return None

    return wait_until(find, timeout_s, f"{needle!r} in {worker.log_path.name}")


def held_batch(line: str) -> str:
    return line.rsplit("of batch ", 1)[1].strip()


def wait_done(run_store, timeout_s: float = 90) -> None:
    total = len(json.loads(run_store.read("plan/batches.json")))
    wait_until(lambda: len(done_batches(run_store)) == total, timeout_s, "every batch to get its marker", poll_s=0.3)


def assert_complete(run_store) -> None:
    """verify passes, and every planned sample is stored exactly once."""
    from producer.verify import verify_run

    report = verify_run(run_store)
    assert report["ok"], json.dumps(report["problems"], indent=1)[:3000]
    stored = read_samples(run_store)  # fails on a sample stored twice
    assert set(stored) == set(plan_samples(run_store))


def shards_of(run_store, batch: str) -> list[str]:
    return [k for k in run_store.list("shards/") if k.rsplit("/", 1)[-1].startswith(batch + "-")]


#: A ``sitecustomize`` that shifts this process's wall clock (``time.time``, ``time.time_ns``) by
#: ``TEST_CLOCK_SKEW_S`` seconds; ``time.monotonic`` is untouched, as on a node whose clock is off.
SKEW_SITECUSTOMIZE = """
import os, time
_skew = float(os.environ.get("TEST_CLOCK_SKEW_S") or 0)
if _skew:
    _time, _time_ns = time.time, time.time_ns
    time.time = lambda: _time() + _skew
    time.time_ns = lambda: _time_ns() + int(_skew * 1e9)
"""


def skewed_env(tmp: Path, env_pythonpath: str, skew_s: float) -> dict[str, str]:
    """``os_env`` for :meth:`Cluster.worker`: a process whose wall clock is ``skew_s`` seconds off
    (a ``sitecustomize.py`` under ``tmp/skew`` put first on ``PYTHONPATH``, see :data:`SKEW_SITECUSTOMIZE`)."""
    site = tmp / "skew"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SKEW_SITECUSTOMIZE)
    return {"PYTHONPATH": f"{site}:{env_pythonpath}", "TEST_CLOCK_SKEW_S": str(skew_s)}
