"""Layer ids: which hidden states a run captures, and how they map across conventions.

Our convention (also SpecForge's and DFlash's ``target_layer_ids``): id ``i`` is the **output of
decoder layer i**, 0-based, i.e. the residual stream after layer ``i``. The same state is
HF ``output_hidden_states`` index ``i + 1`` (index 0 is the embeddings, index N is the final state
*after* the norm) and vLLM / speculators id ``i + 1`` ("input to layer i+1"; id N is the final
state *before* the norm). See docs/FACTS.md §1 for the off-by-one bugs this avoids.

Final states are separate from layer ids (:class:`hsx.shard.Final`): ``postnorm`` is what
``lm_head`` consumes (computed with the model's own final norm module), ``prenorm`` is the raw
output of the last layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from hsx.errors import BadConfig
from hsx.shard import Final

PRESETS = ("eagle3", "dflash")


def eagle3_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3 auxiliary layers ``[1, N//2 - 1, N - 4]`` (SpecForge), output-of convention."""
    return [1, num_layers // 2 - 1, num_layers - 4]


def dflash_layer_ids(num_layers: int, num_draft_layers: int = 5) -> list[int]:
    """DFlash target layers: K ids spread evenly from 1 to N-3, rounded with Python's ``round``.

    With one draft layer DFlash takes ``N // 2`` (docs/FACTS.md §1).

    Raises:
        BadConfig: K < 1.
    """
    if num_draft_layers < 1:
        raise BadConfig(f"--dflash-layers {num_draft_layers}: a DFlash draft model has at least one layer")
    if num_draft_layers == 1:
        return [num_layers // 2]
    start, end = 1, num_layers - 3
    span = end - start
    return [round(start + span * j / (num_draft_layers - 1)) for j in range(num_draft_layers)]


@dataclass(frozen=True)
class LayerSelection:
    """The captured layers of a run.

    ``layer_ids`` are ascending, 0-based, output-of convention; ``final`` a :class:`hsx.shard.Final`
    (a plain string such as ``"both"`` is converted; ValueError for one that is not a Final).
    """

    layer_ids: tuple[int, ...]
    final: Final
    preset: str | None
    num_layers: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "final", Final(self.final))

    @property
    def hf_indices(self) -> list[int]:
        """The same states as indices into HF ``output_hidden_states`` (``i + 1``)."""
        return [i + 1 for i in self.layer_ids]

    @property
    def vllm_ids(self) -> list[int]:
        """The same states in the vLLM / speculators convention (``i + 1``)."""
        return [i + 1 for i in self.layer_ids]

    @property
    def deepest_layer(self) -> int:
        """Index of the last decoder layer the forward must run (N-1 if a final state is wanted)."""
        if self.final != Final.NONE:
            return self.num_layers - 1
        return max(self.layer_ids)

    def as_dict(self) -> dict:
        notes = []
        if self.num_layers - 1 in self.layer_ids:
            notes.append(f"id {self.num_layers - 1} is the raw output of the last layer (before the final norm); "
                         f"HF's hidden_states[{self.num_layers}] is the state after the norm, which is final_postnorm here")
        return {
            "layer_ids": list(self.layer_ids),
            "convention": "output of decoder layer i, 0-based (HF hidden_states index i+1)",
            "hf_hidden_states_indices": self.hf_indices,
            "vllm_ids": self.vllm_ids,
            "final": self.final,
            "preset": self.preset,
            "num_layers": self.num_layers,
            **({"notes": notes} if notes else {}),
        }


def parse_layer_ids(text: str) -> list[int]:
    """Parse ``"1,16,31"``; raises :class:`BadConfig` on anything that is not a non-empty list of
    integers (an empty ``--layers`` would otherwise mean the default preset without saying so)."""
    try:
        ids = [int(part) for part in text.replace(" ", "").split(",") if part != ""]
    except ValueError:
        ids = None
    if not ids:
        raise BadConfig(f"--layers {text!r}: expected comma-separated integers such as 1,16,31 "
                        "(leave --layers out for the eagle3 preset)")
    return ids


def select_layers(
    num_layers: int,
    *,
    layer_ids: list[int] | None = None,
    preset: str | None = None,
    final: str | None = None,
    dflash_layers: int = 5,
) -> LayerSelection:
    """Validate a layer request against a model with ``num_layers`` decoder layers.

    With neither ids nor preset, the EAGLE-3 preset is used. ``final`` defaults to ``postnorm``
    for EAGLE-3 and ``none`` otherwise.

    Raises:
        BadConfig: ids out of ``[0, N-1]``, duplicated or unsorted; unknown preset or final;
            both ids and a preset given.
    """
    if layer_ids is not None and preset is not None:
        raise BadConfig("give either --layers or --preset, not both")
    if layer_ids is None:
        preset = preset or "eagle3"
        if preset == "eagle3":
            layer_ids = eagle3_layer_ids(num_layers)
        elif preset == "dflash":
            layer_ids = dflash_layer_ids(num_layers, dflash_layers)
        else:
            raise BadConfig(f"--preset {preset!r}: unknown preset; choose one of {', '.join(PRESETS)}")
    if final is None:
        final = Final.POSTNORM if preset == "eagle3" else Final.NONE
    if final not in tuple(Final):
        raise BadConfig(f"--final {final!r}: choose one of {', '.join(Final)}")
    if not layer_ids:
        raise BadConfig("--layers is empty: give at least one layer id (0-based, output of layer i)")
    bad = [i for i in layer_ids if not 0 <= i < num_layers]
    if bad:
        raise BadConfig(
            f"layer ids {bad} are out of range for a model with {num_layers} layers: "
            f"ids are 0-based outputs of decoder layers, so they must be in [0, {num_layers - 1}]"
        )
    if len(set(layer_ids)) != len(layer_ids):
        if preset:
            fix = "pass --layers explicitly"
            if preset == "dflash":  # the most draft layers this depth gives distinct ids for
                fits = [k for k in range(dflash_layers - 1, 0, -1) if len(set(dflash_layer_ids(num_layers, k))) == k]
                if fits:
                    fix = f"give --dflash-layers {fits[0]} or fewer, or pass --layers explicitly"
            raise BadConfig(
                f"--preset {preset} on a model with {num_layers} layers gives ids {layer_ids}, which repeat: "
                f"the model is too shallow for this preset; {fix}"
            )
        raise BadConfig(f"layer ids {layer_ids} contain duplicates: each layer may be captured once")
    if list(layer_ids) != sorted(layer_ids):
        raise BadConfig(f"layer ids {layer_ids} must be ascending (the shard stores them in id order): use {sorted(layer_ids)}")
    return LayerSelection(tuple(layer_ids), final, preset, num_layers)


DRAFT_CONFIG_KEYS = ("target_layer_ids", "eagle_aux_hidden_state_layer_ids", "aux_hidden_state_layer_ids")


def layer_ids_from_draft_config(path: str, *, convention: str = "output-of") -> tuple[list[int], str]:
    """Read the target layer ids a draft model was (or will be) trained on from its config file.

    Looks for ``target_layer_ids`` (DFlash) or ``eagle_aux_hidden_state_layer_ids`` (EAGLE-3) at
    the top level or one level down (``dflash_config``, ``eagle_config``...). SpecForge and DFlash
    write them in the output-of convention (our own); pass ``convention="vllm"`` for ids in the
    vLLM / speculators input-to-layer convention (id - 1 here).

    Returns:
        (ids in our convention, "file: key" describing where they came from).

    Raises:
        BadConfig: unreadable file, no known key, or ids that are not integers.
    """
    import json

    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise BadConfig(f"--draft-config {path}: no such file; give the draft model's config.json") from None
    except (OSError, ValueError) as exc:
        raise BadConfig(f"--draft-config {path}: cannot read it as JSON ({exc})") from None
    candidates = [("", data)] + [(k + ".", v) for k, v in data.items() if isinstance(v, dict)] if isinstance(data, dict) else []
    for prefix, section in candidates:
        for key in DRAFT_CONFIG_KEYS:
            ids = section.get(key)
            if ids is None:
                continue
            if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
                raise BadConfig(f"--draft-config {path}: {prefix}{key} = {ids!r} is not a list of integers")
            if convention == "vllm":
                ids = [i - 1 for i in ids]
            elif convention != "output-of":
                raise BadConfig(f"--draft-layer-convention {convention!r}: choose output-of or vllm")
            return list(ids), f"{path}: {prefix}{key} ({convention})"
    raise BadConfig(f"--draft-config {path}: none of {', '.join(DRAFT_CONFIG_KEYS)} found (top level or one level down)")
