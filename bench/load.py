"""How a worker loads its target: peak host memory against the checkpoint's size, GB/s, cold start.

Each measurement runs in a fresh child process (``python bench/load.py child ...``), so that the
memory figures are the loading process's own:

- ``rss_peak_bytes``: ``VmHWM`` of ``/proc/self/status``, the peak resident set. It counts the
  checkpoint's file pages that the loader maps (``RssFile``: page cache, which the kernel takes
  back under pressure; on tmpfs the file's own pages) as well as private memory;
- ``anon_peak_bytes``: the peak of ``RssAnon`` above the process's level before the load, sampled
  every millisecond by a thread: the private copies of weights a loader makes, which is what
  runs a host out of memory (a full second copy of the checkpoint shows as its whole size);
- ``load_s`` and ``load_gb_s`` (checkpoint bytes / seconds of ``from_pretrained`` and the move to
  the device); for ``--loader worker`` also ``identity_s`` (the checkpoint's identity: a ``stat``
  per file once it is in the hash cache), ``warmup_s`` and ``ready_s`` (from the child's
  process start, as the kernel stamped it, to the target ready for its first task).

Loaders: ``worker`` is the path users run (``workers.target.load_target``: hash, load straight to
the device through pinned buffers (``workers/loading.py``), warm-up, memory probe);
``streamed`` is ``workers.loading.load_streamed`` alone (no identity, no warm-up) and
``streamed_copying`` the same with transformers' loading loop as it comes (a converter deep copy per
checkpoint tensor: ``workers.loading.converters_reused``, the comparison for an MoE checkpoint);
``streamed_spans_64k`` with only tensors up to 64 KiB read together (``workers.loading.Span``: an
MoE's 1-2 MB expert tensors each read alone, by the thread that asks for it);
``worker_transformers`` the same as ``worker`` with ``HSX_FAST_LOAD=false`` (transformers' own loader: a memory
map per file, a copy per tensor); ``files`` and ``instanttensor`` are the ceilings of the same
bytes to the same device with no model (our reader alone; InstantTensor, when installed); ``plain`` is the load without a device map followed by
``model.to(device)`` (what the worker did before issue 20: the whole model in host memory first);
``read`` is ``from_pretrained(disable_mmap=True)``, which reads every file into host memory
(a loader that holds a full second copy: the control of the memory figure).
``switch`` is a worker that serves two runs of different targets, one after the other
(``workers.target.get_target`` of the checkpoint, then of a second directory of hard links to its
files, ``CHECKPOINT.switch``): ``reserved_after_release_bytes`` is the GPU memory still reserved
when the first model has been released and the second starts loading (what the second load cannot
have); ``switch_warm_up`` the same with transformers' one-segment ``caching_allocator_warmup`` put
back (``workers.loading.load_streamed``'s docstring), the control.

Before the first child, the checkpoint's files are read once (page cache warm: ``--cold`` skips
it) and its identity is computed once (the hash cache of ``--cache-dir``, as a planner's run
leaves it on the machine).

``--cold-start`` measures item 3 of issue 20 instead: three children of ``--loader worker``, each
with an empty ``TRITON_CACHE_DIR``: ``first`` (the store holds no compile cache: it compiles, then
saves its cache in the store), ``from_store`` (a new node: it downloads that cache before its
warm-up) and ``no_store`` (``HSX_COMPILE_CACHE=false``: compiles again). The store is
``--store`` (default: a fresh directory under the output's folder).

    # on the GPU machine: a checkpoint given by path (random weights from a real config: --build)
    python bench/load.py --build /work/shared/data/configs/qwen3.5-27b.json --layers 64 --dest /dev/shm/ckpt-27b
    python bench/load.py /dev/shm/ckpt-27b --loader worker,plain --json bench/results/load-h200-27b.json
    python bench/load.py /dev/shm/ckpt-27b --cold-start --json bench/results/cold-start-h200-27b.json
    # on a CPU: a tiny checkpoint, fields only
    python bench/load.py --build tests/data/configs/qwen3-8b.json --layers 1 --vocab 2048 --dest /tmp/ckpt
    python bench/load.py /tmp/ckpt --loader worker,plain,read --json /tmp/load.json
    # an FP8 release's layout (Qwen3-Next-80B-A3B shape, 48 layers: 80 GB; --fp8 makes and quantises one tensor at a time)
    python bench/load.py --build /work/shared/data/configs/qwen3-next-80b-a3b-thinking.json --fp8 --dest /dev/shm/ckpt-next-fp8
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

LOADERS = ("worker", "worker_transformers", "streamed", "streamed_copying", "streamed_spans_64k", "plain", "read", "files",
           "instanttensor", "switch", "switch_warm_up")


def proc_status() -> dict[str, int]:
    """``VmHWM``, ``VmRSS``, ``RssAnon``, ``RssFile``, ``RssShmem`` of this process in bytes (Linux)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(value.split()[0]) * 1024
    return out


