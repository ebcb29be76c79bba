"""The capture path, top to bottom: one batched forward, hooks on the chosen layers, valid tokens
gathered on the device, one device-to-host copy per captured tensor, the shard's tensors.

Legend (shape suffixes):
    B = rows in the batch (= N samples, one per row, right-padded)
    S = padded row length (longest sample in the batch)
    T = valid tokens in the batch (sum of sample lengths; no padding)
    K = captured layers, H = hidden size, N = samples

Conventions: layer id ``i`` is the output of decoder layer ``i`` (0-based), which is HF
``output_hidden_states[i + 1]``. ``final_postnorm`` is the model's own final norm applied to the last
layer's output (what ``lm_head`` consumes; Qwen3.5 / Qwen3-Next use a zero-centred norm, so it must
be the model's module, FIELD-NOTES section 1), ``final_prenorm`` the last layer's raw output.
Right padding with a 2-D attention mask is exact for Gated DeltaNet layers; left padding and
packing without boundary-aware kernels are not (FIELD-NOTES section 2).
"""

from __future__ import annotations

import torch

from core.layers import LayerSelection


class _StopForward(Exception):
    """Raised by the deepest hook when nothing later is needed: layers after it are not run."""


def decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    """The base decoder (``.layers`` and ``.norm``) inside a ``*ForCausalLM``; running it skips lm_head."""
    base = getattr(model, "model", model)
    if not hasattr(base, "layers") or not hasattr(base, "norm"):
        raise TypeError(f"{type(model).__name__}: expected a decoder with .layers and .norm under .model")
    return base


def _first(output):
    # Decoder layers return a tensor in transformers 5, a tuple in older versions.
    return output[0] if isinstance(output, tuple) else output


@torch.inference_mode()
def capture_batch(
    model: torch.nn.Module,
    input_ids_T: torch.Tensor,
    cu_seqlens_N1: torch.Tensor,
    selection: LayerSelection,
    *,
    store_dtype: torch.dtype,
    pad_token_id: int = 0,
) -> dict[str, torch.Tensor]:
    """Run one right-padded batch and return the shard tensors on the host.

    Args:
        model: a ``*ForCausalLM`` on its device, in eval mode.
        input_ids_T: int tensor [T] (any device): the batch's samples concatenated.
        cu_seqlens_N1: int64 [N+1]: sample j is ``input_ids_T[cu[j]:cu[j+1]]``.
        selection: which layers (ascending ids) and final states to capture.
        store_dtype: dtype of the returned states (the cast happens on the device, before the copy).

    Returns:
        ``hidden_states`` [T, K, H] and, as asked, ``final_postnorm`` / ``final_prenorm`` [T, H],
        all on the CPU in ``store_dtype``; token t of the result is token t of ``input_ids_T``.
    """
    decoder = decoder_of(model)
    device = next(decoder.parameters()).device
    lengths_N = (cu_seqlens_N1[1:] - cu_seqlens_N1[:-1]).to(device)
    N, S = lengths_N.shape[0], int(lengths_N.max())
    positions_S = torch.arange(S, device=device)
    valid_BS = positions_S[None, :] < lengths_N[:, None]

    input_ids_BS = torch.full((N, S), pad_token_id, dtype=torch.long, device=device)
    input_ids_BS[valid_BS] = input_ids_T.to(device=device, dtype=torch.long)
    attention_mask_BS = valid_BS.long()

    # Hooks keep only the valid tokens, so padded activations are freed as the forward goes on.
    captured_TH: dict[int, torch.Tensor] = {}
    want_post = selection.final in ("postnorm", "both")
    want_pre = selection.final in ("prenorm", "both")
    last = selection.num_layers - 1
    stop_after = selection.deepest_layer
    finals_TH: dict[str, torch.Tensor] = {}

    def layer_hook(layer_id: int):
        def hook(_module, _args, output):
            hidden_BSH = _first(output)
            if layer_id in selection.layer_ids:
                captured_TH[layer_id] = hidden_BSH[valid_BS].to(store_dtype)
            if want_pre and layer_id == last:
                finals_TH["final_prenorm"] = hidden_BSH[valid_BS].to(store_dtype)
            if layer_id == stop_after and not want_post:
                raise _StopForward

        return hook

    def norm_hook(_module, _args, output):
        finals_TH["final_postnorm"] = output[valid_BS].to(store_dtype)

    hook_ids = sorted(set(selection.layer_ids) | ({last} if want_pre else set()) | {stop_after})
    handles = [decoder.layers[i].register_forward_hook(layer_hook(i)) for i in hook_ids]
    if want_post:
        handles.append(decoder.norm.register_forward_hook(norm_hook))
    try:
        decoder(input_ids=input_ids_BS, attention_mask=attention_mask_BS, use_cache=False)
    except _StopForward:
        pass
    finally:
        for h in handles:
            h.remove()

    hidden_TKH = torch.stack([captured_TH[i] for i in selection.layer_ids], dim=1)
    out_device = {"hidden_states": hidden_TKH, **finals_TH}
    # One device-to-host copy per captured tensor for the whole batch.
    pin = device.type == "cuda"
    out_host = {}
    for name, tensor in out_device.items():
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
        host.copy_(tensor, non_blocking=pin)
        out_host[name] = host
    if pin:
        torch.cuda.current_stream(device).synchronize()
    return out_host


def nonfinite_samples(tensors: dict[str, torch.Tensor], cu_seqlens_N1: torch.Tensor) -> list[int]:
    """Positions (0..N-1) of samples whose captured states hold NaN or Inf."""
    bad_T = torch.zeros(int(cu_seqlens_N1[-1]), dtype=torch.bool)
    for tensor in tensors.values():
        finite = torch.isfinite(tensor.float()) if tensor.dtype not in (torch.float32, torch.float64) else torch.isfinite(tensor)
        bad_T |= ~finite.reshape(finite.shape[0], -1).all(dim=1)
    if not bad_T.any():
        return []
    sample_of_T = torch.repeat_interleave(torch.arange(len(cu_seqlens_N1) - 1), cu_seqlens_N1[1:] - cu_seqlens_N1[:-1])
    return sorted(set(sample_of_T[bad_T].tolist()))
