"""The upload path of a shard: spool -> store with checksums, retries on transient errors, and the
spool's backpressure gate (workers/spool.py, hsx/store/helpers.py, hsx/store/retry.py), against the real S3
server of conftest.py where a server is involved."""

from __future__ import annotations

import errno
import hashlib
import os
import random
import subprocess
import sys
import threading
import time
from collections import namedtuple
from pathlib import Path

import pytest

from hsx.errors import FidelityError, SpoolFull, StoreError
from hsx.store import backoff_s, exists, open_store, retry_transient, verify, write_file
from faultproxy import Rule
from workers.spool import Spool, default_spool_dir, remove_dead_spool_files

pytestmark = pytest.mark.timeout(120)


def _file(tmp_path: Path, nbytes: int) -> tuple[Path, str]:
    path = tmp_path / "shard.bin"
    data = random.Random(nbytes).randbytes(nbytes)
    path.write_bytes(data)
    return path, hashlib.sha256(data).hexdigest()


def _proxied(s3_bucket, rules=()):
    """A FaultProxy in front of the bucket's server (it records every request in ``seen``) and a store through it."""
    from faultproxy import FaultProxy, proxied_settings

    proxy = FaultProxy(s3_bucket.settings.s3_endpoint_url, list(rules)).start()
    return proxy, open_store(s3_bucket.url, proxied_settings(s3_bucket, proxy))


# --- store: a spool file to the store, checked by its sha256 ---------------------------------


def test_a_spool_file_is_stored_with_the_sha256_it_was_written_with_and_nothing_is_read_back(s3_bucket, tmp_path):
    """write_file streams the file through write_stream: it returns the spool's (bytes, sha256), the object holds those
    bytes, and not one GET was sent to check them (the server checked each part's SHA-256 on arrival)."""
    proxy, store = _proxied(s3_bucket)
    try:
        path, sha = _file(tmp_path, 300_000)
        assert write_file(store, "shards/a.safetensors", path, sha) == (300_000, sha)
        assert [r for r in proxy.seen if r[0] == "GET" and "/shards/" in r[1]] == [], proxy.seen
    finally:
        proxy.stop()
    assert open_store(s3_bucket.url, s3_bucket.settings).read("shards/a.safetensors") == path.read_bytes()
    assert path.exists(), "the source file is left in place"


def test_a_spool_file_that_changed_since_it_was_hashed_is_refused_and_not_left_stored(store, tmp_path):
    """write_file with a sha256 that is not the file's (its bytes changed on disk): FidelityError naming both digests,
    and nothing stays under the key, on both backends."""
    path, real = _file(tmp_path, 10_000)
    claimed = hashlib.sha256(b"other").hexdigest()
    with pytest.raises(FidelityError) as info:
        write_file(store, "shards/b.safetensors", path, claimed)
    assert real in str(info.value) and claimed in str(info.value) and "shards/b.safetensors" in str(info.value)
    assert not exists(store, "shards/b.safetensors") and store.list("") == []


def test_an_unreadable_spool_file_is_a_permanent_store_error_naming_it(store, tmp_path):
    """write_file of a path that cannot be read: StoreError(transient=False) naming the path, not a network error to retry."""
    missing = tmp_path / "gone.safetensors"
    with pytest.raises(StoreError) as info:
        write_file(store, "shards/c.safetensors", missing)
    assert not info.value.transient and str(missing) in str(info.value)
    assert store.list("") == []


def test_a_large_shard_goes_up_in_parallel_parts_and_no_upload_stays_open(s3_bucket, tmp_path):
    """Above multipart_bytes (5 MiB here): 11 MiB go up as 3 parts, byte-exact, and no multipart upload is left."""
    proxy, store = _proxied(s3_bucket)
    try:
        store.multipart_bytes = 5 << 20
        nbytes = (11 << 20) + 12345
        path, sha = _file(tmp_path, nbytes)
        assert write_file(store, "shards/big.safetensors", path, sha) == (nbytes, sha)
        parts = [r for r in proxy.seen if r[0] == "PUT" and "partNumber=" in r[1]]
        assert len(parts) == 3, proxy.seen
    finally:
        proxy.stop()
    direct = open_store(s3_bucket.url, s3_bucket.settings)
    assert direct.read("shards/big.safetensors") == path.read_bytes()
    assert direct.remove_incomplete("shards/", older_than_s=0) == []


def test_an_object_changed_after_upload_fails_verify(s3_bucket, tmp_path):
    """Another process overwrites the object after our upload: verify (size, then the streamed sha256) names it."""
    store = open_store(s3_bucket.url, s3_bucket.settings)
    path, sha = _file(tmp_path, 50_000)
    write_file(store, "shards/c.safetensors", path, sha)
    verify(store, "shards/c.safetensors", 50_000, sha)
    store.write("shards/c.safetensors", b"x" * 50_000)
    with pytest.raises(FidelityError, match="shards/c.safetensors"):
        verify(store, "shards/c.safetensors", 50_000, sha)