class AnonPeak:
    """The peak of ``RssAnon`` while the ``with`` block runs, sampled every ``every_s`` seconds."""

    def __init__(self, every_s: float = 0.001):
        self.every_s, self.peak, self._stop = every_s, 0, threading.Event()

    def __enter__(self) -> "AnonPeak":
        self.base = proc_status()["RssAnon"]
        self.peak = self.base
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, proc_status()["RssAnon"])
            time.sleep(self.every_s)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, proc_status()["RssAnon"])

    @property
    def above_base(self) -> int:
        """Bytes of private memory at the peak above the level before the block."""
        return self.peak - self.base


class StackSampler:
    """Where this process's threads are while the ``with`` block runs: every ``every_s`` seconds,
    the innermost frame of each thread but the sampler's (file:line function), counted; a
    diagnostic of a load's waits (a thread blocked in a call shows that call's line)."""

    def __init__(self, every_s: float = 0.002):
        from collections import Counter

        self.every_s, self.counts, self._stop = every_s, Counter(), threading.Event()

    def __enter__(self) -> "StackSampler":
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.is_set():
            for ident, frame in sys._current_frames().items():
                if ident != me:
                    self.counts[f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} {frame.f_code.co_name}"] += 1
            time.sleep(self.every_s)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def top(self, n: int) -> list[tuple[str, int]]:
        return self.counts.most_common(n)


def checkpoint_bytes(path: Path) -> int:
    """Bytes of the files that decide the checkpoint (``hsx.models.checkpoint_files``)."""
    from hsx.models import checkpoint_files

    return sum(f.stat().st_size for f in checkpoint_files(path))


