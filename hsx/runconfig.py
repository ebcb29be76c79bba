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
| 4 | version 3's but ``model_name``; each typed part by its :meth:`ConfigPart.identity` | the parts (``model``, ``layers``, ``tokenizer``, ``sample_policy``, ``dataset_options``) are typed (:class:`ConfigPart`), and only their fields that decide the bytes are hashed: ``layers`` by its ids and final states, not its prose (``convention``, ``notes``), its derived ids or the ``--draft-config`` path the ids were read from (``source``); ``model`` by name, type, layer count, hidden size, revision and quantisation (a local checkpoint directory planned by this code by its bytes, ``revision`` and ``files_revision``, not by its name, a path: the same checkpoint copied elsewhere is the same run; a hub id, a built-in model and a local run planned before ``files_revision`` was recorded by name, and keep their ids); ``tokenizer`` by all it holds; ``sample_policy`` by its three choices; ``dataset_options`` by the options set. ``model_name`` (a repeat of ``model.name``) is not hashed. Versions 1-3 hashed each part as run.json holds it, and still do for their runs, so those keep their ids and their markers' ``config_sha256`` |

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

Why version 4: rewording the layers' prose, or passing the same draft config from another
path, gave a new run id under versions 1-3, and nothing resumed. A run's own ``identity_version``
decides how it is hashed, so a version-3 run keeps its id; the same options planned by this code
get a version-4 id (a new run, as with every version before), and a version-3 run resumed under its
``--run-id`` is compared at version 4: only what decides the bytes must agree.

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
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hsx.errors import RunConflict, RunFormatError
from hsx.layout import RUN_JSON
from hsx.shard import SCHEMA_VERSION  # the shard layout's version, recorded (and hashed) in run.json
from hsx.shard import Final
from hsx.store import MissingKey, Store

if TYPE_CHECKING:
    from hsx.layers import LayerSelection
    from hsx.models import ModelInfo

_RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

#: The identity version of the runs this code creates.
IDENTITY_VERSION = 4
#: The version of a ``run.json`` written without ``identity_version`` (before it existed).
LEGACY_IDENTITY_VERSION = 1
#: The first identity version that hashes the typed parts' :meth:`ConfigPart.identity` (the fields
#: that decide the bytes) instead of each part as stored (:meth:`ConfigPart.as_dict`).
TYPED_IDENTITY_VERSION = 4
#: Per identity version, the run.json fields hashed into the identity (see the module docstring).
IDENTITY_FIELDS: dict[int, tuple[str, ...]] = {
    1: ("model", "model_name", "layers", "max_length", "batch_tokens", "max_batch_samples", "store_dtype",
        "tokenizer", "dataset_fingerprint", "limit", "sample_policy", "schema_version"),
}
IDENTITY_FIELDS[2] = IDENTITY_FIELDS[1] + ("special_tokens_in_content",)
IDENTITY_FIELDS[3] = IDENTITY_FIELDS[2] + ("plan_windows", "dataset_options")
# model_name repeats model.name (hashed in model's identity).
IDENTITY_FIELDS[4] = tuple(name for name in IDENTITY_FIELDS[3] if name != "model_name")
#: Fields recorded in run.json that this version's identity never hashes (they do not change the
#: bytes of the shards). ``dataset_source`` and ``chat_template_file`` are paths (the bytes they
#: name are hashed: ``dataset_fingerprint``, ``tokenizer.chat_template_sha256``); ``dataset``
#: describes the source; ``model_name`` repeats ``model.name`` (versions 1-3 hashed it).
NON_IDENTITY_FIELDS = ("identity_version", "run_id", "created_at", "dataset_source", "dataset",
                       "chat_template_file", "model_name")