def test_remove_incomplete_aborts_old_multipart_uploads_and_local_temp_files(s3_bucket, tmp_path):
    """An abandoned multipart upload (a worker killed mid-upload: here its abort never reaches the server) and a local
    temp file are removed once older than the grace, and only then."""
    aborts = Rule(lambda method, path, headers: method == "DELETE" and "uploadId=" in path, ("reset",))
    proxy, store = _proxied(s3_bucket, [aborts])
    try:
        run = store.child("run")
        run.multipart_bytes = 5 << 20

        def dies_after_one_part():
            yield memoryview(b"x" * (6 << 20))
            raise ValueError("the worker died")

        with pytest.raises(ValueError, match="the worker died"):
            run.write_stream("shards/x-1.safetensors", dies_after_one_part())
        assert aborts.hits >= 1, "the abort was sent, and lost"
    finally:
        proxy.stop()
    run = open_store(s3_bucket.url, s3_bucket.settings).child("run")
    assert run.remove_incomplete("shards/", older_than_s=3600) == []
    assert run.remove_incomplete("shards/", older_than_s=0) == ["shards/x-1.safetensors"]
    assert run.remove_incomplete("shards/", older_than_s=0) == [], "the upload is gone"

    local = open_store(str(tmp_path / "store"))
    local.write("shards/keep.safetensors", b"k")
    tmp = tmp_path / "store" / "shards" / ".hsx-tmp-dead-keep.safetensors"
    tmp.write_bytes(b"partial")
    assert local.remove_incomplete("shards/", older_than_s=3600) == []
    assert local.remove_incomplete("shards/", older_than_s=0) == ["shards/.hsx-tmp-dead-keep.safetensors"]
    assert local.list("shards/") == ["shards/keep.safetensors"]


def test_a_stopped_server_is_a_transient_error_and_a_missing_bucket_is_not(s3_bucket, tmp_path):
    """Connection refused -> StoreError(transient=True); no such bucket -> transient=False (a retry cannot fix it)."""
    from hsx.store import S3Store
    from settings import Settings

    closed = Settings(_env_file=None, s3_endpoint_url=f"http://127.0.0.1:{_closed_port()}", s3_region="us-east-1",
                      s3_access_key_id="k", s3_secret_access_key="s")
    store = S3Store.from_url("s3://nobody", closed)
    with pytest.raises(StoreError) as info:
        store.write("x", b"1")
    assert info.value.transient
    missing = S3Store.from_url(f"s3://{s3_bucket.name}-missing", s3_bucket.settings)
    with pytest.raises(StoreError) as info:
        missing.write("x", b"1")
    assert not info.value.transient


def _closed_port() -> int:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


# --- retries ----------------------------------------------------------------------------------


def test_backoff_is_exponential_with_full_jitter_and_capped():
    """Wait after attempt n is uniform in [0, min(cap, base * 2**n)]: never above the ceiling, spread below it."""
    rng = random.Random(0)
    for n in range(12):
        ceiling = min(30.0, 1.0 * 2 ** n)
        waits = [backoff_s(n, rng=rng) for _ in range(200)]
        assert all(0 <= w <= ceiling for w in waits)
        assert max(waits) > 0.8 * ceiling and min(waits) < 0.2 * ceiling


def test_a_transient_store_error_is_retried_until_it_passes_and_others_are_raised_at_once():
    """Two transient failures then success -> the result; a non-transient error -> raised on the first call."""
    calls = []
    slept = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise StoreError("S3 down", transient=True)
        return "ok"

    assert retry_transient(flaky, "store x", total_s=60, sleep=slept.append) == "ok"
    assert len(calls) == 3 and len(slept) == 2

    def refused():
        calls.append(1)
        raise StoreError("credentials refused", transient=False)

    calls.clear()
    with pytest.raises(StoreError, match="credentials"):
        retry_transient(refused, "store x", total_s=60, sleep=slept.append)
    assert len(calls) == 1


def test_retrying_stops_after_the_time_budget_with_the_attempts_named():
    """A store that never comes back: the last error is raised once total_s has passed, saying how long and how often."""
    now = [0.0]

    def sleep(s):
        now[0] += s

    def down():
        raise StoreError("connection refused", transient=True)

    with pytest.raises(StoreError, match=r"still failing after \d+ attempts") as info:
        retry_transient(down, "store shard s", total_s=120, sleep=sleep, clock=lambda: now[0])
    assert info.value.transient and now[0] <= 120


# --- spool: backpressure -----------------------------------------------------------------------

Usage = namedtuple("Usage", "total used free")


class FakeDisk:
    """A filesystem of ``total`` bytes whose usage the test sets."""

    def __init__(self, total: int, used: int = 0):
        self.total, self.used = total, used

    def __call__(self, _path):
        return Usage(self.total, self.used, self.total - self.used)


