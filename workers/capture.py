"""The capture path, top to bottom: one batched forward, hooks on the chosen layers, valid tokens
gathered on the device, a finiteness check on the device, fp8 quantisation on the device when the
run stores fp8 (``hsx/fp8.py``), one device-to-host copy per captured tensor on a side stream, the
shard's tensors.

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
docs/FACTS.md §1). Rows are right-padded and run without an attention mask: every layer is
causal, so padding after a sample's last token never reaches it (see :func:`launch_capture`; the
tests compare every family against unpadded per-sample forwards). Left padding without a mask, or
packing without boundary-aware kernels, is wrong (docs/FACTS.md §2) and is not used.

A worker splits a batch in two steps: :func:`launch_capture` (under the GPU lock) only queues the
forward, the gathers and the copies, with no host sync; ``PendingCapture.wait()`` (after the lock
is released) waits for the copies. The next batch's forward is queued behind this one without a
gap while its states travel to the host on a side stream.

Hooks act only for the thread that registered them: two threads capturing on one model at once
(``HSX_WORKER_CONCURRENCY`` > 1, or a duplicate delivery run in-process) never see each other's
activations.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch

from hsx.decoder import NORM_NAMES, Decoder, decoder_of, first_output
from hsx.errors import BadConfig, FidelityError
from hsx.fp8 import FP8_DTYPE, quantize_states, row_amax
from hsx.layers import LayerSelection
from hsx.shard import FINAL_POSTNORM, FINAL_PRENORM, HIDDEN_STATES, Final, scale_name


class _StopForward(Exception):
    """Raised by the deepest hook when nothing later is needed: layers after it are not run."""


_rows_unpacked = threading.local()


def _skip_packed_sequence_check() -> None:
    """Stop transformers' packed-sequence check from syncing the host in our forwards.

    With ``attention_mask=None`` and no cache, transformers' ``create_causal_mask`` calls
    ``masking_utils.find_packed_sequence_indices(position_ids)``, whose ``.all()`` on a device tensor
    makes the host wait for every kernel queued before it (transformers 5.24, ``masking_utils.py``
    l. 761): a batch's launch stalls at its first layer until the previous batch's forward has run,
    and the GPU idles while the rest is launched (measured with torch's sync debug mode:
    ``bench/forward_profile.py``). Our rows are never packed (each is one sample from position 0, the
    positions the model builds itself), so the check's answer is known: None, "no packed sequences".
    It is answered without a sync only inside :func:`launch_capture`'s forward on its own thread;
    every other caller (the reference forward, generation) gets transformers' own function.
    """
    try:
        import transformers.masking_utils as masking_utils
    except ImportError:  # a transformers without it has no such check
        return
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None or getattr(original, "hsx_unpacked_rows", False):
        return

    def find_packed_sequence_indices(position_ids):
        if getattr(_rows_unpacked, "active", False):
            return None
        return original(position_ids)

    find_packed_sequence_indices.hsx_unpacked_rows = True
    find_packed_sequence_indices.original = original
    masking_utils.find_packed_sequence_indices = find_packed_sequence_indices


def _check_model(decoder: Decoder, model: torch.nn.Module, selection: LayerSelection) -> None:
    if len(decoder.layers) != selection.num_layers:
        raise FidelityError(
            f"{type(model).__name__} has {len(decoder.layers)} decoder layers but the layer selection was made for "
            f"{selection.num_layers}: layer ids would point at other layers. Re-plan the run for this model."
        )
    if Final(selection.final).has_postnorm and decoder.norm is None:
        raise BadConfig(
            f"--final {selection.final}: {type(model).__name__} has no final norm module (looked for "
            f"{', '.join(NORM_NAMES)} on {decoder.path or 'the model'!r}), so its post-norm state cannot be taken "
            "from the model's own norm; use --final prenorm or none"
        )


@dataclass
class CapturedBatch:
    """One batch's captured states on the host, ready for the shard.

    ``states``: ``hidden_states`` [T, K, H] plus the final states asked for, [T, H], in the store
    dtype; for fp8 also each one's float32 scale (``hidden_states_scale`` [T, K], ``final_*_scale``
    [T], ``hsx/fp8.py``). ``nonfinite``: sample position j (0..N-1) -> the parts of it that hold NaN or Inf
    (layer ids as strings, ``final_postnorm``, ``final_prenorm``); empty when every value is finite.
    """

    states: dict[str, torch.Tensor]
    nonfinite: dict[int, list[str]]


@dataclass
class Rows:
    """A batch laid out as right-padded rows, built on the host before the GPU lock is taken.

    ``input_ids_BS`` int64 [B, S] (pinned when the target is on CUDA), ``valid_T`` int64 [T]: the
    flat row-major positions (``b * S + s``) of the T valid tokens, in ``input_ids_T`` order;
    ``cu_seqlens_N1`` int64 [N+1] as given.
    """

    input_ids_BS: torch.Tensor
    valid_T: torch.Tensor
    cu_seqlens_N1: torch.Tensor

    @property
    def shape(self) -> tuple[int, int, int]:
        """(B, S, T)."""
        B, S = self.input_ids_BS.shape
        return B, S, self.valid_T.shape[0]


def right_padded_rows(input_ids_T: torch.Tensor, cu_seqlens_N1: torch.Tensor, *, pad_token_id: int = 0,
                      pin: bool = False) -> Rows:
    """Lay ``input_ids_T`` [T] (sample j = ``input_ids_T[cu[j]:cu[j+1]]``) out as right-padded
    rows, one sample per row, on the host (numpy index arithmetic: no device sync later).

    Raises:
        FidelityError: ``cu_seqlens_N1`` does not describe ``input_ids_T``.
    """
    cu_N1 = cu_seqlens_N1.to(torch.int64).cpu()
    lengths_N = (cu_N1[1:] - cu_N1[:-1]).numpy()
    N, T = int(lengths_N.shape[0]), int(cu_N1[-1])
    if input_ids_T.shape[0] != T or N == 0 or (lengths_N <= 0).any():
        raise FidelityError(f"input_ids has {input_ids_T.shape[0]} tokens but cu_seqlens {cu_N1.tolist()[:8]}... "
                            "ends elsewhere or has an empty sample")
    S = int(lengths_N.max())
    # Token t of sample j sits at row j, column t - cu[j]: flat position j*S + t - cu[j].
    valid_T = torch.from_numpy(np.repeat(np.arange(N, dtype=np.int64) * S - cu_N1[:-1].numpy(), lengths_N)
                               + np.arange(T, dtype=np.int64))
    input_ids_BS = torch.full((N, S), pad_token_id, dtype=torch.int64)
    input_ids_BS.view(-1)[valid_T] = input_ids_T.to(torch.int64).cpu()
    if pin:
        input_ids_BS, valid_T = input_ids_BS.pin_memory(), valid_T.pin_memory()
    return Rows(input_ids_BS, valid_T, cu_N1)


class PendingCapture:
    """A launched capture: the forward and its copies are queued on the device, not yet done.

    Made by :func:`launch_capture` under the GPU lock; :meth:`wait` is called after the lock is
    released, so the next batch's forward is queued behind this one's without a gap while this
    batch's states travel to the host on a side stream.
    """

    def __init__(self, states_host: dict[str, torch.Tensor], finite_TP_host: torch.Tensor, parts: list[str],
                 cu_seqlens_N1: torch.Tensor, done: "torch.cuda.Event | None", keep_alive: tuple):
        self._states_host, self._finite_TP_host, self._parts = states_host, finite_TP_host, parts
        self._cu_N1, self._done, self._keep_alive = cu_seqlens_N1, done, keep_alive

    def wait(self) -> CapturedBatch:
        """Block until the states are on the host (releases the GIL meanwhile); return them."""
        if self._done is not None:
            self._done.synchronize()
        self._keep_alive = ()  # device tensors may be reused only after the copies finished
        return CapturedBatch(self._states_host, nonfinite_from_flags(self._finite_TP_host, self._cu_N1, self._parts))


@torch.inference_mode()
def launch_capture(
    model: torch.nn.Module,
    rows: Rows,
    selection: LayerSelection,
    *,
    store_dtype: torch.dtype,
    host_buffer: "HostBuffer | None" = None,
    keep_states: bool = True,
) -> PendingCapture:
    """Queue one batch's forward, gather, finiteness flags and device-to-host copies; no host sync.

    Attention: right-padded rows run WITHOUT an attention mask. Every layer of a decoder-only
    model is causal (softmax attention under ``is_causal``, Gated DeltaNet's recurrence and its
    causal short convolution), so token t of a row depends only on tokens 0..t of that row, and
    padding placed after the last valid token can never reach a valid one. This keeps the
    base model's fastest path (flash sdpa, fla kernels without a mask), the ceiling's path; the
    padded positions' outputs are garbage and are never gathered. Left padding or packing would
    need a mask or boundary-aware kernels (docs/FACTS.md §2) and are not used.

    Args:
        model: a ``*ForCausalLM`` (or a bare decoder) on its device, in eval mode.
        rows: from :func:`right_padded_rows`.
        selection: which layers (ascending ids) and final states to capture.
        store_dtype: dtype of the returned states (the cast happens on the device, before the copy).
            ``torch.float8_e4m3fn``: fp8 with a float32 scale per token and part: the hooks keep
            the states in the model's dtype, the NaN/Inf flags are taken on them, then
            :func:`hsx.fp8.quantize_states` quantises them on the device before the copy; the
            scales come back as ``<name>_scale``.
        host_buffer: host memory (pinned on CUDA) the copies land in; the returned tensors alias
            it and stay valid until its next use. Without it, fresh host tensors are allocated.
        keep_states: False for a follower rank of a tensor-parallel group (``workers/parallel.py``):
            the forward runs exactly as far as with True (the ranks' collectives must match), but
            nothing is gathered, kept or copied to the host; ``wait()`` gives an empty
            :class:`CapturedBatch`. Under tensor parallelism the residual stream is replicated,
            so rank 0's copy is the whole state.

    Returns:
        :class:`PendingCapture`; its ``wait()`` gives the :class:`CapturedBatch`.

    Raises:
        BadConfig: no decoder found, or a post-norm state asked of a model without a final norm.
        FidelityError: the model's layer count is not the selection's, or a hook never fired.
    """
    decoder = decoder_of(model)
    _check_model(decoder, model, selection)
    device = next(decoder.module.parameters()).device
    on_cuda = device.type == "cuda"
    B, S, T = rows.shape
    input_ids_BS = rows.input_ids_BS.to(device, non_blocking=True)
    valid_T = rows.valid_T.to(device, non_blocking=True)

    def gather_TH(hidden_BSH: torch.Tensor) -> torch.Tensor:
        return hidden_BSH.reshape(B * S, hidden_BSH.shape[-1]).index_select(0, valid_T)

    # Hooks keep only the valid tokens, so padded activations are freed as the forward goes on:
    # cast to the store dtype, or, for fp8, as the model made them (quantised after the forward,
    # below). states["hidden_states"] [T, K, H] is allocated by the first hook (H is known then) and
    # each layer writes its slot k: no stack, no second copy of the K layers.
    slot_of_layer = {layer_id: k for k, layer_id in enumerate(selection.layer_ids)}
    last_layer = selection.num_layers - 1
    final = Final(selection.final)
    # With a post-norm state the forward must reach the norm; otherwise stop after the deepest layer.
    stop_after = None if final.has_postnorm else selection.deepest_layer
    owner = threading.get_ident()
    # fp8 holds the states in the model's dtype until the forward is done (as a bf16 run holds its
    # own), so that its NaN/Inf flags are taken on unquantised values and quantising is one step.
    quantize = store_dtype == FP8_DTYPE
    held_dtype = None if quantize else store_dtype  # None: the model's own dtype
    states: dict[str, torch.Tensor] = {}
    filled_layers: set[int] = set()

    def keep(name: str, x_TH: torch.Tensor) -> None:  # a final state [T, H]
        states[name] = x_TH if held_dtype is None else x_TH.to(held_dtype)

    def layer_hook(layer_id: int):
        def hook(_module, _args, output):
            if threading.get_ident() != owner:
                return None
            hidden_BSH = first_output(output)
            if keep_states and layer_id in slot_of_layer:
                if HIDDEN_STATES not in states:
                    K, H = len(selection.layer_ids), hidden_BSH.shape[-1]
                    states[HIDDEN_STATES] = torch.empty((T, K, H), dtype=held_dtype or hidden_BSH.dtype, device=device)
                states[HIDDEN_STATES][:, slot_of_layer[layer_id]] = gather_TH(hidden_BSH)
                filled_layers.add(layer_id)
            if keep_states and final.has_prenorm and layer_id == last_layer:
                keep(FINAL_PRENORM, gather_TH(hidden_BSH))
            if layer_id == stop_after:
                raise _StopForward
            return None

        return hook

    def norm_hook(_module, _args, output):
        if keep_states and threading.get_ident() == owner:
            keep(FINAL_POSTNORM, gather_TH(output))

    hooked_ids = sorted(set(selection.layer_ids) | ({last_layer} if final.has_prenorm else set()) | {selection.deepest_layer})
    handles = [decoder.layers[i].register_forward_hook(layer_hook(i)) for i in hooked_ids]
    if final.has_postnorm:
        handles.append(decoder.norm.register_forward_hook(norm_hook))
    _skip_packed_sequence_check()
    _rows_unpacked.active = True
    try:
        decoder.module(input_ids=input_ids_BS, attention_mask=None, use_cache=False)
    except _StopForward:
        pass
    finally:
        _rows_unpacked.active = False
        for handle in handles:
            handle.remove()
    if not keep_states:  # wait() still waits for the forward, which reads the pinned inputs
        done = torch.cuda.Event() if on_cuda else None
        if done is not None:
            done.record(torch.cuda.current_stream(device))
        return PendingCapture({}, torch.ones((T, 0), dtype=torch.bool), [], rows.cu_seqlens_N1, done,
                              (input_ids_BS, valid_T, rows))

    missing = [str(i) for i in selection.layer_ids if i not in filled_layers]
    missing += [name for name in final.tensors if name not in states]
    if missing:
        raise FidelityError(f"{type(model).__name__}: the forward never produced {', '.join(missing)}; its hooks did not fire")

    # NaN/Inf flags per token and part, computed on the device (a host scan of [T, K, H] is not cheap)
    # and copied with the states: [T, P] bools, read after wait(). Taken before fp8 quantisation:
    # e4m3fn has no Inf (hsx/fp8.py).
    # One max-|x| pass per state gives both (an inf-norm is NaN or inf exactly where a row is not finite).
    amax = {name: row_amax(x) for name, x in states.items()}
    finite_TP, parts = finite_flags(states, selection.layer_ids, amax)
    if quantize:
        states = quantize_states(states, amax)  # fp8: q [..., H] and a float32 <name>_scale [...] per state

    # One device-to-host copy per captured tensor, on a side stream so that the next batch's forward
    # (queued on the compute stream as soon as the GPU lock is released) overlaps with it.
    names = [n for n in (HIDDEN_STATES, FINAL_POSTNORM, FINAL_PRENORM) if n in states]
    names += [scale_name(n) for n in names if scale_name(n) in states]
    specs = [(tuple(states[n].shape), states[n].dtype) for n in names] + [(tuple(finite_TP.shape), torch.bool)]
    if host_buffer is not None:
        views = host_buffer.views(specs, pin=on_cuda)
    else:
        views = [torch.empty(shape, dtype=dtype, pin_memory=on_cuda) for shape, dtype in specs]
    sources = [states[n] for n in names] + [finite_TP]
    done = None
    if on_cuda:
        copy_stream = _copy_stream(device)
        copy_stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(copy_stream):
            for host, source in zip(views, sources):
                host.copy_(source, non_blocking=True)
            done = torch.cuda.Event()
            done.record(copy_stream)
    else:
        for host, source in zip(views, sources):
            host.copy_(source)
    # Kept alive until wait(): the copies read them, and the pinned inputs feed queued uploads.
    keep_alive = (tuple(sources), input_ids_BS, valid_T, rows)
    return PendingCapture(dict(zip(names, views[:-1])), views[-1], parts, rows.cu_seqlens_N1, done, keep_alive)


_copy_streams: dict[torch.device, "torch.cuda.Stream"] = {}
_copy_streams_lock = threading.Lock()


def _copy_stream(device: torch.device) -> "torch.cuda.Stream":
    with _copy_streams_lock:
        if device not in _copy_streams:
            _copy_streams[device] = torch.cuda.Stream(device)
        return _copy_streams[device]


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
    """Run one right-padded batch and return the shard tensors on the host (blocking).

    :func:`right_padded_rows` + :func:`launch_capture` + ``wait()``; a worker calls the parts
    itself so that only the launch holds the GPU lock.

    Args:
        model: a ``*ForCausalLM`` (or a bare decoder) on its device, in eval mode.
        input_ids_T: int tensor [T] (any device): the batch's samples concatenated.
        cu_seqlens_N1: int64 [N+1]: sample j is ``input_ids_T[cu[j]:cu[j+1]]``.
        selection: which layers (ascending ids) and final states to capture.
        store_dtype: dtype of the returned states.
        pad_token_id: id written into the padding (never reaches a valid token: see :func:`launch_capture`).
        host_buffer: see :func:`launch_capture`.

    Returns:
        :class:`CapturedBatch`: ``states`` holds ``hidden_states`` [T, K, H] and, as asked,
        ``final_postnorm`` / ``final_prenorm`` [T, H], on the CPU in ``store_dtype``; token t of
        each is token t of ``input_ids_T``. ``nonfinite`` names the samples with NaN/Inf.

    Raises:
        BadConfig, FidelityError: as :func:`launch_capture` and :func:`right_padded_rows`.
    """
    device = next(decoder_of(model).module.parameters()).device
    rows = right_padded_rows(input_ids_T, cu_seqlens_N1, pad_token_id=pad_token_id, pin=device.type == "cuda")
    return launch_capture(model, rows, selection, store_dtype=store_dtype, host_buffer=host_buffer).wait()


def split_by_tokens(cu_seqlens_N1: torch.Tensor, max_padded_tokens: int | None) -> list[tuple[int, int]]:
    """Consecutive sample ranges ``[j0, j1)`` of a batch whose right-padded rows (rows x longest
    row) each hold at most ``max_padded_tokens``: the forwards a batch too big for this GPU is run
    in. One range for the whole batch when it fits or when there is no limit (None); a sample
    longer than the limit alone gets a range of its own.
    """
    lengths = (cu_seqlens_N1[1:] - cu_seqlens_N1[:-1]).tolist()
    if not max_padded_tokens or len(lengths) * max(lengths) <= max_padded_tokens:
        return [(0, len(lengths))]
    ranges, start, longest = [], 0, 0
    for j, n in enumerate(lengths):
        if j > start and (j - start + 1) * max(longest, n) > max_padded_tokens:
            ranges.append((start, j))
            start, longest = j, 0
        longest = max(longest, n)
    ranges.append((start, len(lengths)))
    return ranges


def merge_captured(parts: list[CapturedBatch], first_samples: list[int]) -> CapturedBatch:
    """One batch's :class:`CapturedBatch` from those of its consecutive sample ranges (in order;
    ``first_samples[i]`` is the batch position of part i's sample 0): states concatenated along
    tokens, nonfinite positions shifted to the batch's."""
    states = {name: torch.cat([p.states[name] for p in parts]) for name in parts[0].states}
    nonfinite = {first + j: names for part, first in zip(parts, first_samples) for j, names in part.nonfinite.items()}
    return CapturedBatch(states, nonfinite)


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
        need = nbytes + 8 * self._ALIGN  # alignment slack: up to 7 views (3 states, fp8's 3 scales, the flags)
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


def finite_flags(states: dict[str, torch.Tensor], layer_ids,
                 amax: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, list[str]]:
    """Per token and captured part, whether every value is finite: (bool [T, P], the P part names).

    ``states`` maps ``hidden_states`` [T, K, H] and ``final_*`` [T, H] to tensors on one device;
    the flags are computed there (no host sync), from each row's max |x| (``hsx.fp8.row_amax``:
    NaN or inf exactly where the row holds a NaN or an Inf), given in ``amax`` by name ([T, K] or
    [T]) or computed here. Parts: the layer ids as strings, in the order of ``layer_ids``, then the
    finals by name.
    """
    parts: list[str] = []
    finite_cols = []
    for name in sorted(states, key=lambda n: (n != "hidden_states", n)):
        row_max = amax[name] if amax is not None else row_amax(states[name])
        if name == "hidden_states":
            parts += [str(layer_id) for layer_id in layer_ids]
            finite_cols.append(torch.isfinite(row_max))  # [T, K]
        else:
            parts.append(name)
            finite_cols.append(torch.isfinite(row_max)[:, None])  # [T, 1]
    return torch.cat(finite_cols, dim=1), parts


def nonfinite_from_flags(finite_TP: torch.Tensor, cu_seqlens_N1: torch.Tensor, parts: list[str]) -> dict[int, list[str]]:
    """Samples with a non-finite part, from :func:`finite_flags`'s output on the host:
    {sample position j: [part names]}; {} when every flag is True."""
    bad_TP = ~finite_TP.cpu().numpy()
    if not bad_TP.any():
        return {}
    cu = cu_seqlens_N1.cpu().numpy()
    bad_NP = np.logical_or.reduceat(bad_TP, cu[:-1], axis=0)  # samples are never empty
    return {j: [parts[p] for p in np.flatnonzero(row)] for j, row in enumerate(bad_NP) if row.any()}


def nonfinite_samples(states: dict[str, torch.Tensor], cu_seqlens_N1: torch.Tensor, layer_ids) -> dict[int, list[str]]:
    """Samples whose captured states hold NaN or Inf, with the parts where they do.

    ``states`` maps ``hidden_states`` [T, K, H] and ``final_*`` [T, H] to tensors on any one device.
    Returns {sample position j: ["3", "final_postnorm", ...]}, layers in id order then finals;
    {} when every value is finite.
    """
    finite_TP, parts = finite_flags(states, layer_ids)
    return nonfinite_from_flags(finite_TP, cu_seqlens_N1, parts)
