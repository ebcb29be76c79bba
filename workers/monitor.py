"""What a worker process tells about itself: its GPU (NVML), the batches it runs, its recent rate.

``celery -A workers inspect gpu_stats`` (or ``app.control.broadcast("gpu_stats", reply=True)``,
which is what ``python -m producer status`` sends) returns one reply per worker process:

| field | meaning |
|---|---|
| ``host``, ``pid``, ``device`` | where it runs; ``device`` is the torch device of its loaded model (``cuda:0``, ``cpu``), or None before one is loaded |
| ``gpus`` | one entry per GPU this process sees (``CUDA_VISIBLE_DEVICES`` order): ``index``, ``uuid``, ``name``, ``utilization_pct``, ``memory_utilization_pct``, ``memory_used_bytes``, ``memory_total_bytes``, ``temperature_c``, ``power_w``, ``power_limit_w``, ``sm_clock_mhz``, ``sm_clock_max_mhz``, ``mem_clock_mhz``; a reading the GPU does not support is None |
| ``no_gpu`` | None when ``gpus`` is filled, else why not (no NVML library, no NVIDIA driver, no visible GPU) |
| ``torch_memory`` | ``{allocated_bytes, reserved_bytes, max_allocated_bytes}`` of this process on its CUDA device, when CUDA is initialised |
| ``running`` | the batches in progress: ``[{run_id, batch, task_id, started_at, seconds}]`` |
| ``batches_done``, ``tokens_done`` | batches this process certified since it started, and their tokens |
| ``tokens_per_s`` | tokens of the batches it finished in the last :data:`RATE_WINDOW_S` seconds over the wall time they span (overlapping task threads counted once); None before the first |
| ``last_batch_at``, ``at`` | when its last batch finished, when this reply was made (UTC, ISO 8601) |

NVML reads the whole machine and ignores ``CUDA_VISIBLE_DEVICES``: the process's GPUs are found
by the UUID torch reports once CUDA is initialised, and before that by the ids (or UUIDs) in
``CUDA_VISIBLE_DEVICES``, which ``python -m workers`` sets for each process.

Batches are tracked with Celery's ``task_prerun`` / ``task_postrun`` signals, so the task code
stays as it is; the reply needs no lock on the GPU and costs a few NVML calls (about a millisecond).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import deque
from datetime import datetime, timezone

from celery.signals import task_postrun, task_prerun
from celery.worker.control import inspect_command

from hsx.queue import EXTRACT_TASK

log = logging.getLogger(__name__)

#: Seconds of finished batches that ``tokens_per_s`` averages over.
RATE_WINDOW_S = 300.0
#: Finished batches kept for the rate (the window is cut to these many).
RATE_HISTORY = 256


def _utc(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).isoformat(timespec="seconds")


class BatchTracker:
    """The batches a worker process runs now and the ones it finished recently (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[str, dict] = {}
        self._finished: deque[tuple[float, float, int]] = deque(maxlen=RATE_HISTORY)  # (start, end, tokens), wall clock
        self.batches_done = 0
        self.tokens_done = 0

    def started(self, task_id: str, run_url: str, batch: str) -> None:
        """Record that ``task_id`` (batch ``batch`` of the run at ``run_url``) began now."""
        with self._lock:
            self._running[task_id] = {"run_id": str(run_url).rstrip("/").rsplit("/", 1)[-1], "batch": batch,
                                      "task_id": task_id, "t0": time.time()}

    def finished(self, task_id: str, result) -> None:
        """Record the end of ``task_id``; a result ``{"status": "done", "num_tokens": n}`` counts toward the rate."""
        now = time.time()
        with self._lock:
            info = self._running.pop(task_id, None)
            if info is not None and isinstance(result, dict) and result.get("status") == "done":
                tokens = int(result.get("num_tokens") or 0)
                self._finished.append((info["t0"], now, tokens))
                self.batches_done += 1
                self.tokens_done += tokens

    def snapshot(self, now: float | None = None) -> dict:
        """``running``, ``batches_done``, ``tokens_done``, ``tokens_per_s``, ``last_batch_at`` (see the module doc)."""
        now = time.time() if now is None else now
        with self._lock:
            running = [{"run_id": r["run_id"], "batch": r["batch"], "task_id": r["task_id"], "started_at": _utc(r["t0"]),
                        "seconds": round(now - r["t0"], 1)} for r in self._running.values()]
            recent = [f for f in self._finished if f[1] >= now - RATE_WINDOW_S]
            last = self._finished[-1][1] if self._finished else None
            done, tokens = self.batches_done, self.tokens_done
        rate = None
        if recent:
            span = max(f[1] for f in recent) - min(f[0] for f in recent)
            rate = round(sum(f[2] for f in recent) / max(span, 1e-3), 1)
        return {"running": running, "batches_done": done, "tokens_done": tokens, "tokens_per_s": rate,
                "last_batch_at": _utc(last) if last else None}


tracker = BatchTracker()


@task_prerun.connect
def _on_prerun(task_id=None, task=None, args=None, **_kw) -> None:
    if task is not None and task.name == EXTRACT_TASK and args and len(args) >= 2:
        tracker.started(task_id, args[0], args[1])


@task_postrun.connect
def _on_postrun(task_id=None, task=None, retval=None, **_kw) -> None:
    if task is not None and task.name == EXTRACT_TASK:
        tracker.finished(task_id, retval)


# --------------------------------------------------------------------------------------------
# NVML

_nvml_lock = threading.Lock()
_nvml_state: dict = {}


def _nvml():
    """The ``pynvml`` module, initialised once; raises with the reason when NVML is unusable."""
    with _nvml_lock:
        if "error" in _nvml_state:
            raise RuntimeError(_nvml_state["error"])
        if "module" not in _nvml_state:
            try:
                import pynvml
            except ImportError:
                _nvml_state["error"] = "no GPU: the NVML library (nvidia-ml-py, the gpu extra) is not installed"
                raise RuntimeError(_nvml_state["error"]) from None
            try:
                pynvml.nvmlInit()
            except Exception as exc:
                _nvml_state["error"] = f"no GPU: NVML cannot start ({exc.__class__.__name__}: {exc}); no NVIDIA driver here"
                raise RuntimeError(_nvml_state["error"]) from None
            _nvml_state["module"] = pynvml
        return _nvml_state["module"]


def _visible_handles(pynvml) -> list:
    """NVML handles of the GPUs this process uses (see the module doc for how they are found)."""
    try:
        import torch

        if torch.cuda.is_initialized():
            handles = []
            for i in range(torch.cuda.device_count()):
                uuid = str(torch.cuda.get_device_properties(i).uuid)
                handles.append(pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"))
            return handles
    except Exception as exc:  # fall back to the environment's ids
        log.debug("gpu_stats: torch's device UUIDs not usable (%s)", exc)
    # Not a setting: the CUDA runtime's own variable, set per process by the launcher.
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    handles = []
    for token in (t.strip() for t in visible.split(",")):
        if token in ("", "-1"):
            break  # CUDA stops at the first invalid id
        if token.isdigit():
            handles.append(pynvml.nvmlDeviceGetHandleByIndex(int(token)))
        else:
            handles.append(pynvml.nvmlDeviceGetHandleByUUID(token))
    return handles


def _read(fn, *args, scale: float = 1.0):
    try:
        value = fn(*args)
    except Exception:  # NVMLError_NotSupported and friends: this GPU does not report it
        return None
    return round(value * scale, 1) if scale != 1.0 else value


def _text(value):
    return value.decode() if isinstance(value, bytes) else value


def gpu_readings() -> tuple[list[dict], str | None]:
    """One dict per GPU this process sees, and None; or ``[]`` and why there is no GPU reading."""
    try:
        pynvml = _nvml()
        handles = _visible_handles(pynvml)
    except Exception as exc:
        return [], str(exc)
    if not handles:
        return [], "no GPU: CUDA_VISIBLE_DEVICES hides every GPU from this process"
    out = []
    for h in handles:
        util = _read(pynvml.nvmlDeviceGetUtilizationRates, h)
        mem = _read(pynvml.nvmlDeviceGetMemoryInfo, h)
        out.append({
            "index": _read(pynvml.nvmlDeviceGetIndex, h),
            "uuid": _text(_read(pynvml.nvmlDeviceGetUUID, h)),
            "name": _text(_read(pynvml.nvmlDeviceGetName, h)),
            "utilization_pct": getattr(util, "gpu", None),
            "memory_utilization_pct": getattr(util, "memory", None),
            "memory_used_bytes": getattr(mem, "used", None),
            "memory_total_bytes": getattr(mem, "total", None),
            "temperature_c": _read(pynvml.nvmlDeviceGetTemperature, h, pynvml.NVML_TEMPERATURE_GPU),
            "power_w": _read(pynvml.nvmlDeviceGetPowerUsage, h, scale=1e-3),
            "power_limit_w": _read(pynvml.nvmlDeviceGetEnforcedPowerLimit, h, scale=1e-3),
            "sm_clock_mhz": _read(pynvml.nvmlDeviceGetClockInfo, h, pynvml.NVML_CLOCK_SM),
            "sm_clock_max_mhz": _read(pynvml.nvmlDeviceGetMaxClockInfo, h, pynvml.NVML_CLOCK_SM),
            "mem_clock_mhz": _read(pynvml.nvmlDeviceGetClockInfo, h, pynvml.NVML_CLOCK_MEM),
        })
    return out, None


def _torch_side() -> tuple[str | None, dict | None]:
    """The loaded target's device, and this process's CUDA allocator numbers when CUDA is initialised."""
    device = None
    try:
        from workers.target import loaded_targets

        targets = loaded_targets()
        if targets:
            device = str(targets[0].device)
    except Exception:
        pass
    memory = None
    try:
        import torch

        if torch.cuda.is_initialized():
            memory = {"allocated_bytes": torch.cuda.memory_allocated(), "reserved_bytes": torch.cuda.memory_reserved(),
                      "max_allocated_bytes": torch.cuda.max_memory_allocated()}
    except Exception:
        pass
    return device, memory


def gpu_stats() -> dict:
    """This worker process's reply to the ``gpu_stats`` inspect command (fields in the module doc)."""
    gpus, no_gpu = gpu_readings()
    device, memory = _torch_side()
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "device": device,
        "gpus": gpus,
        "no_gpu": no_gpu,
        "torch_memory": memory,
        **tracker.snapshot(),
        "at": _utc(time.time()),
    }


@inspect_command(name="gpu_stats")
def gpu_stats_command(state) -> dict:
    """Celery inspect command: GPU readings, batches in progress and recent tokens/s of this worker."""
    return gpu_stats()
