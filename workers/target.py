"""The target model inside a worker process: loaded once, warmed up, reused by every task.

Loading follows docs/FACTS.md §2: ``AutoModelForCausalLM`` (a Qwen3.5 / 3.6 multimodal
checkpoint loads as the text-only model), ``use_safetensors=True`` (no pickle checkpoints),
``trust_remote_code`` only when the settings allow it, bf16 on CUDA and fp32 on the CPU.
"""

from __future__ import annotations

import gc
import importlib.metadata
import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from hsx.decoder import decoder_of
from hsx.errors import BadConfig
from hsx.models import hub_kwargs, model_info, resolve_model_path, safetensors_only
from settings import Settings
from workers import compile_cache, faults, loading, quantized
from workers.capture import PendingCapture, Rows, launch_capture, right_padded_rows
from workers.memory import forward_tokens_that_fit

log = logging.getLogger(__name__)


@dataclass
class Target:
    """A loaded target model. ``info`` is :class:`hsx.models.ModelInfo`; ``engine`` is for shard metadata."""

    name: str
    model: torch.nn.Module
    device: torch.device
    compute_dtype: torch.dtype
    info: object
    engine: dict
    pad_token_id: int
    load_s: float
    warmup_s: float
    max_forward_tokens: int | None = None
    """Most padded tokens one forward may hold (:func:`forward_tokens_that_fit`); None: no limit."""
    compile_cache: dict | None = None
    """What the warm-up did with the compile cache in the store (``workers.compile_cache.around_warm_up``);
    None when nothing travels (CPU, ``HSX_COMPILE_CACHE=false``, no Triton)."""
    gpu_lock: threading.Lock = field(default_factory=threading.Lock)
    """Held during the forward and the device-to-host copy: with two task threads per worker, one
    batch runs on the GPU while the other writes and stores its shard."""
    group: object | None = None
    """The tensor-parallel group this process leads (:class:`workers.group.Group`) when
    ``HSX_GPUS_PER_WORKER`` > 1; None: the whole model is in this process."""

    def launch(self, rows: Rows, selection, *, store_dtype: torch.dtype, host_buffer=None) -> PendingCapture:
        """Queue one forward's capture (``workers.capture.launch_capture``); in a group, through
        the group (``Group.lead``: broadcast to the followers first). Call it under :attr:`gpu_lock`.

        Raises:
            hsx.errors.GroupBroken: the group is broken, or broke in this forward (transient).
            What ``launch_capture`` raises, without a group.
        """
        if self.group is None:
            return launch_capture(self.model, rows, selection, store_dtype=store_dtype, host_buffer=host_buffer)
        return self.group.lead(self.model, rows, selection, store_dtype=store_dtype, host_buffer=host_buffer)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def kernel_report(model: torch.nn.Module) -> dict:
    """Which kernels this process runs: attention implementation, fla, causal-conv1d."""
    fla = causal = False
    try:
        import fla.ops.gated_delta_rule  # noqa: F401

        fla = True
    except Exception:
        pass
    try:
        import causal_conv1d  # noqa: F401

        causal = True
    except Exception:
        pass
    return {
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "fla": fla,
        "causal_conv1d": causal,
    }


GDN_MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "olmo_hybrid", "qwen4_exp")


def is_gdn(config) -> bool:
    """True for Gated DeltaNet (linear-attention hybrid) models (docs/FACTS.md §2)."""
    text = config.get_text_config()
    return text.model_type in GDN_MODEL_TYPES or "linear_attention" in (getattr(text, "layer_types", None) or [])


#: fla's chunk size for the gated delta rule (``fla.ops.gated_delta_rule.chunk``: 64 by default).
GDN_CHUNK = 64