def process_start_epoch() -> float:
    """When the kernel started this process (seconds since the epoch), from ``/proc/self/stat``."""
    ticks = os.sysconf("SC_CLK_TCK")
    start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return time.time() - uptime + start_ticks / ticks


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def child(args) -> dict:
    """One load in this process; returns its record (module docstring)."""
    import torch

    from settings import Settings

    path = Path(args.checkpoint)
    settings = Settings(_env_file=None, cache_dir=Path(args.cache_dir), device=args.device or None,
                        **({"store_url": args.store} if args.store else {}))
    record: dict = {"loader": args.loader, "checkpoint": str(path), "checkpoint_bytes": checkpoint_bytes(path)}
    import_s = time.time() - process_start_epoch()  # interpreter start and imports, before any model work
    with AnonPeak() as anon:
        t0 = time.perf_counter()
        if args.loader.startswith("streamed"):  # workers.loading.load_streamed alone: no identity, no warm-up
            from workers import loading

            if args.loader == "streamed_spans_64k":  # only tensors up to 64 KiB share a read (an MoE's experts alone)
                loading.SMALL_BYTES = 64 << 10
            from workers.target import _set_load_threads, load_device_map, pick_device

            device = pick_device(settings)
            _set_load_threads(settings.load_threads)
            with StackSampler() as sampler:
                # streamed_copying: transformers' loop with a converter copy per tensor, as it comes
                model = loading.load_streamed(str(path), device=device, dtype=torch.bfloat16,
                                              device_map=load_device_map(device),
                                              reuse_converters=args.loader != "streamed_copying")
            _sync(device)
            record.update(load_s=round(time.perf_counter() - t0, 3), streamed=dict(loading.last_load),
                          where_threads_were=sampler.top(20))
        elif args.loader in ("files", "instanttensor"):
            model, device = _files_to_device(path, args.loader, settings)
            record["load_s"] = round(time.perf_counter() - t0, 3)
        elif args.loader in ("switch", "switch_warm_up"):
            record.update(_switch(path, settings, warm_up=args.loader == "switch_warm_up"))
            from workers.target import loaded_targets

            (target,) = loaded_targets()  # one model per worker process: the second
            model, device, record["held"] = target.model, target.device, target.name
            path = switch_twin(path)
        elif args.loader in ("worker", "worker_transformers"):
            from hsx.models import model_info
            from workers.target import load_target

            t = time.perf_counter()
            model_info(str(path), settings.cache_dir)
            record["identity_s"] = round(time.perf_counter() - t, 3)
            if args.loader == "worker_transformers":
                settings = settings.model_copy(update={"fast_load": False})
            target = load_target(str(path), settings)
            model, device = target.model, target.device
            from workers import loading

            record["streamed"] = dict(loading.last_load) or None
            record.update(load_s=round(target.load_s, 3), warmup_s=round(target.warmup_s, 3),
                          compile_cache=getattr(target, "compile_cache", None))
            record["ready_s"] = round(time.time() - process_start_epoch(), 3)
        else:
            from transformers import AutoModelForCausalLM

            from workers.target import pick_device

            device = pick_device(settings)
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, use_safetensors=True,
                                                         disable_mmap=args.loader == "read")
            model.to(device)
            _sync(device)
            record["load_s"] = round(time.perf_counter() - t0, 3)
    status = proc_status()
    if args.loader.startswith(("worker", "switch", "streamed")):
        record["file_check"] = check_against_files(model, path, every=args.check_every)
    params = [p for p in model.parameters()]
    record.update(
        device=str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
        param_bytes=sum(p.numel() * p.element_size() for p in params),
        params_on_device=all(p.device.type == device.type for p in params),
        import_s=round(import_s, 3),
        rss_peak_bytes=status["VmHWM"],
        rss_file_bytes_after=status["RssFile"],
        anon_peak_bytes=anon.above_base,
        anon_before_bytes=anon.base,
        load_gb_s=round(record["checkpoint_bytes"] / record["load_s"] / 1e9, 3) if record["load_s"] else None,
    )
    record["rss_peak_over_checkpoint"] = round(record["rss_peak_bytes"] / record["checkpoint_bytes"], 4)
    record["anon_peak_over_checkpoint"] = round(record["anon_peak_bytes"] / record["checkpoint_bytes"], 4)
    return record


def switch_twin(path: Path) -> Path:
    """``PATH.switch``: a second checkpoint directory of hard links to ``path``'s files (another
    target by name and path, the same bytes), made once."""
    twin = path.with_name(path.name + ".switch")
    if not twin.is_dir():
        tmp = path.with_name(path.name + ".switch.tmp")
        subprocess.run(["rm", "-rf", str(tmp)], check=True)
        subprocess.run(["cp", "-al", str(path), str(tmp)], check=True)
        tmp.rename(twin)
    return twin


def _switch(path: Path, settings, *, warm_up: bool) -> dict:
    """A worker's switch of targets (``get_target`` of ``path``, then of :func:`switch_twin`), with
    the GPU memory reserved and allocated at the moment the first model has been released (read
    where ``get_target`` reads it: ``workers.target._say_memory_kept``)."""
    import functools

    import torch

    from workers import loading
    from workers import target as worker_target

    if warm_up:  # the control: transformers' one-segment warm-up, as load_streamed did before
        worker_target.loading.load_streamed = functools.partial(loading.load_streamed, allocator_warm_up=True)
    at_release: dict = {}
    say = worker_target._say_memory_kept

    def recording(previous, name):
        if torch.cuda.is_available():
            at_release.update(reserved_after_release_bytes=torch.cuda.memory_reserved(),
                              allocated_after_release_bytes=torch.cuda.memory_allocated())
        say(previous, name)

    worker_target._say_memory_kept = recording
    first = worker_target.get_target(str(path), settings)
    record = {"first_load_s": round(first.load_s, 3), "first_warmup_s": round(first.warmup_s, 3)}
    if torch.cuda.is_available():
        record.update(reserved_with_first_bytes=torch.cuda.memory_reserved(),
                      gpu_total_bytes=torch.cuda.get_device_properties(0).total_memory)
    del first
    second = worker_target.get_target(str(switch_twin(path)), settings)
    record.update(at_release, allocator_warm_up=warm_up, load_s=round(second.load_s, 3),
                  warmup_s=round(second.warmup_s, 3))
    return record


