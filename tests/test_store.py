"""The store contract: local directory and S3 pass the same tests (fixture ``store``)."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import closed_port
from hsx.errors import BadConfig, FidelityError, StoreError
from hsx.store import LocalStore, MissingKey, S3Store, Store, download, exists, mask_url, open_store, verify, write_file
from settings import Settings

RACERS = 16


def test_store_fixture_gives_a_store_protocol_instance(store):
    """Both backends satisfy the Store Protocol and start empty."""
    assert isinstance(store, Store)
    assert store.list("") == []


def test_write_then_read_round_trips_bytes_and_overwrites(store):
    """read returns what write stored; a second write replaces it."""
    store.write("a/b/c.bin", b"\x00\x01hello")
    assert store.read("a/b/c.bin") == b"\x00\x01hello"
    store.write("a/b/c.bin", b"new")
    assert store.read("a/b/c.bin") == b"new"
    store.write("empty", b"")
    assert store.read("empty") == b"" and store.size("empty") == 0


def test_write_file_stores_a_local_file(store, tmp_path):
    """write_file (over write_stream) stores a file's exact bytes, returns their size and sha256, and leaves the source in place."""
    src = tmp_path / "src.bin"
    data = bytes(range(256)) * 4096 * 9  # 9 MiB: more than one FILE_PIECE_BYTES piece
    src.write_bytes(data)
    assert write_file(store, "shards/00000.safetensors", src) == (len(data), hashlib.sha256(data).hexdigest())
    assert store.read("shards/00000.safetensors") == data
    assert store.size("shards/00000.safetensors") == len(data)
    assert src.exists()