def test_the_overflow_takes_a_shard_only_while_the_spool_stays_under_its_limit(tmp_path):
    """Disk 85% used, limit 80%: try_admit says no at once (the shard stays in host memory) and names why; at 50% it says yes and reserves the bytes."""
    disk = FakeDisk(1000, used=850)
    spool = Spool(tmp_path, max_fraction=0.8, max_pending_uploads=2, disk_usage=disk)
    t0 = time.monotonic()
    assert spool.try_admit(10) is None and time.monotonic() - t0 < 1, "never waits"
    reason = spool.full_reason(10)
    assert "spool 85% full" in reason and "limit 80%" in reason and "HSX_SPOOL_MAX_FRACTION" in reason
    disk.used = 500
    ticket = spool.try_admit(10)
    assert ticket is not None and spool.usage().reserved_bytes == 10 and spool.usage().uploads_pending == 1
    ticket.written()
    assert spool.usage().reserved_bytes == 0 and spool.usage().uploads_pending == 1
    ticket.release()
    assert spool.usage().uploads_pending == 0


def test_the_next_shard_counts_against_the_limit_so_the_disk_never_fills(tmp_path):
    """70% used + 5% reserved by an admitted shard + a shard of 6% > 80%: refused, though usage alone is below the limit."""
    disk = FakeDisk(1000, used=700)
    spool = Spool(tmp_path, max_fraction=0.8, disk_usage=disk)
    first = spool.try_admit(50)  # 75%
    assert first is not None and spool.try_admit(60) is None and "81%" in spool.full_reason(60)
    first.release()  # the first shard failed before it was written: its reservation goes back
    assert spool.try_admit(60) is not None


def test_the_overflow_holds_at_most_max_pending_uploads_shards(tmp_path):
    """Two shards in the spool waiting for the store (limit 2): a third stays in host memory until one is stored."""
    spool = Spool(tmp_path, max_pending_uploads=2, disk_usage=FakeDisk(10**9))
    tickets = [spool.try_admit(1), spool.try_admit(1)]
    for tk in tickets:
        tk.written()
    assert spool.try_admit(1) is None
    assert spool.full_reason(1).startswith("2 shards waiting in the spool to be stored (limit 2, HSX_MAX_PENDING_UPLOADS)")
    tickets[0].release()
    assert spool.try_admit(1) is not None and spool.usage().uploads_pending == 2


def test_a_shard_bigger_than_the_spool_may_ever_hold_fails_at_once(tmp_path):
    """A shard over max_fraction of the filesystem can never be admitted: SpoolFull with the sizes and the fix, no wait."""
    spool = Spool(tmp_path, max_fraction=0.8, disk_usage=FakeDisk(1_000_000_000))
    t0 = time.monotonic()
    with pytest.raises(SpoolFull, match="HSX_SPOOL_DIR"):
        spool.try_admit(900_000_000, what="batch b000001")
    assert time.monotonic() - t0 < 1


def test_the_host_buffer_pool_makes_the_next_forward_wait_until_a_shard_is_stored(tmp_path):
    """Pool of 2: two batches hold buffers; a third waits (calling on_wait) until one is given back."""
    from workers.spool import HostBufferPool

    pool = HostBufferPool(2)
    held = [pool.acquire(), pool.acquire()]
    waits, got = [], []
    t = threading.Thread(target=lambda: got.append(pool.acquire(on_wait=lambda: waits.append(1), poll_s=0.01)), daemon=True)
    t.start()
    time.sleep(0.2)
    assert t.is_alive() and waits and not got
    pool.release(held[0])
    t.join(5)
    assert not t.is_alive() and got == [held[0]] and pool.free == 0


def test_spool_files_of_dead_worker_processes_are_removed(tmp_path):
    """Files named after a pid that no longer runs go; ours and a live process's stay."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    for pid in (dead, str(os.getpid()), "1"):
        (tmp_path / f"hsx-{pid}-run-b000001-abc.safetensors").write_bytes(b"x")
    removed = remove_dead_spool_files(tmp_path)
    assert [p.name for p in removed] == [f"hsx-{dead}-run-b000001-abc.safetensors"]
    assert len(list(tmp_path.iterdir())) == 2


def test_the_default_spool_is_dev_shm_only_when_it_has_room(tmp_path):
    """/dev/shm with enough free space -> /dev/shm/hsx-spool; too small or absent -> the temp dir."""
    assert default_spool_dir(shm=tmp_path, min_free_bytes=1) == tmp_path / "hsx-spool"
    assert default_spool_dir(shm=tmp_path, min_free_bytes=1 << 62).parent != tmp_path
    assert default_spool_dir(shm=tmp_path / "absent").name == "hsx-spool"


def test_a_full_disk_while_writing_is_an_out_of_space_error_naming_the_spool(tmp_path):
    """ENOSPC from the writer becomes SpoolFull naming the directory and the free space."""
    from workers.spool import is_disk_full, spool_full_error

    exc = OSError(errno.ENOSPC, "No space left on device")
    assert is_disk_full(exc) and not is_disk_full(OSError(errno.EACCES, "denied"))
    err = spool_full_error(tmp_path / "hsx-1-run-b1-x.safetensors", exc, 5_000_000)
    assert isinstance(err, StoreError) and str(tmp_path) in str(err) and "No marker was written" in str(err)
