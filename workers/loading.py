"""A target's weights from its safetensors files to the GPU through pinned host buffers.

transformers' own path (``from_pretrained`` with a device map, ``workers.target.load_device_map``)
maps each file and copies every tensor from the mapped pages to the device (``tensor[...]`` then
``.to(device)``, ``core_model_loading.py`` ``_materialize_copy``, transformers 5.24): each 4 KiB
page is faulted in on first touch and the host-to-device copy is from pageable memory, so a 52 GB
checkpoint loaded at 2.0-2.4 GB/s on the H200 however many threads ran it (BENCHMARKS.md,
"Loading a target").

Here each tensor is read with ``os.preadv`` (no page faults, no map) into one of the pinned slots
that the loading thread uses in turn, and copied from it to the device asynchronously while the
thread reads on: it waits for a copy only when it comes back to that copy's slot, never per tensor
(a wait per tensor made a 54 GB checkpoint of 24,600 MoE expert tensors load at 2.0 GB/s on the
H200, against 25.6 GB/s for a dense one of 1,000 tensors: BENCHMARKS.md, "Loading a target"). The
tensors are handed to transformers as a lazy ``state_dict`` (``from_pretrained(None, config=...,
state_dict=...)``, its public argument for weights that do not come from its own files): every
step after reading a tensor (key renaming, fusing MoE experts, FP8 scales, tied weights, the
device map, the dtype) is still transformers', run by its own pool of loading threads
(``GLOBAL_WORKERS``, ``HSX_LOAD_THREADS``). Host memory holds the pinned slots (:data:`SLOTS` of
:data:`CHUNK_BYTES` per loading thread), never a copy of the weights, and not the file's pages in
this process's RSS either.

The format (safetensors): 8 bytes little-endian header length N, N bytes of JSON
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": ...}``), then the data,
each tensor's bytes at ``8 + N + begin``, C order, little endian
(https://github.com/huggingface/safetensors, "Format").
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import struct
import threading
import time
from pathlib import Path

import torch

from hsx.errors import BadConfig

log = logging.getLogger(__name__)

#: Bytes of one pinned slot: one ``preadv`` and one host-to-device copy at most.
CHUNK_BYTES = 8 << 20
#: Tensors of at most this many bytes are read together with their small neighbours (:class:`Span`):
#: one read and one host-to-device copy for several, where a copy call per tensor was the cost of an
#: MoE checkpoint's thousands of small expert tensors (BENCHMARKS.md, "Loading a target").
SMALL_BYTES = 4 << 20
#: Pinned slots per loading thread, used in turn (16 threads: 1 GiB of pinned host memory while
#: loading, freed after): a thread waits for a copy only when it comes back to that copy's slot.
SLOTS = 8

#: safetensors' dtype names (its ``Dtype`` enum) and torch's.
DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
    "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
}
if hasattr(torch, "float8_e8m0fnu"):
    DTYPES["F8_E8M0"] = torch.float8_e8m0fnu


_DONE = threading.Event()  # the claim of a tensor its asker reads itself
_DONE.set()


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of the local checkpoint directory ``path``: those its
    ``model.safetensors.index.json`` names (a sharded save), else ``model.safetensors``; [] when it
    has neither (another layout, which :func:`can_stream` leaves to transformers)."""
    p = Path(path)
    index = p / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [p / n for n in names]
    single = p / "model.safetensors"
    return [single] if single.is_file() else []


