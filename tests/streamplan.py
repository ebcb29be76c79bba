"""A streamed plan that stops between windows, for the tests of what reads a plan still being written
(``status``, ``verify``, ``reconcile``, the live reader: tests/test_streamed_plan_readers.py).

:func:`plan_options` is the plan of those tests: real ShareGPT records, the tiny-qwen3.5 target,
one tokenising process, windows of :data:`FIRST_WINDOW` samples and then doubling
(:func:`small_windows`; the planner's own start at 1,024: a test would tokenise 1,500 records per
plan). With ``limit=600`` it has three windows: 256 samples, the rest of the records (the
``--limit`` is reached there), and the empty last window.

Run as a script it is a planner process that a test can watch, pause and kill::

    python tests/streamplan.py CACHE OUTPUT LIMIT [--pause-after N --release FILE]

It prints one JSON line per window as the planner hands it on (``{"window", "batches", "address",
"pid"}``), after the window's record is in the store; with ``--pause-after N`` it then waits, in the
planner's ``on_window``, until ``FILE`` exists, before it lets the planner write the next window.
At the end it prints ``{"done": true, "batches": n}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


#: The first window's samples in these tests' plans (then doubling up to 4,096).
FIRST_WINDOW = 256


def small_windows() -> tuple[int, int]:
    """Set the planner's window schedule (``producer.planner.PLAN_WINDOWS``) to the tests' in this
    process; returns the one it replaces."""
    from producer import planner

    before, planner.PLAN_WINDOWS = planner.PLAN_WINDOWS, (FIRST_WINDOW, 4096)
    return before


def plan_options(output: Path, limit: int):
    """The tests' plan: ``sharegpt`` with tiny-qwen3.5, ``limit`` records, samples of at most 512 tokens in
    batches of 8,192, one tokenising process."""
    from producer.planner import PlanOptions

    return PlanOptions(dataset="sharegpt", model="tiny-qwen3.5", output=str(output), limit=limit, num_proc=1,
                       max_length=512, batch_tokens=8192,  # short batches: the CPU worker extracts one in a moment
                       command=f"python -m producer run sharegpt --model tiny-qwen3.5 --limit {limit} --max-length 512 "
                               "--batch-tokens 8192")


def plan_settings(cache: Path):
    from settings import Settings

    return Settings(_env_file=None, cache_dir=cache)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("cache", type=Path)
    ap.add_argument("output", type=Path)
    ap.add_argument("limit", type=int)
    ap.add_argument("--pause-after", type=int, default=None, help="wait after this window (0-based) until --release exists")
    ap.add_argument("--release", type=Path)
    args = ap.parse_args(argv)
    from producer.planner import plan_run

    small_windows()
    seen = []

    def on_window(job, batches: list[dict]) -> None:
        index = len(seen)
        seen.append(batches)
        print(json.dumps({"window": index, "batches": [b.batch for b in batches], "address": job.run_url,
                          "pid": os.getpid()}), flush=True)
        if args.pause_after is not None and index == args.pause_after:
            while not args.release.exists():
                time.sleep(0.05)

    planned = plan_run(plan_options(args.output, args.limit), plan_settings(args.cache), on_window=on_window)
    print(json.dumps({"done": True, "batches": len(planned.batches)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
