"""Target models: resolving a name to a checkpoint, its identity, and the built-in tiny model.

A model name is a Hugging Face hub id, a local checkpoint directory, or ``tiny-qwen3.5``: the
real Qwen3.5-27B architecture (hybrid Gated DeltaNet + gated attention, from the bundled
``assets/qwen3.5-27b.json``) shrunk to 8 layers of hidden size 64, with random weights from a fixed
seed and the real Qwen3 tokenizer. Its hidden states are synthetic: it exists so that the whole
job runs on a fresh clone with no hub and no GPU, not to train a useful draft model.

**Identity** (``ModelInfo.revision``, recorded in ``run.json`` and checked by every worker):

- a hub id: the commit hash transformers resolved it to (``config._commit_hash``, or, since transformers 5
  sets none, the name of the cache snapshot its config was read from);
- a local checkpoint directory: ``sha256:<hex>``, the sha256 of one line ``<file name>\t<sha256 of
  its bytes>`` per file that decides the model (:func:`checkpoint_files`: ``config.json``, the
  safetensors index and every ``*.safetensors`` file; the pickle weight files when there is no
  safetensors file), in name order. Every file is read once (16 MiB chunks, the files in parallel
  threads), a Hugging Face cache blob (``.../blobs/<64 hex>``) too: its name is the sha256 the hub
  downloaded, but a blob can be overwritten in place after that, and the name would then vouch for
  bytes it does not describe. The digest is cached under ``<cache_dir>/checkpoint-hashes/``, keyed by its real path, device, inode, size,
  mtime and ctime (ctime too: no tool can set it back, while ``touch`` and ``cp -p`` set mtime), so
  planning the same run again, or starting a worker on the same machine, costs a ``stat`` per file.
  Processes hashing the same file at once wait on a lock and hash it once;
- a built-in model: its generated directory, as a local checkpoint.

A local checkpoint directory (not a built-in model) also records ``files_revision``: the same kind
of hash over its other files (:func:`other_files`: the tokenizer's, ``generation_config.json``, ...;
not documentation). With both, the directory is named by its bytes and not by its path: the run
identity (``hsx/runconfig.py`` ``ModelConfig.identity``) leaves its name out, and a worker serving
the same bytes from another directory serves its runs (:meth:`ModelInfo.differences`).

Runs of identity version 1 (``hsx/runconfig.py``) recorded ``local-<16 hex>`` for a local
directory instead (a hash of the weight files' names and sizes and of ``config.json``: other
weights of the same shapes kept it). :attr:`ModelInfo.legacy_revision` still computes it, so a
worker can check such a run's checkpoint the way it was recorded (:meth:`ModelInfo.differences`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from hsx.errors import BadConfig

log = logging.getLogger(__name__)

ASSETS = Path(__file__).resolve().parent / "assets"
TOKENIZER_DIR = ASSETS / "qwen3-tokenizer"
BUILTIN_MODELS = ("tiny-qwen3.5",)
_TINY_VERSION = 1  # bump when the generated checkpoint changes
_TINY_SEED = 1234


#: Prefix of a local checkpoint's content revision (module docstring).
CONTENT_REVISION_PREFIX = "sha256:"
#: Where file digests are cached, under the settings' ``cache_dir``.
HASH_CACHE_DIR = "checkpoint-hashes"
#: Bytes read at a time when hashing a checkpoint file.
HASH_CHUNK_BYTES = 16 << 20
#: Files of one checkpoint hashed at once (threads; hashlib releases the GIL on large buffers).
HASH_THREADS = 8
_HF_BLOB = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class ModelInfo:
    """What the planner and the run config need to know about a target model, without weights.

    ``num_layers`` is the number of decoder layers N; ``hidden_size`` is H; ``revision`` is the
    checkpoint's identity (module docstring): a hub commit hash, or ``sha256:<hex>`` of a local
    checkpoint's bytes. ``legacy_revision``: what identity version 1 recorded for the same
    checkpoint (``local-<16 hex>`` for a local directory; the same as ``revision`` for a hub id).
    ``quantization``: how the checkpoint's weights are stored when they are quantised
    (:func:`quantization_of`: e.g. ``{"quant_method": "fp8", "fmt": "e4m3", "weight_block_size":
    [128, 128], ...}`` from ``config.json``'s ``quantization_config``), None for an unquantised one.
    ``files_revision``: ``sha256:<hex>`` of a local checkpoint directory's other files
    (:func:`files_revision`); None for a hub id and a built-in model.
    """

    name: str
    path: str
    model_type: str
    num_layers: int
    hidden_size: int
    revision: str
    legacy_revision: str = field(default="", compare=False)
    quantization: dict | None = field(default=None, hash=False)
    files_revision: str | None = None

    def as_dict(self) -> dict:
        """The ``model`` of ``run.json`` (``legacy_revision`` is not part of it).

        ``quantization`` is there only for a quantised checkpoint: ``model`` is hashed into the run
        identity (``hsx/runconfig.py``), so an unquantised model's dict, and with it every run id
        made before the field existed, stays what it was, while an FP8 release of a model never
        shares a run id with its bf16 release, and a conflict between them names the quantisation.
        """
        out = {
            "name": self.name,
            "model_type": self.model_type,
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "revision": self.revision,
        }
        if self.quantization is not None:
            out["quantization"] = self.quantization
        if self.files_revision is not None:
            out["files_revision"] = self.files_revision
        return out

    def differences(self, recorded) -> list[str]:
        """How this checkpoint differs from a run's recorded ``model`` (run.json's
        :class:`hsx.runconfig.ModelConfig`); [] when it is the same.

        A recorded revision that is not a content revision (``sha256:``) comes from identity
        version 1 (or a hub commit, where both agree): it is compared with
        :attr:`legacy_revision`, the way it was computed.

        A recorded ``files_revision`` names a local checkpoint by its bytes: the names (paths) are
        not compared, so the same checkpoint copied to another directory is the run's. A run planned
        before ``files_revision`` was recorded is compared as then, by its name too.
        """
        recorded = recorded.as_dict()
        mine = self.as_dict()
        if (not str(recorded.get("revision", "")).startswith(CONTENT_REVISION_PREFIX)
                and recorded.get("revision") == self.legacy_revision):
            mine["revision"] = self.legacy_revision
        if "files_revision" in recorded:
            recorded.pop("name", None)
            mine.pop("name", None)
        else:
            mine.pop("files_revision", None)
        return [f"{k}: recorded {recorded.get(k)!r}, this checkpoint {mine.get(k)!r}"
                for k in sorted(set(mine) | set(recorded)) if mine.get(k) != recorded.get(k)]


def _tiny_config() -> dict:
    full = json.loads((ASSETS / "qwen3.5-27b.json").read_text())
    text = dict(full["text_config"])
    text.update(
        architectures=["Qwen3_5ForCausalLM"],
        model_type="qwen3_5_text",
        hidden_size=64,
        num_hidden_layers=8,
        layer_types=text["layer_types"][:8],  # 3 linear + 1 full, twice: both kinds of layer
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        intermediate_size=128,
        vocab_size=151936,  # Qwen3's padded vocab; the tokenizer has 151,669 entries
        initializer_range=0.1,  # large enough that contamination between samples is visible
        eos_token_id=151645,
        bos_token_id=None,
        pad_token_id=151643,
        tie_word_embeddings=False,
        dtype="float32",
    )
    # mrope sections must sum to rotary_dim / 2 = head_dim * partial_rotary_factor / 2 = 4
    text["rope_parameters"] = dict(text["rope_parameters"], mrope_section=[2, 1, 1])
    return text


def _build_tiny(target: Path) -> None:
    import torch
    import transformers

    cfg_dict = _tiny_config()
    cfg_dict.pop("model_type")
    config = transformers.Qwen3_5TextConfig(**cfg_dict)
    torch.manual_seed(_TINY_SEED)
    model = transformers.Qwen3_5ForCausalLM(config).eval()
    transformers.utils.logging.disable_progress_bar()  # no "Writing model shards" bar in our CLI output
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        for f in TOKENIZER_DIR.iterdir():
            if f.name != "SOURCE.md":
                shutil.copyfile(f, tmp / f.name)
        shutil.copyfile(TOKENIZER_DIR / "SOURCE.md", tmp / "TOKENIZER_SOURCE.md")
        (tmp / "README.md").write_text(
            "tiny-qwen3.5: Qwen3.5-27B architecture shrunk to 8 layers x hidden 64, RANDOM weights "
            f"(seed {_TINY_SEED}), real Qwen3 tokenizer. Hidden states are synthetic.\n"
        )
        try:
            os.rename(tmp, target)  # atomic; another process may have won the race
        except OSError:
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def resolve_model_path(name: str, cache_dir: Path) -> str:
    """Return a local directory (built-in or checkpoint) or the hub id to pass to ``from_pretrained``.

    ``tiny-qwen3.5`` is generated under ``cache_dir/models/`` on first use (about 2 s on CPU).
    """
    if name in BUILTIN_MODELS:
        target = Path(cache_dir) / "models" / f"{name}-v{_TINY_VERSION}"
        if not (target / "config.json").exists():
            _build_tiny(target)
        return str(target)
    if looks_like_path(name):
        path = Path(name).expanduser()
        if not path.exists():
            raise BadConfig(f"--model {name!r}: no such directory ({path.absolute()} does not exist). Give a local "
                            f"checkpoint directory, a hub id such as Qwen/Qwen3-8B, or one of {', '.join(BUILTIN_MODELS)}")
        if not path.is_dir():
            raise BadConfig(f"--model {name!r}: {path.absolute()} is a file; give the checkpoint's directory "
                            "(with its config.json)")
        return str(path) if name.startswith("~") else name
    if "/" not in name and not Path(name).exists():
        import difflib

        close = difflib.get_close_matches(name, BUILTIN_MODELS, n=1, cutoff=0.8)
        if close:  # a misspelled built-in would otherwise go to the hub (retries, a long wait offline)
            raise BadConfig(f"--model {name!r}: not a built-in model, a local directory or a hub id (org/name); "
                            f"did you mean {close[0]!r}?")
    return name


#: Seconds the one look at the hub may take: an unreachable hub is said at once, not after
#: huggingface_hub's retries with backoff (26 s for an offline hub id, issue 22 item 9).
HUB_TIMEOUT_S = 10.0


def _hub_cache_dir() -> Path:
    """The hub cache as the environment names it now (``HF_HUB_CACHE``, else ``HF_HOME/hub``)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _hub_offline() -> bool:
    from huggingface_hub import constants

    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on") or bool(constants.HF_HUB_OFFLINE)