def test_write_file_uploads_big_files_in_parts_on_s3(s3_bucket, tmp_path):
    """A file over the multipart threshold (5 MiB parts here) is stored byte-exact and verifies."""
    store = open_store(s3_bucket.url, s3_bucket.settings)
    store.multipart_bytes = 5 << 20
    data = hashlib.sha256(b"seed").digest() * (11 * (1 << 20) // 32 + 7)  # ~11 MiB, 3 parts
    src = tmp_path / "big.bin"
    src.write_bytes(data)
    write_file(store, "big.bin", src, hashlib.sha256(data).hexdigest())
    assert store.read("big.bin") == data
    verify(store, "big.bin", len(data), hashlib.sha256(data).hexdigest())


def _pieces(data: bytes, sizes: list[int]) -> list[memoryview]:
    view, out, at = memoryview(data), [], 0
    for n in sizes:
        out.append(view[at:at + n])
        at += n
    return out + [view[at:]]


def test_write_stream_stores_the_pieces_once_and_returns_what_it_hashed(store):
    """write_stream stores the concatenation, returns its size and sha256, and that object verifies."""
    data = hashlib.sha256(b"stream").digest() * 40_000  # 1.28 MB, odd piece sizes
    nbytes, sha = store.write_stream("shards/00001-a.safetensors", _pieces(data, [7, 100_000, 3]))
    assert (nbytes, sha) == (len(data), hashlib.sha256(data).hexdigest())
    assert store.read("shards/00001-a.safetensors") == data
    verify(store, "shards/00001-a.safetensors", nbytes, sha)
    assert store.list("shards/") == ["shards/00001-a.safetensors"], "no temp object is listed"


def test_write_stream_in_parts_on_s3_is_byte_exact_when_parts_do_not_line_up_with_pieces(s3_bucket):
    """Over the part size (5 MiB here), parts that do not line up with the pieces: the object and
    the returned sha256 are those of the concatenation."""
    store = open_store(s3_bucket.url, s3_bucket.settings)
    store.multipart_bytes = 5 << 20
    data = hashlib.sha256(b"parts").digest() * (12 * (1 << 20) // 32 + 5)  # ~12 MiB: 3 parts
    nbytes, sha = store.write_stream("big.bin", _pieces(data, [8, 3 << 20, 4 << 20]))
    assert (nbytes, sha) == (len(data), hashlib.sha256(data).hexdigest())
    assert store.read("big.bin") == data
    assert store.sha256("big.bin") == (nbytes, sha)


def test_write_stream_that_fails_midway_leaves_no_object_and_no_parts(store):
    """A source that raises after some bytes: nothing is visible under the key, and no upload stays open."""
    if isinstance(store, S3Store):
        store.multipart_bytes = 5 << 20

    def pieces():
        yield memoryview(b"x" * (6 << 20))
        raise ValueError("the producer of the bytes failed")

    with pytest.raises(ValueError, match="producer of the bytes"):
        store.write_stream("shards/00002-a.safetensors", pieces())
    assert not exists(store, "shards/00002-a.safetensors") and store.list("") == []
    assert store.remove_incomplete("", older_than_s=-60) == [], "the failed write cleaned up after itself"


def test_read_of_an_absent_key_raises_missing_key_a_key_error(store):
    """Reading an absent key raises MissingKey, which is a KeyError."""
    with pytest.raises(MissingKey):
        store.read("nope")
    with pytest.raises(KeyError):
        store.read("no/such/dir/key")


def test_list_is_recursive_sorted_and_by_string_prefix(store):
    """list returns every key under a prefix, recursively, sorted, relative to the store root."""
    keys = ["run.json", "markers/00002.json", "markers/00001.json", "shards/00001.st", "markers/sub/x", "markersX"]
    for k in keys:
        store.write(k, k.encode())
    assert store.list("") == sorted(keys)
    assert store.list("markers/") == ["markers/00001.json", "markers/00002.json", "markers/sub/x"]
    assert store.list("markers") == ["markers/00001.json", "markers/00002.json", "markers/sub/x", "markersX"]
    assert store.list("markers/0000") == ["markers/00001.json", "markers/00002.json"]
    assert store.list("nothing/") == []


def test_list_paginates_past_1000_keys_on_s3(s3_bucket):
    """An S3 listing of 1,100 keys returns all of them (more than one 1000-key page)."""
    store = open_store(s3_bucket.url, s3_bucket.settings)
    keys = [f"many/{i:05d}" for i in range(1100)]
    with ThreadPoolExecutor(32) as pool:
        list(pool.map(lambda k: store.write(k, b"."), keys))
    store.write("other/x", b".")
    got = store.list("many/")
    assert len(got) == 1100 and got == keys


def test_create_twice_returns_true_then_false_and_keeps_the_first_bytes(store):
    """create is create-if-absent: first call True, second False, the object keeps the first bytes."""
    assert store.create("markers/00001.json", b"first") is True
    assert store.create("markers/00001.json", b"second") is False
    assert store.read("markers/00001.json") == b"first"


def test_create_on_moto_returns_false_on_412(moto_bucket):
    """moto also answers If-None-Match: * with 412, which create reports as False."""
    store = open_store(moto_bucket.url, moto_bucket.settings)
    assert store.create("m", b"one") is True
    assert store.create("m", b"two") is False
    assert store.read("m") == b"one"


def _race_s3(store) -> list[bool]:
    barrier = threading.Barrier(RACERS)

    def go(i: int) -> bool:
        barrier.wait()
        return store.create("race/marker.json", f"writer-{i}".encode())

    with ThreadPoolExecutor(RACERS) as pool:
        return list(pool.map(go, range(RACERS)))


@pytest.mark.parametrize("server", ["s3_bucket", "moto_bucket"])
def test_sixteen_racing_s3_creators_give_exactly_one_winner(server, request):
    """16 threads race create on one key: exactly one True, and the object holds the winner's bytes."""
    bucket = request.getfixturevalue(server)
    store = open_store(bucket.url, bucket.settings)
    results = _race_s3(store)
    assert results.count(True) == 1, results
    assert store.read("race/marker.json") == f"writer-{results.index(True)}".encode()


def _local_racer(root: str, i: int, barrier, out) -> None:
    store = LocalStore(Path(root))
    barrier.wait()
    out.put((i, store.create("race/marker.json", f"writer-{i}".encode())))


def test_sixteen_racing_local_processes_give_exactly_one_winner(tmp_path):
    """16 processes race create on one local key: exactly one True, the file holds the winner's bytes."""
    # fork: the racers need only LocalStore, already imported (spawn re-imports pytest's world, ~5 s)
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    barrier, out = ctx.Barrier(RACERS), ctx.Queue()
    procs = [ctx.Process(target=_local_racer, args=(str(tmp_path), i, barrier, out)) for i in range(RACERS)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=30) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    assert len(results) == RACERS
    winners = [i for i, won in results.items() if won]
    assert len(winners) == 1, results
    assert LocalStore(tmp_path).read("race/marker.json") == f"writer-{winners[0]}".encode()
    assert LocalStore(tmp_path).list("") == ["race/marker.json"], "temp files must not be left behind"


def test_s3_create_after_a_409_conflict_on_an_existing_object_returns_false(s3_bucket, monkeypatch):
    """One 409 ConditionalRequestConflict, then the server's 412 for the object that is there: create retries the
    409 and reports the settled outcome, False, and the object keeps its first bytes."""
    import hsx.store.s3 as s3_store
    from faultproxy import FaultProxy, proxied_settings

    monkeypatch.setattr(s3_store, "CONFLICT_BACKOFF_S", 0.01)
    open_store(s3_bucket.url, s3_bucket.settings).write("k", b"first")
    proxy = FaultProxy(s3_bucket.settings.s3_endpoint_url, [_conflicts(1)]).start()
    try:
        store = open_store(s3_bucket.url, proxied_settings(s3_bucket, proxy))
        assert store.create("k", b"x") is False
        assert proxy.rules[0].hits == 1
    finally:
        proxy.stop()
    assert open_store(s3_bucket.url, s3_bucket.settings).read("k") == b"first"


def test_delete_of_an_absent_key_is_fine_and_delete_removes(store):
    """delete removes a key and is silent when the key is absent."""
    store.delete("never/was")
    store.write("k", b"v")
    store.delete("k")
    assert not exists(store, "k") and store.list("") == []


def test_size_is_none_for_absent_and_bytes_for_present(store):
    """size reports bytes for an object and None when it is absent; exists (size is not None) agrees."""
    assert store.size("absent") is None and exists(store, "absent") is False
    store.write("dir/present", b"12345")
    assert store.size("dir/present") == 5 and exists(store, "dir/present") is True
    assert store.size("dir") is None and exists(store, "dir") is False, "a directory is not a key"


def test_verify_passes_and_catches_wrong_size_wrong_hash_and_absence(store):
    """verify accepts the right size+sha256 and raises FidelityError otherwise."""
    data = b"shard bytes" * 1000
    digest = hashlib.sha256(data).hexdigest()
    store.write("s", data)
    verify(store, "s", len(data), digest)
    with pytest.raises(FidelityError, match="bytes, expected"):
        verify(store, "s", len(data) + 1, digest)
    with pytest.raises(FidelityError, match="sha256"):
        verify(store, "s", len(data), hashlib.sha256(b"other").hexdigest())
    with pytest.raises(FidelityError, match="absent"):
        verify(store, "missing", len(data), digest)


def test_verify_after_write_file_passes_and_catches_a_shard_replaced_since(store, tmp_path):
    """A file stored with write_file (and its sha256) verifies; replaced by other bytes of the same size, it does not."""
    data = bytes(range(256)) * 400
    digest = hashlib.sha256(data).hexdigest()
    for key in ("shards/a", "shards/b"):
        src = tmp_path / key.replace("/", "-")
        src.write_bytes(data)
        write_file(store, key, src, digest)
        src.unlink()  # as the worker does with its spool file
    verify(store, "shards/a", len(data), digest)
    store.write("shards/b", data[::-1])
    with pytest.raises(FidelityError, match="sha256"):
        verify(store, "shards/b", len(data), digest)


def test_a_local_shard_altered_in_place_after_its_write_fails_verify(tmp_path):
    """verify always hashes the stored bytes: a file altered in place after write_stream (same inode, same size) is caught."""
    store = LocalStore(tmp_path / "store")
    data = bytes(range(256)) * 8192
    nbytes, sha = store.write_stream("s.bin", [memoryview(data)])
    verify(store, "s.bin", nbytes, sha)
    with open(store.local_path("s.bin"), "r+b") as f:
        f.seek(10)
        f.write(b"\xff")
    with pytest.raises(FidelityError, match="sha256"):
        verify(store, "s.bin", nbytes, sha)


def test_child_is_scoped_to_its_prefix(store):
    """child(p) reads and lists only under p, and its keys are relative to p."""
    run = store.child("run-1")
    run.write("markers/0.json", b"m")
    store.write("run-2/markers/0.json", b"other")
    assert store.read("run-1/markers/0.json") == b"m"
    assert run.list("") == ["markers/0.json"]
    assert run.child("markers").list("") == ["0.json"]
    assert run.url.endswith("run-1")
    assert run.create("markers/0.json", b"x") is False
    with pytest.raises(MissingKey):
        run.read("run-2/markers/0.json")


@pytest.mark.parametrize("key", ["../x", "a/../../x", "/etc/passwd", "a//b", "a/./b", "", "a/", "a\\..\\b"])
def test_keys_that_could_escape_the_root_are_refused(store, key):
    """Keys with '..', '.', empty segments, a leading '/' or backslashes raise BadConfig everywhere."""
    for op in (lambda: store.write(key, b"x"), lambda: store.read(key), lambda: store.create(key, b"x"),
               lambda: store.size(key), lambda: store.delete(key), lambda: store.child(key)):
        with pytest.raises(BadConfig):
            op()
    with pytest.raises(BadConfig):
        store.list("../")


def test_local_path_is_a_readable_file_locally_and_none_on_s3(store):
    """local_path gives an mmap-able path on the local store and None on S3."""
    store.write("x/y", b"abc")
    path = store.local_path("x/y")
    if isinstance(store, LocalStore):
        assert path is not None and path.read_bytes() == b"abc"
    else:
        assert path is None


def test_open_store_accepts_relative_paths_and_file_urls(tmp_path, monkeypatch):
    """A relative path becomes absolute; file:///abs opens the same directory."""
    monkeypatch.chdir(tmp_path)
    s = open_store("out")
    assert isinstance(s, LocalStore) and s.root == tmp_path / "out" and s.root.is_dir()
    s.write("k", b"v")
    assert open_store((tmp_path / "out").as_uri()).read("k") == b"v"


def test_open_store_refuses_an_unknown_scheme_naming_the_accepted_forms():
    """An unknown scheme raises BadConfig naming the URL and the accepted forms."""
    with pytest.raises(BadConfig, match=r"gs://bucket.*s3://BUCKET"):
        open_store("gs://bucket/x")


def test_open_store_with_a_prefix_url_scopes_the_store(s3_bucket):
    """s3://bucket/prefix keys live under prefix/ in the bucket."""
    store = open_store(f"{s3_bucket.url}/runs/a", s3_bucket.settings)
    store.write("k", b"v")
    assert open_store(s3_bucket.url, s3_bucket.settings).list("") == ["runs/a/k"]
    assert store.list("") == ["k"]


def test_open_store_on_an_unreachable_endpoint_fails_fast_naming_it():
    """A closed port fails in under 10 s with StoreError naming the endpoint and the fix."""
    endpoint = f"http://127.0.0.1:{closed_port()}"
    settings = Settings(_env_file=None, s3_endpoint_url=endpoint, s3_region="us-east-1",
                        s3_access_key_id="a", s3_secret_access_key="b")
    t0 = time.monotonic()
    with pytest.raises(StoreError) as info:
        open_store("s3://somebucket", settings)
    elapsed = time.monotonic() - t0
    assert elapsed < 10, f"took {elapsed:.1f} s"
    assert endpoint in str(info.value) and "HSX_S3_ENDPOINT_URL" in str(info.value)


def test_open_store_on_a_missing_bucket_names_the_bucket(s3_server):
    """A bucket that does not exist raises StoreError naming it and how to create it."""
    settings = Settings(_env_file=None, s3_endpoint_url=s3_server.endpoint_url, s3_region="us-east-1",
                        s3_access_key_id=s3_server.access_key, s3_secret_access_key=s3_server.secret_key)
    with pytest.raises(StoreError, match=r"'no-such-bucket-hsx' does not exist.*create"):
        open_store("s3://no-such-bucket-hsx", settings)


def test_mask_url_hides_passwords():
    """mask_url hides user:password@ passwords, bare tokens and secret query values."""
    assert "secret" not in mask_url("redis://:secret@h:6379/0")
    assert mask_url("redis://:secret@h:6379/0") == "redis://:***@h:6379/0"
    assert mask_url("redis://user:pw@host/1") == "redis://user:***@host/1"
    assert "tok" not in mask_url("https://tok@host/x")
    assert "hunter2" not in mask_url("redis+socket:///tmp/s.sock?password=hunter2&virtual_host=0")
    assert mask_url("s3://bucket/prefix") == "s3://bucket/prefix"
    assert mask_url("/plain/path") == "/plain/path"


def test_s3_display_url_never_contains_the_secret_key(s3_bucket):
    """The store's url and repr show bucket and endpoint but never the secret key."""
    store = open_store(s3_bucket.url, s3_bucket.settings)
    secret = s3_bucket.settings.s3_secret_access_key
    assert store.url == s3_bucket.url
    assert secret not in store.url and secret not in repr(store) and secret not in repr(store.child("r"))


def test_s3_url_with_inline_credentials_is_refused_without_echoing_them():
    """s3://key:secret@bucket is refused, and the message masks the secret."""
    with pytest.raises(BadConfig) as info:
        open_store("s3://AKIA:topsecret@bucket/x")
    assert "topsecret" not in str(info.value)


def test_s3_server_fixture_survives_stop_and_start_with_its_data(s3_server, s3_bucket):
    """After s3_server.stop() the store errors; after start() the same endpoint serves the old objects."""
    store = open_store(s3_bucket.url, s3_bucket.settings)
    store.write("before", b"kept")
    s3_server.stop()
    try:
        with pytest.raises(StoreError):
            open_store(s3_bucket.url, s3_bucket.settings)
    finally:
        s3_server.start()
    assert store.read("before") == b"kept"


# --- ranged reads and streamed hashes (verify reads through these) --------------------------


def test_read_range_returns_the_bytes_asked_for_fewer_at_the_end_and_none_past_it(store):
    """read_range(key, offset, length): exact slices, a short slice at the end, b'' past the end, MissingKey if absent."""
    data = bytes(range(256)) * 40
    store.write("obj/range.bin", data)
    assert store.read_range("obj/range.bin", 0, 8) == data[:8]
    assert store.read_range("obj/range.bin", 1000, 333) == data[1000:1333]
    assert store.read_range("obj/range.bin", len(data) - 5, 100) == data[-5:]
    assert store.read_range("obj/range.bin", len(data) + 10, 4) == b""
    with pytest.raises(MissingKey):
        store.read_range("obj/absent.bin", 0, 4)


def test_sha256_streams_the_stored_bytes_and_names_an_absent_key(store):
    """sha256(key) is (bytes, hex digest) of what is stored; MissingKey when it is absent."""
    import hashlib

    data = os.urandom(3 * (1 << 20) + 17)  # more than one CHUNK_BYTES read
    store.write("obj/hash.bin", data)
    assert store.sha256("obj/hash.bin") == (len(data), hashlib.sha256(data).hexdigest())
    with pytest.raises(MissingKey):
        store.sha256("obj/absent.bin")


# --- read-only opens --------------------------------------------------------------------------


def test_open_store_without_create_refuses_a_missing_directory_and_makes_nothing(tmp_path, monkeypatch):
    """create=False (read-only commands, workers): a missing root is a StoreError naming it and the fix; no directory appears."""
    from hsx.errors import StoreError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(StoreError) as info:
        open_store(str(tmp_path / "no" / "such" / "run"), create=False)
    assert "does not exist" in str(info.value) and "nothing was created" in str(info.value)
    assert not (tmp_path / "no").exists()
    (tmp_path / "run").mkdir()
    assert open_store("run", create=False).root == tmp_path / "run"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_a_run_deleted_under_an_open_store_is_not_brought_back_by_a_late_write(tmp_path):
    """A worker holds the store of an existing run (create=False); someone deletes the run (rm -rf). A late
    write (a status record, a failure record) is a StoreError naming the root, and the directory stays gone."""
    import shutil

    from hsx.errors import StoreError

    (tmp_path / "run").mkdir()
    store = open_store(str(tmp_path / "run"), create=False)
    store.write("workers/a.json", b"{}")
    shutil.rmtree(tmp_path / "run")
    with pytest.raises(StoreError, match="no longer exists"):
        store.write("workers/a.json", b"{}")
    assert not (tmp_path / "run").exists()


def test_a_scheme_with_one_slash_is_refused_as_a_typo_not_made_a_directory(tmp_path, monkeypatch):
    """'s3:/bad' (one slash) is refused naming the accepted forms, with or without create; './s3:/bad' stays a local path."""
    monkeypatch.chdir(tmp_path)
    for create in (True, False):
        with pytest.raises(BadConfig, match="one slash"):
            open_store("s3:/bad", create=create)
    assert list(tmp_path.iterdir()) == []
    assert open_store("./s3:/bad").root == tmp_path / "s3:" / "bad"


# --- an unsettled conditional create (a misbehaving server: tests/faultproxy.py) -------------------


def _conflicts(times):
    from faultproxy import Rule

    return Rule(lambda method, path, headers: method == "PUT" and headers.get("If-None-Match") == "*",
                ("error", 409, "ConditionalRequestConflict"), times=times)


def test_s3_create_that_never_settles_is_a_transient_error_not_a_lost_race(s3_bucket, monkeypatch):
    """409 on every attempt: create raises a transient StoreError naming the key and the 409s; it never returns False,
    and the object is not there."""
    import hsx.store.s3 as s3_store
    from hsx.errors import StoreError
    from faultproxy import FaultProxy, proxied_settings

    monkeypatch.setattr(s3_store, "CONFLICT_BACKOFF_S", 0.01)
    proxy = FaultProxy(s3_bucket.settings.s3_endpoint_url, [_conflicts(None)]).start()
    try:
        store = open_store(s3_bucket.url, proxied_settings(s3_bucket, proxy))
        with pytest.raises(StoreError) as info:
            store.create("markers/b000001.json", b"{}")
        assert info.value.transient
        assert "markers/b000001.json" in str(info.value) and "409" in str(info.value)
        assert proxy.rules[0].hits == s3_store.CONFLICT_RETRIES + 1
        assert not exists(open_store(s3_bucket.url, s3_bucket.settings), "markers/b000001.json")
    finally:
        proxy.stop()


def test_s3_create_after_conflicts_that_settle_creates_once(s3_bucket, monkeypatch):
    """Two 409s, then the real server answers: create returns True and the object holds our bytes."""
    import hsx.store.s3 as s3_store
    from faultproxy import FaultProxy, proxied_settings

    monkeypatch.setattr(s3_store, "CONFLICT_BACKOFF_S", 0.01)
    proxy = FaultProxy(s3_bucket.settings.s3_endpoint_url, [_conflicts(2)]).start()
    try:
        store = open_store(s3_bucket.url, proxied_settings(s3_bucket, proxy))
        assert store.create("markers/b000002.json", b"mine") is True
        assert store.create("markers/b000002.json", b"theirs") is False  # a real 412: settled
        assert store.read("markers/b000002.json") == b"mine"
    finally:
        proxy.stop()


# --- download (the streaming reader's copy of a shard) ----------------------------------------


def test_download_copies_an_object_in_ranged_parts_and_returns_its_sha256(store, tmp_path):
    """download(store, key, path) writes the object's exact bytes, read in parts (here 1 MiB, 4 at a time) and hashed
    in order; an absent key is MissingKey."""
    data = os.urandom(5 * (1 << 20) + 123)
    store.write("shards/d.bin", data)
    out = tmp_path / "copy.bin"
    assert download(store, "shards/d.bin", out, part_bytes=1 << 20, threads=4) == (len(data), hashlib.sha256(data).hexdigest())
    assert out.read_bytes() == data
    store.write("empty", b"")
    assert download(store, "empty", tmp_path / "empty") == (0, hashlib.sha256(b"").hexdigest())
    with pytest.raises(MissingKey):
        download(store, "shards/absent.bin", tmp_path / "absent")


def test_download_rides_out_cut_off_range_reads_through_the_stores_retries(s3_bucket, tmp_path):
    """Ranged GETs reset 5 times (more than botocore's own attempts of one call): download retries each part on the
    transient StoreError within retry_s and the copy is exact; with retry_s=0 the same faults raise a transient StoreError."""
    from faultproxy import FaultProxy, Rule, proxied_settings

    data = os.urandom(3 * (1 << 20))
    open_store(s3_bucket.url, s3_bucket.settings).write("shards/r.bin", data)
    ranged = lambda method, path, headers: method == "GET" and "shards/r.bin" in path and "Range" in headers  # noqa: E731
    proxy = FaultProxy(s3_bucket.settings.s3_endpoint_url, [Rule(ranged, ("reset",), times=5)]).start()
    try:
        store = open_store(s3_bucket.url, proxied_settings(s3_bucket, proxy))
        got = download(store, "shards/r.bin", tmp_path / "r.bin", part_bytes=1 << 20, retry_s=60)
        assert got == (len(data), hashlib.sha256(data).hexdigest()) and (tmp_path / "r.bin").read_bytes() == data
        assert proxy.rules[0].hits == 5
        proxy.rules[:] = [Rule(ranged, ("reset",))]
        with pytest.raises(StoreError) as info:
            download(store, "shards/r.bin", tmp_path / "r2.bin", part_bytes=1 << 20, retry_s=0)
        assert info.value.transient
    finally:
        proxy.stop()


# --- the interface's boundary ------------------------------------------------------------------

#: the Store Protocol's members; anything else is a helper over them (hsx/store/helpers.py).
PROTOCOL_ATTRIBUTES = {"url", "location"}
PROTOCOL_MEMBERS = PROTOCOL_ATTRIBUTES | {"read", "write", "create", "delete", "write_stream", "read_range", "sha256",
                                          "size", "local_path", "list", "list_modified", "remove_incomplete", "child"}


def test_the_store_protocol_has_only_its_documented_members_and_both_backends_have_them_all():
    """The Protocol holds what callers outside the package use: exactly PROTOCOL_MEMBERS (the probe, ``check``,
    is only ``open_store``'s, on the backend it built); LocalStore and S3Store implement every one, and the probe."""
    members = {n for n in vars(Store) if not n.startswith("_")} | set(Store.__annotations__)
    assert members == PROTOCOL_MEMBERS, sorted(members ^ PROTOCOL_MEMBERS)
    for cls in (LocalStore, S3Store):
        methods = PROTOCOL_MEMBERS - PROTOCOL_ATTRIBUTES | {"check"}
        assert not [m for m in methods if not callable(getattr(cls, m, None))], cls


def test_a_store_says_where_it_lives_typed_not_by_a_missing_local_path(tmp_path):
    """``store.location``: local with its absolute path, or S3 with bucket and prefix; a child's is the child's."""
    from hsx.store import StoreURL

    local = LocalStore(tmp_path / "runs")
    assert local.location == StoreURL("local", path=str(tmp_path / "runs")) and local.location.is_local
    assert local.child("r1").location.path == str(tmp_path / "runs" / "r1")
    s3 = S3Store(object(), "bucket", "runs/x")
    assert s3.location == StoreURL("s3", bucket="bucket", prefix="runs/x") and s3.location.is_s3
    assert s3.child("r1").location.prefix == "runs/x/r1" and str(s3.child("r1").location) == s3.child("r1").url


def test_no_module_outside_the_store_imports_boto3_or_touches_a_raw_client():
    """Only hsx/store/ talks to boto3/botocore or a client: every other store call goes through the Protocol, whose
    errors say whether to retry. bench/servers.py may, to start the test and bench servers and make buckets (setup),
    and bench/plain_upload.py, the S3 ceiling the benches compare with (boto3 alone, no code of ours)."""
    import re

    root = Path(__file__).resolve().parents[1]
    boto = re.compile(r"^\s*(import|from)\s+(boto3|botocore)\b", re.M)
    # A store's client (``run_store.client``), its probe client, an S3 call on any ``.client`` (not kombu's or
    # http.client, which are no S3 clients), or an S3Store built around a client of one's own.
    client = re.compile(r"\w*store\w*\.(client|_probe_client)\b|\._probe_client\b|\bS3Store\("
                        r"|\.client\.(meta|\w*object\w*|download_\w+|upload_\w+|create_\w+|list_\w+|head_\w+|get_paginator)\b")
    files = [p for d in ("hsx", "producer", "workers", "bench", "examples", "scripts", "tests") for p in (root / d).rglob("*.py")]
    files.append(root / "settings.py")
    offenders = []
    for path in files:
        rel = path.relative_to(root).as_posix()
        # bench/plain_upload.py: the S3 ceiling is boto3 itself, with none of our code on its path.
        if rel.startswith("hsx/store/") or rel in ("bench/servers.py", "tests/test_store.py", "bench/plain_upload.py"):
            continue
        text = path.read_text()
        offenders += [f"{rel}: {m.group(0).strip()}" for m in boto.finditer(text)]
        offenders += [f"{rel}: {m.group(0)}" for m in client.finditer(text)]
    assert len(files) > 50, "the scan must see the code base"
    assert offenders == [], offenders


def test_importing_the_store_does_not_import_boto3():
    """hsx.store loads boto3 only when an S3 store is built (about 0.25 s each CLI command and reader would pay)."""
    import subprocess
    import sys

    code = "import sys, hsx.store; print('boto3' in sys.modules or 'botocore' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.strip() == "False"


def test_a_test_s3_server_takes_writes_in_more_buckets_than_the_suite_makes(tmp_path):
    """Every S3 test gets a bucket of its own, and a SeaweedFS bucket is a collection with volumes of its
    own: a fresh ``weed mini`` as the suite starts it takes a write in each of 160 new buckets (its
    default volume cap, free disk / volume size, ran out after 76 on an 80 GB-free disk: HTTP 500)."""
    from bench.servers import SeaweedServer, s3_client, weed_binary

    binary = weed_binary()
    if not binary:
        pytest.skip("SeaweedFS (weed) is not installed")
    server = SeaweedServer(binary, tmp_path / "data")
    server.start()
    try:
        client = s3_client(server.endpoint_url)

        def bucket_and_write(i: int) -> None:
            client.create_bucket(Bucket=f"many-{i:03d}")
            client.put_object(Bucket=f"many-{i:03d}", Key="k", Body=b"x" * 1000)

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(bucket_and_write, range(160)))
        assert client.get_object(Bucket="many-159", Key="k")["Body"].read() == b"x" * 1000
    finally:
        server.stop()
