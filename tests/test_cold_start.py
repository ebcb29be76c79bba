"""A worker's cold start (issue 20, item 3): what it must not do again at every start.

- The checkpoint's identity is not hashed from its bytes again when a worker restarts on the same
  machine: the digests are cached under ``HSX_CACHE_DIR`` by each file's stat (``hsx/models.py``),
  which outlives the process. Checked with real worker loads in two fresh processes.
- Triton's compile cache travels through the store (``workers/compile_cache.py``): the first worker
  stores what its warm-up compiled, a new node's worker unpacks it before its warm-up. On the CPU
  nothing is compiled, so the warm-up here is a stand-in that writes into the cache directory what
  Triton writes (kernel files, and a half-written temp directory); the store (a directory and an S3
  server) and the archive are the real ones.
"""

from __future__ import annotations

import io
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest
import torch

from jobfixtures import clean_env, run_python
from hsx.models import resolve_model_path
from workers import compile_cache
from workers.compile_cache import around_warm_up, cache_key


WORKER_START = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
from pathlib import Path
from settings import Settings
from workers.target import load_target
target = load_target(sys.argv[1], Settings(_env_file=None, cache_dir=Path(sys.argv[2]), device="cpu"))
print(target.info.revision)
"""


def _start_worker(ckpt: Path, cache: Path) -> subprocess.CompletedProcess:
    # a process of its own (forked from the tests' fork server: the project's modules imported afresh)
    proc = run_python(["-c", WORKER_START, str(ckpt), str(cache)], clean_env(), timeout_s=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_a_worker_restarted_on_an_unchanged_checkpoint_reads_no_byte_of_it_to_hash_it(tmp_path, tiny_cache):
    """The first start on a machine hashes each file once (and says so); a second process with the
    same HSX_CACHE_DIR gets the same identity from the cache, hashing nothing."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(resolve_model_path("tiny-qwen3.5", tiny_cache), ckpt)
    cache = tmp_path / "cache"
    first = _start_worker(ckpt, cache)
    assert f"hashing {ckpt.resolve() / 'model.safetensors'}" in first.stderr
    assert list((cache / "checkpoint-hashes").glob("*.json"))  # where it lives: under HSX_CACHE_DIR
    second = _start_worker(ckpt, cache)
    assert "hashing " not in second.stderr, second.stderr
    assert second.stdout.split()[-1] == first.stdout.split()[-1]


# --- the Triton cache travels through the store ------------------------------------------------

VERSIONS = {"torch": "2.13.0+cu128", "triton": "3.5.0", "fla": "0.4.0"}
KEY = cache_key((9, 0), VERSIONS)
KERNELS = {"AbCd12/chunk_gated_delta_rule_fwd_kernel.cubin": b"\x7fELF compiled",
           "AbCd12/chunk_gated_delta_rule_fwd_kernel.json": b'{"num_warps": 4}',
           "Ef34/__grp__chunk_local_cumsum.json": b'{"child_paths": {}}'}


def fake_triton_warm_up(cache_dir: Path, seen: list):
    """A warm-up that compiles what is not in ``cache_dir`` yet, as Triton does; ``seen`` gets the
    files that were there before it ran."""
    def warm_up():
        seen.extend(sorted(str(p.relative_to(cache_dir)) for p in cache_dir.rglob("*") if p.is_file()))
        for rel, data in KERNELS.items():
            path = cache_dir / rel
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
        half = cache_dir / "tmp.pid_77_123" / "being_written.cubin"
        half.parent.mkdir(parents=True, exist_ok=True)
        half.write_bytes(b"half")
    return warm_up


def test_the_key_is_the_gpu_architecture_and_the_versions_that_decide_the_compiled_code():
    assert KEY == "compile-cache/triton/sm90-torch2.13.0_cu128-triton3.5.0-fla0.4.0.tar.gz"
    assert cache_key((10, 0), VERSIONS) != KEY
    assert cache_key((9, 0), dict(VERSIONS, triton="3.4.0")) != KEY
    assert cache_key((9, 0), dict(VERSIONS, fla="0.4.1")) != KEY


def test_the_key_names_what_the_warm_up_compiles_so_an_archive_of_a_smaller_warm_up_is_not_taken_for_complete():
    """A worker whose warm-up compiles more (another revision, row buckets up to more tokens) finds no
    archive stored by a warm-up that compiled less, and stores its own."""
    from workers.target import warm_up_tag

    tagged = cache_key((9, 0), VERSIONS, warm_up=warm_up_tag(32768))
    assert tagged.endswith("-fla0.4.0-" + warm_up_tag(32768) + ".tar.gz") and tagged != KEY
    assert cache_key((9, 0), VERSIONS, warm_up=warm_up_tag(65536)) != tagged