@lru_cache(maxsize=None)
def hub_local_only(name: str) -> bool:
    """For a hub id: True when it is read from the local hub cache alone (``local_files_only``),
    False when the hub answers. One look at each: the cache (``try_to_load_from_cache``, no
    network), then, unless ``HF_HUB_OFFLINE`` is set, one request to the hub (``HfApi.model_info``,
    at most :data:`HUB_TIMEOUT_S` s, no retries). A model in the cache is read from it when the hub
    does not answer; one that is not is refused at once.

    Raises:
        BadConfig: the model is neither in the cache nor to be had from the hub: names the model,
            the cache looked in, why the hub was not asked or what it said, and the fix.
    """
    from huggingface_hub import HfApi, constants, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    cache = _hub_cache_dir()
    cached = isinstance(try_to_load_from_cache(name, "config.json", cache_dir=cache), str)
    looked = (f"the local Hugging Face cache {cache} holds no copy of it "
              f"(looked for {cache / ('models--' + name.replace('/', '--'))})")
    fix = (f"download it where there is network (`hf download {name}`, into this cache: HF_HOME / HF_HUB_CACHE), "
           f"or give the checkpoint's local directory, or one of {', '.join(BUILTIN_MODELS)}")
    if _hub_offline():
        if cached:
            return True
        raise BadConfig(f"--model {name!r}: HF_HUB_OFFLINE is set, so the hub was not asked, and {looked}. Fix: {fix}; "
                        "or unset HF_HUB_OFFLINE where the hub can be reached")
    endpoint = os.environ.get("HF_ENDPOINT") or constants.ENDPOINT
    try:
        HfApi(endpoint=endpoint).model_info(name, timeout=HUB_TIMEOUT_S)
        return False
    except GatedRepoError:
        why = (f"the hub says it is gated: accept its terms on huggingface.co/{name} and set HF_TOKEN (or hf auth login) "
               "to a token of that account")
    except RepositoryNotFoundError:
        why = (f"the hub has no model {name!r} (or it is private: set HF_TOKEN to a token that can read it), and no "
               "local directory of that name exists")
    except Exception as exc:  # no network, a proxy, a 5xx: httpx / requests / OSError / HfHubHTTPError
        why = f"the hub at {endpoint} could not be reached ({type(exc).__name__}: {str(exc)[:200]}; asked once)"
    if cached:
        log.warning("--model %s: %s; reading it from the local hub cache %s (set HF_HUB_OFFLINE=1 to not ask the hub)",
                    name, why, cache)
        return True
    raise BadConfig(f"--model {name!r}: {why}; {looked}. Fix: {fix}; on a machine without network, with the model "
                    "in the cache, set HF_HUB_OFFLINE=1")


