"""Where a worker's GPU waits, seen from inside the worker process: a diagnostic for the benches.

Loaded into every Python process of a bench's run by ``bench/worker_trace_site/sitecustomize.py``
when ``HSXBENCH_TRACE_DIR`` is set (the bench puts that directory first on ``PYTHONPATH``); it does
nothing in a process that never imports ``workers.extract``. No product code knows of it.

In a worker, it wraps ``workers.extract.forward`` (the step that takes the GPU lock and queues the
forward and its copies) to count and time each call, and a tracer thread of its own:

- after ``HSXBENCH_TRACE_SKIP`` forwards (default 12: the warm-up batches outside), starts
  ``torch.profiler`` with CUDA activity only (CUPTI: every kernel and copy on the GPU, and every
  CUDA runtime/driver call of every host thread, with its thread id), and samples the Python stack
  of every thread every 5 ms;
- stops after ``HSXBENCH_TRACE_BATCHES`` more forwards (default 8) and writes
  ``worker-trace-<pid>.json`` (the summary below) and ``worker-trace-<pid>.json.gz`` (the chrome
  trace) into ``HSXBENCH_TRACE_DIR``.

The summary: the GPU's busy fraction over the traced span (union of kernels, copies and memsets),
the longest idle gaps with the CUDA calls each host thread was inside or made during each one, the
CUDA runtime/driver calls summed by name and thread, the forward step's timings per call (lock
wait, launch, copy wait), and the most sampled Python stacks of each thread (``forward_step``: a thread in that step).
"""

from __future__ import annotations

import gzip
import json
import os
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path


def install() -> None:
    """Wait (on a daemon thread) for ``workers.extract`` to be imported, then wrap its ``forward``."""
    if not os.environ.get("HSXBENCH_TRACE_DIR"):
        return

    def wait_for_module():
        for _ in range(36000):  # up to an hour
            module = sys.modules.get("workers.extract")
            if module is not None and hasattr(module, "forward"):
                _wrap(module)
                return
            time.sleep(0.1)

    threading.Thread(target=wait_for_module, name="hsxbench-trace-install", daemon=True).start()


class _State:
    def __init__(self):
        self.lock = threading.Lock()
        self.calls = 0
        self.done_calls = 0
        self.records: list[dict] = []
        self.start = threading.Event()
        self.stop = threading.Event()
        self.in_lock: dict[int, str] = {}  # native thread id -> batch, while that thread is in the forward step


_state = _State()


def _wrap(module) -> None:
    original = module.forward
    if getattr(original, "hsxbench_traced", False):
        return
    skip = int(os.environ.get("HSXBENCH_TRACE_SKIP", "12"))
    count = int(os.environ.get("HSXBENCH_TRACE_BATCHES", "8"))

    def forward(work, job):
        with _state.lock:
            _state.calls += 1
            n = _state.calls
        if n == skip + 1:
            _state.start.set()
        tid = threading.get_native_id()
        t0 = time.perf_counter()
        _state.in_lock[tid] = job.batch
        try:
            out = original(work, job)
        finally:
            _state.in_lock.pop(tid, None)
        t1 = time.perf_counter()
        with _state.lock:
            _state.done_calls += 1
            if skip < n <= skip + count:
                _state.records.append({"n": n, "batch": job.batch, "tid": tid, "t0_unix": time.time() - (t1 - t0),
                                       "step_s": round(t1 - t0, 4), "launch_s": round(out.launch_s, 4),
                                       "launch_and_copies_s": round(out.forward_s, 4), "forwards": out.forwards,
                                       "tokens": int(work.claimed.plan.num_tokens),
                                       "rows_shape": [list(r.shape) for r in work.rows]})
            if _state.done_calls >= skip + count:
                _state.stop.set()
        return out

    forward.hsxbench_traced = True
    module.forward = forward
    threading.Thread(target=_trace, name="hsxbench-tracer", daemon=True).start()


def _trace() -> None:
    import torch

    out_dir = Path(os.environ["HSXBENCH_TRACE_DIR"])
    out_dir.mkdir(parents=True, exist_ok=True)
    _state.start.wait()
    sampler = _PythonSampler()
    cuda = torch.cuda.is_available()
    activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
    prof = torch.profiler.profile(activities=[activity])
    prof.start()
    t_start = time.time()
    sampler.start()
    _state.stop.wait(timeout=600)
    sampler.stop()
    if cuda:
        torch.cuda.synchronize()
    prof.stop()
    t_stop = time.time()
    # Only the raw trace here: parsing and compressing it in the worker held the GIL for 7.8 s and
    # stalled the run it watches (H100, 2026-12-06); the bench reads it after the run (finish()).
    prof.export_chrome_trace(str(out_dir / f"worker-trace-{os.getpid()}.raw.json"))
    summary = {"traced_wall_s": round(t_stop - t_start, 3), "forward_steps": _state.records,
               "python_stacks": sampler.summary()}
    (out_dir / f"worker-trace-{os.getpid()}.json").write_text(json.dumps(summary, indent=1))


