"""Planning throughput on real ShareGPT with the Qwen3 tokenizer, in one run.

Measures samples/s and tokens/s of nested stages over the same first ``--limit`` usable
ShareGPT records (the tokenizer is the one of the built-in ``tiny-qwen3.5``: the real Qwen3
tokenizer and chat template):

(a) ``stream``: :func:`producer.datasets.iter_conversations` only (read the JSON array, parse,
    normalise the records);
(b) ``encode``: (a) + :meth:`producer.masks.ChatTokeniser.encode`, one record at a time (chat
    template, tokenisation, assistant loss mask) on this thread;
(b2) ``encode_many``: (a) + :meth:`ChatTokeniser.encode_many` (renders on this thread, each chunk
    of renders tokenised in one batch call on a helper thread), the path ``plan_run`` takes;
(c) ``plan_run``: the whole :func:`producer.planner.plan_run` into a local store in a temp dir:
    config checks, tokenizer load, dataset fingerprint, (b2), batching and writing the plan files.

tokens/s always counts the planned tokens (after truncation at ``--max-length``) of the samples
that (b) kept, so the rows are comparable; for (a) that is "tokens' worth of records". Fixed costs
paid once per plan are timed on their own and included in (c) only: loading the tokenizer (the
first load in a process also imports transformers' tokenizer code; every load builds the BPE from
vocab.json + merges.txt) and the sha256 fingerprint of the whole 125 MB ShareGPT file, whatever
``--limit`` is. The fingerprint runs first, so the file is in the page cache for every stage.
Each stage runs once; the load average at start is recorded (other work on the machine skews it).

Run from the repository root::

    PYTHONPATH=. python bench/planning.py --limit 5000 --json bench/results/planning-cpu.json

Options: ``--limit`` records (default 5000), ``--max-length`` tokens (default: the settings'
4096), ``--cache-dir`` for the generated tiny model (default ``HSX_CACHE_DIR`` or ~/.cache/hsx),
``--json OUT`` to save the figures and the machine description. Prints a table and the machine.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the project's packages live at the repo root
    sys.path.insert(0, str(ROOT))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

MODEL = "tiny-qwen3.5"


# --------------------------------------------------------------------------------------------
# The machine (shared with bench/task_overhead.py)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _ram_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / (1 << 20), 1)  # kB -> GiB
    except OSError:
        pass
    return None


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine_info() -> dict:
    """CPU count and model, RAM, OS, Python and library versions, the git commit, the UTC date."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    changed = [line[3:] for line in _git("status", "--porcelain").splitlines()
               if line[3:].startswith(("hsx/", "producer/", "workers/", "settings.py"))]
    return {
        "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "cpus_usable": usable,
        "cpu_model": _cpu_model(),
        "ram_gib": _ram_gib(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "tokenizers": _version("tokenizers"),
        "celery": _version("celery"),
        "loadavg_1m_5m": [round(x, 2) for x in os.getloadavg()],  # > 0.5 at start: something else was running
        "git_commit": _git("rev-parse", "--short", "HEAD"),
        "uncommitted_code": changed,  # measured code that differs from the commit (modified or untracked)
    }


def machine_line(m: dict) -> str:
    return (f"{m['cpus_usable']} CPUs ({m['cpu_model']}), {m['ram_gib']} GiB RAM, Python {m['python']}, "
            f"torch {m['torch']}, transformers {m['transformers']}, tokenizers {m['tokenizers']}, "
            f"commit {m['git_commit']}, {m['date_utc']}, load average at start {m['loadavg_1m_5m']}")


# --------------------------------------------------------------------------------------------
# Stages


class Clock:
    """Wall and process-CPU seconds of a block (CPU/wall > 1 means more than one core was busy)."""

    def __enter__(self) -> "Clock":
        self.wall0, self.cpu0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall_s = time.perf_counter() - self.wall0
        self.cpu_s = time.process_time() - self.cpu0


def _stage(name: str, clock: Clock, samples: int, tokens: int, what: str) -> dict:
    return {
        "stage": name,
        "what": what,
        "samples": samples,
        "tokens": tokens,
        "wall_s": round(clock.wall_s, 4),
        "cpu_s": round(clock.cpu_s, 4),
        "samples_per_s": round(samples / clock.wall_s, 1),
        "tokens_per_s": round(tokens / clock.wall_s),
    }


def run(limit: int, max_length: int | None, cache_dir: Path) -> dict:
    """Time the stages; returns the JSON-able report (``machine``, ``params``, ``fixed``, ``stages``)."""
    from hsx.errors import BadRecord
    from hsx.models import load_tokenizer, resolve_model_path
    from producer.datasets import SHAREGPT, SkipCounter, iter_conversations
    from producer.masks import ChatTokeniser
    from producer.planner import PlanOptions, dataset_fingerprint, plan_run
    from settings import Settings

    machine = machine_info()  # before the work: its load average says whether the machine was idle
    settings = Settings(_env_file=None, cache_dir=cache_dir)
    max_length = max_length or settings.max_length
    fixed = {}
    with Clock() as c:
        resolve_model_path(MODEL, cache_dir)  # generates the tiny checkpoint on first use
    fixed["tiny_model_ready_s"] = round(c.wall_s, 3)
    with Clock() as c:
        dataset_fingerprint(SHAREGPT)  # also warms the page cache for every stage below
    fixed["dataset_fingerprint_s"] = round(c.wall_s, 3)
    with Clock() as c:
        load_tokenizer(MODEL, cache_dir)
    fixed["tokenizer_first_load_s"] = round(c.wall_s, 3)  # + importing transformers' tokenizer code
    with Clock() as c:
        tokenizer = load_tokenizer(MODEL, cache_dir)  # what plan_run pays below
        chat = ChatTokeniser(tokenizer, max_length=max_length)
    fixed["tokenizer_load_s"] = round(c.wall_s, 3)

    stages = []
    with Clock() as c:
        skips_a = SkipCounter()
        records = sum(1 for _ in iter_conversations(SHAREGPT, skips_a, limit=limit))
    clock_a = c

    with Clock() as c:
        skips_b = SkipCounter()
        kept_b, tokens_b = 0, 0
        for conv in iter_conversations(SHAREGPT, skips_b, limit=limit):
            try:
                sample = chat.encode(conv)
            except BadRecord as err:
                skips_b.add(err)
            else:
                kept_b += 1
                tokens_b += sample.num_tokens
    stages.append(_stage("a_stream", clock_a, records, tokens_b, "stream + normalise records"))
    stages.append(_stage("b_encode", c, kept_b, tokens_b, "(a) + chat template + tokenise + loss mask (encode)"))

    if hasattr(chat, "encode_many"):
        with Clock() as c:
            kept, tokens = 0, 0
            for item in chat.encode_many(iter_conversations(SHAREGPT, SkipCounter(), limit=limit)):
                if not isinstance(item, BadRecord):
                    kept += 1
                    tokens += item.num_tokens
        stages.append(_stage("b2_encode_many", c, kept, tokens, "(a) + encode_many (batched tokenise on a helper thread)"))
        if (kept, tokens) != (kept_b, tokens_b):
            stages[-1]["mismatch"] = f"encode_many kept {kept} samples / {tokens} tokens, encode {kept_b} / {tokens_b}"

    with tempfile.TemporaryDirectory(prefix="hsx-bench-plan-") as tmp:
        opts = PlanOptions(dataset=SHAREGPT, model=MODEL, output=str(Path(tmp) / "out"), limit=limit,
                           max_length=max_length)
        with Clock() as c:
            planned = plan_run(opts, settings)
        st = planned.stats
        stage_c = _stage("c_plan_run", c, st["samples"], st["tokens"],
                         "whole plan_run into a local store (config, fingerprint, tokenizer, (b2), batches, files)")
        stage_c["batches"] = st["batches"]
        stage_c["plan_bytes"] = sum(p.stat().st_size for p in (Path(tmp) / "out").rglob("*") if p.is_file())
        if (st["samples"], st["tokens"]) != (kept_b, tokens_b):
            stage_c["mismatch"] = f"plan_run kept {st['samples']} samples / {st['tokens']} tokens, encode {kept_b} / {tokens_b}"
        stages.append(stage_c)

    wall = {s["stage"]: s["wall_s"] for s in stages}
    derived = {
        "encode_only_samples_per_s": round(kept_b / max(wall["b_encode"] - clock_a.wall_s, 1e-9), 1),
        "encode_share_of_b": round(1 - clock_a.wall_s / wall["b_encode"], 3),
    }
    if "b2_encode_many" in wall:
        derived["encode_many_speedup_over_encode"] = round(wall["b_encode"] / wall["b2_encode_many"], 2)
        derived["plan_run_minus_encode_many_s"] = round(wall["c_plan_run"] - wall["b2_encode_many"], 3)
    return {
        "benchmark": "planning",
        "machine": machine,
        "loadavg_1m_at_end": round(os.getloadavg()[0], 2),
        "params": {"dataset": SHAREGPT, "model": MODEL, "limit": limit, "max_length": max_length,
                   "records_streamed": records, "samples_kept": kept_b,
                   "skipped_stream": skips_a.total, "skipped_total": skips_b.total,
                   "tokenizers_parallelism": os.environ.get("TOKENIZERS_PARALLELISM")},
        "fixed": fixed,
        "stages": stages,
        "derived": derived,
    }


def print_report(report: dict, console: Console) -> None:
    t = Table(title=f"planning throughput, ShareGPT, --limit {report['params']['limit']}, "
                    f"max_length {report['params']['max_length']}", title_justify="left")
    for col in ("stage", "samples", "tokens", "wall s", "cpu s", "samples/s", "tokens/s"):
        t.add_column(col, justify="left" if col == "stage" else "right")
    for s in report["stages"]:
        t.add_row(s["stage"], f"{s['samples']:,}", f"{s['tokens']:,}", f"{s['wall_s']:.2f}", f"{s['cpu_s']:.2f}",
                  f"{s['samples_per_s']:,.1f}", f"{s['tokens_per_s']:,}")
    console.print(t)
    console.print("fixed costs (s): " + ", ".join(f"{k} {v}" for k, v in report["fixed"].items()))
    console.print("derived: " + ", ".join(f"{k} {v}" for k, v in report["derived"].items()))
    for s in report["stages"]:
        if "mismatch" in s:
            console.print(f"[red]mismatch[/] {s['stage']}: {s['mismatch']}")
    console.print("machine: " + machine_line(report["machine"]))


def main(argv: list[str] | None = None) -> int:
    from settings import Settings

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=5000, help="usable ShareGPT records to read (default 5000)")
    parser.add_argument("--max-length", type=int, default=None, help="tokens per sample (default: the settings', 4096)")
    parser.add_argument("--cache-dir", type=Path, default=None, help="where tiny-qwen3.5 is generated (default HSX_CACHE_DIR or ~/.cache/hsx)")
    parser.add_argument("--json", type=Path, default=None, metavar="OUT", help="write the report as JSON to OUT")
    args = parser.parse_args(argv)
    if args.limit < 1:
        parser.error(f"--limit {args.limit}: must be a positive number of records")
    cache_dir = args.cache_dir or Settings().cache_dir
    report = run(args.limit, args.max_length, cache_dir)
    report["command"] = " ".join(["python", "bench/planning.py", *(argv if argv is not None else sys.argv[1:])])
    print_report(report, Console(width=120))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
