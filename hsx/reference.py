"""The reference forward: one sample alone, the plain transformers path, states in our convention.

Everything that checks captured states against the model runs this: ``producer verify
--recompute``, the tests (``tests/jobfixtures.py``) and the benches' fidelity figures
(``bench/gpu_throughput.py``). It is deliberately not the capture path: no batching, no
padding, no early stop, no gather; the HF ``output_hidden_states`` tuple read with its own
convention.

Legend: S = tokens of the sample, K = asked layers, H = hidden size, N = decoder layers.

Conventions (docs/FACTS.md §1, ``hsx/layers.py``). Layer id ``i`` is the output of decoder
layer ``i`` (0-based), the EAGLE-3 (SpecForge) and DFlash ``target_layer_ids`` convention. HF
``output_hidden_states`` gives a tuple of N + 1: index 0 is the embeddings and index ``i + 1`` is
the output of layer ``i`` for ``i < N - 1``; but transformers replaces the last entry, index N,
with the state *after* the final norm. So:

- id ``i < N - 1``: ``hidden_states[i + 1]``;
- id ``N - 1`` and ``final_prenorm``: the raw output of the last layer, taken by a forward hook on
  it (``hidden_states[N]`` is NOT it);
- ``final_postnorm``: ``hidden_states[N]``, the model's own final norm of that output (what
  ``lm_head`` reads).
"""

from __future__ import annotations

import torch

from hsx.decoder import decoder_of, first_output
from hsx.errors import FidelityError
from hsx.shard import FINAL_POSTNORM, FINAL_PRENORM, HIDDEN_STATES, Final


@torch.inference_mode()
def reference_states(model: torch.nn.Module, input_ids_S: torch.Tensor, layer_ids, final: str = Final.NONE) -> dict:
    """One sample's states as a shard stores them, from the model's own forward on that sample alone.

    Args:
        model: a ``*ForCausalLM`` (or a multimodal model's language model, or a bare decoder),
            in eval mode, on any device; only the decoder runs (no ``lm_head``).
        input_ids_S: int tensor [S] (any device): the sample's token ids.
        layer_ids: ids in our convention (module docstring), each in ``[0, N - 1]``, in the
            order wanted (a shard's are ascending).
        final: a :class:`hsx.shard.Final` value: which final states to return as well.

    Returns:
        ``hidden_states`` [S, K, H] (slot k = layer ``layer_ids[k]``) and, as ``final`` asks,
        ``final_postnorm`` / ``final_prenorm`` [S, H]; float32 on the CPU, whatever the model's
        dtype and device.

    Raises:
        ValueError: a layer id outside ``[0, N - 1]``.
        hsx.errors.FidelityError: the model's ``output_hidden_states`` is not N + 1 states.
        hsx.errors.BadConfig: no decoder found in ``model`` (``hsx/decoder.py``).
    """
    final = Final(final)
    decoder = decoder_of(model)
    num_layers = len(decoder.layers)
    bad = [i for i in layer_ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"layer ids {bad} are outside [0, {num_layers - 1}] for a model with {num_layers} decoder layers "
                         "(ids are 0-based outputs of decoder layers)")
    device = next(decoder.module.parameters()).device
    last: dict[str, torch.Tensor] = {}

    def keep_last(_module, _args, output):  # HF overwrites hidden_states[N] with the post-norm state
        last["out"] = first_output(output)

    handle = decoder.layers[num_layers - 1].register_forward_hook(keep_last)
    try:
        out = decoder.module(input_ids=input_ids_S.to(device=device, dtype=torch.long)[None], use_cache=False,
                             output_hidden_states=True)
    finally:
        handle.remove()
    hf_1SH = out.hidden_states
    if len(hf_1SH) != num_layers + 1 or "out" not in last:
        raise FidelityError(f"{type(model).__name__}: output_hidden_states gave {len(hf_1SH)} states for {num_layers} "
                            "decoder layers (expected N + 1), or the last layer's hook never fired: this model does not "
                            "follow the transformers convention the reference reads")
    last_SH = last["out"][0].float().cpu()

    def layer_SH(i: int) -> torch.Tensor:
        return last_SH if i == num_layers - 1 else hf_1SH[i + 1][0].float().cpu()

    S, H = last_SH.shape
    states = {HIDDEN_STATES: torch.stack([layer_SH(i) for i in layer_ids], dim=1) if len(layer_ids) else torch.empty(S, 0, H)}
    if final.has_postnorm:
        states[FINAL_POSTNORM] = hf_1SH[num_layers][0].float().cpu()
    if final.has_prenorm:
        states[FINAL_PRENORM] = last_SH
    return states