#: Fields hashed only when they differ from the value given here, at every identity version: a
#: choice added after the runs that made its default implicitly (their bytes are what the default
#: gives), so those runs and the same options planned now keep one run id, and the other value gets
#: another. ``added_tokens_in_content``: "token", what every run before the choice did.
IDENTITY_FIELDS_UNLESS_DEFAULT: dict[str, object] = {"added_tokens_in_content": "token",
                                                    # a regenerate run's generation options (hsx/regen.py);
                                                    # None: an extraction run, as every run before it
                                                    "regenerate": None}

#: Fields of a regenerate run's run.json that only decide hidden-state bytes (``--layers``,
#: ``--preset``, ``--dflash-layers``, ``--draft-config``, ``--final``: ``layers``; ``--store-dtype``):
#: recorded, never hashed into its identity, so the same dataset, model and generation options give
#: one regenerate run whatever the extraction options (the extraction chained after it hashes them).
REGEN_EXTRACTION_ONLY_FIELDS = ("layers", "store_dtype")
#: Generation options that greedy decoding (``temperature`` 0) does not use: left out of a greedy
#: regenerate run's identity.
REGEN_SAMPLING_ONLY = ("seed", "top_p", "top_k")


def regen_identity(regenerate: dict) -> dict:
    """The hashed part of a regenerate run's ``regenerate`` (``hsx.regen.RegenConfig`` as a dict):
    all of it but, when greedy (``temperature`` 0), :data:`REGEN_SAMPLING_ONLY`."""
    if regenerate.get("temperature", 0.0) == 0:
        return {k: v for k, v in regenerate.items() if k not in REGEN_SAMPLING_ONLY}
    return dict(regenerate)


P = TypeVar("P", bound="ConfigPart")


