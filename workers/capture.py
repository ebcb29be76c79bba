"""The capture path, top to bottom: one batched forward, hooks on the chosen layers, valid tokens
gathered on the device, a finiteness check on the device, one device-to-host copy per captured
tensor, the shard's tensors.

Legend (shape suffixes):
    B = rows in the batch (= N samples, one per row, right-padded)
    S = padded row length (longest sample in the batch)
    T = valid tokens in the batch (sum of sample lengths; no padding)
    K = captured layers, H = hidden size, N = samples
    P = captured parts (the K layers, then the final states asked for)

Conventions: layer id ``i`` is the output of decoder layer ``i`` (0-based), which is HF
``output_hidden_states[i + 1]`` for ``i < N - 1``. For the last layer the HF index ``N`` does NOT
hold its output: transformers overwrites ``hidden_states[-1]`` with the post-norm state, so the
raw output of layer ``N - 1`` is ``final_prenorm`` (and the slot of id ``N - 1``).
``final_postnorm`` is the model's own final norm module's output (what ``lm_head`` consumes;
Qwen3.5 / Qwen3-Next use a zero-centred ``(1 + w)`` norm, so it must be the model's module,
FIELD-NOTES section 1). Right padding with a 2-D attention mask is exact for Gated DeltaNet
layers; left padding and packing without boundary-aware kernels are not (FIELD-NOTES section 2).

Hooks act only for the thread that registered them: two threads capturing on one model at once
(``HSX_WORKER_CONCURRENCY`` > 1, or a duplicate delivery run in-process) never see each other's
activations.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from core.errors import BadConfig, FidelityError
from core.layers import LayerSelection

#: Where the base decoder (``.layers`` + final norm) sits inside a model, tried in order:
#: ``*ForCausalLM`` (``.model``), a multimodal ``*ForConditionalGeneration``
#: (``.model.language_model``), a bare language model, the decoder itself.
DECODER_PATHS = ("model", "model.language_model", "language_model", "")
#: Names of the final norm module on the decoder (Llama / Qwen: ``norm``; Phi, GPT-NeoX style:
#: ``final_layernorm``; GPT-2 style: ``ln_f``).
NORM_NAMES = ("norm", "final_layernorm", "final_norm", "ln_f")


class _StopForward(Exception):
    """Raised by the deepest hook when nothing later is needed: layers after it are not run."""


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


def _check_model(decoder: Decoder, model: torch.nn.Module, selection: LayerSelection) -> None:
    if len(decoder.layers) != selection.num_layers:
        raise FidelityError(
            f"{type(model).__name__} has {len(decoder.layers)} decoder layers but the layer selection was made for "
            f"{selection.num_layers}: layer ids would point at other layers. Re-plan the run for this model."
        )
    if selection.final in ("postnorm", "both") and decoder.norm is None:
        raise BadConfig(
            f"--final {selection.final}: {type(model).__name__} has no final norm module (looked for "
            f"{', '.join(NORM_NAMES)} on {decoder.path or 'the model'!r}), so its post-norm state cannot be taken "
            "from the model's own norm; use --final prenorm or none"
        )


def _first(output):
    # Decoder layers return a tensor in transformers 5, a tuple (hidden, attn weights, ...) in older versions.
    return output[0] if isinstance(output, (tuple, list)) else output


@dataclass
class CapturedBatch:
    """One batch's captured states on the host, ready for the shard.

    ``states``: ``hidden_states`` [T, K, H] plus the final states asked for, [T, H], in the store
    dtype. ``nonfinite``: sample position j (0..N-1) -> the parts of it that hold NaN or Inf
    (layer ids as strings, ``final_postnorm``, ``final_prenorm``); empty when every value is finite.
    """

    states: dict[str, torch.Tensor]
    nonfinite: dict[int, list[str]]


@torch.inference_mode()
def capture_batch(
    model: torch.nn.Module,
    input_ids_T: torch.Tensor,
    cu_seqlens_N1: torch.Tensor,
    selection: LayerSelection,
    *,
    store_dtype: torch.dtype,
    pad_token_id: int = 0,
    host_buffer: "HostBuffer | None" = None,
) -> CapturedBatch:
    """Run one right-padded batch and return the shard tensors on the host.

    Args:
        model: a ``*ForCausalLM`` (or a bare decoder) on its device, in eval mode.
        input_ids_T: int tensor [T] (any device): the batch's samples concatenated.
        cu_seqlens_N1: int64 [N+1]: sample j is ``input_ids_T[cu[j]:cu[j+1]]``.
        selection: which layers (ascending ids) and final states to capture.
        store_dtype: dtype of the returned states (the cast happens on the device, before the copy).
        pad_token_id: id written into the padding (masked out; its value never reaches a valid token).
        host_buffer: reuse this (pinned, on CUDA) host memory for the copies instead of allocating:
            pinning gigabytes per batch costs a large fraction of a forward. The returned tensors
            then alias the buffer and stay valid only until its next use.

    Returns:
        :class:`CapturedBatch`: ``states`` holds ``hidden_states`` [T, K, H] and, as asked,
        ``final_postnorm`` / ``final_prenorm`` [T, H], on the CPU in ``store_dtype``; token t of
        each is token t of ``input_ids_T``. ``nonfinite`` names the samples with NaN/Inf.

    Raises:
        BadConfig: no decoder found, or a post-norm state asked of a model without a final norm.
        FidelityError: the model's layer count is not the selection's.
    """
    decoder = decoder_of(model)
    _check_model(decoder, model, selection)
    device = next(decoder.module.parameters()).device

    # 1. Right-padded rows [B, S] and their mask: valid_BS is True on the T real tokens, row-major,
    #    so gathering with it yields tokens in input_ids_T order.
    lengths_N = (cu_seqlens_N1[1:] - cu_seqlens_N1[:-1]).to(device)
    N, S, T = lengths_N.shape[0], int(lengths_N.max()), int(cu_seqlens_N1[-1])
    if input_ids_T.shape[0] != T:
        raise FidelityError(f"input_ids has {input_ids_T.shape[0]} tokens but cu_seqlens ends at {T}")
    valid_BS = torch.arange(S, device=device)[None, :] < lengths_N[:, None]
    # Flat row-major positions of the T valid tokens: one host sync here, none in the hooks
    # (boolean-mask indexing would sync at every hooked layer and starve the GPU's queue).
    valid_T = valid_BS.reshape(-1).nonzero().squeeze(1)
    input_ids_BS = torch.full((N, S), pad_token_id, dtype=torch.long, device=device)
    input_ids_BS.view(-1)[valid_T] = input_ids_T.to(device=device, dtype=torch.long)
    attention_mask_BS = valid_BS.long()

    def gather_TH(hidden_BSH: torch.Tensor) -> torch.Tensor:
        return hidden_BSH.reshape(N * S, hidden_BSH.shape[-1]).index_select(0, valid_T)

    # 2. Hooks keep only the valid tokens, cast to the store dtype, so padded activations are freed as
    #    the forward goes on. states["hidden_states"] [T, K, H] is allocated by the first hook (H is
    #    known then) and each layer writes its slot k: no stack, no second copy of the K layers.
    slot_of_layer = {layer_id: k for k, layer_id in enumerate(selection.layer_ids)}
    last_layer = selection.num_layers - 1
    want_post = selection.final in ("postnorm", "both")
    want_pre = selection.final in ("prenorm", "both")
    # With a post-norm state the forward must reach the norm; otherwise stop after the deepest layer.
    stop_after = None if want_post else selection.deepest_layer
    owner = threading.get_ident()
    states: dict[str, torch.Tensor] = {}
    filled_layers: set[int] = set()

    def layer_hook(layer_id: int):
        def hook(_module, _args, output):
            if threading.get_ident() != owner:
                return None
            hidden_BSH = _first(output)
            if layer_id in slot_of_layer:
                if "hidden_states" not in states:
                    K, H = len(selection.layer_ids), hidden_BSH.shape[-1]
                    states["hidden_states"] = torch.empty((T, K, H), dtype=store_dtype, device=device)
                states["hidden_states"][:, slot_of_layer[layer_id]] = gather_TH(hidden_BSH)
                filled_layers.add(layer_id)
            if want_pre and layer_id == last_layer:
                states["final_prenorm"] = gather_TH(hidden_BSH).to(store_dtype)
            if layer_id == stop_after:
                raise _StopForward
            return None

        return hook

    def norm_hook(_module, _args, output):
        if threading.get_ident() == owner:
            states["final_postnorm"] = gather_TH(output).to(store_dtype)

    hooked_ids = sorted(set(selection.layer_ids) | ({last_layer} if want_pre else set()) | {selection.deepest_layer})
    handles = [decoder.layers[i].register_forward_hook(layer_hook(i)) for i in hooked_ids]
    if want_post:
        handles.append(decoder.norm.register_forward_hook(norm_hook))
    try:
        decoder.module(input_ids=input_ids_BS, attention_mask=attention_mask_BS, use_cache=False)
    except _StopForward:
        pass
    finally:
        for handle in handles:
            handle.remove()

    missing = [str(i) for i in selection.layer_ids if i not in filled_layers]
    missing += [name for name, wanted in (("final_postnorm", want_post), ("final_prenorm", want_pre)) if wanted and name not in states]
    if missing:
        raise FidelityError(f"{type(model).__name__}: the forward never produced {', '.join(missing)}; its hooks did not fire")

    # 3. NaN/Inf per sample, found on the device (cheap there; a host-side scan of [T, K, H] is not).
    nonfinite = nonfinite_samples(states, cu_seqlens_N1.to(device), selection.layer_ids)

    # 4. One device-to-host copy per captured tensor for the whole batch.
    pin = device.type == "cuda"
    names = [n for n in ("hidden_states", "final_postnorm", "final_prenorm") if n in states]
    if host_buffer is not None:
        views = host_buffer.views([(tuple(states[n].shape), store_dtype) for n in names], pin=pin)
    else:
        views = [torch.empty(states[n].shape, dtype=store_dtype, pin_memory=pin) for n in names]
    states_host = {}
    for name, host in zip(names, views):
        host.copy_(states[name], non_blocking=pin)
        states_host[name] = host
    if pin:
        torch.cuda.current_stream(device).synchronize()
    return CapturedBatch(states_host, nonfinite)


class HostBuffer:
    """Host memory reused across batches by one task thread (pinned when copying from CUDA).

    Grows (with 25% headroom) when a batch needs more; never shrinks. Not thread-safe: give each
    task thread its own.
    """

    _ALIGN = 64

    def __init__(self) -> None:
        self.bytes_U8: torch.Tensor | None = None

    def reserve(self, nbytes: int, *, pin: bool) -> None:
        """Make the buffer at least ``nbytes`` (plus alignment slack) now, outside any GPU lock.

        Pinning gigabytes takes a large fraction of a second (cudaHostAlloc page-locks every
        page), so a worker reserves once per task thread for the run's largest batch.
        """
        need = nbytes + 4 * self._ALIGN
        if self.bytes_U8 is None or self.bytes_U8.numel() < need or self.bytes_U8.is_pinned() != pin:
            self.bytes_U8 = None  # free the old buffer first
            self.bytes_U8 = torch.empty(need, dtype=torch.uint8, pin_memory=pin)

    def views(self, specs: list[tuple[tuple[int, ...], torch.dtype]], *, pin: bool) -> list[torch.Tensor]:
        """Tensors of the given (shape, dtype), carved out of the buffer without overlap."""
        sizes = [int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size() for shape, dtype in specs]
        need = sum(-(-n // self._ALIGN) * self._ALIGN for n in sizes)
        if self.bytes_U8 is None or self.bytes_U8.numel() < need or self.bytes_U8.is_pinned() != pin:
            self.bytes_U8 = torch.empty(int(need * 1.25) + self._ALIGN, dtype=torch.uint8, pin_memory=pin)
        out, offset = [], 0
        for (shape, dtype), n in zip(specs, sizes):
            out.append(self.bytes_U8[offset : offset + n].view(dtype).view(shape))
            offset += -(-n // self._ALIGN) * self._ALIGN
        return out


def nonfinite_samples(states: dict[str, torch.Tensor], cu_seqlens_N1: torch.Tensor, layer_ids) -> dict[int, list[str]]:
    """Samples whose captured states hold NaN or Inf, with the parts where they do.

    ``states`` maps ``hidden_states`` [T, K, H] and ``final_*`` [T, H] to tensors on any one device
    (``cu_seqlens_N1`` on the same device). Returns {sample position j: ["3", "final_postnorm", ...]},
    layers in id order then finals; {} when every value is finite.
    """
    parts: list[str] = []
    finite_cols = []
    for name in sorted(states, key=lambda n: (n != "hidden_states", n)):
        tensor = states[name]
        if name == "hidden_states":
            for k, layer_id in enumerate(layer_ids):
                parts.append(str(layer_id))
                finite_cols.append(torch.isfinite(tensor[:, k]).all(dim=-1))  # [T]
        else:
            parts.append(name)
            finite_cols.append(torch.isfinite(tensor).all(dim=-1))
    bad_TP = ~torch.stack(finite_cols, dim=1)
    if not bool(bad_TP.any()):
        return {}
    lengths_N = cu_seqlens_N1[1:] - cu_seqlens_N1[:-1]
    sample_of_T = torch.repeat_interleave(torch.arange(len(lengths_N), device=bad_TP.device), lengths_N)
    bad_NP = torch.zeros((len(lengths_N), len(parts)), dtype=torch.int64, device=bad_TP.device)
    bad_NP.index_add_(0, sample_of_T, bad_TP.long())
    return {
        j: [parts[p] for p in range(len(parts)) if row[p]]
        for j, row in enumerate((bad_NP > 0).tolist())
        if any(row)
    }
