"""The ``gpu_stats`` readings (workers/monitor.py) without a GPU: a stand-in ``pynvml`` module plays
a two-GPU machine, so the field mapping, the CUDA_VISIBLE_DEVICES mapping and the unsupported-field
path are checked on CPU. The real NVML path answers "no GPU" here (test_monitoring.py covers that
through a real worker).
"""

from __future__ import annotations

import sys
import types

import pytest

from workers import monitor


class _Unsupported(Exception):
    pass


def fake_nvml(*, power_supported: bool = True) -> types.ModuleType:
    """A ``pynvml`` stand-in with two H200s (index 0 and 1, UUIDs GPU-aaa and GPU-bbb)."""
    gpus = [{"uuid": "GPU-aaa", "util": 91, "mem_util": 40, "used": 90 * 2**30, "temp": 58, "power": 612_000},
            {"uuid": "GPU-bbb", "util": 3, "mem_util": 0, "used": 1 * 2**30, "temp": 31, "power": 80_000}]
    m = types.ModuleType("pynvml")
    m.NVML_TEMPERATURE_GPU, m.NVML_CLOCK_SM, m.NVML_CLOCK_MEM = 0, 1, 2
    m.nvmlInit = lambda: None
    m.nvmlDeviceGetCount = lambda: len(gpus)
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetHandleByUUID = lambda u: [g["uuid"] for g in gpus].index(u)
    m.nvmlDeviceGetIndex = lambda h: h
    m.nvmlDeviceGetUUID = lambda h: gpus[h]["uuid"]
    m.nvmlDeviceGetName = lambda h: b"NVIDIA H200"
    m.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=gpus[h]["util"], memory=gpus[h]["mem_util"])
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=gpus[h]["used"], total=141 * 2**30)
    m.nvmlDeviceGetTemperature = lambda h, sensor: gpus[h]["temp"]

    def power(h):
        if not power_supported:
            raise _Unsupported("NVML_ERROR_NOT_SUPPORTED")
        return gpus[h]["power"]

    m.nvmlDeviceGetPowerUsage = power
    m.nvmlDeviceGetEnforcedPowerLimit = lambda h: 700_000
    m.nvmlDeviceGetClockInfo = lambda h, clock: {1: 1980, 2: 3201}[clock]
    m.nvmlDeviceGetMaxClockInfo = lambda h, clock: 1980
    return m


@pytest.fixture
def nvml(monkeypatch):
    """Install a stand-in pynvml and forget any NVML state the process had."""
    def install(**kw):
        monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(**kw))
        monkeypatch.setattr(monitor, "_nvml_state", {})
    return install


def test_gpu_readings_map_every_nvml_field_of_the_visible_gpu(nvml, monkeypatch):
    """CUDA_VISIBLE_DEVICES=1: one reading, of NVML's GPU 1, with utilisation, memory, temperature, power (W) and clocks."""
    nvml()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    gpus, why = monitor.gpu_readings()
    assert why is None
    assert gpus == [{"index": 1, "uuid": "GPU-bbb", "name": "NVIDIA H200", "utilization_pct": 3, "memory_utilization_pct": 0,
                     "memory_used_bytes": 2**30, "memory_total_bytes": 141 * 2**30, "temperature_c": 31, "power_w": 80.0,
                     "power_limit_w": 700.0, "sm_clock_mhz": 1980, "sm_clock_max_mhz": 1980, "mem_clock_mhz": 3201}]


def test_gpu_readings_follow_cuda_visible_devices_by_uuid_and_stop_at_an_invalid_id(nvml, monkeypatch):
    """UUIDs select GPUs like indices do; CUDA stops at the first invalid id (-1), and so do the readings."""
    nvml()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-bbb,GPU-aaa")
    assert [g["index"] for g in monitor.gpu_readings()[0]] == [1, 0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,-1,1")
    assert [g["index"] for g in monitor.gpu_readings()[0]] == [0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    gpus, why = monitor.gpu_readings()
    assert gpus == [] and why.startswith("no GPU")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert [g["index"] for g in monitor.gpu_readings()[0]] == [0, 1]


def test_a_reading_the_gpu_does_not_support_is_none_and_the_rest_is_kept(nvml, monkeypatch):
    """A GPU that cannot report its power gives power_w None; every other field is still read."""
    nvml(power_supported=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    (g,), _ = monitor.gpu_readings()
    assert g["power_w"] is None and g["utilization_pct"] == 91 and g["temperature_c"] == 58


def test_without_nvml_the_reply_says_there_is_no_gpu(monkeypatch):
    """No NVML library: gpus is empty and no_gpu names the missing package; the reply still has host, pid and the batch fields."""
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    monkeypatch.setattr(monitor, "_nvml_state", {})
    reply = monitor.gpu_stats()
    assert reply["gpus"] == [] and "nvidia-ml-py" in reply["no_gpu"]
    assert reply["pid"] > 0 and reply["running"] == [] and "tokens_per_s" in reply


class _Nowhere:
    """A store that takes the heartbeat's status records and keeps nothing."""

    def write(self, key, data, **_kw):
        pass


def test_the_heartbeat_rate_counts_overlapping_batches_once_and_forgets_old_ones(monkeypatch):
    """The process's one tracker of its batches is its heartbeat (workers/heartbeat.py): the gpu_stats reply reads
    it. Two overlapping batches of 1000 tokens over 2 s of wall time: 1000 tok/s; after the window, no rate but the
    totals stay."""
    from workers import heartbeat

    t = {"now": 1000.0}
    monkeypatch.setattr(heartbeat.time, "time", lambda: t["now"])
    beat, store, run = heartbeat.Heartbeat(interval_s=3600), _Nowhere(), "s3://b/runs/r1"
    beat.phase(run, store, "b000001", "claimed", task_id="t1")
    t["now"] = 1000.5
    beat.phase(run, store, "b000002", "claimed", task_id="t2")
    beat.phase(run, store, "b000001", "forward", task_id="t1")  # a later phase keeps the batch's start
    snap = beat.activity()
    assert [(r["run_id"], r["batch"], r["task_id"]) for r in snap["running"]] == [("r1", "b000001", "t1"),
                                                                                  ("r1", "b000002", "t2")]
    assert snap["running"][0]["seconds"] == 0.5
    t["now"] = 1001.5
    beat.finished(run, "b000001", certified=True, tokens=1000)
    t["now"] = 1002.0
    beat.finished(run, "b000002", certified=True, tokens=1000)
    beat.phase(run, store, "b000003", "claimed", task_id="t3")
    beat.finished(run, "b000003", certified=False)  # failed or lost its race: not counted
    snap = beat.activity()
    assert snap["running"] == [] and snap["batches_done"] == 2 and snap["tokens_done"] == 2000
    assert snap["tokens_per_s"] == 1000.0
    snap = beat.activity(now=1002.0 + heartbeat.RATE_WINDOW_S + 1)
    assert snap["tokens_per_s"] is None and snap["tokens_done"] == 2000