def local_dir(path: str, revision: str | None = None) -> str:
    """The local directory of the checkpoint ``path``: itself when it is one; for a hub id, its
    snapshot in the hub cache (``huggingface_hub.snapshot_download`` of its config, weights and
    tokenizer files, downloading what the cache lacks unless the hub is not to be asked:
    ``hsx.models.hub_local_only``), as ``from_pretrained`` would have fetched them; at ``revision``
    when it is a hub commit (the identity the worker read: not a newer ``main``).

    Raises:
        BadConfig: what ``hub_local_only`` raises (not in the cache, the hub unreachable).
    """
    if Path(path).is_dir():
        return path
    from huggingface_hub import snapshot_download

    from hsx.models import hub_kwargs

    kw = hub_kwargs(path)
    commit = revision if revision and len(revision) == 40 and all(c in "0123456789abcdef" for c in revision) else None
    return snapshot_download(path, cache_dir=kw["cache_dir"], local_files_only=kw["local_files_only"], revision=commit,
                             allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"])


def can_stream(path: str, device: torch.device, *, trust_remote_code: bool) -> bool:
    """True when :func:`load_streamed` can load the checkpoint at ``path`` onto ``device``: a CUDA
    device, a local directory with safetensors files, and no remote code (whose classes
    transformers resolves from the checkpoint's path, which the ``state_dict`` form does not take)."""
    return device.type == "cuda" and not trust_remote_code and Path(path).is_dir() and bool(checkpoint_files(path))


class FileTensor:
    """One tensor of a safetensors file, read when indexed: the lazy slice transformers expects in
    a ``state_dict`` (the interface of safetensors' ``PySafeSlice``: ``get_dtype``, ``get_shape``,
    ``tensor[...]``, which ``core_model_loading._materialize_copy`` and the quantisers call)."""

    __slots__ = ("reader", "name", "dtype", "shape", "offset", "nbytes", "_fd", "span")

    def __init__(self, reader: "StreamedCheckpoint", fd: int, name: str, dtype: str, shape: list[int],
                 offset: int, nbytes: int):
        self.reader, self._fd, self.name, self.dtype, self.shape = reader, fd, name, dtype, shape
        self.offset, self.nbytes = offset, nbytes
        self.span: Span | None = None  # the run of small neighbours it is read with (StreamedCheckpoint._index)

    def get_dtype(self) -> str:
        return self.dtype

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, index) -> torch.Tensor:
        tensor = self.reader.read(self)
        return tensor if index is Ellipsis else tensor[index]


class Span:
    """Neighbouring small tensors of one file (each at most :data:`SMALL_BYTES`, together at most
    :data:`CHUNK_BYTES`), read with one ``preadv`` and one host-to-device copy when the first of
    them is asked for; the others wait in :attr:`ready` until transformers asks for them."""

    __slots__ = ("members", "offset", "nbytes", "lock", "ready")

    def __init__(self, members: list[FileTensor]):
        self.members = members
        self.offset = members[0].offset
        self.nbytes = members[-1].offset + members[-1].nbytes - self.offset
        self.lock = threading.Lock()
        self.ready: dict[str, torch.Tensor] | None = None