def test_the_first_worker_stores_its_compile_cache_and_a_new_nodes_worker_has_it_before_its_warm_up(store, tmp_path):
    first_seen: list = []
    first = around_warm_up(store, KEY, tmp_path / "node1" / "triton", fake_triton_warm_up(tmp_path / "node1" / "triton", first_seen))
    assert first_seen == [] and first["restored"] is None
    assert first["saved"]["files"] == len(KERNELS) and store.size(KEY) == first["saved"]["bytes"]

    later: list = []
    cache2 = tmp_path / "node2" / "triton"
    second = around_warm_up(store, KEY, cache2, fake_triton_warm_up(cache2, later))
    assert later == sorted(KERNELS)  # every kernel there before the warm-up: nothing to compile
    assert second["restored"]["files_added"] == len(KERNELS) and second["saved"] is None
    assert {rel: (cache2 / rel).read_bytes() for rel in KERNELS} == KERNELS
    with tarfile.open(fileobj=io.BytesIO(store.read(KEY)), mode="r:gz") as tar:
        assert not any("tmp.pid" in name for name in tar.getnames())  # a half-written kernel does not travel


def test_workers_of_one_node_keep_the_files_they_have_and_only_one_archive_is_stored(tmp_path):
    from hsx.store import open_store

    store = open_store(str(tmp_path / "store"))
    cache = tmp_path / "triton"
    around_warm_up(store, KEY, cache, fake_triton_warm_up(cache, []))
    (cache / "AbCd12" / "chunk_gated_delta_rule_fwd_kernel.json").write_bytes(b"mine")
    again = around_warm_up(store, KEY, cache, lambda: None)
    assert again["restored"]["files_added"] == 0
    assert (cache / "AbCd12" / "chunk_gated_delta_rule_fwd_kernel.json").read_bytes() == b"mine"
    other = tmp_path / "other"
    (other / "k").mkdir(parents=True)
    (other / "k" / "x.cubin").write_bytes(b"other")
    assert compile_cache.save(store, KEY, other) is None  # create-if-absent: the first archive stays
    assert store.list("compile-cache/") == [KEY]


MID_RUN = {"9f8e/l2norm_fwd_kernel.cubin": b"\x7fELF bucket 3", "9f8e/l2norm_fwd_kernel.json": b'{"NB": 3}'}


