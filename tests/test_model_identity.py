"""Specifications of a target model's identity (hsx.models): a local checkpoint is named by its bytes.

Project issue 12, item 2: the revision of a local checkpoint is a hash of its weight bytes (every file
hashed once and cached by its stat, a hub cache's blobs too: issue 22 item 1); a run
resumed with other weights is refused before any model work; a worker's loaded checkpoint is
checked against ``run.json``. All on the real tiny-qwen3.5 checkpoint and the legacy run fixture.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import hsx.models
from hsx.errors import BadConfig, RunConflict
from hsx.models import CONTENT_REVISION_PREFIX, checkpoint_files, file_sha256, model_info, resolve_model_path
from hsx.runconfig import ModelConfig, RunConfig, load_run
from hsx.store import open_store
from producer.planner import PlanOptions, plan_run
from settings import Settings

LEGACY = Path(__file__).resolve().parent / "data" / "legacy-runs"
DATASET = LEGACY / "chats.jsonl"


@pytest.fixture
def ckpt(tmp_path, tiny_cache):
    """A copy of the tiny checkpoint as a local directory (weights, config, tokenizer)."""
    target = tmp_path / "ckpt"
    shutil.copytree(resolve_model_path("tiny-qwen3.5", tiny_cache), target)
    return target


@pytest.fixture
def hashed(monkeypatch):
    """The names of the files whose bytes hsx.models reads to hash them (real paths: a blob's name), in order."""
    seen: list[str] = []
    real = hsx.models._sha256_of_bytes

    def counting(path):
        seen.append(Path(path).name)
        return real(path)

    monkeypatch.setattr(hsx.models, "_sha256_of_bytes", counting)
    return seen


def _other_weights_of_the_same_shapes(ckpt: Path) -> None:
    """Replace model.safetensors by other weights: same names, shapes, dtypes and file size."""
    path = ckpt / "model.safetensors"
    size = path.stat().st_size
    state = load_file(path)
    save_file({k: v + 0.5 for k, v in state.items()}, path, metadata={"format": "pt"})
    assert path.stat().st_size == size


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- the revision is a hash of the bytes ----------------------------------------------------------


def test_other_weights_of_the_same_shapes_give_another_revision(ckpt, tmp_path):
    """The measured case: replacing model.safetensors by other weights of the same shapes kept the
    version-1 revision (names, sizes, config.json); the content revision changes."""
    before = model_info(str(ckpt), tmp_path / "cache")
    _other_weights_of_the_same_shapes(ckpt)
    after = model_info(str(ckpt), tmp_path / "cache")
    assert before.revision.startswith(CONTENT_REVISION_PREFIX) and len(before.revision) == len("sha256:") + 64
    assert after.revision != before.revision
    assert after.legacy_revision == before.legacy_revision  # what version 1 could not tell apart


def test_the_revision_is_the_sha256_of_each_files_digest_by_name(ckpt, tmp_path):
    """``sha256:`` of one ``name<TAB>sha256`` line per file that decides the model, in name order."""
    files = checkpoint_files(ckpt)
    assert [f.name for f in files] == ["config.json", "model.safetensors"]  # not the tokenizer, not README.md
    manifest = "".join(f"{f.name}\t{_sha256(f)}\n" for f in files)
    assert model_info(str(ckpt), tmp_path / "cache").revision == "sha256:" + hashlib.sha256(manifest.encode()).hexdigest()


def test_the_files_that_decide_a_checkpoint_are_its_config_index_and_weights(tmp_path):
    """Sharded safetensors with their index; pickle weights only where there is no safetensors file."""
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for name in ("config.json", "model-00002-of-00002.safetensors", "model-00001-of-00002.safetensors",
                 "model.safetensors.index.json", "tokenizer.json", "pytorch_model.bin", "generation_config.json"):
        (sharded / name).write_text("x")
    assert [f.name for f in checkpoint_files(sharded)] == [
        "config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    pickles = tmp_path / "pickles"
    pickles.mkdir()
    for name in ("config.json", "pytorch_model.bin", "tokenizer.json"):
        (pickles / name).write_text("x")
    assert [f.name for f in checkpoint_files(pickles)] == ["config.json", "pytorch_model.bin"]


def test_a_config_change_alone_changes_the_revision(ckpt, tmp_path):
    config = json.loads((ckpt / "config.json").read_text())
    before = model_info(str(ckpt), tmp_path / "cache").revision
    config["rms_norm_eps"] = config["rms_norm_eps"] * 10
    (ckpt / "config.json").write_text(json.dumps(config))
    assert model_info(str(ckpt), tmp_path / "cache").revision != before


# --- the cache: hashed once ------------------------------------------------------------------------


def test_a_re_plan_reads_no_weight_bytes_and_a_touched_file_is_hashed_again(ckpt, tmp_path, hashed):
    """First model_info reads each file once; the next reads none (cache by path, inode, size, mtime,
    ctime); a file whose mtime changed is read again, with the same digest when its bytes are the same."""
    cache = tmp_path / "cache"
    first = model_info(str(ckpt), cache).revision
    assert sorted(hashed) == ["config.json", "model.safetensors"]
    hashed.clear()
    assert model_info(str(ckpt), cache).revision == first
    assert hashed == [], "the second look read weight bytes"
    os.utime(ckpt / "model.safetensors", ns=(1, 1))
    assert model_info(str(ckpt), cache).revision == first
    assert hashed == ["model.safetensors"]
    assert len(list((cache / "checkpoint-hashes").glob("*.json"))) == 3  # one entry per (file, stat) seen


def test_a_file_replaced_with_the_same_size_and_mtime_is_hashed_again(ckpt, tmp_path, hashed):
    """``cp`` of other bytes over the file, then its old mtime set back (``touch -d``): the ctime (or the
    inode of a new file) still differs, so the cached digest is not used."""
    cache = tmp_path / "cache"
    first = model_info(str(ckpt), cache).revision
    st = (ckpt / "model.safetensors").stat()
    _other_weights_of_the_same_shapes(ckpt)
    os.utime(ckpt / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (ckpt / "model.safetensors").stat().st_mtime_ns == st.st_mtime_ns
    hashed.clear()
    assert model_info(str(ckpt), cache).revision != first
    assert hashed == ["model.safetensors"]


def test_two_threads_hashing_the_same_file_read_it_once(ckpt, tmp_path, monkeypatch):
    """The cache entry's lock makes a second hasher wait and read the first one's digest (as 8 workers
    starting on one node do)."""
    reads = []
    real = hsx.models._sha256_of_bytes

    def slow(path):
        reads.append(path)
        time.sleep(0.3)
        return real(path)

    monkeypatch.setattr(hsx.models, "_sha256_of_bytes", slow)
    out = []
    threads = [threading.Thread(target=lambda: out.append(file_sha256(ckpt / "model.safetensors", tmp_path / "c")))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(reads) == 1 and out == [_sha256(ckpt / "model.safetensors")] * 2


def _hub_snapshot(ckpt: Path, tmp_path: Path) -> Path:
    """A Hugging Face cache layout of ``ckpt``: ``snapshots/<rev>/<file>`` links to ``blobs/<sha256>``."""
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / ("c0ffee" * 6 + "c0ff")
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in ckpt.iterdir():
        blob = repo / "blobs" / (_sha256(f) if f.suffix == ".safetensors" else hashlib.sha1(f.read_bytes()).hexdigest())
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


def test_a_hub_cache_snapshot_is_hashed_once_like_any_checkpoint_and_then_costs_a_stat(ckpt, tmp_path, hashed):
    """A snapshot whose files link to ``blobs/<sha256>``: each blob is read once (its name is not taken on
    trust), the revision equals a plain copy's, and the next look reads nothing."""
    snapshot = _hub_snapshot(ckpt, tmp_path)
    plain = model_info(str(ckpt), tmp_path / "cache-a").revision
    hashed.clear()
    assert model_info(str(snapshot), tmp_path / "cache-b").revision == plain
    assert sorted(hashed) == sorted(os.path.basename(os.path.realpath(f)) for f in snapshot.iterdir()
                                    if f.name == "config.json" or f.suffix == ".safetensors")
    hashed.clear()
    assert model_info(str(snapshot), tmp_path / "cache-b").revision == plain
    assert hashed == []


def test_a_hub_blob_overwritten_in_place_gives_another_revision_and_the_run_is_refused(ckpt, tmp_path, hashed):
    """Issue 22 item 1: plan a run on a snapshot, copy other weights of the same size over ``blobs/<sha>`` (the
    name stays): the revision changes, and the same --run-id is refused (RunConflict naming the revision)."""
    snapshot = _hub_snapshot(ckpt, tmp_path)
    first = _plan(snapshot, tmp_path, run_id="blob")
    blob = Path(os.path.realpath(snapshot / "model.safetensors"))
    other = tmp_path / "other"
    shutil.copytree(ckpt, other)
    _other_weights_of_the_same_shapes(other)
    shutil.copyfile(other / "model.safetensors", blob)  # in place: same name, same size, other bytes
    assert Path(os.path.realpath(snapshot / "model.safetensors")) == blob and _sha256(blob) != blob.name
    assert model_info(str(snapshot), tmp_path / "cache").revision != first.config.model.revision
    with pytest.raises(RunConflict, match="model.revision"):
        _plan(snapshot, tmp_path, run_id="blob")


def test_a_snapshot_file_replaced_by_a_plain_file_is_hashed(ckpt, tmp_path):
    """The blob name is trusted only for a link into blobs/: a weight file put in its place is read."""
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / ("ab" * 20)
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in ckpt.iterdir():
        blob = repo / "blobs" / _sha256(f)
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(blob)
    before = model_info(str(snapshot), tmp_path / "cache").revision
    (snapshot / "model.safetensors").unlink()
    shutil.copyfile(ckpt / "model.safetensors", snapshot / "model.safetensors")
    _other_weights_of_the_same_shapes(snapshot)
    assert model_info(str(snapshot), tmp_path / "cache").revision != before


# --- runs: refused before any work, checked by every worker ---------------------------------------------


def _plan(ckpt: Path, tmp_path: Path, **kw):
    settings = Settings(_env_file=None, cache_dir=tmp_path / "cache")
    opts = PlanOptions(dataset=str(DATASET), model=str(ckpt), output=str(tmp_path / "out"), max_length=64,
                       batch_tokens=128, **kw)
    return plan_run(opts, settings)


def test_a_resumed_run_with_other_weights_is_refused_before_any_model_work(ckpt, tmp_path):
    """The same --run-id after the weights changed: RunConflict naming the revision, nothing written;
    without --run-id the new weights are another run."""
    first = _plan(ckpt, tmp_path, run_id="swap")
    assert first.config.model.revision.startswith("sha256:")
    assert _plan(ckpt, tmp_path, run_id="swap").reused
    default_id = _plan(ckpt, tmp_path).config.run_id
    before = (tmp_path / "out" / "swap" / "run.json").read_bytes()
    _other_weights_of_the_same_shapes(ckpt)
    with pytest.raises(RunConflict, match=r'model.revision: stored "sha256:[0-9a-f]{64}" != requested "sha256:'):
        _plan(ckpt, tmp_path, run_id="swap")
    assert (tmp_path / "out" / "swap" / "run.json").read_bytes() == before
    other = _plan(ckpt, tmp_path)
    assert not other.reused and other.config.run_id != default_id
    assert other.config.model.revision != first.config.model.revision


def test_the_worker_checks_the_checkpoint_it_loaded_against_run_json(ckpt, tmp_path):
    """A worker's ``info`` equals the run's ``model`` for the same bytes (the check extract.py makes) and
    differs, naming the revision, once the weights were replaced."""
    from workers.target import load_target

    planned = _plan(ckpt, tmp_path)
    recorded = load_run(open_store(str(tmp_path / "out" / planned.config.run_id))).model
    settings = Settings(_env_file=None, cache_dir=tmp_path / "cache", device="cpu")
    target = load_target(str(ckpt), settings)
    assert target.info.as_dict() == recorded.as_dict() and target.info.differences(recorded) == []
    _other_weights_of_the_same_shapes(ckpt)
    swapped = load_target(str(ckpt), settings)
    assert swapped.info.as_dict() != recorded.as_dict()
    (difference,) = swapped.info.differences(recorded)
    assert difference.startswith(f"revision: recorded {recorded.revision!r}, this checkpoint 'sha256:")
    assert not torch.equal(next(swapped.model.parameters()), next(target.model.parameters()))


def test_the_same_checkpoint_at_another_path_is_the_same_run_and_its_worker_serves_it(ckpt, tmp_path):
    """The run identity names a local checkpoint by its bytes (revision, files_revision), not by its path:
    a copy elsewhere plans the same run id (resumed), and a worker serving the copy (HSX_MODEL, as
    `producer run` starts them) passes the check against run.json. Other weights, or another tokenizer
    file, are another run; documentation is not part of it."""
    from workers.target import load_target

    copy = tmp_path / "elsewhere" / "copy-of-ckpt"
    shutil.copytree(ckpt, copy)
    first = _plan(ckpt, tmp_path)
    assert first.config.model.files_revision.startswith(CONTENT_REVISION_PREFIX)
    moved = _plan(copy, tmp_path)
    assert moved.reused and moved.config.run_id == first.config.run_id
    recorded = load_run(open_store(str(tmp_path / "out" / first.config.run_id))).model
    assert recorded.name == str(ckpt), "run.json still records where it was planned from"
    target = load_target(str(copy), Settings(_env_file=None, cache_dir=tmp_path / "cache", device="cpu"))
    assert target.info.differences(recorded) == []
    (copy / "README.md").write_text("a note about this copy\n")
    assert _plan(copy, tmp_path).config.run_id == first.config.run_id
    config_path = copy / "tokenizer_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "model_max_length": 1234}))
    retokenised = _plan(copy, tmp_path)
    assert not retokenised.reused and retokenised.config.run_id != first.config.run_id
    assert retokenised.config.model.revision == first.config.model.revision
    _other_weights_of_the_same_shapes(ckpt)
    reweighted = _plan(ckpt, tmp_path)
    assert not reweighted.reused and reweighted.config.run_id not in (first.config.run_id, retokenised.config.run_id)


def test_a_local_run_planned_before_files_revision_is_still_checked_by_its_path(ckpt, tmp_path):
    """A run.json whose ``model`` has no files_revision (planned before it was recorded) hashed the path:
    a worker compares the name too, as it did, and does not ask for the files_revision it lacks."""
    info = model_info(str(ckpt), tmp_path / "cache")
    recorded = ModelConfig.model_validate({k: v for k, v in info.as_dict().items() if k != "files_revision"})
    assert info.files_revision and info.differences(recorded) == []
    elsewhere = recorded.model_copy(update={"name": "/data/other/ckpt"})
    assert info.differences(elsewhere) == [f"name: recorded '/data/other/ckpt', this checkpoint {str(ckpt)!r}"]


def test_a_checkpoint_that_changes_while_a_worker_loads_it_is_refused(ckpt, tmp_path, monkeypatch):
    """The identity is taken before the weights are read and again after: a copy still being written is refused."""
    import transformers

    from workers.target import load_target

    real = transformers.AutoModelForCausalLM.from_pretrained

    def load_then_change(*args, **kwargs):
        model = real(*args, **kwargs)
        _other_weights_of_the_same_shapes(ckpt)
        return model

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", load_then_change)
    with pytest.raises(BadConfig, match="changed while this worker loaded it"):
        load_target(str(ckpt), Settings(_env_file=None, cache_dir=tmp_path / "cache", device="cpu"))


def test_a_version_1_run_is_still_checked_the_way_its_revision_was_recorded(tiny_cache, tmp_path):
    """The legacy run recorded ``local-<16 hex>`` for tiny-qwen3.5: the same checkpoint now has a content
    revision (so as_dict() differs) and still matches that record through its legacy revision.

    Version 1 hashed ``config.json``'s bytes, which name the transformers that saved it: the run was made
    with the checkpoint transformers 5.24.0 saved (tests/data/legacy-runs/SOURCE.md), so the checkpoint
    checked here is the built one with that version in its config, whatever transformers is installed."""
    recorded = RunConfig.from_json((LEGACY / "chats-307617162427" / "run.json").read_bytes()).model
    assert recorded.revision.startswith("local-")
    cache = tmp_path / "cache"
    shutil.copytree(tiny_cache, cache)
    config_json = Path(resolve_model_path("tiny-qwen3.5", cache)) / "config.json"
    saved_by = json.dumps(json.loads(config_json.read_text())["transformers_version"])
    config_json.write_text(config_json.read_text().replace(f'"transformers_version": {saved_by}',
                                                           '"transformers_version": "5.24.0"'))
    info = model_info("tiny-qwen3.5", cache)
    assert info.as_dict() != recorded.as_dict()
    assert info.legacy_revision == recorded.revision and info.differences(recorded) == []
    assert info.differences(recorded.model_copy(update={"revision": "local-0000000000000000"})) != []


def test_a_misspelled_built_in_model_is_refused_at_once_naming_the_built_in(tmp_path):
    """``tiny-qwen3`` is neither a directory nor an org/name hub id but close to ``tiny-qwen3.5``: refused before
    any hub lookup (which retries for long offline); a hub id without an org (``gpt2``) is passed on."""
    from hsx.errors import BadConfig
    from hsx.models import resolve_model_path

    with pytest.raises(BadConfig, match=r"did you mean 'tiny-qwen3\.5'\?"):
        resolve_model_path("tiny-qwen3", tmp_path)
    assert resolve_model_path("gpt2", tmp_path) == "gpt2"


# --- a hub id offline (issue 22, item 9) ---------------------------------------------------------


@pytest.mark.parametrize("offline", [False, True], ids=["hub-unreachable", "HF_HUB_OFFLINE"])
def test_a_hub_id_that_is_not_cached_and_cannot_be_fetched_is_refused_at_once(tmp_path, tiny_cache, offline):
    """``producer run ... --model Qwen/Qwen3-8B`` with no network (the hub's endpoint a closed port of this
    machine) and an empty hub cache: refused without huggingface_hub's retries (they took 26 s), naming the
    model, the cache it looked in, and the fix (download it, a local directory; HF_HUB_OFFLINE when it is
    cached). With HF_HUB_OFFLINE set the hub is not asked at all."""
    import subprocess
    import sys

    from jobfixtures import ROOT, clean_env, free_port

    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "hello"}]}) + "\n")
    env = {**clean_env(cache_dir=tiny_cache, state_dir=tmp_path / "state"), "HF_HOME": str(tmp_path / "hf"),
           "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}", "COLUMNS": "400"}
    env.pop("HF_HUB_CACHE", None)
    env.pop("HUGGINGFACE_HUB_CACHE", None)
    env.pop("HF_HUB_OFFLINE", None)
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    proc = subprocess.run([sys.executable, "-m", "producer", "run", str(data), "--model", "Qwen/Qwen3-8B",
                           "--output", str(tmp_path / "out")], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    said = " ".join(proc.stderr.split())
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "Retrying" not in proc.stderr, f"the hub was retried:\n{proc.stderr[-3000:]}"
    cache = tmp_path / "hf" / "hub"
    for words in ("--model 'Qwen/Qwen3-8B'", f"cache {cache} holds no copy of it", str(cache / "models--Qwen--Qwen3-8B"),
                  "`hf download Qwen/Qwen3-8B`", "local directory"):
        assert words in said, f"{words!r} not in:\n{proc.stderr[-3000:]}"
    assert ("HF_HUB_OFFLINE is set, so the hub was not asked" in said) == offline, said
    assert ("could not be reached" in said and "asked once" in said and "set HF_HUB_OFFLINE=1" in said) != offline, said
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir()), "a refused run writes nothing"


def test_a_cached_hub_id_is_read_from_the_cache_at_once_when_the_hub_cannot_be_reached(ckpt, tmp_path, monkeypatch):
    """The same id in the local hub cache (a real snapshot layout of the tiny checkpoint) and no network: its
    config is read from the cache after one refused connection (no retries); with HF_HUB_OFFLINE the hub is
    not asked."""
    from jobfixtures import free_port

    snapshot = _hub_snapshot(ckpt, tmp_path)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text(snapshot.name)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    for offline in ("", "1"):
        monkeypatch.setenv("HF_HUB_OFFLINE", offline)
        hsx.models.hub_local_only.cache_clear()
        info = model_info("org/tiny", tmp_path / "cache")
        assert hsx.models.hub_local_only("org/tiny") is True
        assert info.path == "org/tiny" and info.model_type == "qwen3_5_text" and info.num_layers == 8, info
        # the commit of the snapshot the config came from (transformers 5 sets no _commit_hash): two revisions
        # of one hub id must not share a run identity
        assert info.revision == snapshot.name, info.revision
    hsx.models.hub_local_only.cache_clear()
