"""The run config (``run.json``): everything that decides the bytes of a run's output.

The run id is derived from the config and the dataset's content, so the same dataset and config
always give the same run id (re-running ``enqueue`` resumes), and a different config can never be
written into an existing run by accident (:class:`core.errors.RunConflict`).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field

from core.errors import RunConflict
from core.store import Store

SCHEMA_VERSION = 1
RUN_JSON = "run.json"
_RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

# Fields that are reported but do not change the output bytes: excluded from the identity.
_NON_IDENTITY = ("run_id", "created_at", "dataset_source", "stats")


@dataclass
class RunConfig:
    """What a run extracts and how. Stored as ``<run>/run.json``; workers read it, never the CLI args.

    ``model`` is :meth:`core.models.ModelInfo.as_dict`, ``layers`` is
    :meth:`core.layers.LayerSelection.as_dict`; ``store_dtype`` is the dtype of the stored hidden
    states (``bfloat16`` or ``float32``). ``tokenizer`` holds the tokenizer class, vocab size, chat
    template hash, end-of-turn ids and ``enable_thinking`` (None: the template's default).
    ``sample_policy``: which records become samples and how: ``over_length`` (``truncate`` or
    ``drop``), ``allow_text`` (plain-text records used) and ``min_consecutive_supervised``; empty
    in run.json files written before it existed.
    """

    model: dict
    model_name: str
    layers: dict
    max_length: int
    batch_tokens: int
    max_batch_samples: int
    store_dtype: str
    tokenizer: dict
    dataset_fingerprint: str
    dataset_source: str
    limit: int | None
    sample_policy: dict = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION
    run_id: str = ""
    created_at: str = ""
    stats: dict = field(default_factory=dict)

    def identity(self) -> dict:
        """The part of the config that decides the output bytes (used for the run id and conflicts)."""
        return {k: v for k, v in self.as_dict().items() if k not in _NON_IDENTITY}

    def identity_sha256(self) -> str:
        return hashlib.sha256(json.dumps(self.identity(), sort_keys=True).encode()).hexdigest()

    def default_run_id(self, dataset_name: str) -> str:
        """``<dataset name>-<12 hex of the identity hash>``, e.g. ``sharegpt-3fa9c1d2e4b5``."""
        stem = re.sub(r"[^A-Za-z0-9._-]+", "-", dataset_name).strip("-.")[:40] or "run"
        return f"{stem}-{self.identity_sha256()[:12]}"

    def as_dict(self) -> dict:
        return dict(self.__dict__)

    def to_json(self) -> bytes:
        return json.dumps(self.as_dict(), indent=2, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "RunConfig":
        return cls(**json.loads(data))


def check_run_id(run_id: str) -> str:
    """Refuse run ids that are not safe as one path segment. Raises :class:`ValueError`."""
    if not _RUN_ID_RE.match(run_id):
        raise ValueError(f"run id {run_id!r}: use 1-128 characters from A-Z a-z 0-9 . _ - (starting with a letter or digit)")
    return run_id


def diff_identity(old: dict, new: dict) -> list[str]:
    """Human-readable differences between two config identities (for :class:`RunConflict`)."""
    out = []
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            out.append(f"{key}: stored {json.dumps(old.get(key))[:120]} != requested {json.dumps(new.get(key))[:120]}")
    return out


def claim_run(run_store: Store, config: RunConfig) -> bool:
    """Write ``run.json`` if absent; if present, check it holds the same identity.

    Returns True when this call created the run, False when it already existed with the same config.

    Raises:
        RunConflict: the stored run.json has another config (nothing is written).
    """
    if run_store.create(RUN_JSON, config.to_json()):
        return True
    stored = RunConfig.from_json(run_store.read(RUN_JSON))
    differences = diff_identity(stored.identity(), config.identity())
    if differences:
        raise RunConflict(
            f"run {config.run_id!r} already exists at {run_store.url} with another config:\n  "
            + "\n  ".join(differences)
            + "\nUse another --run-id (or omit it to get one derived from the config), or another --output."
        )
    return False


def load_run(run_store: Store) -> RunConfig:
    """Read ``run.json``. Raises :class:`core.store.MissingKey` if the run does not exist."""
    return RunConfig.from_json(run_store.read(RUN_JSON))
