"""The shard: one safetensors file per batch with the captured hidden states, no padding stored.

Legend: T = valid tokens in the batch, N = samples, K = captured layers, H = hidden size.

| tensor         | dtype                 | shape   | meaning                                                      |
|----------------|-----------------------|---------|--------------------------------------------------------------|
| input_ids      | int32                 | [T]     | token ids exactly as fed to the model                        |
| loss_mask      | uint8                 | [T]     | 1 on tokens the draft model is trained to predict            |
| cu_seqlens     | int64                 | [N+1]   | sample boundaries: sample j is rows [cu[j], cu[j+1])         |
| sample_index   | int64                 | [N]     | the sample's row in the run's plan (``plan/samples.jsonl``)  |
| hidden_states  | bf16 / fp32 / fp8     | [T,K,H] | the K captured layers, ascending layer id (output-of, 0-based)|
| final_postnorm | bf16 / fp32 / fp8     | [T,H]   | optional: last layer after the model's final norm            |
| final_prenorm  | bf16 / fp32 / fp8     | [T,H]   | optional: last layer before the final norm                   |
| hidden_states_scale  | fp32            | [T,K]   | fp8 runs only: the scale of each token's layer slot k        |
| final_postnorm_scale | fp32            | [T]     | fp8 runs only, with final_postnorm                           |
| final_prenorm_scale  | fp32            | [T]     | fp8 runs only, with final_prenorm                            |

fp8 (``store_dtype`` ``fp8``, ``--store-dtype fp8``) is float8 e4m3 (safetensors ``F8_E4M3``,
``torch.float8_e4m3fn``) with one float32 scale per token and part: ``scale = amax(|x|) / 448``
over the H values (1 for a zero row), ``q = x / scale``; the value is ``q.float() * scale[..., None]``
(:func:`core.fp8.dequantize_fp8`), within ``2**-4 |x| + 2**-10 scale`` of the captured one, at most
1/28 of the token's largest value (``core/fp8.py``). The readers (``core/reader.py``) and the
exports return dequantised tensors (bf16 by default); ``raw=True`` gives the stored ones.

A shard holds the batch's planned samples minus the quarantined ones: a sample whose captured
states hold NaN or Inf is left out (its tokens, ids, mask and states; ``cu_seqlens`` and
``sample_index`` are recomputed without it) and listed in the marker's ``quarantined`` with its
reason (see ``core/marker.py``). ``sample_index`` says which planned samples a shard holds.

String metadata (safetensors header): ``schema_version``, ``run_id``, ``batch``, ``layer_ids``
(JSON list), ``layer_id_convention``, ``hf_hidden_states_indices``, ``vllm_ids``, ``final``,
``model``, ``engine`` (JSON: torch / transformers / fla / causal-conv1d versions, device, dtypes);
fp8 shards add ``store_dtype`` (``fp8``) and ``fp8_scaling`` (the convention in words).
"""

from __future__ import annotations

import json
from pathlib import Path

from core.errors import FidelityError

SCHEMA_VERSION = 1
REQUIRED = ("input_ids", "loss_mask", "cu_seqlens", "sample_index", "hidden_states")
FINAL_NAMES = {"postnorm": ("final_postnorm",), "prenorm": ("final_prenorm",), "both": ("final_postnorm", "final_prenorm"), "none": ()}
FP8_STORE_DTYPE = "fp8"
FP8_SCALING = ("float8_e4m3fn, one float32 scale per token and part in <name>_scale: scale = amax(|x|) / 448 "
               "(1 for a zero row), value = q * scale")


def state_names(final: str, store_dtype: str) -> tuple[str, ...]:
    """The state tensors of a shard: ``hidden_states``, the finals of ``final``, and for an fp8 run
    each one's ``<name>_scale``."""
    names = ("hidden_states",) + FINAL_NAMES[final]
    if store_dtype == FP8_STORE_DTYPE:
        names += tuple(n + "_scale" for n in names)
    return names


def shard_metadata(run_id: str, batch: str, layers: dict, model: dict, engine: dict,
                   store_dtype: str | None = None) -> dict[str, str]:
    """The safetensors header metadata of a shard (all values are strings, as safetensors requires).

    ``store_dtype`` ``fp8`` adds ``store_dtype`` and ``fp8_scaling`` (other dtypes add nothing, so
    their headers are what they always were)."""
    extra = {"store_dtype": FP8_STORE_DTYPE, "fp8_scaling": FP8_SCALING} if store_dtype == FP8_STORE_DTYPE else {}
    return {
        "schema_version": str(SCHEMA_VERSION),
        "run_id": run_id,
        "batch": batch,
        "layer_ids": json.dumps(layers["layer_ids"]),
        "layer_id_convention": layers["convention"],
        "hf_hidden_states_indices": json.dumps(layers["hf_hidden_states_indices"]),
        "vllm_ids": json.dumps(layers["vllm_ids"]),
        "final": layers["final"],
        "model": json.dumps(model, sort_keys=True),
        "engine": json.dumps(engine, sort_keys=True),
        **extra,
    }