class ConfigPart(BaseModel):
    """Base of the typed parts of ``run.json`` (``model``, ``layers``, ``tokenizer``,
    ``sample_policy``, ``dataset_options``).

    A part reads the object run.json holds under its name, with the same keys as ever, and keeps
    exactly what it read: keys it does not know (written by a newer hsx) are kept (pydantic
    ``extra="allow"``), and keys the object did not hold (it predates them) are not added back
    (:meth:`as_dict`). That is what lets identity versions 1-3, which hashed each part as stored,
    compute the same hash from a typed part. Parts are frozen: a changed part is a new one
    (``part.model_copy(update={...})``).
    """

    model_config = ConfigDict(extra="allow", frozen=True, populate_by_name=True)

    @classmethod
    def parse(cls: type[P], raw: Any, name: str) -> P:
        """The part from run.json's value under ``name``.

        Raises:
            RunFormatError: not an object, a required key missing or a value of the wrong type.
        """
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            problems = "; ".join(f"{name}.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
            raise RunFormatError(f"run.json: {problems}") from None

    def as_dict(self) -> dict:
        """The part as run.json holds it: the keys it was read or made with (unknown ones too), none added."""
        return self.model_dump(mode="json", by_alias=True, exclude_unset=True)

    def identity(self) -> dict:
        """The part's fields that decide the shards' bytes, as hashed from identity version 4 on:
        no prose, no notes, no paths."""
        raise NotImplementedError


class ModelConfig(ConfigPart):
    """``run.json`` ``model``: the target checkpoint (:class:`hsx.models.ModelInfo` without its path).

    ``num_layers`` is the number of decoder layers N, ``hidden_size`` H; ``revision`` the checkpoint's
    identity (``hsx/models.py``: a hub commit, or ``sha256:<hex>`` of a local checkpoint's bytes;
    ``local-<16 hex>`` in identity-version-1 runs); ``quantization`` the checkpoint's
    ``quantization_config`` (e.g. fine-grained FP8), absent for an unquantised one;
    ``files_revision`` the same kind of hash of a local checkpoint directory's other files (its
    tokenizer's, ``generation_config.json``: :func:`hsx.models.files_revision`), absent for a hub
    id, a built-in model and a run planned before it was recorded.
    """

    name: str
    """What the run was planned with: a hub id, a local checkpoint directory or ``tiny-qwen3.5``."""
    model_type: str
    num_layers: int
    hidden_size: int
    revision: str
    quantization: dict | None = None
    files_revision: str | None = None

    @classmethod
    def of(cls, info: "ModelInfo") -> "ModelConfig":
        """The ``model`` of a run planned for ``info`` (``quantization`` set only when quantised)."""
        return cls.model_validate(info.as_dict())

    def identity(self) -> dict:
        # A local checkpoint directory is hashed by its bytes, not by its name (a path: the same
        # checkpoint copied elsewhere is the same run): revision (config.json, weights) and
        # files_revision (the tokenizer's files and the others). A hub id and a built-in model are
        # hashed by name and revision, and so is a local checkpoint of a run planned before
        # files_revision was recorded (its tokenizer files were in no hash but its path's): those
        # runs keep their ids and their markers' config_sha256.
        out = {"model_type": self.model_type, "num_layers": self.num_layers, "hidden_size": self.hidden_size,
               "revision": self.revision}
        if self.files_revision is None:
            out["name"] = self.name
        else:
            out["files_revision"] = self.files_revision
        if self.quantization is not None:
            out["quantization"] = self.quantization
        return out


class LayersConfig(ConfigPart):
    """``run.json`` ``layers``: which states the run captures (:class:`hsx.layers.LayerSelection`).

    ``layer_ids``: ascending, 0-based, the output of decoder layer i (HF ``hidden_states[i + 1]``);
    ``final``: the final states stored beside them. The rest says the same for readers, or where
    the ids came from: ``convention`` (prose), ``hf_hidden_states_indices`` and ``vllm_ids`` (the
    ids in other conventions), ``notes`` (prose), ``source`` (the ``--draft-config`` file and key
    the ids were read from); recorded, and from identity version 4 on never hashed.
    """

    layer_ids: tuple[int, ...]
    final: Final
    preset: str | None = None
    num_layers: int
    convention: str
    hf_hidden_states_indices: tuple[int, ...]
    vllm_ids: tuple[int, ...]
    notes: list[str] | None = None
    source: str | None = None

    @classmethod
    def of(cls, selection: "LayerSelection", source: str | None = None) -> "LayersConfig":
        """The ``layers`` of a run capturing ``selection``; ``source``: the draft config the ids came from."""
        return cls.model_validate({**selection.as_dict(), **({"source": source} if source else {})})

    def selection(self) -> "LayerSelection":
        """The :class:`hsx.layers.LayerSelection` these layers record."""
        from hsx.layers import LayerSelection

        return LayerSelection(tuple(self.layer_ids), self.final, self.preset, self.num_layers)

    def identity(self) -> dict:
        # num_layers is the model's (model.num_layers); the preset only chose the ids.
        return {"layer_ids": list(self.layer_ids), "final": Final(self.final).value}


class TokenizerConfig(ConfigPart):
    """``run.json`` ``tokenizer``: what turns a conversation into token ids and a loss mask.

    ``tokenizer_class`` (``class`` in run.json): the tokenizer's class name; ``vocab_size``: ``len(tokenizer)``;
    ``chat_template_sha256``: hex sha256 of the chat template used; ``end_of_turn_ids``: the ids that
    close an assistant turn (supervised); ``enable_thinking``: passed to the template, None for the
    template's default (absent in run.json files written before it existed).
    """

    tokenizer_class: str = Field(alias="class")
    vocab_size: int
    chat_template_sha256: str
    end_of_turn_ids: list[int]
    enable_thinking: bool | None = None

    def identity(self) -> dict:
        return {"class": self.tokenizer_class, "vocab_size": self.vocab_size, "chat_template_sha256": self.chat_template_sha256,
                "end_of_turn_ids": list(self.end_of_turn_ids), "enable_thinking": self.enable_thinking}


class SamplePolicy(ConfigPart):
    """``run.json`` ``sample_policy``: which records become samples and how.

    ``over_length``: ``truncate`` or ``drop`` a conversation longer than ``max_length``;
    ``allow_text``: plain-text records are used; ``min_consecutive_supervised``: the fewest
    consecutive supervised tokens a sample must hold. All None in run.json files written before
    the policy was recorded (``{}``).
    """

    over_length: Literal["truncate", "drop"] | None = None
    allow_text: bool | None = None
    min_consecutive_supervised: int | None = None

    def identity(self) -> dict:
        return {"over_length": self.over_length, "allow_text": self.allow_text,
                "min_consecutive_supervised": self.min_consecutive_supervised}


class DatasetOptions(ConfigPart):
    """``run.json`` ``dataset_options``: which records of the dataset are read, in which order
    (``producer.sources.SourceOptions``): ``shuffle`` with ``seed``, ``sample`` (a seeded subset of
    that many records), a hub dataset's ``subset`` and ``split``. run.json holds only those set
    (``{}``: every record, in the dataset's order; also what runs before version 3 read).
    """

    split: str | None = None
    subset: str | None = None
    shuffle: bool = False
    seed: int | None = None
    sample: int | None = None

    def identity(self) -> dict:
        # Only what changes which records are read: the seed only with shuffle or sample.
        out: dict[str, Any] = {k: getattr(self, k) for k in ("split", "subset", "sample") if getattr(self, k) is not None}
        if self.shuffle:
            out["shuffle"] = True
        if self.shuffle or self.sample is not None:
            out["seed"] = self.seed
        return out


#: The typed parts of run.json, by field name.
CONFIG_PARTS: dict[str, type[ConfigPart]] = {"model": ModelConfig, "layers": LayersConfig, "tokenizer": TokenizerConfig,
                                             "sample_policy": SamplePolicy, "dataset_options": DatasetOptions}


@dataclass
class RunConfig:
    """What a run extracts and how. Stored as ``<run>/run.json``; workers read it, never the CLI args.

    The nested parts are typed (:class:`ConfigPart`): ``model`` (:class:`ModelConfig`), ``layers``
    (:class:`LayersConfig`), ``tokenizer`` (:class:`TokenizerConfig`), ``sample_policy``
    (:class:`SamplePolicy`), ``dataset_options`` (:class:`DatasetOptions`); each reads and writes
    the keys run.json has always held under its name. ``store_dtype`` is the dtype of the stored
    hidden states, a :class:`hsx.shard.StoreDtype` value (``bfloat16``, ``float32`` or ``fp8``:
    float8 e4m3 with per-token scales, ``hsx/fp8.py``). ``special_tokens_in_content``: how
    special-token strings inside message content were tokenised, ``text`` or ``special``
    (:data:`producer.masks.SPECIAL_TOKENS_IN_CONTENT`); ``special`` in run.json files written before
    it existed (what that code did). ``identity_version`` says which fields make the identity
    (:data:`IDENTITY_FIELDS`), how they are hashed and how ``model.revision`` was computed (module
    docstring). ``added_tokens_in_content``: how the strings of non-special added tokens
    (``<think>``) inside message content were tokenised, ``token`` (their ids: every run before the
    choice) or ``text`` (:data:`producer.masks.ADDED_TOKENS_IN_CONTENT`); hashed only when ``text``
    (:data:`IDENTITY_FIELDS_UNLESS_DEFAULT`).

    Keys of a run.json that this code does not know (written by a newer version, or ``stats``:
    always ``{}``, no longer a field) are kept in ``extra`` and written back, never hashed.

    Raises:
        TypeError: a part given as something other than its :class:`ConfigPart` class.
    """

    model: ModelConfig
    model_name: str
    layers: LayersConfig
    max_length: int
    batch_tokens: int
    max_batch_samples: int
    store_dtype: str
    tokenizer: TokenizerConfig
    dataset_fingerprint: str
    dataset_source: str
    limit: int | None
    sample_policy: SamplePolicy = field(default_factory=SamplePolicy)
    special_tokens_in_content: str = "special"
    added_tokens_in_content: str = "token"
    #: ``[first, largest]`` samples per window of the streamed plan; None: the whole dataset sorted
    #: at once (runs made before identity version 3).
    plan_windows: list[int] | None = None
    #: Which records are read, in which order; nothing set before version 3.
    dataset_options: DatasetOptions = field(default_factory=DatasetOptions)
    #: What the dataset is (kind, files and sizes, hub revision): recorded, never hashed, read by no code.
    dataset: dict = field(default_factory=dict)
    #: The --chat-template file that replaced the tokenizer's template (its sha256 is in ``tokenizer``).
    chat_template_file: str | None = None
    #: A regenerate run (``producer regenerate``, ``hsx/regen.py`` :class:`~hsx.regen.RegenConfig` as a
    #: dict): its workers answer the prompts with the target instead of capturing states. None: extraction.
    regenerate: dict | None = None
    schema_version: int = SCHEMA_VERSION
    identity_version: int = IDENTITY_VERSION
    run_id: str = ""
    created_at: str = ""
    #: run.json keys this code does not know; kept, never hashed.
    extra: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    #: identity fields the loaded run.json did not hold (it predates them): left out of the hash,
    #: as the code that wrote it did.
    _absent: frozenset = field(default=frozenset(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name, part in CONFIG_PARTS.items():
            if not isinstance(getattr(self, name), part):
                raise TypeError(f"RunConfig.{name} is a {type(getattr(self, name)).__name__}, not a {part.__name__} "
                                f"(read a run.json with RunConfig.from_json)")

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
        out = {k: self._identity_value(k, version) for k in names if k not in absent}
        out.update({k: getattr(self, k) for k, default in IDENTITY_FIELDS_UNLESS_DEFAULT.items()
                    if getattr(self, k) != default})
        if self.regenerate is not None:  # a regenerate run: no hidden states, and greedy uses no sampling option
            for name in REGEN_EXTRACTION_ONLY_FIELDS:
                out.pop(name, None)
            out["regenerate"] = regen_identity(self.regenerate)
        if version >= 2:
            out["identity_version"] = version
        return out

    def _identity_value(self, name: str, version: int):
        value = getattr(self, name)
        if isinstance(value, ConfigPart):
            # Versions 1-3 hashed each part as stored, prose and paths included.
            return value.identity() if version >= TYPED_IDENTITY_VERSION else value.as_dict()
        return value

    def identity_sha256(self, version: int | None = None) -> str:
        """sha256 of :meth:`identity`: the ``config_sha256`` of the run's markers."""
        return hashlib.sha256(json.dumps(self.identity(version), sort_keys=True).encode()).hexdigest()

    def default_run_id(self, dataset_name: str) -> str:
        """``<dataset name>-<12 hex of the identity hash>``, e.g. ``sharegpt-3fa9c1d2e4b5``."""
        stem = re.sub(r"[^A-Za-z0-9._-]+", "-", dataset_name).strip("-.")[:40] or "run"
        return f"{stem}-{self.identity_sha256()[:12]}"

    def as_dict(self) -> dict:
        """run.json's object: every field (the parts as :meth:`ConfigPart.as_dict`) and ``extra``.

        Identity fields the loaded run.json did not hold are left out, so that the written file
        hashes as the one read (written with its default, a field would be hashed on the next read).
        """
        out = dict(self.extra)
        out.update({k: getattr(self, k) for k in self.field_names() if k not in self._absent})
        out.update({k: out[k].as_dict() for k in CONFIG_PARTS if k in out})
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
        for name, part in CONFIG_PARTS.items():
            if name in kwargs:
                kwargs[name] = part.parse(kwargs[name], name)
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
    if stored.model.files_revision is None and config.model.files_revision is not None:
        # a run planned before a local checkpoint was named by its bytes hashed its name: compared so
        config = dataclasses.replace(config, model=config.model.model_copy(update={"files_revision": None}))
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