class RowsAsSequences:
    """fla's ``chunk_gated_delta_rule`` called on right-padded rows as one variable-length row.

    transformers' Gated DeltaNet layers call the kernel with ``[B, T, H, K]`` rows. fla compiles its
    chunk-local cumsum with the batch size ``B`` as a ``tl.constexpr`` and autotunes it per value
    (``fla/ops/utils/cumsum.py`` at fla-core 0.6.0: ``key=['B', 'H', 'BT', 'IS_VARLEN', 'REVERSE']``),
    so a length-sorted run, which meets nearly every row count, pays a compile and an autotune per
    count (270 s cold for 1..256 rows, measured on the H200). Here the B rows are passed as B
    sequences of one row, ``[1, B*T, H, K]`` with ``cu_seqlens = [0, T, 2T, ..., BT]``, fla's own
    variable-length mode (its docstring's "inputs with variable lengths" example): the same
    recurrence per sequence from a zero state, so the same values, with ``B`` always 1 and one
    compiled variant for every batch. The ``chunk_indices`` that fla would derive from
    ``cu_seqlens`` with a host sync are built on the host and copied once per batch shape.

    Anything else (a cache's initial state, explicit ``cu_seqlens``) goes to the kernel unchanged.
    """

    def __init__(self, kernel):
        self.kernel = kernel
        self._last: tuple | None = None  # (B, T, device) -> device tensors, reused by every layer of a forward

    def offsets(self, B: int, T: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(cu_seqlens int64 [B+1], chunk_indices int64 [B*ceil(T/64), 2]) on ``device`` for B rows of T."""
        key = (B, T, device)
        if self._last is None or self._last[0] != key:
            n_chunks = -(-T // GDN_CHUNK)
            cu_N1 = torch.arange(0, (B + 1) * T, T, dtype=torch.int64)
            chunks_C2 = torch.stack([torch.arange(B).repeat_interleave(n_chunks), torch.arange(n_chunks).repeat(B)], 1)
            pin = device.type == "cuda"
            host = (cu_N1.pin_memory() if pin else cu_N1, chunks_C2.pin_memory() if pin else chunks_C2)
            self._last = (key, tuple(t.to(device, non_blocking=True) for t in host), host)
        return self._last[1]

    def __call__(self, query, key, value, *args, cu_seqlens=None, initial_state=None, **kwargs):
        if cu_seqlens is not None or initial_state is not None:
            return self.kernel(query, key, value, *args, cu_seqlens=cu_seqlens, initial_state=initial_state, **kwargs)
        B, T = query.shape[:2]
        cu_N1, chunks_C2 = self.offsets(B, T, query.device)
        flat = [x.reshape(1, B * T, *x.shape[2:]) for x in (query, key, value)]
        args = [a.reshape(1, B * T, *a.shape[2:]) if isinstance(a, torch.Tensor) and a.shape[:2] == (B, T) else a for a in args]
        kwargs = {k: v.reshape(1, B * T, *v.shape[2:]) if k in ("g", "beta") and isinstance(v, torch.Tensor) else v
                  for k, v in kwargs.items()}
        out, state = self.kernel(*flat, *args, cu_seqlens=cu_N1, chunk_indices=chunks_C2, **kwargs)
        return out.reshape(B, T, *out.shape[2:]), state


def rows_as_sequences_active(model: torch.nn.Module) -> bool:
    """Whether every Gated DeltaNet layer of ``model`` runs through :class:`RowsAsSequences`."""
    import sys

    names = {type(m).__module__ for m in linear_attention_modules(model)}
    return bool(names) and all(isinstance(getattr(sys.modules.get(n), "torch_chunk_gated_delta_rule", None), RowsAsSequences)
                               for n in names)


def run_rows_as_sequences(model: torch.nn.Module) -> list[str]:
    """Route the Gated DeltaNet layers of ``model`` through :class:`RowsAsSequences` (CUDA with fla
    only: the torch fallback has no variable-length mode). Returns the modules patched."""
    import sys

    if kernel_report(model)["fla"] is False or next(model.parameters()).device.type != "cuda":
        return []
    patched = []
    for name in sorted({type(m).__module__ for m in linear_attention_modules(model)}):
        module = sys.modules.get(name)
        kernel = getattr(module, "torch_chunk_gated_delta_rule", None)
        if kernel is not None and not isinstance(kernel, RowsAsSequences):
            module.torch_chunk_gated_delta_rule = RowsAsSequences(kernel)
            patched.append(name)
    return patched


def check_kernels(model: torch.nn.Module, device: torch.device, settings: Settings) -> dict:
    """Refuse the slow path on CUDA: a GDN model needs fla unless ``allow_slow_kernels`` is set.

    Returns the kernel report. Raises :class:`hsx.errors.BadConfig` naming the fix.
    causal-conv1d is optional (it cannot be built quickly; transformers falls back to a torch conv
    that is correct and costs little next to the layers), so its absence is only logged.
    """
    from hsx.errors import BadConfig

    report = kernel_report(model)
    if device.type == "cuda" and is_gdn(model.config):
        if not report["fla"] and not settings.allow_slow_kernels:
            raise BadConfig(
                f"{model.config.get_text_config().model_type} is a Gated DeltaNet model and the fla kernels are not importable on "
                "this CUDA worker: the torch fallback is many times slower. Install the gpu extra "
                "(pip install flash-linear-attention fla-core), or set HSX_ALLOW_SLOW_KERNELS=true to run slowly on purpose"
            )
        if not report["causal_conv1d"]:
            log.warning("causal-conv1d is not installed: the GDN short convolution runs on the torch fallback (correct, slower)")
    return report


def pick_device(settings: Settings) -> torch.device:
    if settings.device:
        return torch.device(settings.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _engine(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> dict:
    return {
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "flash-linear-attention": _version("flash-linear-attention"),
        "causal-conv1d": _version("causal-conv1d"),
        "gdn_rows_as_sequences": rows_as_sequences_active(model),
        "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
        "compute_dtype": str(dtype).removeprefix("torch."),
        **kernel_report(model),
    }


def _pad_id(model: torch.nn.Module) -> int:
    pad = model.config.get_text_config().pad_token_id
    return int(pad) if isinstance(pad, int) else 0


def adopt_model(name: str, model: torch.nn.Module, info, *, warm_up: bool = True, max_rows: int = 256,
                max_forward_tokens: int | None = None) -> Target:
    """Register an already-built model as this process's target ``name`` (benchmarks, tests).

    ``info`` must equal what the run's ``run.json`` records as its model
    (:meth:`hsx.models.ModelInfo.as_dict` is compared), or tasks refuse the run.
    """
    param = next(model.parameters())
    t0 = time.perf_counter()
    run_rows_as_sequences(model)
    if warm_up:
        _warm_up(model, info, _pad_id(model), max_rows)
    target = Target(name, model, param.device, param.dtype, info, _engine(model, param.device, param.dtype),
                    _pad_id(model), 0.0, time.perf_counter() - t0)
    target.max_forward_tokens = max_forward_tokens or forward_tokens_that_fit(model)
    with _lock:
        _loaded.clear()
        _loaded[name] = target
    return target


def load_device_map(device: torch.device) -> dict[str, torch.device]:
    """The ``device_map`` of ``from_pretrained`` that puts the whole model on ``device`` (a bare
    ``cuda`` is made ``cuda:<current device>``, the worker's one GPU under CUDA_VISIBLE_DEVICES).

    Why a device map (transformers 5.24, read in ``.venv``): without one, ``from_pretrained``
    builds every parameter on the CPU, so the whole checkpoint sits in host RAM before
    ``model.to("cuda")`` (a worker then needs free host memory equal to its checkpoint). With
    ``{"": device}``, each safetensors file is opened with ``safe_open(..., backend="mmap")`` and
    every tensor is a lazy ``get_slice`` (``modeling_utils.py`` ``_load_pretrained_model``, l.
    4559-4582); ``convert_and_load_state_dict_in_model`` (``core_model_loading.py`` l. 1938-1960)
    materialises each one with ``_materialize_copy`` (l. 1461: ``tensor[...]`` then
    ``.to(device=..., dtype=...)``) in a pool of ``GLOBAL_WORKERS = min(4, cpus)`` threads (l. 1458),
    and the result lives on the device. Host memory holds the mapped file pages (page cache,
    reclaimable; counted in the process's RSS as ``RssFile`` while the files are open) and at most
    a few tensors in flight, never a second copy of the model. ``caching_allocator_warmup``
    (``modeling_utils.py`` l. 5158) reserves the model's bytes on the GPU in one allocation first.
    On the CPU the map changes nothing: the parameters are what they were without it (a checkpoint
    already in the compute dtype stays mapped from the file, not copied). ``bench/load.py``
    measures it (peak private and total RSS against the checkpoint's bytes, GB/s).
    """
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return {"": device}


def _set_load_threads(n: int) -> None:
    """Size transformers' tensor-loading pool (``core_model_loading.GLOBAL_WORKERS``, read when each
    load starts its ``ThreadPoolExecutor``, l. 1873 at 5.24): ``min(n, cpus)``. Upstream caps it at 4,
    which left a 52 GB load at 2.0 GB/s on the H200 (BENCHMARKS.md, "Loading a target"). A
    transformers without that constant is left as it is."""
    import os

    try:
        import transformers.core_model_loading as loading
    except ImportError:
        return
    if hasattr(loading, "GLOBAL_WORKERS"):
        loading.GLOBAL_WORKERS = max(1, min(n, os.cpu_count() or 1))


def load_target(name: str, settings: Settings) -> Target:
    """Load ``name`` on this worker's device and run one warm-up forward.

    The weights go from the safetensors files to the device one tensor at a time
    (:func:`load_device_map`): a loading worker needs little free host memory besides the page
    cache, whatever the checkpoint's size.

    A fine-grained FP8 checkpoint (``quantization_config`` in its config.json, as the Qwen ``-FP8``
    releases) loads as released: on CUDA with float8 weights and transformers' FP8 matmuls, the
    captured states bf16 as for any target; on the CPU dequantised to fp32 while loading
    (``workers/quantized.py``).

    The checkpoint's identity (``info.revision``: a hash of a local checkpoint's bytes, or the hub
    commit; ``hsx/models.py``) is computed before the weights are read and again after (from the
    hash cache: a ``stat`` per file), so ``info`` names the bytes this process loaded; tasks compare
    it with their run's ``run.json``.

    Raises:
        hsx.errors.BadConfig: the model or its config cannot be read, its weights are pickle
            files and ``HSX_ALLOW_PICKLE_CHECKPOINTS`` is off (refused before any weight file is
            read), or the checkpoint's files changed while they were loaded. An FP8 checkpoint whose
            transformers kernel cannot be loaded on CUDA runs with plain-torch FP8 matmuls, with a
            warning (``workers.quantized.check_fp8_kernels``).
    """
    from transformers import AutoModelForCausalLM

    from workers.group import Group, group_size

    device = pick_device(settings)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    path = resolve_model_path(name, settings.cache_dir)
    use_safetensors = safetensors_only(path, settings.allow_pickle_checkpoints)
    info = model_info(name, settings.cache_dir, trust_remote_code=settings.trust_remote_code)
    t0 = time.perf_counter()
    _set_load_threads(settings.load_threads)
    group = None
    if group_size(settings) > 1:
        # K ranks, this process rank 0 (workers/group.py); the followers start before CUDA is touched here
        from workers.parallel import load_tensor_parallel

        group = Group.start(name, settings)
        model = load_tensor_parallel(path, dtype=dtype, use_safetensors=use_safetensors,
                                     trust_remote_code=settings.trust_remote_code)
        device = next(model.parameters()).device
    else:
        local = loading.local_dir(path, info.revision) if settings.fast_load and device.type == "cuda" else path
        model = None
        if settings.fast_load and loading.can_stream(local, device, trust_remote_code=settings.trust_remote_code):
            # pread into pinned buffers, asynchronous copies to the GPU (workers/loading.py), not transformers' mmap
            try:
                model = loading.load_streamed(local, device=device, dtype=dtype, device_map=load_device_map(device),
                                              prefetch_threads=settings.load_prefetch_threads,
                                              **quantized.load_kwargs(info, device, path))
            except (BadConfig, torch.cuda.OutOfMemoryError):
                raise
            except Exception:  # our loader's own failure: the user's run goes on with transformers' loader
                log.exception("the streamed loader (workers/loading.py) failed on %s; loading it with transformers' "
                              "own loader instead (HSX_FAST_LOAD=false skips the streamed loader)", local)
                torch.cuda.empty_cache()
        if model is None:
            with loading.converters_reused():  # an MoE's converter copy per expert tensor (workers/loading.py)
                model = AutoModelForCausalLM.from_pretrained(
                    path,
                    dtype=dtype,
                    use_safetensors=use_safetensors,
                    trust_remote_code=settings.trust_remote_code,
                    device_map=load_device_map(device),  # straight to the device, one tensor at a time (load_device_map)
                    **hub_kwargs(path),  # a hub id: its cache, read alone when the hub cannot be reached (no retries)
                    **quantized.load_kwargs(info, device, path),  # FP8 on the CPU: dequantised while loading
                )
    faults.hooks().at_load()  # HSX_FAULTS=die_load (tests): dies here, as the OOM killer kills a loading worker
    after = model_info(name, settings.cache_dir, trust_remote_code=settings.trust_remote_code)
    if after.revision != info.revision:
        raise BadConfig(f"checkpoint {path} changed while this worker loaded it (revision {info.revision} before, "
                        f"{after.revision} after): let whatever writes it finish, then start the worker again")
    if group is None:
        model.to(device)  # a no-op: every tensor is on the device already (a buffer left behind would move)
    model.eval()
    model.requires_grad_(False)
    check_kernels(model, device, settings)
    fp8_weights = quantized.check_fp8_kernels(info, device)  # FP8 on CUDA: its matmul kernels loaded now
    run_rows_as_sequences(model)
    load_s = time.perf_counter() - t0
    pad = _pad_id(model)
    engine = _engine(model, device, dtype)
    if info.quantization:  # shard metadata: how the weights ran (the states are bf16 / fp32 either way)
        engine["weights"] = fp8_weights or info.quantization.get("quant_method")
    if group is not None:
        engine["tensor_parallel"] = group.size  # shard metadata: K ranks made these states
    launch = group.lead if group is not None else launch_capture
    ranks = group.size if group is not None else 1
    t1 = time.perf_counter()
    # the default --batch-tokens bounds a planned batch's padded tokens (producer/batching.py), or the forward cap
    warm_tokens = min(settings.batch_tokens, settings.max_forward_tokens or settings.batch_tokens)
    shared = compile_cache.for_worker(settings, device, warm_up=warm_up_tag(warm_tokens))
    if shared is None:
        _warm_up(model, info, pad, settings.max_batch_samples, launch=launch, decode=group is None,
                 max_tokens=warm_tokens, ranks=ranks)
        cache_record = None
    else:  # Triton's kernels from the store before the warm-up, stored after it if the store had none
        store, key, cache_dir = shared
        cache_record = compile_cache.around_warm_up(
            store, key, cache_dir, lambda: _warm_up(model, info, pad, settings.max_batch_samples, launch=launch,
                                                    decode=group is None, max_tokens=warm_tokens, ranks=ranks))
        # kernels compiled later (shapes or row buckets the warm-up did not meet) travel too
        compile_cache.start_top_up(store, key, cache_dir, settings.compile_cache_top_up_s)
    warmup_s = time.perf_counter() - t1
    max_forward = settings.max_forward_tokens or (group.probe(model) if group is not None else forward_tokens_that_fit(model))
    log.info("target %s loaded on %s in %.1f s, warm-up %.1f s, kernels %s, at most %s padded tokens per forward%s",
             name, device, load_s, warmup_s, kernel_report(model), f"{max_forward:,}" if max_forward else "unlimited",
             f", split over a group of {group.size} ranks ({group.backend})" if group is not None else "")
    return Target(name, model, device, dtype, info, engine, pad, load_s, warmup_s, max_forward, cache_record, group=group)


#: Sample lengths of the warm-up batches. Triton compiles one variant of a kernel per
#: specialisation of its integer arguments (value 1, multiple of 16), and fla's chunked kernels
#: see the row length and the number of 64-token chunks: rows of 16k and 16k+r tokens, one row and
#: several, one chunk and more than 16 compile every variant a real run meets, so that no task
#: stalls on a JIT compile mid-run (docs/FACTS.md §7: ~50 s cold for a GDN model).
WARM_UP_LENGTHS = ((32, 16), (33,), (80, 47, 5), (1024,), (1041, 700))


def _warm_up(model: torch.nn.Module, info, pad: int, max_rows: int = 256, launch=launch_capture,
             decode: bool = False, max_tokens: int = 0, ranks: int = 1) -> None:
    # Small padded batches through every layer: JIT-compiles kernels before the first real task.
    # ``launch``: launch_capture, or a group's lead (every rank must run every forward) of ``ranks`` ranks.
    # ``max_tokens``: padded tokens of the largest forward to expect (_warm_up_row_buckets).
    # ``decode``: also the Gated DeltaNet decode kernels a regenerate batch runs (_warm_up_decode).
    from hsx.layers import select_layers
    from hsx.shard import Final

    n = info.num_layers
    selection = select_layers(n, layer_ids=[n - 1], final=Final.POSTNORM)
    on_cuda = next(model.parameters()).device.type == "cuda"
    # On the CPU nothing is JIT-compiled: one small batch checks that the model runs.
    for lengths in WARM_UP_LENGTHS if on_cuda else WARM_UP_LENGTHS[:1]:
        cu = torch.tensor([0, *lengths], dtype=torch.long).cumsum(0)
        ids_T = torch.arange(1, 1 + int(cu[-1]), dtype=torch.long) % 1000
        rows = right_padded_rows(ids_T, cu, pad_token_id=pad, pin=on_cuda)
        launch(model, rows, selection, store_dtype=torch.float32).wait()
    if decode and on_cuda and is_gdn(model.config):
        _warm_up_decode(model, pad)
    if on_cuda and launch is launch_capture:
        _warm_up_row_buckets(model, max_tokens)
    elif on_cuda:
        _warm_up_group_row_buckets(model, launch, max_tokens, pad, ranks)
    if not rows_as_sequences_active(model):
        if launch is not launch_capture:  # a bare module call on rank 0 alone would leave the followers behind
            if on_cuda:
                log.warning("a group does not warm up the batched Gated DeltaNet kernels per row count: each new row "
                            "count compiles on first use")
            return
        _warm_up_row_counts(model, max_rows)  # only the batched kernels compile per row count


#: fla's row-wise kernels bucket their rows by 65,536 and take the bucket as a ``tl.constexpr``
#: autotune key: ``NB = triton.cdiv(T, 2048 * 32)`` in ``l2norm_fwd`` (q and k of every Gated
#: DeltaNet layer, ``use_qk_l2norm_in_kernel``) and ``layer_norm_gated`` (fla/modules/norm/l2norm.py,
#: fused_norm_gate.py at flash-linear-attention 0.6.0). Each bucket compiles and autotunes 25
#: configurations: a 7.3 s stall mid-run on the H100 when a batch met a new one (2026-12-06).
FLA_ROW_BUCKET = 2048 * 32

#: Bump when the warm-up compiles another set of kernels: the compile cache in the store is keyed by
#: it (:func:`warm_up_tag`), so an archive an earlier warm-up stored is not taken for complete.
WARM_UP_REVISION = 2


def warm_up_tag(max_tokens: int) -> str:
    """The warm-up's part of the compile cache's key (``workers.compile_cache.cache_key``): its
    revision and the padded tokens its row buckets cover, e.g. ``warm2-t32768``."""
    return f"warm{WARM_UP_REVISION}-t{int(max_tokens)}"


def gdn_token_counts(max_tokens: int, heads) -> list[int]:
    """Token counts ``T <= max_tokens`` whose rows ``T * h`` fall into each of fla's row buckets
    (:data:`FLA_ROW_BUCKET`) that some ``T' <= max_tokens`` meets, for each head count ``h`` in
    ``heads``: one forward per count compiles every bucket a batch of at most ``max_tokens`` padded
    tokens can meet. Ascending; [] for ``max_tokens < 1``."""
    counts = set()
    for h in {int(h) for h in heads if h and int(h) > 0}:
        for bucket in range(1, -(-max_tokens * h // FLA_ROW_BUCKET) + 1):
            t = min(max_tokens, bucket * FLA_ROW_BUCKET // h)  # the most tokens whose rows stay in the bucket
            if t >= 1:
                counts.add(t)
    return sorted(counts)


@torch.inference_mode()
def _warm_up_row_buckets(model: torch.nn.Module, max_tokens: int) -> None:
    """Compile fla's row-bucketed kernels for every bucket a forward of up to ``max_tokens`` padded
    tokens meets (CUDA, Gated DeltaNet): one call of the first GDN layer on ``[1, T, hidden]`` zeros
    per count of :func:`gdn_token_counts` (the caller runs it on CUDA only; on the CPU nothing is
    compiled), over the layer's key and value head counts (fla is given q and k with the key
    heads; transformers' torch fallback repeats them to the value heads: both are covered). Without
    it a length-sorted run compiled them mid-run, one stall per new bucket on every node, outside the
    compile cache the first worker stores (``workers/compile_cache.py``). A run with a larger
    ``--batch-tokens`` than the worker's ``HSX_BATCH_TOKENS`` compiles its extra buckets on first
    use. A tensor-parallel group warms them up with whole forwards instead
    (:func:`_warm_up_group_row_buckets`)."""
    modules = linear_attention_modules(model)
    param = next(model.parameters())
    if not modules or max_tokens < 1:
        return
    text = model.config.get_text_config()
    heads = (getattr(text, "linear_num_key_heads", 0), getattr(text, "linear_num_value_heads", 0))
    for tokens in gdn_token_counts(max_tokens, heads):
        modules[0](torch.zeros((1, tokens, text.hidden_size), dtype=param.dtype, device=param.device))
    if param.device.type == "cuda":
        torch.cuda.synchronize(param.device)


@torch.inference_mode()
def _warm_up_group_row_buckets(model: torch.nn.Module, launch, max_tokens: int, pad: int, ranks: int) -> None:
    """:func:`_warm_up_row_buckets` for a tensor-parallel group of ``ranks`` processes: every rank must
    run every forward (a module call on rank 0 alone would leave its followers waiting), so each
    token count of :func:`gdn_token_counts` is one whole forward of a single row of that many tokens
    through ``launch`` (the group's ``lead``). A rank holds ``heads / ranks`` of each Gated DeltaNet
    layer's heads (transformers' tensor-parallel plan splits them), so the counts cover the
    per-rank head counts, and the whole ones in case a layer is replicated. The rows are no larger
    than a planned batch's (``max_tokens``); an error is raised as any warm-up forward's is (a
    forward that fails on one rank breaks the group: ``workers/group.py``)."""
    from hsx.layers import select_layers
    from hsx.shard import Final

    if not linear_attention_modules(model) or max_tokens < 1:
        return
    text = model.config.get_text_config()
    heads = [h // k for h in (getattr(text, "linear_num_key_heads", 0), getattr(text, "linear_num_value_heads", 0))
             for k in {1, max(1, int(ranks))} if h and h % k == 0]
    n = text.num_hidden_layers
    selection = select_layers(n, layer_ids=[n - 1], final=Final.POSTNORM)
    on_cuda = next(model.parameters()).device.type == "cuda"
    for tokens in gdn_token_counts(max_tokens, heads):
        ids_T = torch.arange(1, 1 + tokens, dtype=torch.long) % min(1000, text.vocab_size)
        rows = right_padded_rows(ids_T, torch.tensor([0, tokens]), pad_token_id=pad, pin=on_cuda)
        launch(model, rows, selection, store_dtype=torch.float32).wait()


#: Row counts of the decode warm-up: Triton specialises an integer argument on being 1 and on being
#: a multiple of 16, so 1, 2 and 16 rows compile each variant a batch of any size meets.
DECODE_WARM_UP_ROWS = (1, 2, 16)


@torch.inference_mode()
def _warm_up_decode(model: torch.nn.Module, pad: int) -> None:
    """A two-token ``model.generate`` on 1, 2 and 16 short left-padded rows (CUDA, Gated DeltaNet).

    A regenerate batch's decode steps run fla's recurrent kernel (one token per step with the cached
    state), which the capture forward never runs: without this its first batch on a node compiled it
    inside its generate (the Qwen3.5-27B shape's first batch on the H200 ran at 0.58 of the same
    batch's ``generate`` in a warm process, 2026-12-04). Here it is compiled at the warm-up, so the
    compile cache in the store (``workers/compile_cache.py``) carries it too. A failure is logged,
    never raised: the batch then compiles on first use as before."""
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    config = GenerationConfig(max_new_tokens=2, min_new_tokens=2, do_sample=False, num_beams=1, pad_token_id=int(pad))
    try:
        for rows in DECODE_WARM_UP_ROWS:
            ids_BL = (torch.arange(rows * 24, dtype=torch.long).view(rows, 24) % 1000 + 1).to(device)
            mask_BL = torch.ones_like(ids_BL)
            mask_BL[1:, :5] = 0  # left padding on all rows but the first, as a batch of prompts has
            ids_BL[mask_BL == 0] = int(pad)
            model.generate(input_ids=ids_BL, attention_mask=mask_BL, generation_config=config)
    except Exception as exc:  # a warm-up: the worker still serves extraction and generate compiles on first use
        log.warning("decode warm-up failed (%s: %s): a regenerate batch compiles its decode kernels on first use",
                    exc.__class__.__name__, exc)


def linear_attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The Gated DeltaNet token mixers of the decoder's layers (``layer.linear_attn`` in
    transformers' Qwen3.5 / Qwen3-Next), in layer order; [] for other models."""
    return [layer.linear_attn for layer in decoder_of(model).layers if isinstance(getattr(layer, "linear_attn", None), torch.nn.Module)]


@torch.inference_mode()
def _warm_up_row_counts(model: torch.nn.Module, max_rows: int) -> None:
    """Compile the Gated DeltaNet kernels for every row count 1..``max_rows`` (CUDA only).

    fla's chunk-local cumsum (``fla.ops.utils.cumsum``, used by ``chunk_gated_delta_rule``) takes
    the batch size as a ``tl.constexpr`` and autotunes per batch size: every new number of rows
    compiles and benchmarks it again (~1 s measured on the H200, with the GPU idle meanwhile), and a
    length-sorted run meets nearly every count up to ``max_batch_samples``. One call of one GDN
    module per count, on a single 64-token chunk, pays that before the first task; with a
    persistent ``TRITON_CACHE_DIR`` the compiled variants and fla's autotune results are reused
    by the next start.
    """
    modules = linear_attention_modules(model)
    param = next(model.parameters())
    if not modules or param.device.type != "cuda":
        return
    hidden = model.config.get_text_config().hidden_size
    for rows in range(1, max_rows + 1):
        modules[0](torch.zeros((rows, 64, hidden), dtype=param.dtype, device=param.device))
    torch.cuda.synchronize(param.device)


_lock = threading.Lock()
_loaded: dict[str, Target] = {}


def loaded_targets() -> list[Target]:
    """The targets this process has loaded (none before the first load). Never waits on a load in progress."""
    return list(_loaded.values())


def _say_memory_kept(previous: list[tuple[str, torch.device]], name: str) -> None:
    """Warn when the GPU memory of the released target(s) ``previous`` (name, device) is not given
    back before ``name`` loads (live tensors: something still holds the model; reserved only: a
    segment kept by a small live tensor, as transformers' one-allocation warm-up can leave one;
    BENCHMARKS.md, the FP8 row): the load that follows may then run out of GPU memory, and this
    says why. Takes names, not the targets: a reference held here kept the whole previous model
    alive through the next load (an H100 ran out of memory switching 27B targets, 2026-12-06)."""
    for previous_name, device in previous:
        if device.type != "cuda":
            continue
        reserved, allocated = torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device)
        if reserved > (1 << 30):
            log.warning("switching from target %s to %s: %.1f GB of GPU memory is still reserved after the previous "
                        "model was released (%.1f GB of it in live tensors); if the next load runs out of GPU memory, "
                        "restart the worker (or pin it to one model with HSX_MODEL)", previous_name, name,
                        reserved / 1e9, allocated / 1e9)


def get_target(name: str, settings: Settings) -> Target:
    """The loaded target for ``name``, loading it on first use (one model per process at a time)."""
    with _lock:
        group = next((t.group for t in _loaded.values() if t.group is not None), None)
        if name not in _loaded and group is not None:
            from hsx.access import ModelNotServed

            raise ModelNotServed(f"model {name!r}: this worker leads a tensor-parallel group of {group.size} ranks "
                                 f"loaded with {group.model!r}, and a group serves the one model it loaded; fix: "
                                 "send the run to workers of its model (HSX_MODEL), or restart this worker")
        if name not in _loaded:
            previous = [(t.name, t.device) for t in _loaded.values()]  # names only: no reference to the models
            _loaded.clear()  # free the previous model before loading another
            gc.collect()  # a model in a reference cycle is freed only by the collector
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
                _say_memory_kept(previous, name)
            _loaded[name] = load_target(name, settings)
        return _loaded[name]
