"""Target models: resolving a name to a checkpoint, its identity, and the built-in tiny model.

A model name is a Hugging Face hub id, a local checkpoint directory, or ``tiny-qwen3.5``: the
real Qwen3.5-27B architecture (hybrid Gated DeltaNet + gated attention, from the bundled
``assets/qwen3.5-27b.json``) shrunk to 8 layers of hidden size 64, with random weights from a fixed
seed and the real Qwen3 tokenizer. Its hidden states are synthetic: it exists so that the whole
job runs on a fresh clone with no hub and no GPU, not to train a useful draft model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from core.errors import BadConfig

ASSETS = Path(__file__).resolve().parent / "assets"
TOKENIZER_DIR = ASSETS / "qwen3-tokenizer"
BUILTIN_MODELS = ("tiny-qwen3.5",)
_TINY_VERSION = 1  # bump when the generated checkpoint changes
_TINY_SEED = 1234


@dataclass(frozen=True)
class ModelInfo:
    """What the planner and the run config need to know about a target model, without weights.

    ``num_layers`` is the number of decoder layers N; ``hidden_size`` is H.
    """

    name: str
    path: str
    model_type: str
    num_layers: int
    hidden_size: int
    revision: str

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "model_type": self.model_type,
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "revision": self.revision,
        }


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
    return name


def looks_like_path(name: str) -> bool:
    """True for a model name that can only be a local path, not a hub id (``org/name``): absolute,
    starting with ``.`` or ``~``, or with more than one ``/``."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or (os.sep != "/" and os.sep in name)


def _revision(path: str, config) -> str:
    commit = getattr(config, "_commit_hash", None)
    if commit:
        return commit
    p = Path(path)
    weights = sorted(p.glob("*.safetensors")) if p.is_dir() else []
    if weights:
        # Local checkpoint: identify it by the weight files' names and sizes (cheap, stable).
        h = hashlib.sha256()
        for w in weights:
            h.update(f"{w.name}:{w.stat().st_size};".encode())
        h.update((p / "config.json").read_bytes() if (p / "config.json").exists() else b"")
        return "local-" + h.hexdigest()[:16]
    return "unknown"


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

    Raises:
        BadConfig: the model cannot be found or its config read.
    """
    from transformers import AutoConfig

    path = resolve_model_path(name, cache_dir)
    if Path(path).is_dir() and not (Path(path) / "config.json").is_file():
        raise BadConfig(f"--model {name!r}: the directory {path} has no config.json; give the directory of a "
                        "Hugging Face checkpoint (config.json, tokenizer files, *.safetensors)")
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
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
        revision=_revision(path, config),
    )


def load_tokenizer(name: str, cache_dir: Path, *, trust_remote_code: bool = False):
    """The target model's tokenizer (with its chat template). Raises :class:`BadConfig`."""
    from transformers import AutoTokenizer

    path = resolve_model_path(name, cache_dir)
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise BadConfig(f"--model {name!r}: cannot load its tokenizer ({exc.__class__.__name__}: {str(exc)[:300]})") from None
