"""One target split across a group of K processes by tensor parallelism, and the capture on it.

A group is K processes of one ``torch.distributed`` process group (NCCL on GPUs, gloo on the
CPU), each holding 1/K of the sharded weights. The model is loaded with transformers'
``tp_plan="auto"`` (the checkpoint's ``base_model_tp_plan``: attention q/k/v and MLP gate/up
column-wise, o/down row-wise with an all-reduce; Gated DeltaNet's projections column-wise with
their outputs gathered, ``transformers/models/qwen3_5/configuration_qwen3_5.py`` at 5.24), so the
residual stream between decoder layers is replicated: every rank holds the whole hidden state
after each layer. Every rank runs the same forward (the collectives must match); only rank 0
gathers the valid tokens and copies them to the host (``launch_capture(..., keep_states=False)``
on the others), so a batch crosses PCIe once, not K times.

Rank 0 leads: :func:`lead_capture` broadcasts a batch (its rows and layer selection) to the
group and launches its own capture; ranks 1..K-1 run :func:`follow`, a loop that receives each
broadcast, runs the same forward and ends on :func:`stop_followers`. The broadcast is plain
int64 tensors (no pickle): a header, then the rows.

Limits (checked by :func:`check_group_size`): K must divide the attention heads, the KV heads
and the MLP width. transformers' plan does not replicate KV heads when K exceeds them: a KV
head split across ranks fails in the attention's reshape (``RuntimeError: shape '[1, 14, -1,
16]' is invalid`` in ``transformers/models/qwen3/modeling_qwen3.py``, ``Qwen3Attention.forward``,
measured with K=4 and 2 KV heads), so Qwen3-Next-80B (2 KV heads) runs at K=2 at most.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from hsx.errors import BadConfig
from hsx.layers import LayerSelection
from hsx.shard import Final
from hsx.decoder import decoder_of
from workers.capture import PendingCapture, Rows, _check_model, launch_capture

log = logging.getLogger(__name__)

#: ``LayerSelection.final`` <-> its code in the broadcast header (its index here).
FINALS = tuple(Final)
#: header ops
OP_STOP, OP_BATCH, OP_PROBE = 0, 1, 2
#: header: op, B, S, T, N, num_layers, final code, K (captured layers)
HEADER_LEN = 8


def tp_plan_of(model_or_config) -> dict[str, str]:
    """The checkpoint's tensor-parallel plan (``base_model_tp_plan`` of its text config), {} when it has none."""
    config = getattr(model_or_config, "config", model_or_config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return dict(getattr(text, "base_model_tp_plan", None) or {})


def check_group_size(config, world_size: int) -> None:
    """Refuse a group size the checkpoint's plan cannot split.

    Raises:
        BadConfig: the model has no ``base_model_tp_plan``, or ``world_size`` does not divide one
            of the sizes its plan shards (attention heads, KV heads, MLP width, Gated DeltaNet
            heads, the experts' width); the message names the size and the group sizes that work.
    """
    if world_size <= 1:
        return
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    kind = getattr(text, "model_type", type(config).__name__)
    if not tp_plan_of(text):
        raise BadConfig(f"{kind} has no tensor-parallel plan (base_model_tp_plan) in transformers: it cannot be split "
                        f"across {world_size} GPUs; fix: HSX_GPUS_PER_WORKER=1 (one GPU per worker)")
    sizes = {name: getattr(text, name, None) for name in (
        "num_attention_heads", "num_key_value_heads", "intermediate_size", "linear_num_key_heads",
        "linear_num_value_heads", "moe_intermediate_size", "shared_expert_intermediate_size")}
    for name, size in sizes.items():
        if isinstance(size, int) and size % world_size:
            works = [k for k in (2, 4, 8) if all(not isinstance(v, int) or v % k == 0 for v in sizes.values())]
            raise BadConfig(
                f"{kind}: {name}={size} is not divisible by the group size {world_size}: tensor parallelism gives each "
                f"of the {world_size} ranks an equal share of it (transformers does not replicate KV heads); "
                f"fix: --gpus-per-worker {' or '.join(map(str, works)) if works else '1'} "
                f"(HSX_GPUS_PER_WORKER={' or '.join(map(str, works)) if works else '1'} for workers started on their own)")


def load_tensor_parallel(path, *, dtype: torch.dtype, use_safetensors: bool = True,
                         trust_remote_code: bool = False) -> torch.nn.Module:
    """Load the ``*ForCausalLM`` at ``path`` sharded across the current process group.

    Every rank of an initialised ``torch.distributed`` group calls this with the same arguments
    (transformers reads its rank from it; on CUDA it binds ``cuda:LOCAL_RANK``). Parameters come
    back as DTensors holding this rank's shard; the model is in eval mode with grads off.
    Needs the ``accelerate`` package (transformers refuses ``tp_plan`` without it).

    Raises:
        BadConfig: no process group is initialised, or :func:`check_group_size` refuses it.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if not dist.is_available() or not dist.is_initialized():
        raise BadConfig("load_tensor_parallel needs an initialised torch.distributed process group "
                        "(torch.distributed.init_process_group, one process per GPU of the group)")
    from hsx.models import hub_kwargs

    hub = hub_kwargs(path)  # a hub id: its cache looked at once, no retries of an unreachable hub
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, **hub)
    check_group_size(config, dist.get_world_size())
    from workers.loading import converters_reused

    with converters_reused():  # an MoE's converter copy per expert tensor (workers/loading.py)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, tp_plan="auto", use_safetensors=use_safetensors,
                                                     trust_remote_code=trust_remote_code, **hub)
    model.requires_grad_(False)
    return model.eval()


def _wire_device() -> torch.device:
    # NCCL broadcasts device tensors; gloo host tensors.
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _broadcast_header(header: torch.Tensor | None) -> torch.Tensor:
    wire = _wire_device()
    buf = header.to(wire) if header is not None else torch.empty(HEADER_LEN, dtype=torch.int64, device=wire)
    dist.broadcast(buf, src=0)
    return buf.cpu()


def lead_capture(model: torch.nn.Module, rows: Rows, selection: LayerSelection, *, store_dtype: torch.dtype,
                 host_buffer=None) -> PendingCapture:
    """Rank 0: send the batch to the followers, then launch its own capture (``launch_capture``).

    The broadcast is a header (op, B, S, T, N, num_layers, final, K) and one int64 tensor of
    ``input_ids_BS`` [B*S], ``valid_T`` [T], ``cu_seqlens_N1`` [N+1] and the K layer ids. With
    one process (no group, or a group of 1) it is ``launch_capture`` alone. Returns its
    :class:`~workers.capture.PendingCapture`, which holds the whole states.
    """
    if dist.is_initialized() and dist.get_world_size() > 1:
        # What launch_capture refuses is refused before the broadcast: a follower must never run
        # a forward its leader does not (the group would be left waiting in a collective).
        _check_model(decoder_of(model), model, selection)
        B, S, T = rows.shape
        N = rows.cu_seqlens_N1.shape[0] - 1
        ids = torch.tensor(selection.layer_ids, dtype=torch.int64)
        _broadcast_header(torch.tensor([OP_BATCH, B, S, T, N, selection.num_layers, FINALS.index(selection.final), len(ids)],
                                       dtype=torch.int64))
        payload = torch.cat([rows.input_ids_BS.reshape(-1).to(torch.int64), rows.valid_T.to(torch.int64),
                             rows.cu_seqlens_N1.to(torch.int64), ids])
        dist.broadcast(payload.to(_wire_device()), src=0)
    return launch_capture(model, rows, selection, store_dtype=store_dtype, host_buffer=host_buffer)


def lead_probe(model: torch.nn.Module) -> int | None:
    """Rank 0: measure the padded tokens per forward that fit the group's GPUs, all ranks at once.

    Every rank runs ``workers.memory.forward_tokens_that_fit`` (two bare forwards, the same on
    each rank: their collectives match) and the group takes the smallest answer (an all-reduce
    MIN), since the rank with the least free memory bounds the forward. None on the CPU (no
    limit; no forward runs), or without a group.
    """
    from workers.memory import forward_tokens_that_fit

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return forward_tokens_that_fit(model)
    _broadcast_header(torch.tensor([OP_PROBE] + [0] * (HEADER_LEN - 1), dtype=torch.int64))
    return _probe(model)


def _probe(model: torch.nn.Module) -> int | None:
    from workers.memory import forward_tokens_that_fit

    fit = forward_tokens_that_fit(model)
    wire = torch.tensor([-1 if fit is None else fit], dtype=torch.int64, device=_wire_device())
    dist.all_reduce(wire, op=dist.ReduceOp.MIN)
    value = int(wire.item())
    return None if value < 0 else value


def stop_followers() -> None:
    """Rank 0: end the followers' :func:`follow` loops (they return)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        _broadcast_header(torch.tensor([OP_STOP] + [0] * (HEADER_LEN - 1), dtype=torch.int64))


def follow(model: torch.nn.Module, before_forward=None) -> int:
    """Ranks 1..K-1: run every batch rank 0 sends (:func:`lead_capture`) until :func:`stop_followers`.

    Each batch runs the same forward as rank 0, as far as its selection needs, keeping nothing
    (``keep_states=False``); a probe (:func:`lead_probe`) runs the same memory probe as rank 0.
    ``before_forward(n)``, if given, is called with the batch's number (1-based) after it arrived
    and before its forward (fault injection: ``workers/faults.py``). Returns the number of
    batches followed.

    Raises:
        Whatever the forward raises (a rank that fails leaves the group's next collective
        hanging until the process group's timeout: the group is then restarted as a whole).
    """
    followed = 0
    while True:
        op, B, S, T, N, num_layers, final, K = _broadcast_header(None).tolist()
        if op == OP_STOP:
            return followed
        if op == OP_PROBE:
            _probe(model)
            continue
        payload = torch.empty(B * S + T + N + 1 + K, dtype=torch.int64, device=_wire_device())
        dist.broadcast(payload, src=0)
        payload = payload.cpu()
        ids_BS, valid_T, cu_N1, layer_ids = payload.split([B * S, T, N + 1, K])
        rows = Rows(ids_BS.reshape(B, S).clone(), valid_T.clone(), cu_N1.clone())
        selection = LayerSelection(tuple(layer_ids.tolist()), FINALS[final], None, num_layers)
        if before_forward is not None:
            before_forward(followed + 1)
        launch_capture(model, rows, selection, store_dtype=torch.float32, keep_states=False).wait()
        followed += 1