class StreamedCheckpoint:
    """The tensors of a checkpoint's safetensors files, each read to ``device`` when transformers
    asks for it (:class:`FileTensor`); a context manager that closes the files and frees the pinned
    buffers on exit.

    Args:
        files: the checkpoint's ``*.safetensors`` files.
        device: where the tensors are made (CUDA: through pinned buffers; CPU: read straight into
            the tensor, which the tests use to check the reading against safetensors' own).

    Raises:
        BadConfig: a file is not safetensors (its header cannot be read, or a tensor's bytes lie
            beyond the file's end), or holds a dtype this loader does not know.
    """

    def __init__(self, files: list[Path], device: torch.device):
        self.device = device
        self._fds: list[int] = []
        self._buffers: dict[int, tuple] = {}
        self._lock = threading.Lock()
        self.tensors: dict[str, FileTensor] = {}
        self.bytes_read = 0
        self.first_read: float | None = None  # perf_counter of the first read's start, of the last one's end
        self.last_read: float | None = None
        # read ahead (prefetch): name -> the event set once its reader is done; a name there is not read again
        self._claims: dict[str, threading.Event] | None = None
        self._prefetched: dict[str, torch.Tensor] = {}
        self._prefetchers: list[threading.Thread] = []
        self._stop = threading.Event()
        self.prefetched_bytes = 0
        self._closed = False
        for f in files:
            self._index(Path(f))

    def _index(self, path: Path) -> None:
        fd = os.open(path, os.O_RDONLY)
        self._fds.append(fd)
        size = os.fstat(fd).st_size
        head = os.pread(fd, 8, 0)
        (n,) = struct.unpack("<Q", head) if len(head) == 8 else (size,)
        if n + 8 > size:
            raise BadConfig(f"{path}: not a safetensors file (header of {n} bytes in a file of {size})")
        try:
            header = json.loads(os.pread(fd, n, 8))
        except ValueError as e:
            raise BadConfig(f"{path}: not a safetensors file (its header is not JSON: {e})") from None
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            if entry["dtype"] not in DTYPES:
                raise BadConfig(f"{path}: tensor {name} has dtype {entry['dtype']}, which this loader does not read; "
                                "set HSX_FAST_LOAD=false to load with transformers' own loader")
            begin, end = entry["data_offsets"]
            if 8 + n + end > size:
                raise BadConfig(f"{path}: tensor {name} ends at byte {8 + n + end}, past the file's {size} bytes "
                                "(a truncated file)")
            self.tensors[name] = FileTensor(self, fd, name, entry["dtype"], entry["shape"], 8 + n + begin, end - begin)
        self._make_spans(sorted((t for t in self.tensors.values() if t._fd == fd), key=lambda t: t.offset))

    @staticmethod
    def _make_spans(by_offset: list[FileTensor]) -> None:
        """Group runs of adjacent small tensors of one file (sorted by offset) into :class:`Span` s."""
        run: list[FileTensor] = []

        def close():
            if len(run) > 1:
                span = Span(list(run))
                for t in run:
                    t.span = span
            run.clear()

        for t in by_offset:
            small = 0 < t.nbytes <= SMALL_BYTES
            if run and (not small or run[-1].offset + run[-1].nbytes != t.offset
                        or t.offset + t.nbytes - run[0].offset > CHUNK_BYTES):
                close()
            if small:
                run.append(t)
        close()

    def _thread_ring(self) -> list:
        """This thread's :data:`SLOTS` pinned slots, each with the event of its last copy (made on first use)."""
        key = threading.get_ident()
        with self._lock:
            ring = self._buffers.get(key)
        if ring is None:
            pinned = torch.empty(SLOTS * CHUNK_BYTES, dtype=torch.uint8, pin_memory=True)
            ring = [[pinned[k * CHUNK_BYTES:(k + 1) * CHUNK_BYTES], None, torch.cuda.Event()] for k in range(SLOTS)]
            for slot in ring:
                slot[1] = slot[0].numpy()
            ring.append(0)  # the next slot
            with self._lock:
                self._buffers[key] = ring
        return ring

    def prefetch(self, threads: int, dtypes: set[str]) -> None:
        """Start reading the tensors of safetensors dtypes ``dtypes`` in file order, in ``threads``
        threads, before transformers asks for them: :func:`load_streamed` starts it before it imports
        the model's code, whose seconds the reads then fill (they wait in ``preadv`` and in the copy,
        outside the GIL). A tensor asked for while a read-ahead thread reads it is waited for; one
        not yet reached is read by its asker. Only tensors kept as they are stored should be given
        (the load's dtype, FP8 weights that stay FP8): each then becomes its parameter (or, for MoE
        experts, is stacked and dropped, as transformers' own loading pool does with the tensors it
        reads ahead), so the read-ahead adds no more GPU memory than the load takes anyway, except
        for tensors the model never asks for: :meth:`stop_prefetch` drops those it knows of. The
        threads stop when every such tensor is read, at :meth:`stop_prefetch` or at :meth:`close`.
        """
        order = sorted((t for t in self.tensors.values() if t.dtype in dtypes), key=lambda t: (t._fd, t.offset))
        if not order or threads < 1:
            return
        with self._lock:
            if self._claims is None:
                self._claims = {}
        queue = iter(order)

        def run() -> None:
            while not self._stop.is_set():
                with self._lock:
                    t = next(queue, None)
                    if t is None:
                        return
                    if t.name in self._claims:  # asked for already
                        continue
                    self._claims[t.name] = done = threading.Event()
                tensor = None
                try:
                    tensor = self._read(t)
                except BaseException as exc:  # the asker reads it again and gets the error itself
                    log.debug("read-ahead of %s failed (%s: %s); its asker reads it", t.name, type(exc).__name__, exc)
                    return
                finally:
                    with self._lock:
                        if tensor is None:
                            del self._claims[t.name]
                        else:
                            self._prefetched[t.name] = tensor
                            self.prefetched_bytes += t.nbytes
                    done.set()  # never leaves an asker waiting

        for k in range(min(threads, len(order))):
            thread = threading.Thread(target=run, name=f"hsx-prefetch-{k}", daemon=True)
            thread.start()
            self._prefetchers.append(thread)

    def stop_prefetch(self, unused: list[str] = ()) -> None:
        """Stop the read-ahead (:meth:`prefetch`) once its threads' current reads are done, and
        drop the tensors read ahead whose names match one of the regular expressions ``unused``
        (the model's ``_keys_to_ignore_on_load_unexpected``: a release's ``mtp.*`` layers), so that
        no unused tensor holds GPU memory through ``from_pretrained``."""
        import re

        self._stop.set()
        for thread in self._prefetchers:
            thread.join()
        self._prefetchers.clear()
        if unused:
            pattern = re.compile("|".join(f"(?:{u})" for u in unused))
            with self._lock:
                for name in [n for n in self._prefetched if pattern.search(n)]:
                    self.prefetched_bytes -= self.tensors[name].nbytes
                    del self._prefetched[name]
                    del self._claims[name]  # read again if asked after all

    def read(self, t: FileTensor) -> torch.Tensor:
        """The tensor ``t`` on :attr:`device`, with the file's bytes (a new tensor each call; the
        one read ahead for it, :meth:`prefetch`, the first time).

        Raises:
            BadConfig: the file ended before the tensor's last byte (changed while loading).
        """
        if self._claims is not None:
            with self._lock:
                done = self._claims.get(t.name)
                if done is None:
                    self._claims[t.name] = _DONE  # read here: no read-ahead thread takes it now
            if done is not None:
                done.wait()
                with self._lock:
                    out = self._prefetched.pop(t.name, None)
                if out is not None:
                    return out
        return self._read(t)

    def _read(self, t: FileTensor) -> torch.Tensor:
        """The tensor ``t`` on :attr:`device`, with the file's bytes (a new tensor each call).

        On CUDA the copies are queued on the thread's current stream (the default stream, on which
        transformers uses the tensor next: ordered after them) and not waited for; a pinned slot is
        reused once its last copy is done (its event). :meth:`close` waits for all of them.

        Raises:
            BadConfig: the file ended before the tensor's last byte (changed while loading).
        """
        if self._closed:  # a loading thread still running after a failed from_pretrained: its fds are gone
            raise BadConfig(f"tensor {t.name}: read after its checkpoint was closed (the load had failed)")
        if t.span is not None:
            return self._read_from_span(t)
        dtype = DTYPES[t.dtype]
        start = time.perf_counter()
        if self.device.type != "cuda":
            out = torch.empty(t.shape, dtype=dtype)
            self._pread_into(t, memoryview(out.view(-1).view(torch.uint8).numpy()), t.offset)
        elif t.nbytes == 0:
            out = torch.empty(t.shape, dtype=dtype, device=self.device)
        else:
            flat = torch.empty(t.nbytes, dtype=torch.uint8, device=self.device)
            ring = self._thread_ring()
            stream = torch.cuda.current_stream(self.device)
            done = 0
            while done < t.nbytes:
                n = min(CHUNK_BYTES, t.nbytes - done)
                k = ring[-1]
                ring[-1] = (k + 1) % SLOTS
                pinned, view, event = ring[k]
                event.synchronize()  # the slot's previous copy is done (returns at once if none was queued)
                self._pread_into(t, memoryview(view[:n]), t.offset + done)
                flat[done:done + n].copy_(pinned[:n], non_blocking=True)
                event.record(stream)
                done += n
            out = flat.view(dtype).view(t.shape)
        self._count(t.nbytes, start)
        return out

    def _count(self, nbytes: int, start: float) -> None:
        with self._lock:
            self.bytes_read += nbytes
            self.first_read = start if self.first_read is None else min(self.first_read, start)
            self.last_read = max(self.last_read or 0.0, time.perf_counter())

    def _read_from_span(self, t: FileTensor) -> torch.Tensor:
        """``t`` from its span: the whole span read and copied once (by the first thread to ask for
        one of its tensors), each tensor then cloned out of it on the device into its own storage
        (so that a kept tensor does not hold its neighbours' bytes), handed out once."""
        span = t.span
        with span.lock:
            if span.ready is None:
                span.ready = self._read_span(span)
            out = span.ready.pop(t.name, None)
        if out is None:  # asked for twice: read on its own
            return self._read(FileTensor(self, t._fd, t.name, t.dtype, t.shape, t.offset, t.nbytes))
        return out

    def _read_span(self, span: Span) -> dict[str, torch.Tensor]:
        start = time.perf_counter()
        probe = FileTensor(self, span.members[0]._fd, span.members[0].name, "U8", [span.nbytes], span.offset, span.nbytes)
        if self.device.type != "cuda":
            flat = torch.empty(span.nbytes, dtype=torch.uint8)
            self._pread_into(probe, memoryview(flat.numpy()), span.offset)
        else:
            ring = self._thread_ring()
            k = ring[-1]
            ring[-1] = (k + 1) % SLOTS
            pinned, view, event = ring[k]
            event.synchronize()
            self._pread_into(probe, memoryview(view[:span.nbytes]), span.offset)
            flat = torch.empty(span.nbytes, dtype=torch.uint8, device=self.device)
            flat.copy_(pinned[:span.nbytes], non_blocking=True)
            event.record(torch.cuda.current_stream(self.device))
        out = {}
        for m in span.members:
            a = m.offset - span.offset
            # clone the bytes first: a tensor's offset in the span need not be a multiple of its dtype's size
            out[m.name] = flat[a:a + m.nbytes].clone().view(DTYPES[m.dtype]).view(m.shape)
        self._count(span.nbytes, start)
        return out

    def _pread_into(self, t: FileTensor, view: memoryview, offset: int) -> None:
        got = 0
        while got < len(view):
            n = os.preadv(t._fd, [view[got:]], offset + got)
            if n == 0:
                raise BadConfig(f"tensor {t.name}: its file ended at byte {offset + got} while it was read (the "
                                "checkpoint changed while this worker loaded it)")
            got += n

    def close(self) -> None:
        self._closed = True
        self.stop_prefetch()
        self._prefetched.clear()  # read ahead and never asked for (keys the model lacks)
        if self.device.type == "cuda" and self._buffers:
            torch.cuda.synchronize(self.device)  # every queued copy done before its slot is freed
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()
        with self._lock:
            self._buffers.clear()
        for t in self.tensors.values():  # tensors read with a span and never asked for (keys the model lacks)
            if t.span is not None and t.span.ready:
                t.span.ready.clear()

    def __enter__(self) -> "StreamedCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


