"""Where the decoder sits inside a model: its ``.layers`` and its final norm module.

The capture hooks (``workers/capture.py``) and the reference forward (``hsx/reference.py``) both
hook into these parts, so both find them here, the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hsx.errors import BadConfig

#: Where the base decoder (``.layers`` + final norm) sits inside a model, tried in order:
#: ``*ForCausalLM`` (``.model``), a multimodal ``*ForConditionalGeneration``
#: (``.model.language_model``), a bare language model, the decoder itself.
DECODER_PATHS = ("model", "model.language_model", "language_model", "")
#: Names of the final norm module on the decoder (Llama / Qwen: ``norm``; Phi, GPT-NeoX style:
#: ``final_layernorm``; GPT-2 style: ``ln_f``).
NORM_NAMES = ("norm", "final_layernorm", "final_norm", "ln_f")


@dataclass(frozen=True)
class Decoder:
    """The parts of a model that capture hooks into.

    ``module`` runs embeddings, decoder layers and the final norm (no ``lm_head``); ``norm`` is
    None when the decoder has no final norm module under a known name (:data:`NORM_NAMES`).
    """

    module: torch.nn.Module
    layers: torch.nn.ModuleList
    norm: torch.nn.Module | None
    path: str


def decoder_of(model: torch.nn.Module) -> Decoder:
    """Find the base decoder inside ``model`` (see :data:`DECODER_PATHS`); running it skips lm_head.

    Raises:
        BadConfig: no submodule with a ``.layers`` ModuleList at any known path.
    """
    for path in DECODER_PATHS:
        base = model
        for name in filter(None, path.split(".")):
            base = getattr(base, name, None)
        layers = getattr(base, "layers", None)
        if isinstance(layers, torch.nn.ModuleList):
            norm = next((getattr(base, n) for n in NORM_NAMES if isinstance(getattr(base, n, None), torch.nn.Module)), None)
            return Decoder(base, layers, norm, path)
    raise BadConfig(
        f"{type(model).__name__}: no decoder with a .layers ModuleList at {', '.join(repr(p) for p in DECODER_PATHS)}; "
        "this architecture is not supported by the capture hooks"
    )


def first_output(output):
    """The hidden states of a decoder layer's output: a tensor in transformers 5, the first item of
    a tuple (hidden, attention weights, ...) in older versions."""
    return output[0] if isinstance(output, (tuple, list)) else output