def _files_to_device(path: Path, loader: str, settings):
    """The ceilings of a load: every tensor of the checkpoint's files on the device, no model.
    ``files``: our reader (``workers.loading.StreamedCheckpoint``) in ``HSX_LOAD_THREADS`` threads,
    what ``worker`` does minus transformers; ``instanttensor``: InstantTensor's ``safe_open`` over
    all the files at once (https://github.com/scitix/InstantTensor), when it is installed.
    Returns (a module holding the tensors as buffers, the device)."""
    import torch
    from concurrent.futures import ThreadPoolExecutor

    from workers.loading import StreamedCheckpoint, checkpoint_files
    from workers.target import pick_device

    device = pick_device(settings)
    files = checkpoint_files(path)
    holder = torch.nn.Module()
    tensors = {}
    if loader == "instanttensor":
        import instanttensor

        with instanttensor.safe_open([str(f) for f in files], framework="pt", device=device.index or 0) as f:
            for name, tensor in f.tensors():
                tensors[name] = tensor
    else:
        with StreamedCheckpoint(files, device) as ckpt, ThreadPoolExecutor(settings.load_threads) as pool:
            names = list(ckpt.tensors)
            for name, tensor in zip(names, pool.map(lambda n: ckpt.tensors[n][...], names)):
                tensors[name] = tensor
    _sync(device)
    for i, tensor in enumerate(tensors.values()):
        holder.register_parameter(f"t{i}", torch.nn.Parameter(tensor, requires_grad=False))
    return holder, device


def check_against_files(model, path: Path, every: int = 8) -> dict:
    """Every ``every``-th tensor of the checkpoint's files that is a parameter of ``model`` under
    the same name, read again by safetensors itself and compared with the loaded parameter (cast
    to its dtype): ``{"checked": n, "mismatched": [names]}``."""
    import torch
    from safetensors import safe_open

    from workers.loading import checkpoint_files

    params = dict(model.named_parameters())
    checked, bad, i = 0, [], 0
    for f in checkpoint_files(path):
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                if name not in params:
                    continue
                i += 1
                if i % every:
                    continue
                p = params[name]
                ref = fh.get_tensor(name).to(device=p.device, dtype=p.dtype)
                checked += 1
                if not torch.equal(ref, p):
                    bad.append(name)
    return {"checked": checked, "mismatched": bad}


def child_command(checkpoint: Path, loader: str, *, cache_dir: Path, device: str | None, store: str | None = None,
                  check_every: int = 8) -> list[str]:
    """The command line of :func:`child` (``python bench/load.py child ...``), run from the repository root."""
    return [sys.executable, str(Path(__file__).resolve()), "child", str(checkpoint), "--loader", loader,
            "--cache-dir", str(cache_dir), "--check-every", str(check_every)] + (["--device", device] if device else []) + (["--store", store] if store else [])