#: What the last :func:`load_streamed` of this process measured (bytes read, seconds of reading and of
#: ``from_pretrained``, before the first read and after the last): logged, and read by ``bench/load.py``.
last_load: dict = {}


@contextlib.contextmanager
def _allocator_warm_up(enabled: bool):
    """transformers' ``caching_allocator_warmup`` (``modeling_utils``, called from ``from_pretrained``)
    left on or turned off for the ``with`` block."""
    import transformers.modeling_utils as modeling_utils

    if enabled:
        yield
        return
    warm_up = modeling_utils.caching_allocator_warmup
    modeling_utils.caching_allocator_warmup = lambda *args, **kwargs: None
    try:
        yield
    finally:
        modeling_utils.caching_allocator_warmup = warm_up


#: The lines of ``transformers.core_model_loading.convert_and_load_state_dict_in_model`` that
#: :func:`converters_reused` relies on (transformers 5.x): a copy of the pattern's template converter
#: per checkpoint tensor, kept only for a target key's first tensor, and every kept copy given its
#: tensor before the loop makes the next copy.
_CONVERTER_COPY_LINES = (
    "new_converter = deepcopy(pattern_to_converter[source_pattern])",
    "mapping = param_name_to_load.setdefault(renamed_key, new_converter)",
    "mapping.add_tensor(renamed_key, original_key, source_pattern, future_or_tensor)",
)


