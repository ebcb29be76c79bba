"""The run config (``run.json``): what a run extracts and how, and its **identity**.

The run id is derived from the identity and the dataset's content, so the same dataset and config
always give the same run id (re-running ``enqueue`` / ``run`` resumes), and a different config can
never be written into an existing run by accident (:class:`hsx.errors.RunConflict`). Every marker
carries the identity's sha256 (``config_sha256``); ``verify`` and the readers accept a marker only
when it equals the one computed from ``run.json``.

The identity is an explicit, versioned list of fields: :data:`IDENTITY_FIELDS` for the
``identity_version`` recorded in ``run.json``. Fields not in the list (:data:`NON_IDENTITY_FIELDS`)
are recorded but never hashed, so adding a field to :class:`RunConfig` does not by itself change any
run id or make the markers of existing runs fail ``verify``.

Identity versions:

| version | fields hashed | notes |
|---|---|---|
| 1 | ``model``, ``model_name``, ``layers``, ``max_length``, ``batch_tokens``, ``max_batch_samples``, ``store_dtype``, ``tokenizer``, ``dataset_fingerprint``, ``limit``, ``sample_policy``, ``schema_version`` | what every run made before ``identity_version`` existed hashed (every field but ``run_id``, ``created_at``, ``dataset_source`` and ``stats``); a ``run.json`` without ``identity_version`` is version 1. ``identity_version`` itself is not hashed, so those runs keep their ids and their markers' ``config_sha256`` |
| 3 | version 2's, ``plan_windows`` and ``dataset_options`` | the streamed plan (``producer/planner.py``): samples are sorted and cut into batches within windows of consecutive samples, whose sizes ``plan_windows`` gives (``[first, largest]``, each window twice the one before up to the largest), where versions 1 and 2 sorted the whole dataset (``plan_windows`` absent: ``None``); ``dataset_options`` says which records of the dataset are read and in which order (``shuffle``, ``seed``, ``sample``, and a hub dataset's ``subset`` and ``split``). ``dataset_fingerprint`` is computed over 8 MiB blocks (``producer/sources.py``), the hash that the reading pass checks |
| 2 | version 1's, ``special_tokens_in_content`` and ``identity_version`` | special-token strings inside message content are tokenised as text (``text``) unless ``special`` is asked for (``producer/masks.py``); a version-1 run.json reads as ``special``, what its code did. And ``model.revision`` of a local checkpoint directory is ``sha256:<hex>``, a hash of its weight bytes (``hsx/models.py``), where version 1 recorded ``local-<16 hex>``, a hash of the weight files' names and sizes and of ``config.json``: two checkpoints with weights of the same shapes had one revision. A hub id's revision is its commit hash in both |

Why each version-1 field decides the bytes of the shards: ``model`` (name, type, layer count,
hidden size, revision: which weights; and, for a quantised checkpoint only, ``quantization``:
how they are stored, e.g. fine-grained FP8, ``hsx/models.py`` ``ModelInfo.as_dict``; absent for an
unquantised one, the same rule as :data:`IDENTITY_FIELDS_UNLESS_DEFAULT` inside ``model``, so
no earlier run id changes), ``tokenizer`` (class, vocab size, chat template sha256,
end-of-turn ids, ``enable_thinking``: which token ids and loss masks), ``dataset_fingerprint`` and
``limit`` (which records), ``sample_policy`` (which records become samples, truncated or dropped),
``max_length`` (truncation), ``batch_tokens`` and ``max_batch_samples`` (which samples share a
shard), ``layers`` (which states: ids, final states), ``store_dtype``, ``schema_version`` (the
layout). ``model_name`` repeats ``model.name``, and ``layers`` also holds derived indices and the
draft config it was read from (``source``): kept because version 1 hashed them. Version 2 adds
``special_tokens_in_content`` (which token ids a message's text becomes).

Why version 2 and not only new values: a local checkpoint's revision changed how it is computed,
so every re-planned local run gets a new run id anyway; the version says which way a run's
``model.revision`` was computed, so that a worker of this code can still check a version-1 run's
checkpoint the way it was recorded (:meth:`hsx.models.ModelInfo.differences`), and version-1 runs
keep their ids, their markers' ``config_sha256`` and ``verify``.

Adding a field to :class:`RunConfig`:

- give it a default that means what the code did before it existed (so older ``run.json`` files
  load with the right value);
- if it does not change the bytes of the shards, add it to :data:`NON_IDENTITY_FIELDS`: no run id
  changes;
- if it does, but its default is what every earlier run did (a choice made explicit), add it to
  :data:`IDENTITY_FIELDS_UNLESS_DEFAULT`: it is hashed only when set to another value, so no run id
  changes and the other value gets its own ids (``added_tokens_in_content``);
- if it does, add ``IDENTITY_FIELDS[n + 1] = IDENTITY_FIELDS[n] + ("new_field",)``, set
  :data:`IDENTITY_VERSION` to ``n + 1`` and add a row to the table above. From version 2 on,
  ``identity_version`` is hashed too. Runs of older versions keep their ids and still verify (their
  identity is computed with their own version's list); new runs get new ids.

``tests/test_runconfig.py`` fails when a field is in neither list.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field

from hsx.errors import RunConflict, RunFormatError
from hsx.layout import RUN_JSON
from hsx.shard import SCHEMA_VERSION  # the shard layout's version, recorded (and hashed) in run.json
from hsx.store import MissingKey, Store
_RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

#: The identity version of the runs this code creates.
IDENTITY_VERSION = 3
#: The version of a ``run.json`` written without ``identity_version`` (before it existed).
LEGACY_IDENTITY_VERSION = 1
#: Per identity version, the run.json fields hashed into the identity (see the module docstring).
IDENTITY_FIELDS: dict[int, tuple[str, ...]] = {
    1: ("model", "model_name", "layers", "max_length", "batch_tokens", "max_batch_samples", "store_dtype",
        "tokenizer", "dataset_fingerprint", "limit", "sample_policy", "schema_version"),
}
IDENTITY_FIELDS[2] = IDENTITY_FIELDS[1] + ("special_tokens_in_content",)
IDENTITY_FIELDS[3] = IDENTITY_FIELDS[2] + ("plan_windows", "dataset_options")
#: Fields recorded in run.json that never change the bytes of the shards: never hashed.
#: ``dataset_source`` and ``chat_template_file`` are paths (the bytes they name are hashed:
#: ``dataset_fingerprint``, ``tokenizer.chat_template_sha256``); ``dataset`` describes the source.
NON_IDENTITY_FIELDS = ("identity_version", "run_id", "created_at", "dataset_source", "stats", "dataset",
                       "chat_template_file")
#: Fields hashed only when they differ from the value given here, at every identity version: a
#: choice added after the runs that made its default implicitly (their bytes are what the default
#: gives), so those runs and the same options planned now keep one run id, and the other value gets
#: another. ``added_tokens_in_content``: "token", what every run before the choice did.
IDENTITY_FIELDS_UNLESS_DEFAULT: dict[str, object] = {"added_tokens_in_content": "token"}


@dataclass
class RunConfig:
    """What a run extracts and how. Stored as ``<run>/run.json``; workers read it, never the CLI args.

    ``model`` is :meth:`hsx.models.ModelInfo.as_dict`, ``layers`` is
    :meth:`hsx.layers.LayerSelection.as_dict`; ``store_dtype`` is the dtype of the stored hidden
    states, a :class:`hsx.shard.StoreDtype` value (``bfloat16``, ``float32`` or ``fp8``: float8 e4m3
    with per-token scales, ``hsx/fp8.py``); ``layers["final"]`` is a :class:`hsx.shard.Final` value. ``tokenizer`` holds the tokenizer class, vocab size, chat
    template hash, end-of-turn ids and ``enable_thinking`` (None: the template's default).
    ``sample_policy``: which records become samples and how: ``over_length`` (``truncate`` or
    ``drop``), ``allow_text`` (plain-text records used) and ``min_consecutive_supervised``; empty
    in run.json files written before it existed. ``special_tokens_in_content``: how special-token
    strings inside message content were tokenised, ``text`` or ``special``
    (:data:`producer.masks.SPECIAL_TOKENS_IN_CONTENT`); ``special`` in run.json files written before
    it existed (what that code did). ``identity_version`` says which fields make the identity
    (:data:`IDENTITY_FIELDS`) and how ``model.revision`` was computed (module docstring).
    ``added_tokens_in_content``: how the strings of non-special added tokens (``<think>``) inside
    message content were tokenised, ``token`` (their ids: every run before the choice) or ``text``
    (:data:`producer.masks.ADDED_TOKENS_IN_CONTENT`); hashed only when ``text``
    (:data:`IDENTITY_FIELDS_UNLESS_DEFAULT`).

    Keys of a run.json that this code does not know (written by a newer version) are kept in
    ``extra`` and written back, never hashed.
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
    special_tokens_in_content: str = "special"
    added_tokens_in_content: str = "token"
    #: ``[first, largest]`` samples per window of the streamed plan; None: the whole dataset sorted
    #: at once (runs made before identity version 3).
    plan_windows: list[int] | None = None
    #: Which records are read, in which order: ``shuffle`` (bool), ``seed``, ``sample`` (a seeded
    #: subset of that many records), ``subset`` and ``split`` of a hub dataset; {} before version 3.
    dataset_options: dict = field(default_factory=dict)
    #: What the dataset is (kind, files and sizes, hub revision): recorded, never hashed.
    dataset: dict = field(default_factory=dict)
    #: The --chat-template file that replaced the tokenizer's template (its sha256 is in ``tokenizer``).
    chat_template_file: str | None = None
    schema_version: int = SCHEMA_VERSION
    identity_version: int = IDENTITY_VERSION
    run_id: str = ""
    created_at: str = ""
    stats: dict = field(default_factory=dict)
    #: run.json keys this code does not know; kept, never hashed.
    extra: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    #: identity fields the loaded run.json did not hold (it predates them): left out of the hash,
    #: as the code that wrote it did.
    _absent: frozenset = field(default=frozenset(), init=False, repr=False, compare=False)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The fields written to run.json (not ``extra``)."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.init)

    def identity(self, version: int | None = None) -> dict:
        """The fields that decide the output bytes, as hashed for the run id and the markers.

        ``version``: the identity version to compute (default: this config's own). A config
        compared with a run of a newer version takes its newer fields' defaults.
        """
        version = self.identity_version if version is None else version
        names = identity_fields(version)
        absent = self._absent if version == self.identity_version else frozenset()
        out = {k: getattr(self, k) for k in names if k not in absent}
        out.update({k: getattr(self, k) for k, default in IDENTITY_FIELDS_UNLESS_DEFAULT.items()
                    if getattr(self, k) != default})
        if version >= 2:
            out["identity_version"] = version
        return out

    def identity_sha256(self, version: int | None = None) -> str:
        """sha256 of :meth:`identity`: the ``config_sha256`` of the run's markers."""
        return hashlib.sha256(json.dumps(self.identity(version), sort_keys=True).encode()).hexdigest()

    def default_run_id(self, dataset_name: str) -> str:
        """``<dataset name>-<12 hex of the identity hash>``, e.g. ``sharegpt-3fa9c1d2e4b5``."""
        stem = re.sub(r"[^A-Za-z0-9._-]+", "-", dataset_name).strip("-.")[:40] or "run"
        return f"{stem}-{self.identity_sha256()[:12]}"

    def as_dict(self) -> dict:
        out = dict(self.extra)
        out.update({k: getattr(self, k) for k in self.field_names()})
        return out

    def to_json(self) -> bytes:
        return json.dumps(self.as_dict(), indent=2, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "RunConfig":
        """Read a run.json of any identity version this code knows.

        A run.json without ``identity_version`` is version 1 (:data:`LEGACY_IDENTITY_VERSION`).

        Raises:
            RunFormatError: not a run config, or an identity version this code does not know.
        """
        try:
            raw = json.loads(data)
        except ValueError as exc:
            raise RunFormatError(f"run.json is not JSON ({exc})") from None
        if not isinstance(raw, dict):
            raise RunFormatError("run.json is not a JSON object")
        version = raw.get("identity_version", LEGACY_IDENTITY_VERSION)
        identity_fields(version)  # RunFormatError for a version this code does not know
        names = set(cls.field_names())
        kwargs = {k: v for k, v in raw.items() if k in names}
        kwargs["identity_version"] = version
        try:
            config = cls(**kwargs)
        except TypeError as exc:
            raise RunFormatError(f"run.json lacks a required field ({exc})") from None
        config.extra = {k: v for k, v in raw.items() if k not in names}
        config._absent = frozenset(k for k in IDENTITY_FIELDS[version] if k not in raw)
        return config


def identity_fields(version: int) -> tuple[str, ...]:
    """The fields hashed at identity ``version``. Raises :class:`RunFormatError` for an unknown one."""
    if isinstance(version, bool) or not isinstance(version, int) or version not in IDENTITY_FIELDS:
        raise RunFormatError(
            f"run.json has identity_version {version!r}; this version of hsx knows "
            f"{', '.join(map(str, sorted(IDENTITY_FIELDS)))}: it was written by a newer hsx, upgrade to read it"
        )
    return IDENTITY_FIELDS[version]


def check_run_id(run_id: str) -> str:
    """Refuse run ids that are not safe as one path segment. Raises :class:`ValueError`."""
    if not _RUN_ID_RE.match(run_id):
        raise ValueError(f"run id {run_id!r}: use 1-128 characters from A-Z a-z 0-9 . _ - (starting with a letter or digit)")
    return run_id


def diff_identity(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Human-readable differences between two config identities (for :class:`RunConflict`).

    Fields that are objects on both sides are compared key by key (``model.revision: stored ...``),
    so the part that differs is named, not cut off in a long value.
    """
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            out.extend(diff_identity(a, b, f"{prefix}{key}."))
        else:
            out.append(f"{prefix}{key}: stored {json.dumps(a)[:120]} != requested {json.dumps(b)[:120]}")
    return out


def check_run(run_store: Store, config: RunConfig) -> RunConfig | None:
    """The stored config of the run at ``run_store`` if it holds the same identity as ``config``;
    None when there is no run there yet. Writes nothing.

    The two are compared at the newer of their identity versions, so a run made by an older
    version of hsx is resumed (its run.json is left as it is) when nothing that decides the bytes
    differs.

    Raises:
        RunConflict: the stored run.json has another config.
        RunFormatError: the stored run.json cannot be read (an identity version this code does not know).
    """
    try:
        data = run_store.read(RUN_JSON)
    except MissingKey:
        return None
    stored = RunConfig.from_json(data)
    _check_same(run_store, stored, config)
    return stored


def _check_same(run_store: Store, stored: RunConfig, config: RunConfig) -> None:
    version = max(stored.identity_version, config.identity_version)
    differences = diff_identity(stored.identity(version), config.identity(version))
    if differences:
        raise RunConflict(
            f"run {config.run_id!r} already exists at {run_store.url} with another config:\n  "
            + "\n  ".join(differences)
            + "\nUse another --run-id (or omit it to get one derived from the config), or another --output."
        )


def claim_run(run_store: Store, config: RunConfig) -> bool:
    """Write ``run.json`` if absent; if present, check it holds the same identity (as :func:`check_run`).

    Returns True when this call created the run, False when it already existed with the same config.

    Raises:
        RunConflict: the stored run.json has another config (nothing is written).
        RunFormatError: the stored run.json cannot be read (an identity version this code does not know).
    """
    if run_store.create(RUN_JSON, config.to_json()):
        return True
    _check_same(run_store, RunConfig.from_json(run_store.read(RUN_JSON)), config)
    return False


def load_run(run_store: Store) -> RunConfig:
    """Read ``run.json``.

    Raises:
        hsx.store.MissingKey: the run does not exist.
        RunFormatError: run.json cannot be read by this version of hsx.
    """
    return RunConfig.from_json(run_store.read(RUN_JSON))