def finish(out_dir: Path) -> list[Path]:
    """After the run, in the bench's process: each worker's raw trace summarised into its
    ``worker-trace-<pid>.json`` (:func:`summarise`) and compressed to ``.json.gz``. Returns the
    summaries."""
    done = []
    for raw in sorted(Path(out_dir).glob("worker-trace-*.raw.json")):
        summary_path = raw.with_name(raw.name.replace(".raw.json", ".json"))
        trace = json.loads(raw.read_text())
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
        summary.update(summarise(trace))
        summary_path.write_text(json.dumps(summary, indent=1))
        with gzip.open(raw.with_name(raw.name.replace(".raw.json", ".json.gz")), "wt") as f:
            json.dump(trace, f)
        raw.unlink()
        done.append(summary_path)
    return done


class _PythonSampler:
    """Every 5 ms, the innermost frames of each thread (file:line function, 10 deep), counted per
    thread role: ``forward_step`` for a thread inside the forward step (waiting for the GPU lock or holding it), else the thread's name."""

    def __init__(self, every_s: float = 0.005):
        self.every_s = every_s
        self.counts: dict[str, Counter] = defaultdict(Counter)
        self._stop = threading.Event()

    def start(self):
        self._thread = threading.Thread(target=self._run, name="hsxbench-sampler", daemon=True)
        self._thread.start()

    def stop(self):
        self._stop.set()
        self._thread.join()

    def _run(self):
        me = threading.get_ident()
        while not self._stop.wait(self.every_s):
            threads = {t.ident: t for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                thread = threads.get(ident)
                native = getattr(thread, "native_id", None)
                role = "forward_step" if native in _state.in_lock else (thread.name if thread else str(ident))
                stack = []
                f = frame
                while f is not None and len(stack) < 10:
                    stack.append(f"{Path(f.f_code.co_filename).name}:{f.f_lineno} {f.f_code.co_name}")
                    f = f.f_back
                self.counts[role][" <- ".join(stack)] += 1

    def summary(self, top: int = 25) -> dict:
        return {role: {"samples": sum(c.values()), "top": c.most_common(top)} for role, c in self.counts.items()}


def summarise(trace: dict, gap_us: float = 50.0, top_gaps: int = 25) -> dict:
    """The GPU's busy fraction, idle gaps and CUDA API totals from a torch.profiler chrome trace."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    gpu = sorted((e["ts"], e["ts"] + e.get("dur", 0), e) for e in events
                 if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    api = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    if not gpu:
        return {"error": "no GPU activity in the trace"}
    merged: list[list[float]] = []
    for s, e, _ in gpu:
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    span = merged[-1][1] - merged[0][0]
    busy = sum(e - s for s, e in merged)
    gaps = [(merged[i + 1][0] - merged[i][1], merged[i][1], merged[i + 1][0]) for i in range(len(merged) - 1)]
    big = sorted((g for g in gaps if g[0] >= gap_us), reverse=True)
    api_sorted = sorted(api, key=lambda e: e["ts"])

    def calls_during(t0: float, t1: float) -> list[str]:
        out = Counter()
        for e in api_sorted:
            if e["ts"] > t1:
                break
            if e["ts"] + e.get("dur", 0) >= t0:
                out[f"tid {e.get('tid')} {e.get('name')}"] += 1
        return [f"{k} x{v}" for k, v in out.most_common(8)]

    totals: dict[str, dict] = {}
    for e in api:
        key = f"{e.get('name')} (tid {e.get('tid')})"
        t = totals.setdefault(key, {"calls": 0, "total_ms": 0.0, "max_ms": 0.0})
        t["calls"] += 1
        t["total_ms"] += e.get("dur", 0) / 1000
        t["max_ms"] = max(t["max_ms"], e.get("dur", 0) / 1000)
    kernels = Counter()
    kernel_us = Counter()
    for s, e, ev in gpu:
        kernels[ev.get("name", "?")[:80]] += 1
        kernel_us[ev.get("name", "?")[:80]] += e - s
    return {
        "gpu_span_s": round(span / 1e6, 4),
        "gpu_busy": round(busy / span, 4) if span else None,
        "gpu_idle_s": round((span - busy) / 1e6, 4),
        "gaps_over_us": gap_us,
        "gaps_over_count": len(big),
        "gaps_over_total_s": round(sum(g[0] for g in big) / 1e6, 4),
        "gaps_under_total_s": round(sum(g[0] for g in gaps if g[0] < gap_us) / 1e6, 4),
        "longest_gaps": [{"us": round(g, 1), "at_s": round((t0 - merged[0][0]) / 1e6, 4), "cuda_calls": calls_during(t0, t1)}
                         for g, t0, t1 in big[:top_gaps]],
        "cuda_api": dict(sorted(((k, {kk: round(vv, 3) for kk, vv in v.items()}) for k, v in totals.items()),
                                key=lambda kv: -kv[1]["total_ms"])[:40]),
        "gpu_activities": len(gpu),
        "kernels_top_by_time_ms": [(k, kernels[k], round(us / 1000, 2)) for k, us in kernel_us.most_common(25)],
    }