@contextlib.contextmanager
def converters_reused(enabled: bool = True):
    """For the ``with`` block, transformers' loading loop makes a new copy of a weight converter
    only when it keeps the last one it made.

    ``convert_and_load_state_dict_in_model`` (transformers 5.24-5.25, ``core_model_loading.py``)
    deep-copies the matching ``WeightConverter`` for every checkpoint tensor and keeps the copy only
    for the first tensor of each target key (``dict.setdefault``): an MoE checkpoint's 512 experts
    x 3 projections per layer (and as many FP8 scales) make one ~50-object deep copy each, about
    150 us of the loading loop's thread per tensor, holding the GIL that the loading threads need
    (BENCHMARKS.md, "Loading a target": 49k tensors of a 16-layer FP8 Qwen3-Next). Here a copy that
    was not kept (no tensor added to it: ``layer_targets`` and ``collected_tensors`` empty) is handed
    out again for the next tensor of the same template; it is then what a new deep copy would be
    (nothing touches a copy the loop dropped), with the template's ``_was_used`` brought over. A
    kept copy has its tensor added before the next copy is asked for, so it is never handed out
    twice. Applied only where the function's source holds :data:`_CONVERTER_COPY_LINES`; any other
    transformers is left as it is (logged at debug). Every load of a worker runs under it: this
    loader, transformers' own (``HSX_FAST_LOAD=false``, the CPU) and the tensor-parallel group's
    (``workers/parallel.py``).

    Yields:
        ``{"copies": n, "reused": n}``, counted while the block runs; None where it is not applied.
    """
    import inspect

    import transformers.core_model_loading as cml

    try:
        source = inspect.getsource(cml.convert_and_load_state_dict_in_model)
    except (AttributeError, OSError, TypeError):
        source = ""
    if not enabled or not all(line in source for line in _CONVERTER_COPY_LINES) or not hasattr(cml, "WeightTransform"):
        if enabled:
            log.debug("transformers' loading loop is not the one converters_reused knows: its converter copies are left alone")
        yield None
        return
    deepcopy = cml.deepcopy
    spares: dict[int, tuple] = {}  # id(template) -> (template, its last copy)
    counts = {"copies": 0, "reused": 0}

    def copy_or_reuse(obj, memo=None):
        if memo is not None or not isinstance(obj, cml.WeightTransform):
            return deepcopy(obj, memo)
        spare = spares.get(id(obj))
        if spare is not None and spare[0] is obj and not spare[1].layer_targets and not spare[1].collected_tensors:
            spare[1]._was_used = obj._was_used
            counts["reused"] += 1
            return spare[1]
        fresh = deepcopy(obj)
        spares[id(obj)] = (obj, fresh)
        counts["copies"] += 1
        return fresh

    cml.deepcopy = copy_or_reuse
    try:
        yield counts
    finally:
        cml.deepcopy = deepcopy


