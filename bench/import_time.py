"""Where a worker's load spends the time before the first weight is read (diagnostic, issue 20).

``workers.loading.load_streamed`` reads the config and resolves the model's class (which imports
its modeling module and the kernel packages it pulls in: fla, triton) before ``from_pretrained``.
On an H100 that took 11.8 s of a 19.1-s load of the 27B, against 1.7 s on a CPU-only machine
(BENCHMARKS.md, "Seventh session"). This runs the same two steps in a fresh process, after CUDA
is initialised as in a worker, under cProfile, and prints the seconds of each and the functions
that took the most cumulative time.

    python bench/import_time.py CHECKPOINT_DIR [--top 30] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's packages (workers, hsx)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--json")
    args = ap.parse_args()
    t_start = time.perf_counter()
    import torch

    record = {"import_torch_s": round(time.perf_counter() - t_start, 3)}
    if torch.cuda.is_available():
        t = time.perf_counter()
        torch.zeros(1, device="cuda")
        record["cuda_init_s"] = round(time.perf_counter() - t, 3)
    t = time.perf_counter()
    import workers.target  # noqa: F401  (what a worker has imported before it loads)

    record["import_workers_s"] = round(time.perf_counter() - t, 3)
    profile = cProfile.Profile()
    profile.enable()
    t = time.perf_counter()
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig

    config = AutoConfig.from_pretrained(args.checkpoint)
    t_class = time.perf_counter()
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    t_end = time.perf_counter()
    profile.disable()
    record.update(config_s=round(t_class - t, 3), class_s=round(t_end - t_class, 3), model_class=model_class.__name__)
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(args.top)
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(args.top)  # where, outside the importer
    # who registers torch custom ops (28 of them took 5.1 s on the H100, 2026-12-06) and who imports torch._inductor
    pstats.Stats(profile, stream=out).print_callers(r"custom_ops.py.*\(custom_op\)|inductor_prims.py.*<module>")
    print(json.dumps(record))
    print(out.getvalue())
    if args.json:
        record["profile"] = out.getvalue()
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