def run_child(checkpoint: Path, loader: str, *, cache_dir: Path, device: str | None, store: str | None = None,
              env: dict | None = None, timeout_s: float = 3600, check_every: int = 8) -> dict:
    """:func:`child` in a fresh process; returns its record. Raises RuntimeError with its stderr if it fails."""
    cmd = child_command(checkpoint, loader, cache_dir=cache_dir, device=device, store=store, check_every=check_every)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env or dict(os.environ), cwd=ROOT)
    except subprocess.TimeoutExpired as exc:  # where it was: the child's log so far
        tail = (exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or "")[-4000:]
        raise RuntimeError(f"{loader} load of {checkpoint} did not finish in {timeout_s:.0f} s:\n{tail}") from None
    if proc.returncode != 0:
        raise RuntimeError(f"{loader} load of {checkpoint} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def read_files(path: Path) -> float:
    """Read every checkpoint file once (into the page cache); returns seconds."""
    from hsx.models import checkpoint_files

    t0 = time.perf_counter()
    buf = bytearray(64 << 20)
    for f in checkpoint_files(path):
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass
    return time.perf_counter() - t0


def build(config_path: Path, dest: Path, *, layers: int | None, vocab: int | None, dtype: str, device: str,
          fp8: bool = False) -> dict:
    """A checkpoint directory with random weights (normal, std 0.02) from the real config at
    ``config_path`` (``text_config`` of a multimodal one), cut to ``layers`` decoder layers and a
    ``vocab``-token vocabulary when given; safetensors in 5 GB shards, as releases are.

    ``fp8``: in the layout of the Qwen ``-FP8`` releases (float8_e4m3fn linear weights with bf16
    128x128 ``weight_scale_inv``, ``quantization_config`` in config.json), each tensor made and
    quantised on ``device`` one at a time and written shard by shard
    (``bench/fp8_checkpoint.py`` ``write_random_fp8_checkpoint``): the 80B-A3B shape's 80 GB are
    written with no bf16 model or file (160 GB) anywhere."""
    import torch
    import transformers

    full = json.loads(config_path.read_text())
    cfg = dict(full.get("text_config", full))
    if layers:
        cfg["num_hidden_layers"] = layers
        if isinstance(cfg.get("layer_types"), list):
            cfg["layer_types"] = cfg["layer_types"][:layers]
    if vocab:
        cfg.update(vocab_size=vocab, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    for key in ("torch_dtype", "dtype", "transformers_version"):
        cfg.pop(key, None)
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    from bench.fp8_checkpoint import too_big_to_save

    if fp8 or too_big_to_save(model, device):  # one tensor at a time, quantised as it is made: no bf16 model or files (an 80B shape is 160 GB in bf16)
        from bench.fp8_checkpoint import write_random_fp8_checkpoint

        done = write_random_fp8_checkpoint(model, dest, device=device, fp8=fp8)
        return {"checkpoint": str(dest), "checkpoint_bytes": checkpoint_bytes(dest),
                "build_s": round(time.perf_counter() - t0, 1), "fp8_weights": done["quantized"],
                "kept_bf16": len(done["kept"]), "shards": done["shards"], "written_one_tensor_at_a_time": True}
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=gen)  # buffers (rotary inv_freq) are not saved: the loader computes them
    model.save_pretrained(dest, safe_serialization=True, max_shard_size="5GB")
    return {"checkpoint": str(dest), "checkpoint_bytes": checkpoint_bytes(dest), "build_s": round(time.perf_counter() - t0, 1)}


def environment() -> dict:
    import torch

    from workers.target import _version

    return {"host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": _version("transformers"), "cpus": os.cpu_count(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "mem_total_bytes": _meminfo().get("MemTotal"), "mem_available_bytes": _meminfo().get("MemAvailable")}


def _meminfo() -> dict[str, int]:
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            out[key] = int(value.split()[0]) * 1024
    return out


def cold_start(checkpoint: Path, *, cache_dir: Path, device: str | None, store: str, work: Path,
               cases: tuple[str, ...] = ("first", "from_store", "no_store")) -> dict:
    """The children of ``--cold-start`` (module docstring), those of ``cases`` in that order;
    returns ``{case: record}``."""
    out = {}
    for case in cases:
        env = dict(os.environ, TRITON_CACHE_DIR=str(Path(tempfile.mkdtemp(prefix=f"triton-{case}-", dir=work))))
        env.pop("HSX_COMPILE_CACHE", None)
        if case == "no_store":
            env["HSX_COMPILE_CACHE"] = "false"
        out[case] = run_child(checkpoint, "worker", cache_dir=cache_dir, device=device, store=store, env=env)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", nargs="?", help="checkpoint directory (or 'child CHECKPOINT' for one load)")
    parser.add_argument("rest", nargs="?")
    parser.add_argument("--loader", default="worker", help=f"comma-separated, of {', '.join(LOADERS)}")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--cache-dir", default=None, help="HSX cache dir of the children (default: a fresh one beside --json)")
    parser.add_argument("--store", default=None, help="the workers' store root (HSX_STORE_URL) for --cold-start")
    parser.add_argument("--cold-start", action="store_true", help="measure cold starts with and without the compile cache")
    parser.add_argument("--check-every", type=int, default=8, help="compare every Nth loaded parameter with "
                        "safetensors' own read of the file (worker loaders)")
    parser.add_argument("--cases", default="first,from_store,no_store", help="--cold-start: which of its children")
    parser.add_argument("--cold", action="store_true", help="do not read the files into the page cache first")
    parser.add_argument("--child-timeout-s", type=float, default=3600.0,
                        help="seconds one child load may take; a slower one is recorded as failed with its log")
    parser.add_argument("--json", default=None, help="write the result here (default: stdout only)")
    parser.add_argument("--build", default=None, metavar="CONFIG", help="build a random checkpoint from this config.json")
    parser.add_argument("--dest", default=None, help="with --build: the checkpoint directory to write")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--vocab", type=int, default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--fp8", action="store_true", help="with --build: quantise it as the Qwen -FP8 releases are "
                        "(float8_e4m3fn, 128x128 block scales, quantization_config)")
    args = parser.parse_args(argv)

    if args.checkpoint == "child":
        import logging

        # the worker's own lines (load, warm-up, memory probe) on stderr: a child that times out shows where it was
        logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
        args.checkpoint = args.rest
        print(json.dumps(child(args)))
        return 0
    if args.build:
        import torch

        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        result = build(Path(args.build), Path(args.dest), layers=args.layers, vocab=args.vocab, dtype=args.dtype, device=device,
                       fp8=args.fp8)
        print(json.dumps(result))
        return 0
    if not args.checkpoint:
        parser.error("give a checkpoint directory (or --build CONFIG --dest DIR)")
    checkpoint = Path(args.checkpoint)
    work = Path(tempfile.mkdtemp(prefix="hsx-load-bench-"))
    cache_dir = Path(args.cache_dir) if args.cache_dir else work / "cache"
    from hsx.models import model_info

    t0 = time.perf_counter()
    model_info(str(checkpoint), cache_dir)  # the hash cache, as the planner leaves it
    result: dict = {"bench": "load", "environment": environment(), "checkpoint": str(checkpoint),
                    "checkpoint_bytes": checkpoint_bytes(checkpoint), "first_identity_s": round(time.perf_counter() - t0, 2),
                    "page_cache_warm": not args.cold}
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731 (a call that times out shows where)
    say(f"identity: {result['first_identity_s']} s for {result['checkpoint_bytes'] / 1e9:.1f} GB")
    if not args.cold:
        result["read_files_s"] = round(read_files(checkpoint), 2)
        say(f"page cache warm: {result['read_files_s']} s")
    if args.cold_start:
        store = args.store or str(work / "store")
        result["cold_start"] = cold_start(checkpoint, cache_dir=cache_dir, device=args.device, store=store, work=work,
                                          cases=tuple(args.cases.split(",")))
    else:
        if any(loader.startswith("switch") for loader in args.loader.split(",")):
            model_info(str(switch_twin(checkpoint)), cache_dir)  # its identity in the hash cache too
        result["loads"] = {}
        for loader in args.loader.split(","):
            say(f"{loader}: a child process loads (a worker's load includes its warm-up: minutes on an empty Triton cache)")
            try:
                result["loads"][loader] = run_child(checkpoint, loader, cache_dir=cache_dir, device=args.device,
                                                    check_every=args.check_every, timeout_s=args.child_timeout_s)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:  # kept, with the rest measured
                result["loads"][loader] = {"loader": loader, "failed": str(exc)[-3000:]}
            print(f"{loader}: {json.dumps(result['loads'][loader])[:600]}", file=sys.stderr, flush=True)
    text = json.dumps(result, indent=2)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
