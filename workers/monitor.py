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
| ``tokens_per_s`` | tokens of the batches it finished in the last :data:`~workers.heartbeat.RATE_WINDOW_S` seconds over the wall time they span (overlapping task threads counted once); None before the first |
| ``last_batch_at``, ``at`` | when its last batch finished, when this reply was made (UTC, ISO 8601) |

NVML reads the whole machine and ignores ``CUDA_VISIBLE_DEVICES``: the process's GPUs are found
by the UUID torch reports once CUDA is initialised, and before that by the ids (or UUIDs) in
``CUDA_VISIBLE_DEVICES``, which ``python -m workers`` sets for each process.

The batches are the ones the process's heartbeat tracks (``workers/heartbeat.py``: one tracker per
process, the one its status records and presence are written from); the reply needs no lock on
the GPU and costs a few NVML calls (about a millisecond).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from datetime import datetime, timezone

from celery.worker.control import inspect_command

from workers.heartbeat import current_heartbeat

log = logging.getLogger(__name__)


def _utc(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).isoformat(timespec="seconds")


def activity() -> dict:
    """``running``, ``batches_done``, ``tokens_done``, ``tokens_per_s``, ``last_batch_at``: read from
    the process's one tracker of its batches, its heartbeat (:meth:`workers.heartbeat.Heartbeat.activity`)."""
    beat = current_heartbeat()
    if beat is None:  # no batch yet, and the worker has not started its presence
        return {"running": [], "batches_done": 0, "tokens_done": 0, "tokens_per_s": None, "last_batch_at": None}
    return beat.activity()


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
        **activity(),
        "at": _utc(time.time()),
    }


@inspect_command(name="gpu_stats")
def gpu_stats_command(state) -> dict:
    """Celery inspect command: GPU readings, batches in progress and recent tokens/s of this worker."""
    return gpu_stats()
