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
(:func:`hsx.fp8.dequantize_fp8`), within ``2**-4 |x| + 2**-10 scale`` of the captured one, at most
1/28 of the token's largest value (``hsx/fp8.py``). The readers (``hsx/reader.py``) and the
exports return dequantised tensors (bf16 by default); ``raw=True`` gives the stored ones.

A shard holds the batch's planned samples minus the quarantined ones: a sample whose captured
states hold NaN or Inf is left out (its tokens, ids, mask and states; ``cu_seqlens`` and
``sample_index`` are recomputed without it) and listed in the marker's ``quarantined`` with its
reason (see :class:`hsx.records.Marker`). ``sample_index`` says which planned samples a shard holds.

String metadata (safetensors header): ``schema_version``, ``run_id``, ``batch``, ``layer_ids``
(JSON list), ``layer_id_convention``, ``hf_hidden_states_indices``, ``vllm_ids``, ``final``,
``model``, ``engine`` (JSON: torch / transformers / fla / causal-conv1d versions, device, dtypes);
fp8 shards add ``store_dtype`` (``fp8``) and ``fp8_scaling`` (the convention in words).

In code: :class:`Final` (``none | postnorm | prenorm | both``) and :class:`StoreDtype`
(``bfloat16 | float32 | fp8``) are the two names a run picks (str enums, written as their
strings in run.json, the metadata and the settings); :class:`ShardSpec` is what every shard of a
run holds, and :func:`schema_problems` says what in one shard breaks it (``producer verify``
checks every shard's header with it). The on-disk format above is what trainers read: it does
not change without a new ``schema_version``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

SCHEMA_VERSION = 1
#: the shard's index tensors and their safetensors dtype codes (the table above).
INDEX_TENSORS = {"input_ids": "I32", "loss_mask": "U8", "cu_seqlens": "I64", "sample_index": "I64"}
#: the captured layers, [T, K, H] (the table above).
HIDDEN_STATES = "hidden_states"
#: the final states, [T, H]: after / before the model's final norm (hsx/layers.py, docs/FACTS.md §1).
FINAL_POSTNORM = "final_postnorm"
FINAL_PRENORM = "final_prenorm"
#: suffix of a state tensor's fp8 scale tensor: ``hidden_states`` -> ``hidden_states_scale``.
SCALE_SUFFIX = "_scale"
#: safetensors dtype code of the fp8 scales.
SCALE_CODE = "F32"
#: header metadata every shard carries (:func:`shard_metadata`); fp8 shards add :data:`FP8_METADATA`.
METADATA_KEYS = ("schema_version", "run_id", "batch", "layer_ids", "layer_id_convention", "hf_hidden_states_indices",
                 "vllm_ids", "final", "model", "engine")
FP8_METADATA = ("store_dtype", "fp8_scaling")
FP8_SCALING = ("float8_e4m3fn, one float32 scale per token and part in <name>_scale: scale = amax(|x|) / 448 "
               "(1 for a zero row), value = q * scale")


class Final(StrEnum):
    """Which final states a run stores beside its layers: ``--final``, run.json ``layers.final``,
    the shard metadata ``final``. A str enum: ``Final.BOTH == "both"`` and it is written as ``"both"``.

    ``postnorm`` is the state after the model's own final norm (what ``lm_head`` reads; HF
    ``hidden_states[N]``), ``prenorm`` the raw output of the last decoder layer N-1 (docs/FACTS.md §1).
    """

    NONE = "none"
    POSTNORM = "postnorm"
    PRENORM = "prenorm"
    BOTH = "both"

    @property
    def tensors(self) -> tuple[str, ...]:
        """The shard tensors of these finals, in shard order: ``final_postnorm`` then ``final_prenorm``."""
        return ((FINAL_POSTNORM,) if self.has_postnorm else ()) + ((FINAL_PRENORM,) if self.has_prenorm else ())

    @property
    def has_postnorm(self) -> bool:
        return self in (Final.POSTNORM, Final.BOTH)

    @property
    def has_prenorm(self) -> bool:
        return self in (Final.PRENORM, Final.BOTH)


class StoreDtype(StrEnum):
    """The dtype of a run's stored states: ``--store-dtype``, run.json ``store_dtype``. A str enum
    (``StoreDtype.FP8 == "fp8"``). ``fp8`` is float8 e4m3 with a float32 scale per token and part
    (``hsx/fp8.py``); the others are the torch dtypes of their names."""

    BFLOAT16 = "bfloat16"
    FLOAT32 = "float32"
    FP8 = "fp8"

    @property
    def torch_dtype(self):
        """The stored tensors' torch dtype (``torch.float8_e4m3fn`` for fp8)."""
        import torch

        return {"bfloat16": torch.bfloat16, "float32": torch.float32, "fp8": torch.float8_e4m3fn}[self.value]

    @property
    def code(self) -> str:
        """The stored tensors' safetensors dtype code (``BF16``, ``F32``, ``F8_E4M3``)."""
        return {"bfloat16": "BF16", "float32": "F32", "fp8": "F8_E4M3"}[self.value]

    @property
    def itemsize(self) -> int:
        """Bytes per stored value (fp8's scales not counted: :data:`hsx.fp8.SCALE_BYTES` per token and part)."""
        return {"bfloat16": 2, "float32": 4, "fp8": 1}[self.value]

    @property
    def scaled(self) -> bool:
        """True when each state tensor has a ``<name>_scale`` tensor beside it (fp8)."""
        return self is StoreDtype.FP8


def scale_name(name: str) -> str:
    """The name of the scale tensor of stored state ``name`` (``hidden_states_scale``, ...)."""
    return name + SCALE_SUFFIX


@dataclass(frozen=True)
class ShardSpec:
    """What every shard of one run holds, from its run.json: the layers, the finals, the dtype.

    ``layer_ids`` ascending (output-of convention, hsx/layers.py); ``hidden_size`` H.
    """

    run_id: str
    layer_ids: tuple[int, ...]
    hidden_size: int
    final: Final
    store_dtype: StoreDtype

    @classmethod
    def of_run(cls, config) -> "ShardSpec":
        """The spec of a :class:`hsx.runconfig.RunConfig` (``layers``, ``model.hidden_size``, ``store_dtype``).

        Raises:
            ValueError: the config's ``final`` or ``store_dtype`` is not one this code knows.
        """
        return cls(config.run_id, tuple(config.layers.layer_ids), config.model.hidden_size,
                   config.layers.final, StoreDtype(config.store_dtype))

    @property
    def states(self) -> tuple[str, ...]:
        """The state tensors: ``hidden_states`` then the finals (not the scales)."""
        return (HIDDEN_STATES,) + self.final.tensors

    def tensors(self, T: int, N: int) -> dict[str, tuple[str, list[int]]]:
        """name -> (safetensors dtype code, shape) of every tensor of a shard of T tokens and N samples."""
        K, H = len(self.layer_ids), self.hidden_size
        out = {"input_ids": (INDEX_TENSORS["input_ids"], [T]), "loss_mask": (INDEX_TENSORS["loss_mask"], [T]),
               "cu_seqlens": (INDEX_TENSORS["cu_seqlens"], [N + 1]), "sample_index": (INDEX_TENSORS["sample_index"], [N])}
        for name in self.states:
            shape = [T, K, H] if name == HIDDEN_STATES else [T, H]
            out[name] = (self.store_dtype.code, shape)
            if self.store_dtype.scaled:
                out[scale_name(name)] = (SCALE_CODE, shape[:-1])
        return out


def schema_problems(tensors: dict, metadata: dict, spec: ShardSpec, *, batch: str | None = None,
                    data_bytes: int | None = None) -> list[str]:
    """What in a shard breaks the schema of this module for the run of ``spec`` ([]: nothing).

    Args:
        tensors: name -> a safetensors header entry (``{"dtype": "BF16", "shape": [...],
            "data_offsets": [a, b]}``: the header without ``__metadata__``) or a torch tensor.
        metadata: the header's ``__metadata__`` (string values).
        spec: the run's :class:`ShardSpec`.
        batch: the batch the shard must name in its metadata (None: not checked).
        data_bytes: with header entries, the bytes after the header: the tensors' data offsets
            must tile them exactly (None: not checked).

    Returns:
        One sentence per problem: tensors missing or unexpected, a dtype or shape not the
        schema's (T and N are read from ``input_ids`` and ``sample_index``), data offsets with
        holes or not ending at the end of the file, metadata keys missing or not the run's.
        Shapes and dtypes are checked only when no tensor is missing.
    """
    out: list[str] = []
    entries = {name: _entry(value) for name, value in tensors.items()}
    T = _length(entries.get("input_ids"))
    N = _length(entries.get("sample_index"))
    expected = spec.tensors(T, N)
    missing = [n for n in expected if n not in entries]
    extra = sorted(set(entries) - set(expected))
    if missing:
        out.append(f"missing tensors {missing}")
    if extra:
        out.append(f"unexpected tensors {extra}")
    if not missing:
        K, H = len(spec.layer_ids), spec.hidden_size
        for name, (code, shape) in expected.items():
            got_code, got_shape = entries[name]
            if got_code != code:
                out.append(f"{name} has dtype {got_code}, expected {code} (store_dtype {spec.store_dtype})")
            if got_shape != shape:
                out.append(f"{name} has shape {got_shape}, expected {shape} (T={T}, N={N}, K={K}, H={H})")
    if data_bytes is not None:
        out += _offset_problems(tensors, data_bytes)
    out += _metadata_problems(metadata, spec, batch)
    return out


def _entry(value) -> tuple[str | None, list[int] | None]:
    # (dtype code, shape) of a header entry or a tensor
    if isinstance(value, dict):
        shape = value.get("shape")
        return value.get("dtype"), list(shape) if isinstance(shape, list) else None
    dtype = str(value.dtype).removeprefix("torch.")
    return SAFETENSORS_DTYPES.get(dtype, dtype), list(value.shape)


def _length(entry) -> int:
    # the one dimension of a 1-d tensor; -1 when absent or not 1-d (every shape check then fails)
    return entry[1][0] if entry is not None and entry[1] is not None and len(entry[1]) == 1 else -1


def _offset_problems(header_tensors: dict, data_bytes: int) -> list[str]:
    spans = sorted(tuple(v.get("data_offsets", (-1, -1))) for v in header_tensors.values())
    pos = 0
    for begin, end in spans:
        if begin != pos or end < begin:
            return [f"tensor data offsets are not contiguous at byte {pos} (next tensor at {begin}-{end})"]
        pos = end
    if pos != data_bytes:
        return [f"tensor data ends at byte {pos} of {data_bytes}: the file is truncated or has trailing bytes"]
    return []


def _metadata_problems(metadata: dict, spec: ShardSpec, batch: str | None) -> list[str]:
    out = []
    keys = METADATA_KEYS + (FP8_METADATA if spec.store_dtype.scaled else ())
    missing = [k for k in keys if k not in metadata]
    if missing:
        out.append(f"metadata lacks {missing}")
    want = {"schema_version": str(SCHEMA_VERSION), "run_id": spec.run_id, "final": spec.final.value}
    if batch is not None:
        want["batch"] = batch
    if spec.store_dtype.scaled or "store_dtype" in metadata:  # only fp8 shards write it
        want["store_dtype"] = spec.store_dtype.value
    for key, value in want.items():
        if key in metadata and metadata[key] != value:
            out.append(f"metadata {key}={metadata[key]!r}, expected {value!r}")
    if "layer_ids" in metadata:
        try:
            ids = json.loads(metadata["layer_ids"])
        except ValueError:
            out.append(f"metadata layer_ids={metadata['layer_ids']!r} is not JSON")
        else:
            if ids != list(spec.layer_ids):
                out.append(f"metadata layer_ids={metadata['layer_ids']}, expected {list(spec.layer_ids)}")
    return out


def cu_seqlens_problem(cu_seqlens_N1, num_tokens: int) -> str | None:
    """Why ``cu_seqlens_N1`` (int [N+1]) does not cut ``num_tokens`` tokens into non-empty samples
    (None when it does): it must run from 0 to T and increase strictly."""
    import numpy as np

    cu = np.asarray(cu_seqlens_N1, dtype=np.int64)
    if cu.ndim != 1 or cu.shape[0] < 2 or cu[0] != 0 or cu[-1] != num_tokens or np.any(np.diff(cu) <= 0):
        return f"cu_seqlens {cu[:4].tolist()}... is not increasing from 0 to T={num_tokens}"
    return None


def shard_metadata(run_id: str, batch: str, layers, model, engine: dict,
                   store_dtype: str | None = None) -> dict[str, str]:
    """The safetensors header metadata of a shard (all values are strings, as safetensors requires).

    ``layers`` and ``model`` are the run's :class:`hsx.runconfig.LayersConfig` and
    :class:`hsx.runconfig.ModelConfig` (``model`` as run.json holds it); ``engine`` what the worker
    ran (device, dtypes, kernels).

    ``store_dtype`` ``fp8`` adds ``store_dtype`` and ``fp8_scaling`` (other dtypes add nothing, so
    their headers are what they always were)."""
    extra = {"store_dtype": StoreDtype.FP8.value, "fp8_scaling": FP8_SCALING} if store_dtype == StoreDtype.FP8 else {}
    return {
        "schema_version": str(SCHEMA_VERSION),
        "run_id": run_id,
        "batch": batch,
        "layer_ids": json.dumps(list(layers.layer_ids)),
        "layer_id_convention": layers.convention,
        "hf_hidden_states_indices": json.dumps(list(layers.hf_hidden_states_indices)),
        "vllm_ids": json.dumps(list(layers.vllm_ids)),
        "final": layers.final.value,
        "model": json.dumps(model.as_dict(), sort_keys=True),
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


def read_shard(path: str | Path) -> tuple[dict, dict[str, str]]:
    """Read a shard file as torch tensors (memory-mapped) plus its metadata. Never unpickles."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        return {k: f.get_tensor(k) for k in f.keys()}, meta