def hub_kwargs(path: str) -> dict:
    """``from_pretrained`` arguments for what :func:`resolve_model_path` returned: none for a local
    directory; for a hub id, the cache :func:`hub_local_only` looked in and whether to read it alone
    (one look at the cache and the hub before, so that transformers does not retry the hub for long)."""
    if Path(path).is_dir():
        return {}
    return {"cache_dir": str(_hub_cache_dir()), "local_files_only": hub_local_only(path)}


def looks_like_path(name: str) -> bool:
    """True for a model name that can only be a local path, not a hub id (``org/name``): absolute,
    starting with ``.`` or ``~``, or with more than one ``/``."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or (os.sep != "/" and os.sep in name)


def _legacy_revision(path: str, config) -> str:
    """The revision identity version 1 recorded (kept as it was: runs of version 1 are checked with it)."""
    commit = getattr(config, "_commit_hash", None)
    if commit:
        return commit
    p = Path(path)
    weights = sorted(p.glob("*.safetensors")) if p.is_dir() else []
    if weights:
        h = hashlib.sha256()
        for w in weights:
            h.update(f"{w.name}:{w.stat().st_size};".encode())
        h.update((p / "config.json").read_bytes() if (p / "config.json").exists() else b"")
        return "local-" + h.hexdigest()[:16]
    return "unknown"


def _snapshot_commit(repo_id: str) -> str | None:
    """The commit of the hub cache's snapshot that ``config.json`` of ``repo_id`` was read from
    (``<cache>/models--org--name/snapshots/<40 hex>/config.json``, huggingface_hub's cache layout),
    None when it is not in the cache."""
    import re

    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo_id, "config.json", cache_dir=str(_hub_cache_dir()))
    except Exception:
        return None
    if not isinstance(found, str):
        return None
    commit = Path(found).parent.name
    return commit if re.fullmatch(r"[0-9a-f]{40}", commit) else None


def _revision(path: str, config, cache_dir: Path) -> str:
    """A local directory's content revision, else the hub commit hash (module docstring).

    transformers 5.x no longer sets ``config._commit_hash``; the commit is then the name of the
    cache snapshot the config was read from (:func:`_snapshot_commit`). Without either it is
    ``unknown`` (two revisions of one hub id would then share a run id: a warning says so)."""
    if Path(path).is_dir():
        return content_revision(Path(path), cache_dir)
    commit = getattr(config, "_commit_hash", None) or _snapshot_commit(path)
    if commit is None:
        log.warning("the revision of hub model %s is unknown (no commit hash in its config or cache path): runs of "
                    "two revisions of it would share an identity; give a local directory or pin the revision", path)
    return commit or "unknown"


def checkpoint_files(path: Path) -> list[Path]:
    """The files of a local checkpoint that decide the model, in name order.

    ``config.json``, ``*.safetensors.index.json`` and every top-level ``*.safetensors`` file (what
    ``from_pretrained(use_safetensors=True)`` reads); when there is no safetensors file, the pickle
    weight files (:data:`PICKLE_WEIGHTS`; read only with ``HSX_ALLOW_PICKLE_CHECKPOINTS``) and
    their index.
    """
    weights = sorted(path.glob("*.safetensors"))
    if weights:
        index = sorted(path.glob("*.safetensors.index.json"))
    else:
        weights = sorted({f for pattern in PICKLE_WEIGHTS for f in path.glob(pattern)})
        index = sorted(path.glob("*.bin.index.json"))
    config = [path / "config.json"] if (path / "config.json").is_file() else []
    return sorted(config + index + [w for w in weights if w.is_file()], key=lambda f: f.name)


def content_revision(path: Path, cache_dir: Path) -> str:
    """``sha256:<hex>`` of a local checkpoint's files (module docstring).

    Raises:
        BadConfig: a checkpoint file cannot be read.
    """
    files = checkpoint_files(path)
    try:
        with ThreadPoolExecutor(max_workers=max(1, min(HASH_THREADS, len(files))), thread_name_prefix="hash") as pool:
            digests = list(pool.map(lambda f: file_sha256(f, cache_dir), files))
    except OSError as exc:
        raise BadConfig(f"checkpoint {path}: cannot read {exc.filename or 'a file'} to compute its identity "
                        f"({exc.strerror or exc}); check its permissions") from None
    manifest = "".join(f"{f.name}\t{d}\n" for f, d in zip(files, digests))
    return CONTENT_REVISION_PREFIX + hashlib.sha256(manifest.encode()).hexdigest()


#: Top-level files of a local checkpoint that :func:`other_files` leaves out (lower-cased names):
#: documentation, and weights in formats it is not loaded from (with :data:`PICKLE_WEIGHTS`).
OTHER_FILES_SKIPPED = ("*.md", "license*", "notice*", "*.safetensors", "*.index.json", "*.h5", "*.msgpack", "*.onnx",
                       "*.gguf", "*.npz")


def other_files(path: Path) -> list[Path]:
    """The top-level files of a local checkpoint outside :func:`checkpoint_files`, in name order: its
    tokenizer's (``tokenizer.json``, ``tokenizer_config.json``, the vocabulary, merges, ...),
    ``generation_config.json``, its code and any other, but :data:`OTHER_FILES_SKIPPED`, the pickle
    weights (:data:`PICKLE_WEIGHTS`) and hidden files."""
    from fnmatch import fnmatchcase

    decided = {f.name for f in checkpoint_files(path)}
    skipped = OTHER_FILES_SKIPPED + PICKLE_WEIGHTS
    return sorted((f for f in path.iterdir() if f.is_file() and not f.name.startswith(".") and f.name not in decided
                   and not any(fnmatchcase(f.name.lower(), pattern) for pattern in skipped)), key=lambda f: f.name)


def files_revision(path: Path) -> str:
    """``sha256:<hex>`` of a local checkpoint's :func:`other_files`, one ``<file name>\t<sha256 of its
    bytes>`` line per file, as :func:`content_revision`. They are small (a tokenizer is some MB): read
    each time, not cached.

    Raises:
        BadConfig: a file cannot be read.
    """
    try:
        manifest = "".join(f"{f.name}\t{hashlib.sha256(f.read_bytes()).hexdigest()}\n" for f in other_files(path))
    except OSError as exc:
        raise BadConfig(f"checkpoint {path}: cannot read {exc.filename or 'a file'} to compute its identity "
                        f"({exc.strerror or exc}); check its permissions") from None
    return CONTENT_REVISION_PREFIX + hashlib.sha256(manifest.encode()).hexdigest()


def file_sha256(path: Path, cache_dir: Path) -> str:
    """Hex sha256 of a file's bytes, from the cache or by reading it.

    A Hugging Face blob's name (``blobs/<64 hex>``) is not taken on trust: it is hashed once like any
    file (a blob overwritten in place keeps its name), and a content that does not match its name is
    logged. The digest is cached in ``<cache_dir>/checkpoint-hashes/`` under the file's real path, device, inode, size, mtime and
    ctime; a miss reads the file in :data:`HASH_CHUNK_BYTES` chunks while holding a lock on that
    entry, so processes that start together hash it once. A cache that cannot be written is only
    logged. Raises OSError when the file cannot be read.
    """
    real = Path(os.path.realpath(path))
    st = os.stat(real)
    key = hashlib.sha256(
        f"{real}\0{st.st_dev}\0{st.st_ino}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}".encode()).hexdigest()
    entry = Path(cache_dir) / HASH_CACHE_DIR / f"{key}.json"
    cached = _read_entry(entry)
    if cached:
        return cached
    lock = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        lock = open(entry.with_suffix(".lock"), "a")
        _flock(lock)
        cached = _read_entry(entry)  # another process may have hashed it while we waited
        if cached:
            return cached
    except OSError as exc:
        log.warning("checkpoint hash cache %s is not usable (%s): hashing %s without it", entry.parent, exc, real)
    try:
        # Said, because it is slow (minutes for a large checkpoint) and should happen once per machine.
        log.info("hashing %s (%.2f GB): not in the checkpoint hash cache %s", real, st.st_size / 1e9, entry.parent)
        digest = _sha256_of_bytes(real)
        if real.parent.name == "blobs" and _HF_BLOB.fullmatch(real.name) and digest != real.name:
            log.warning("%s: its bytes hash to %s, not to its name: the blob was changed after the hub downloaded it; "
                        "the model's identity follows the bytes", real, digest)
        try:
            tmp = entry.with_name(f".{entry.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"path": str(real), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                                       "sha256": digest}))
            os.replace(tmp, entry)
        except OSError as exc:
            log.warning("could not cache the sha256 of %s in %s (%s)", real, entry.parent, exc)
        return digest
    finally:
        if lock is not None:
            lock.close()  # releases the flock


def _read_entry(entry: Path) -> str | None:
    try:
        digest = json.loads(entry.read_text())["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return digest if isinstance(digest, str) and _HF_BLOB.fullmatch(digest) else None


def _flock(f) -> None:
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock, at worst two processes hash the same file
        return
    fcntl.flock(f.fileno(), fcntl.LOCK_EX)


def _sha256_of_bytes(path: Path) -> str:
    h = hashlib.sha256()
    view = memoryview(bytearray(HASH_CHUNK_BYTES))
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            h.update(view[:n])
    return h.hexdigest()


#: weight files that are pickles (``torch.load`` runs code from them); never read unless allowed.
PICKLE_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")


def safetensors_only(path: str, allow_pickle: bool) -> bool | None:
    """The ``use_safetensors`` argument of ``from_pretrained`` for the checkpoint at ``path``.

    True (only ``*.safetensors`` weights are read) unless ``allow_pickle``
    (``HSX_ALLOW_PICKLE_CHECKPOINTS``), then None (safetensors when present, else the pickle files).

    Raises:
        BadConfig: ``path`` is a local directory with pickle weights and no safetensors while
            pickles are not allowed (refused before any file is opened).
    """
    if allow_pickle:
        return None
    p = Path(path)
    if p.is_dir() and not any(p.glob("*.safetensors")):
        pickles = sorted(f.name for pattern in PICKLE_WEIGHTS for f in p.glob(pattern))
        if pickles:
            raise BadConfig(
                f"checkpoint {path} has only pickle weights ({', '.join(pickles[:3])}): refused, because loading a pickle "
                "runs whatever code it holds. Convert it to safetensors, or set HSX_ALLOW_PICKLE_CHECKPOINTS=true if you "
                "trust where it comes from"
            )
    return True


def model_info(name: str, cache_dir: Path, *, trust_remote_code: bool = False) -> ModelInfo:
    """Read a target model's config (no weights) and return its identity and shape.

    The identity of a local checkpoint is a hash of its bytes (module docstring): the first call
    for a checkpoint reads every weight file once; later calls on this machine read the cache.

    Raises:
        BadConfig: the model cannot be found, its config read, or a checkpoint file read.
    """
    from transformers import AutoConfig

    path = resolve_model_path(name, cache_dir)
    if Path(path).is_dir() and not (Path(path) / "config.json").is_file():
        raise BadConfig(f"--model {name!r}: the directory {path} has no config.json; give the directory of a "
                        "Hugging Face checkpoint (config.json, tokenizer files, *.safetensors)")
    hub = hub_kwargs(path)  # a hub id: the cache and the hub, each looked at once; BadConfig at once
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, **hub)
    except Exception as exc:  # transformers raises OSError / ValueError / EnvironmentError variants
        if not trust_remote_code and ("trust_remote_code" in str(exc) or "custom code" in str(exc)):
            raise BadConfig(
                f"--model {name!r}: its checkpoint needs its own Python code (config auto_map), which is not run unless "
                "trusted: refused. Read that code, then set HSX_TRUST_REMOTE_CODE=true (trust_remote_code) if you trust it"
            ) from None
        raise BadConfig(
            f"--model {name!r}: cannot read its config ({exc.__class__.__name__}: {str(exc)[:300]}). "
            f"Give a hub id (cached or reachable), a local checkpoint directory, or one of {', '.join(BUILTIN_MODELS)}"
        ) from None
    text = config.get_text_config()
    return ModelInfo(
        name=name,
        path=path,
        model_type=text.model_type,
        num_layers=int(text.num_hidden_layers),
        hidden_size=int(text.hidden_size),
        revision=_revision(path, config, Path(cache_dir)),
        legacy_revision=_legacy_revision(path, config),
        quantization=quantization_of(config),
        files_revision=files_revision(Path(path)) if Path(path).is_dir() and name not in BUILTIN_MODELS else None,
    )


#: Keys of a checkpoint's ``quantization_config`` recorded in its identity: what decides how its
#: weights are stored and computed (transformers' ``FineGrainedFP8Config`` and the other methods'
#: ``bits`` / ``group_size``). The skip list (``modules_to_not_convert``, hundreds of names for
#: Qwen3-Next) is recorded as its sha256: the weight bytes are in ``revision`` already.
QUANTIZATION_KEYS = ("quant_method", "fmt", "weight_block_size", "activation_scheme", "scale_fmt", "bits",
                     "group_size")


def quantization_of(config) -> dict | None:
    """The quantisation a checkpoint's config declares, as recorded in :attr:`ModelInfo.quantization`.

    ``config``: a transformers config (``quantization_config`` a dict as read from ``config.json``,
    or a ``QuantizationConfigMixin``). None when it has no ``quantization_config`` (an unquantised
    checkpoint). E.g. Qwen3-8B-FP8: ``{"activation_scheme": "dynamic", "fmt": "e4m3",
    "quant_method": "fp8", "weight_block_size": [128, 128]}``.
    """
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        qc = getattr(config.get_text_config(), "quantization_config", None) if hasattr(config, "get_text_config") else None
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict()
    out = {k: (list(qc[k]) if isinstance(qc[k], tuple) else qc[k]) for k in QUANTIZATION_KEYS if qc.get(k) is not None}
    skip = qc.get("modules_to_not_convert")
    if skip:
        out["modules_to_not_convert_sha256"] = hashlib.sha256(json.dumps(sorted(skip)).encode()).hexdigest()
    return out or {"quant_method": "unknown"}


def load_tokenizer(name: str, cache_dir: Path, *, trust_remote_code: bool = False):
    """The target model's tokenizer (with its chat template). Raises :class:`BadConfig`."""
    from transformers import AutoTokenizer

    path = resolve_model_path(name, cache_dir)
    hub = hub_kwargs(path)
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, **hub)
    except Exception as exc:
        raise BadConfig(f"--model {name!r}: cannot load its tokenizer ({exc.__class__.__name__}: {str(exc)[:300]})") from None