def _kept_dtypes(path: str, dtype: torch.dtype, device: torch.device, kwargs: dict) -> set[str]:
    """The safetensors dtypes whose tensors become parameters as stored (:meth:`StreamedCheckpoint.prefetch`)
    when the checkpoint at ``path`` loads in ``dtype`` on ``device`` with ``kwargs``: the load's own
    dtype, and FP8 for a fine-grained FP8 release kept in FP8 (not dequantised by ``kwargs``, on a GPU
    of compute capability 8.9 or more, below which transformers dequantises it:
    ``quantizer_finegrained_fp8.py``). None for any other quantisation, pre-quantised or made while
    loading (transformers converts those tensors; its own pool stops reading ahead then)."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return set()
    quant = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    given = kwargs.get("quantization_config")
    kept = {name for name, d in DTYPES.items() if d == dtype}
    if quant is None:
        return set() if given is not None else kept
    if quant.get("quant_method") != "fp8" or (given is not None and getattr(given, "dequantize", True)):
        return set()
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        return set()
    return kept | {"F8_E4M3", "F8_E5M2"}


def load_streamed(path: str, *, device: torch.device, dtype: torch.dtype, device_map: dict,
                  trust_remote_code: bool = False, allocator_warm_up: bool = False, prefetch_threads: int = 4,
                  reuse_converters: bool = True, **kwargs) -> torch.nn.Module:
    """``AutoModelForCausalLM`` of the local checkpoint ``path`` with its weights read by
    :class:`StreamedCheckpoint` onto ``device`` (module docstring); the rest as ``from_pretrained``
    does it: the config, the generation config and ``kwargs`` (e.g. a ``quantization_config``)
    from the same directory.

    ``allocator_warm_up`` (off by default) keeps transformers' ``caching_allocator_warmup``, which
    reserves the whole model as one CUDA segment before the weights arrive. Off, the weights take
    segments of their own: in one segment of the model's size any small tensor left alive in it
    (fla's ``tensor_cache`` keeps its last results: fla/utils/decorators.py) keeps all of it
    reserved after the model is released, and the next model's load runs out of GPU memory (seen on
    an H100 with a 50 GB model, BENCHMARKS.md, the FP8 row). Our reader allocates each tensor where
    it lands, so the warm-up saves it no allocation.

    ``prefetch_threads`` (0: none) start reading the tensors kept as stored
    (:meth:`StreamedCheckpoint.prefetch`) before the config is read and the model's code imported.

    ``reuse_converters`` (on by default) spares transformers' loading loop a deep copy per checkpoint
    tensor (:func:`converters_reused`; off: the comparison ``bench/load.py --loader streamed_copying``).

    Returns:
        the model in eval mode, every parameter on the device map's devices.

    Raises:
        BadConfig: what :class:`StreamedCheckpoint` raises.
    """
    t_config = time.perf_counter()
    with StreamedCheckpoint(checkpoint_files(path), device) as ckpt:
        # none with the one-segment warm-up: it reserves the whole model again beside what was read ahead
        ckpt.prefetch(0 if allocator_warm_up else prefetch_threads, _kept_dtypes(path, dtype, device, kwargs))
        from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig

        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        t_class = time.perf_counter()
        # the class and config AutoModelForCausalLM picks (the auto class itself needs a path): a multimodal
        # release's text model with its text config, the parent's quantization_config copied onto it
        # (transformers 5.24, models/auto/auto_factory.py, _BaseAutoModelClass.from_pretrained l. 456-468)
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
        text_config_class = getattr(config, "sub_configs", {}).get("text_config")
        if text_config_class is not None and getattr(model_class, "config_class", None) == text_config_class:
            parent, config = config, config.get_text_config()
            if getattr(parent, "quantization_config", None) is not None:
                config.quantization_config = parent.quantization_config
        t0 = time.perf_counter()  # the model's code imported (its kernels' packages: fla, triton) from here on
        # from here transformers' own pool reads ahead; what the model will not ask for is let go now
        ckpt.stop_prefetch(list(getattr(model_class, "_keys_to_ignore_on_load_unexpected", None) or ()))
        prefetched_by_then = ckpt.prefetched_bytes
        with _allocator_warm_up(allocator_warm_up), converters_reused(reuse_converters) as converter_copies:
            model = model_class.from_pretrained(None, config=config, state_dict=dict(ckpt.tensors), dtype=dtype,
                                                device_map=device_map, **kwargs)
    t1 = time.perf_counter()
    read_s = (ckpt.last_read - ckpt.first_read) if ckpt.first_read is not None else 0.0
    last_load.clear()
    last_load.update(bytes=ckpt.bytes_read, config_and_import_s=round(t0 - t_config, 3),
                     config_s=round(t_class - t_config, 3), import_s=round(t0 - t_class, 3),
                     from_pretrained_s=round(t1 - t0, 3), read_s=round(read_s, 3),
                     before_first_read_s=round((ckpt.first_read or t1) - t0, 3),
                     after_last_read_s=round(t1 - (ckpt.last_read or t1), 3),
                     prefetched_before_from_pretrained=prefetched_by_then, prefetched=ckpt.prefetched_bytes,
                     converter_copies=converter_copies)
    # before_first_read_s is negative when the read-ahead began before from_pretrained (during the import)
    log.info("read %.1f GB of safetensors in %.1f s (%.1f GB/s; %.1f GB of it read ahead while the model's code was "
             "imported, %.1f s), from_pretrained %.1f s (%.1f s after the last read)",
             ckpt.bytes_read / 1e9, read_s, ckpt.bytes_read / 1e9 / max(read_s, 1e-9), prefetched_by_then / 1e9,
             t0 - t_config, t1 - t0, last_load["after_last_read_s"])
    model.config.name_or_path = str(path)
    from transformers import GenerationConfig

    if (Path(path) / "generation_config.json").is_file() and model.can_generate():
        model.generation_config = GenerationConfig.from_pretrained(path)
    return model
