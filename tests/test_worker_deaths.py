"""A worker that dies while loading is seen (issue 20, item 4).

``producer run`` prints each worker death as it happens, with its signal, when it died (loading
the model or serving) and its likely cause (a SIGKILL while loading: the checkpoint's size against
the host's available memory from ``/proc/meminfo``); after the launcher's restart limit it stops
with that error and exit code 1, not a progress bar that stays at 0; ``producer status`` says the
same. The worker kills itself with SIGKILL while loading through ``HSX_FAULTS=die_load=KILL``
(``workers/faults.py``), as the OOM killer kills it: real ``producer run``, launcher and workers.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
from pathlib import Path

from jobfixtures import clean_env, run_cli
from hsx.models import resolve_model_path
from settings import Settings
from workers.launcher import describe_death

JOB = ["sharegpt", "--limit", "4", "--model", "tiny-qwen3.5", "--max-length", "128", "--batch-tokens", "128"]
GB = 10**9


def test_a_worker_killed_while_loading_is_said_as_it_happens_and_the_run_stops_with_that_error(tmp_path, tiny_cache):
    env = clean_env(cache_dir=tiny_cache, state_dir=tmp_path / "state", spool_dir=tmp_path / "spool",
                    faults="die_load=KILL", worker_restart_limit=1, worker_restart_delay_s=0.1)
    run = run_cli("producer", ["run", *JOB, "--output", str(tmp_path / "store")], env, timeout_s=300)
    out = run.stdout + run.stderr
    assert run.returncode == 1, out[-4000:]
    deaths = re.findall(r"worker cpu0 \(pid (\d+)\) killed by SIGKILL while loading the model: (.*?), after [\d.]+ s; (.*)", out)
    assert len(deaths) == 2, out[-4000:]
    for _pid, cause, _then in deaths:
        assert re.search(r"its checkpoint \([\d.]+ GB\) is less than the host's available memory now \([\d.]+ GB of "
                         r"[\d.]+ GB, /proc/meminfo MemAvailable\)", cause), cause
    assert deaths[0][2].startswith("restarting it in 0.1 s (restart 1 of at most 1 within 600 s)")
    assert deaths[1][2].startswith("it died 2 times within 600 s, more than HSX_WORKER_RESTART_LIMIT=1 allows: "
                                   "the workers gave up, so this run stops")
    said = " ".join(out.split())
    assert ("the workers exited with code 1 before the run was done; finished batches keep their markers: fix what "
            "made them die (above), then run the same command again to resume it. Last lines of their log:") in said, said[-3000:]

    (run_dir,) = [p for p in (tmp_path / "store").iterdir() if (p / "run.json").exists()]
    status = run_cli("producer", ["status", str(run_dir), "--json"], env)
    rows = {r["pid"]: r for r in json.loads(status.stdout)["workers"]}
    for pid, _cause, _then in deaths:
        row = rows[int(pid)]
        assert row["state"] == "lost" and row["exit"].startswith("killed by SIGKILL while loading the model: "), row
    assert "gave up after 1 restart(s)" in rows[int(deaths[1][0])]["exit"]
    text = run_cli("producer", ["status", str(run_dir)], clean_env(cache_dir=tiny_cache, state_dir=tmp_path / "state",
                                                                       worker_restart_limit=1) | {"COLUMNS": "400"})
    assert "killed by SIGKILL while loading the model" in text.stdout, text.stdout[-3000:]


def test_a_sigkill_while_loading_a_checkpoint_larger_than_the_available_memory_names_the_oom_killer(tmp_path, tiny_cache):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(resolve_model_path("tiny-qwen3.5", tiny_cache), ckpt)
    size = sum(f.stat().st_size for f in (ckpt / "model.safetensors", ckpt / "config.json"))
    settings = Settings(_env_file=None, cache_dir=tmp_path / "cache", model=str(ckpt))
    short = {"MemAvailable": size // 2, "MemTotal": 4 * size}
    said = describe_death(-signal.SIGKILL, False, settings, short)
    assert said == (f"killed by SIGKILL while loading the model: likely the kernel's OOM killer: its checkpoint "
                    f"({size / GB:.1f} GB) is more than the host's available memory ({size / 2 / GB:.1f} GB of "
                    f"{4 * size / GB:.1f} GB, /proc/meminfo MemAvailable); free host memory, start fewer workers on this "
                    "host (HSX_WORKERS_PER_NODE), or see `dmesg | grep -i oom`")
    assert describe_death(-signal.SIGSEGV, True, settings, short) == "killed by SIGSEGV while serving"
    assert describe_death(1, False, settings, short) == "exited with code 1 while loading the model"
    assert describe_death(-signal.SIGKILL, True, settings, short).startswith(
        "killed by SIGKILL while serving: sent by a person, a supervisor or the kernel's OOM killer")


# --- ready workers and a long load, as `producer run` says them (producer/worker_events.py) ---


class _Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _append(path: Path, *events: dict) -> None:
    with open(path, "a") as f:
        for e in events:
            f.write(json.dumps(e) + "\n")


def test_until_a_worker_is_ready_a_line_every_minute_says_they_are_still_loading_then_the_ready_line(tmp_path):
    """A first GPU worker can compile kernels for minutes before its first batch: the user sees that it
    is loading (with the log to read), not a bar at 0; the ready line says what the start took; a worker
    that dies after it was ready and is restarted brings the waiting lines back."""
    from producer.worker_events import WorkerEvents

    clock, said = _Clock(), []
    path = tmp_path / "events.jsonl"
    events = WorkerEvents(path, None, lambda line: said.append(("death", line)), say_info=lambda line: said.append(("info", line)),
                          log_path=tmp_path / "workers.log", wait_s=60.0, clock=clock)
    clock.now += 59
    assert events.check() == [] and said == []
    clock.now += 2
    events.check()
    clock.now += 30
    events.check()  # not again within the minute
    assert said == [("info", "workers: still loading the target, 61 s since they started (a first worker on a GPU fleet "
                             "compiles its kernels for minutes, once: later ones take them from the store; its log: "
                             f"{tmp_path / 'workers.log'})")]
    _append(path, {"worker": "gpu0", "pid": 7, "action": "ready", "ran_s": 95.2, "load_s": 16.0, "warmup_s": 3.2,
                   "device": "cuda:0", "kernels": "from the store"})
    clock.now += 60
    events.check()
    assert said[-1] == ("info", "worker gpu0 (pid 7) ready after 95.2 s: target loaded in 16 s, warm-up 3.2 s, kernels "
                                "from the store's compile cache")
    clock.now += 600
    events.check()
    assert len(said) == 2, "no waiting line once a worker is ready"

    _append(path, {"worker": "gpu0", "pid": 7, "host": None, "exit": "killed by SIGKILL while serving", "ran_s": 800.0,
                   "action": "restart", "restart_in_s": 1.0, "restarts": 1, "limit": 5, "window_s": 600.0})
    assert [e["pid"] for e in events.check()] == [7] and said[-1][0] == "death"
    clock.now += 61
    events.check()
    assert said[-1][1].startswith("workers: still loading the target, ") and len(events.ready) == 1