#: safetensors dtype names (the format's spec: https://github.com/huggingface/safetensors, "Format").
SAFETENSORS_DTYPES = {
    "float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64", "int64": "I64", "int32": "I32",
    "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
}
#: bytes per piece of :func:`serialize_shard`: large writes and parts, with the GIL released per call.
PIECE_BYTES = 64 << 20


def serialize_shard(tensors: dict, metadata: dict[str, str]) -> list[memoryview]:
    """A shard's safetensors file as a list of buffers over the tensors' own memory (no copy).

    The concatenation of the pieces is the file: 8-byte little-endian header length, the JSON
    header (``dtype`` / ``shape`` / ``data_offsets`` per tensor and ``__metadata__``, padded with
    spaces to a multiple of 8), then each tensor's raw little-endian bytes, with no holes, in the
    order largest element size first, then name (as ``safetensors.torch.save`` lays them out, so
    each tensor starts aligned to its element size). Data pieces are at most
    :data:`PIECE_BYTES`. ``tests/test_spool.py`` checks that ``safetensors.safe_open`` reads the
    result back bit for bit.

    Args:
        tensors: name -> CPU torch tensor (any shape; made contiguous if it is not, which copies).
        metadata: the string metadata (:func:`shard_metadata`).

    Raises:
        ValueError: a tensor is not on the CPU, or its dtype has no safetensors name.
    """
    import struct

    import torch

    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    header: dict = {"__metadata__": dict(metadata)}
    offset = 0
    raws = []
    for name in order:
        t = tensors[name]
        if t.device.type != "cpu":
            raise ValueError(f"tensor {name} is on {t.device}; a shard is serialised from host tensors")
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {name} has dtype {dtype}, which safetensors cannot store")
        flat = t.detach().contiguous().reshape(-1)
        raw = memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        raws.append(raw)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # data starts 8-byte aligned
    pieces = [memoryview(struct.pack("<Q", len(head)) + head)]
    for raw in raws:
        pieces += [raw[start:start + PIECE_BYTES] for start in range(0, len(raw), PIECE_BYTES)]
    return pieces


def select_samples(tensors: dict, keep_N) -> dict:
    """The shard's tensors with only the samples where ``keep_N`` (bool [N]) is True.

    Token tensors (first dim T: ``input_ids``, ``loss_mask``, ``hidden_states``, ``final_*``) lose
    the rows of the dropped samples; ``sample_index`` keeps the kept entries; ``cu_seqlens`` is
    rebuilt from the kept lengths. Works on torch tensors; returns new tensors.
    """
    import torch

    cu_N1 = tensors["cu_seqlens"].to(torch.int64)
    keep_N = torch.as_tensor(keep_N, dtype=torch.bool)
    lengths_N = cu_N1[1:] - cu_N1[:-1]
    keep_T = torch.repeat_interleave(keep_N, lengths_N)
    out = {name: t[keep_T] for name, t in tensors.items() if name not in ("cu_seqlens", "sample_index")}
    out["cu_seqlens"] = torch.cat([cu_N1.new_zeros(1), torch.cumsum(lengths_N[keep_N], 0)])
    out["sample_index"] = tensors["sample_index"][keep_N]
    return out


def check_shard(tensors: dict, *, num_layers_captured: int, hidden_size: int, final: str, where: str) -> None:
    """Check a shard's tensors against the schema. ``tensors`` maps names to arrays or tensors.

    Raises:
        FidelityError: a tensor is missing, or shapes do not agree (the message names ``where``).
    """
    scaled = "hidden_states_scale" in tensors
    missing = [n for n in REQUIRED + FINAL_NAMES[final] if n not in tensors]
    if scaled:
        missing += [n + "_scale" for n in ("hidden_states",) + FINAL_NAMES[final] if n + "_scale" not in tensors]
    if missing:
        raise FidelityError(f"{where}: missing tensors {missing}")
    T = tensors["input_ids"].shape[0]
    N = tensors["sample_index"].shape[0]
    expect = {
        "loss_mask": (T,),
        "cu_seqlens": (N + 1,),
        "hidden_states": (T, num_layers_captured, hidden_size),
        "final_postnorm": (T, hidden_size),
        "final_prenorm": (T, hidden_size),
        "hidden_states_scale": (T, num_layers_captured),
        "final_postnorm_scale": (T,),
        "final_prenorm_scale": (T,),
    }
    for name, shape in expect.items():
        if name in tensors and tuple(tensors[name].shape) != shape:
            raise FidelityError(f"{where}: {name} has shape {tuple(tensors[name].shape)}, expected {shape}")
    cu = tensors["cu_seqlens"]
    if int(cu[0]) != 0 or int(cu[-1]) != T:
        raise FidelityError(f"{where}: cu_seqlens runs from {int(cu[0])} to {int(cu[-1])}, expected 0 to {T}")


def read_shard(path: str | Path) -> tuple[dict, dict[str, str]]:
    """Read a shard file as torch tensors (memory-mapped) plus its metadata. Never unpickles."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        return {k: f.get_tensor(k) for k in f.keys()}, meta
