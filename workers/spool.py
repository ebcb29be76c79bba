"""The spool: where a worker writes a shard before it is stored.

Shards are written in the safetensors format by a streaming writer that hashes the bytes as they
go out, so that a shard is read from memory exactly once: no serialised copy in RAM (as
``safetensors.torch.save_file`` makes) and no second pass to compute its sha256. The format
(8-byte little-endian header length, JSON header with ``dtype``/``shape``/``data_offsets`` and
``__metadata__``, then the raw little-endian bytes with no holes) is the one documented by the
safetensors project; tests check that ``safetensors.safe_open`` reads our files back bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import struct
import tempfile
from pathlib import Path

import torch

from settings import Settings

_DTYPE_NAMES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_CHUNK_BYTES = 64 << 20  # 64 MiB: large writes, bounded time with the GIL released per call


def spool_dir(settings: Settings) -> Path:
    """The worker's spool directory (``HSX_SPOOL_DIR``, else ``<tmp>/hsx-spool``), created if needed."""
    d = settings.spool_dir or Path(tempfile.gettempdir()) / "hsx-spool"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def write_shard(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> tuple[int, str]:
    """Write ``tensors`` (CPU, any shapes) as a safetensors file; return (bytes, sha256 hex).

    Tensors are laid out largest element size first, then by name (as safetensors does), so each
    one starts aligned to its element size. Raises ``OSError`` when the spool is full or unwritable.
    """
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    header: dict = {"__metadata__": dict(metadata)}
    offset = 0
    for name in order:
        t = tensors[name]
        if t.device.type != "cpu":
            raise ValueError(f"tensor {name} is on {t.device}; the spool writes host tensors")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # data starts 8-byte aligned
    sha = hashlib.sha256()
    total = 0
    with open(path, "wb") as f:
        for piece in (struct.pack("<Q", len(head)), head):
            f.write(piece)
            sha.update(piece)
            total += len(piece)
        for name in order:
            raw = _raw_bytes(tensors[name])
            for start in range(0, len(raw), _CHUNK_BYTES):
                chunk = raw[start : start + _CHUNK_BYTES]
                f.write(chunk)
                sha.update(chunk)
                total += len(chunk)
    return total, sha.hexdigest()
