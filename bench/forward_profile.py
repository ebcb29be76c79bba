"""Where the host waits in one batch's forward: the capture call against the plain forward.

A diagnostic, not a throughput claim (the claim is ``bench/e2e_throughput.py``, through
``producer run``). For one target shape (random weights built on the device from a real config,
cut to ``--num-layers``, the worker's own preparation: ``workers.target.adopt_model``) and one
batch of ``--rows`` right-padded rows of ``--row-len`` tokens at most, it measures, back to back
with the next forward queued before the previous one's states are waited for (as a worker's
task threads do under its GPU lock):

- **plain**: the bare base-model forward over the same rows, full length, through the same
  deepest layer (no hooks, no gather, no copy);
- **ours**: ``workers.capture.launch_capture`` + ``wait()``, the call a task makes;
- **ours, transformers' packed-sequence check**: the same with transformers' own
  ``find_packed_sequence_indices`` (a host sync at the start of each forward) instead of ours.

For each: tokens/s (valid tokens), the median seconds a launch takes on the host, the median GPU
seconds of a forward (CUDA events on the compute stream), the host syncs inside one launch and
where they happen (torch's sync debug mode), and the host ops that take the launch's time
(``torch.profiler``, CPU only).

    python bench/forward_profile.py --shape qwen3-next-80b-a3b --num-layers 16 --json OUT.json   # on the H200
    python bench/forward_profile.py --tiny --shape qwen3-next-80b-a3b --json /tmp/x.json       # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from e2e_throughput import CONFIGS, build_model, text_config  # noqa: E402
from gpu_throughput import sync  # noqa: E402


def make_rows(rows: int, row_len: int, vocab: int, seed: int = 0):
    """``rows`` samples of lengths spread over [0.75, 1] x ``row_len``, longest first (a length-sorted
    batch's shape), as the worker's right-padded rows (pinned on CUDA)."""
    from workers.capture import right_padded_rows

    g = torch.Generator().manual_seed(seed)
    lengths = sorted((int(row_len * (0.75 + 0.25 * torch.rand((), generator=g))) for _ in range(rows)), reverse=True)
    lengths[0] = row_len
    ids_T = torch.randint(0, min(vocab, 151_000), (sum(lengths),), generator=g)
    cu_N1 = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    return right_padded_rows(ids_T, cu_N1, pin=torch.cuda.is_available()), sum(lengths)


class _Stop(Exception):
    pass


def _timed(device, fn):
    """(host seconds of ``fn()``, a pair of CUDA events around it or None), ``fn``'s result."""
    start = end = None
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    result = fn()
    host_s = time.perf_counter() - t0
    if end is not None:
        end.record()
    return host_s, (start, end), result


@torch.inference_mode()
def measure(device, launch, wait, tokens: int, seconds: float, warm: int = 2) -> dict:
    """Back-to-back forwards with one in flight: launch i+1, then wait for i."""
    for _ in range(warm):
        wait(launch())
    sync(device)
    launches, events, pending = [], [], None
    t0 = time.perf_counter()
    steps = 0
    while True:
        host_s, ev, nxt = _timed(device, launch)
        launches.append(host_s)
        events.append(ev)
        if pending is not None:
            wait(pending)
        pending = nxt
        steps += 1
        if steps >= 3 and time.perf_counter() - t0 >= seconds:
            break
    wait(pending)
    sync(device)
    wall = time.perf_counter() - t0
    gpu = [s.elapsed_time(e) / 1000 for s, e in events if s is not None]
    return {"forwards": steps, "tok_s": round(steps * tokens / wall), "wall_s_per_forward": round(wall / steps, 4),
            "launch_s_median": round(statistics.median(launches), 4),
            "gpu_s_median": round(statistics.median(gpu), 4) if gpu else None, "gpu_s_mean": round(statistics.mean(gpu), 4) if gpu else None}


def host_syncs(device, launch_and_wait) -> dict | None:
    """Host syncs inside one launch (torch's sync debug mode; CUDA only) and where they happen."""
    if device.type != "cuda":
        return None
    sites: list[str] = []

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" in str(message):
            frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename and "warnings" not in f.filename]
            sites.append(" <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[-5:][::-1]))

    launch, wait = launch_and_wait
    sync(device)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            pending = launch()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    wait(pending)
    return {"count": len(sites), "sites": sorted(set(sites))[:12]}


def host_ops(device, launch, wait, top: int = 15) -> list[dict]:
    """The host ops that take one launch's time (torch.profiler, CPU activity), most first."""
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        pending = launch()
    wait(pending)
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return [{"op": e.key, "calls": e.count, "self_cpu_ms": round(e.self_cpu_time_total / 1000, 2)} for e in rows]


def profile_shape(args, device) -> dict:
    import transformers.masking_utils as masking_utils

    from hsx.decoder import decoder_of
    from hsx.layers import select_layers
    from hsx.models import ModelInfo
    from workers import capture
    from workers.target import adopt_model

    config = text_config(args.shape, args.num_layers, args.tiny)
    if args.experts:
        config._experts_implementation = args.experts
    model = build_model(config, device)
    text = model.config.get_text_config()
    info = ModelInfo(name=f"{args.shape}-random", path="", model_type=text.model_type, num_layers=text.num_hidden_layers,
                     hidden_size=text.hidden_size, revision="random-seed0")
    adopt_model(info.name, model, info, warm_up=device.type == "cuda")
    selection = select_layers(text.num_hidden_layers, preset=args.preset, final="none")
    rows, tokens = make_rows(args.rows, args.row_len, text.vocab_size)
    decoder = decoder_of(model)
    B, S, _ = rows.shape

    ids_BS = torch.randint(0, min(text.vocab_size, 151_000), (B, S), device=device)
    def stop_hook(*_):
        raise _Stop  # the plain forward stops after the deepest captured layer, as ours does

    stop = decoder.layers[selection.deepest_layer].register_forward_hook(stop_hook)

    def plain_launch():
        try:
            decoder.module(input_ids=ids_BS, use_cache=False)
        except _Stop:
            pass

    result = {"shape": args.shape, "num_layers": text.num_hidden_layers, "layers_run": selection.deepest_layer + 1,
              "layer_ids": list(selection.layer_ids), "rows": B, "row_len": S, "valid_tokens": tokens,
              "experts_implementation": getattr(model.config, "_experts_implementation", None)}
    with torch.inference_mode():
        result["plain"] = measure(device, plain_launch, lambda _: None, B * S, args.seconds)
        result["plain"]["host_syncs"] = host_syncs(device, (plain_launch, lambda _: None))
    stop.remove()

    # Two reused host buffers, as two task threads hold (workers/extract.py): a fresh pinned
    # allocation per batch is not what a worker does.
    buffers, turn = [capture.HostBuffer(), capture.HostBuffer()], [0]

    def ours_launch():
        turn[0] ^= 1
        return capture.launch_capture(model, rows, selection, store_dtype=torch.bfloat16, host_buffer=buffers[turn[0]])

    def ours_wait(pending):
        pending.wait()

    capture._skip_packed_sequence_check()
    original = masking_utils.find_packed_sequence_indices
    result["ours"] = measure(device, ours_launch, ours_wait, tokens, args.seconds)
    result["ours"]["host_syncs"] = host_syncs(device, (ours_launch, ours_wait))
    result["ours"]["host_ops"] = host_ops(device, ours_launch, ours_wait)
    # The same call with transformers' own check (what the worker did before), for the difference.
    own = getattr(original, "original", None)
    if own is not None:
        def with_check(position_ids):
            return own(position_ids)
        with_check.hsx_unpacked_rows = True  # keeps launch_capture from wrapping it again
        masking_utils.find_packed_sequence_indices = with_check
        try:
            result["ours_with_transformers_check"] = measure(device, ours_launch, ours_wait, tokens, args.seconds)
            result["ours_with_transformers_check"]["host_syncs"] = host_syncs(device, (ours_launch, ours_wait))
        finally:
            masking_utils.find_packed_sequence_indices = original
    for name in ("ours", "ours_with_transformers_check"):
        if name in result:
            result[name]["over_plain_same_rows"] = round(result[name]["tok_s"] / (result["plain"]["tok_s"] * tokens / (B * S)), 3)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3-next-80b-a3b", choices=sorted(CONFIGS))
    ap.add_argument("--num-layers", type=int, default=None, help="cut the config to this many layers")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--row-len", type=int, default=2048)
    ap.add_argument("--preset", default="dflash")
    ap.add_argument("--experts", default=None, help="transformers' experts implementation (default: the model's)")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (smoke run: the output's shape only)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.tiny:
        args.rows, args.row_len, args.seconds = min(args.rows, 3), min(args.row_len, 48), min(args.seconds, 0.2)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    import transformers

    row = {"bench": "forward_profile", "date": time.strftime("%Y-%m-%d"), "machine": platform.node(),
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "transformers": transformers.__version__, **profile_shape(args, device)}
    text = json.dumps(row, indent=1)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text)
    print(text)
    for name in ("plain", "ours", "ours_with_transformers_check"):
        if name in row:
            r = row[name]
            print(f"{name:30s} {r['tok_s']:>9,} tok/s  launch {r['launch_s_median']} s  gpu {r['gpu_s_median']} s  "
                  f"syncs {r['host_syncs']['count'] if r.get('host_syncs') else '-'}  over plain {r.get('over_plain_same_rows', '-')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