def compile_mid_run(cache_dir: Path) -> None:
    """What a batch that meets a row bucket the warm-up did not does: Triton adds its kernel files."""
    for rel, data in MID_RUN.items():
        (cache_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (cache_dir / rel).write_bytes(data)


def test_kernels_compiled_after_the_warm_up_travel_to_the_next_nodes_workers(store, tmp_path):
    """A kernel compiled mid-run (a row bucket beyond the worker's warm-up) is stored beside the
    compile cache by the worker's top-up, once for the workers that compiled it, and a new node's
    worker has it before its warm-up; a top-up with nothing new stores nothing."""
    node1 = tmp_path / "node1" / "triton"
    around_warm_up(store, KEY, node1, fake_triton_warm_up(node1, []))
    top_up = compile_cache.TopUp(store, KEY, node1)
    assert compile_cache.top_up(store, KEY, node1, top_up.known) is None  # nothing compiled since the warm-up
    compile_mid_run(node1)
    half = node1 / "tmp.pid_9_1" / "half.cubin"  # still being written: does not travel
    half.parent.mkdir(parents=True, exist_ok=True)
    half.write_bytes(b"half")
    stored = compile_cache.top_up(store, KEY, node1, top_up.known)
    assert stored["created"] and stored["files"] == len(MID_RUN)
    assert stored["key"].startswith(compile_cache.extras_prefix(KEY)) and stored["key"] != KEY
    assert compile_cache.top_up(store, KEY, node1, top_up.known) is None  # stored once

    node1b = tmp_path / "node1b" / "triton"  # another worker that compiled the same kernels: one archive
    around_warm_up(store, KEY, node1b, fake_triton_warm_up(node1b, []))
    shutil.rmtree(node1b / "9f8e")
    compile_mid_run(node1b)
    again = compile_cache.top_up(store, KEY, node1b, compile_cache.cached_files(node1b) - set(MID_RUN))
    assert again["key"] == stored["key"] and not again["created"]
    assert len(store.list(compile_cache.extras_prefix(KEY))) == 1

    seen: list = []
    node2 = tmp_path / "node2" / "triton"
    record = around_warm_up(store, KEY, node2, fake_triton_warm_up(node2, seen))
    assert record["extras"] == {"archives": 1, "files_added": len(MID_RUN), "bytes": store.size(stored["key"])}
    assert seen == sorted(set(KERNELS) | set(MID_RUN))  # all there before the warm-up
    assert {rel: (node2 / rel).read_bytes() for rel in MID_RUN} == MID_RUN


def test_the_top_up_thread_stores_what_the_worker_compiles_while_it_serves(tmp_path):
    """The worker's thread (``HSX_COMPILE_CACHE_TOP_UP_S``) looks on its own: a kernel compiled while
    it runs is in the store within a few of its intervals; one thread per key per process."""
    import time

    from hsx.store import open_store

    store = open_store(str(tmp_path / "store"))
    cache = tmp_path / "triton"
    around_warm_up(store, KEY, cache, fake_triton_warm_up(cache, []))
    thread = compile_cache.start_top_up(store, KEY, cache, interval_s=0.05)
    try:
        assert compile_cache.start_top_up(store, KEY, cache, interval_s=0.05) is thread
        compile_mid_run(cache)
        deadline = time.monotonic() + 30
        while not thread.stored and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [r["files"] for r in thread.stored] == [len(MID_RUN)]
        assert len(store.list(compile_cache.extras_prefix(KEY))) == 1
    finally:
        thread.stop()
        thread.join(5)
    assert compile_cache.start_top_up(store, KEY, cache, interval_s=0) is None  # 0: off


def test_a_damaged_or_escaping_archive_is_not_unpacked_and_the_warm_up_compiles(tmp_path):
    from hsx.store import open_store

    store = open_store(str(tmp_path / "store"))
    store.write(KEY, b"not a tar at all")
    seen: list = []
    cache = tmp_path / "node" / "triton"
    record = around_warm_up(store, KEY, cache, fake_triton_warm_up(cache, seen))
    assert record["restored"] is None and seen == [] and (cache / next(iter(KERNELS))).exists()

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo("../../escaped.cubin")
        info.size = 4
        tar.addfile(info, io.BytesIO(b"evil"))
    store.write(KEY, buf.getvalue())
    fresh = tmp_path / "n3" / "triton"
    assert compile_cache.restore(store, KEY, fresh) is None
    assert not list(tmp_path.rglob("escaped.cubin"))


def test_nothing_travels_for_a_cpu_worker_or_with_the_setting_off(tmp_path):
    from settings import Settings

    on = Settings(_env_file=None, store_url=str(tmp_path / "store"))
    assert compile_cache.for_worker(on, torch.device("cpu")) is None
    off = Settings(_env_file=None, store_url=str(tmp_path / "store"), compile_cache=False)
    assert compile_cache.for_worker(off, torch.device("cuda")) is None


@pytest.mark.parametrize("env_value, expected", [("false", False), ("true", True)])
def test_hsx_compile_cache_is_the_setting(monkeypatch, env_value, expected):
    from settings import Settings

    monkeypatch.setenv("HSX_COMPILE_CACHE", env_value)
    assert Settings(_env_file=None).compile_cache is expected
    monkeypatch.setenv("HSX_COMPILE_CACHE_TOP_UP_S", "0")
    assert Settings(_env_file=None).compile_cache_top_up_s == 0


def test_the_workers_a_producer_run_starts_warm_up_for_that_runs_batch_budget():
    """``producer run --batch-tokens N`` starts its workers with ``HSX_BATCH_TOKENS=N``: their warm-up
    compiles fla's row buckets up to N padded tokens (workers/target.py), whatever the default."""
    from producer.run import worker_env
    from settings import Settings

    env = worker_env(Settings(_env_file=None), "redis+socket:///tmp/b.sock", "Qwen/Qwen3-8B", 65536)
    with_env = Settings(_env_file=None, **{k.removeprefix("HSX_").lower(): v for k, v in env.items()
                                           if k in ("HSX_BATCH_TOKENS", "HSX_MODEL")})
    assert env["HSX_BATCH_TOKENS"] == "65536" and with_env.batch_tokens == 65536
    assert env["HSX_BROKER_URL"] == "redis+socket:///tmp/b.sock" and with_env.model == "Qwen/Qwen3-8B"
