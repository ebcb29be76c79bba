"""``python -m workers``: one Celery worker process per visible GPU (or per group of
``HSX_GPUS_PER_WORKER`` GPUs), each pinned with CUDA_VISIBLE_DEVICES.

With no GPU it starts one CPU worker (or ``HSX_WORKERS_PER_NODE`` of them). Before it starts any,
it loads the settings (a bad ``HSX_*`` value is refused with the variable, the value and the rule)
and checks that ``HSX_BROKER_URL`` is set and answers a PING within ``HSX_BROKER_CHECK_TIMEOUT_S``.

A worker process that dies (killed by a signal, or exiting non-zero) is logged with how it exited
and restarted after a wait that starts at ``HSX_WORKER_RESTART_DELAY_S`` (1 s) and doubles with
each restart of that process within ``HSX_WORKER_RESTART_WINDOW_S`` (600 s), up to
``HSX_WORKER_RESTART_MAX_DELAY_S`` (60 s). One death more than ``HSX_WORKER_RESTART_LIMIT`` (5)
within the window and the launcher gives up: it stops the other workers (warm shutdown) and
exits 1, so that whatever supervises it (docker's restart policy, systemd, ``producer run``) sees
the failure. A worker that exits 0 was asked to stop (a SIGTERM sent to it, ``celery control
shutdown``): it is not restarted.

A worker process with ``HSX_MODEL`` is said ready once its target is loaded and warmed up (logged,
and a line of ``--events``, with what the load and the warm-up took: :func:`write_ready`).

A worker process that dies is also marked on the broker: every claim its presence listed goes
back to the head of the queue at once, then its presence says ``stopped`` (``workers/lease.py``,
"A death the launcher saw"), so a crashed or OOM-killed GPU worker's batch runs again within seconds.

Ctrl-C or SIGTERM is passed on as SIGTERM (Celery's warm shutdown: the running batch finishes,
its marker is written, unstarted tasks stay in the queue) and cancels pending restarts; a second
signal, or a grace period running out, kills what is left. Child processes are started with
fork+exec, never by forking after CUDA is initialised.

No worker outlives its launcher: each child gets SIGTERM (a warm shutdown) when the launcher dies,
however it dies, SIGKILL included (Linux ``PR_SET_PDEATHSIG``, :func:`die_with_parent`), and a
crash of the launcher's own loop stops its workers (SIGTERM, then SIGKILL after the grace period)
before the launcher exits with the error.

Several launchers may run on one host: each worker's Celery node name (``cpu0@host``) is unique
among the launchers of the host that use the same broker (:class:`HostLocks`): the first takes
``cpu0``, the next ``cpu0-1``, and so on, so that ``celery inspect`` and ``status`` tell them apart.
A GPU that another launcher of the host already pins is warned about, naming that launcher's pid
(both would load the model on it); CPU workers share the host freely.

A worker of a group (``HSX_GPUS_PER_WORKER`` > 1) starts its own K-1 follower ranks
(``workers/group.py``); when one of them dies, the worker fails the batches it holds as
transient and exits with code 75, and is restarted here, group and all, like any other death.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from hsx.cliparse import Parser
from hsx.errors import BadConfig
from hsx.processes import describe_exit, pid_alive
from settings import Settings, get_settings
from workers.heartbeat import BEAT_SUFFIX, RUNS_DIR_ENV
from workers.heartbeat import runs_dir as listed_runs_dir

log = logging.getLogger("workers.launcher")

#: seconds between two looks at the children (exits, restarts due, the parent, the grace period).
POLL_S = 0.2
#: seconds the launcher waits at exit for the status records of dead workers to be marked.
MARK_TIMEOUT_S = 30.0

NO_BROKER = (
    "HSX_BROKER_URL is not set: python -m workers needs the broker the producer enqueues into; "
    "fix: export HSX_BROKER_URL=redis://:PASSWORD@HOST:6379/0 (on one machine, 'python -m producer run' "
    "starts a broker and its own workers)"
)


def visible_gpus(env: dict[str, str]) -> list[str]:
    """GPU ids this node offers: CUDA_VISIBLE_DEVICES if set, else every device NVML / torch sees."""
    given = env.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        return [g for g in given.split(",") if g.strip() not in ("", "-1")]
    try:
        import pynvml

        pynvml.nvmlInit()
        return [str(i) for i in range(pynvml.nvmlDeviceGetCount())]
    except Exception:
        pass
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    except Exception:
        return []


def worker_command(settings: Settings, name: str, loglevel: str) -> list[str]:
    """The ``celery worker`` command line of one worker process (node name ``<name>@<host>``)."""
    return [
        sys.executable, "-m", "celery", "-A", "workers", "worker",
        "-Q", settings.queue,
        "-P", "threads", "-c", str(settings.task_threads),
        "-n", f"{name}@{socket.gethostname()}",
        "-l", loglevel,
        "-E",
        "--without-gossip", "--without-mingle",
    ]


def check_broker(url: str, timeout_s: float) -> None:
    """PING the broker at ``url`` until it answers or ``timeout_s`` seconds have passed.

    Connection refused or timed out is tried again (a broker started at the same moment, as
    ``docker compose up`` does, answers within a few seconds); a refused password is not.

    Raises:
        BadConfig: no answer within ``timeout_s``, or the broker refused us; the message names the
            URL with its password masked (``hsx.store.mask_url``) and the fix.
    """
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from hsx.store import mask_url

    shown = mask_url(url)
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while True:
        left = max(deadline - time.monotonic(), 0.1)
        opts = {"socket_connect_timeout": left, "socket_timeout": left, "retry": Retry(NoBackoff(), 0)}
        try:
            if url.startswith("redis+socket://"):
                client = redis.Redis(unix_socket_path=url[len("redis+socket://"):].split("?", 1)[0], **opts)
            else:
                client = redis.Redis.from_url(url, **opts)
            try:
                client.ping()
                return
            finally:
                client.close()
        except (redis.AuthenticationError, redis.ResponseError) as exc:  # a retry cannot fix a refused password
            raise BadConfig(
                f"broker {shown} (HSX_BROKER_URL) refused us: {_scrub(exc, url)}; "
                "fix: put the broker's password in HSX_BROKER_URL (redis://:PASSWORD@HOST:PORT/DB)"
            ) from None
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            last = exc
        except redis.RedisError as exc:  # something answers there, but not a Redis server
            raise BadConfig(
                f"broker {shown} (HSX_BROKER_URL) answers, but not as a Redis server "
                f"({exc.__class__.__name__}: {_scrub(exc, url)}); fix: point HSX_BROKER_URL at the Redis/Valkey port"
            ) from None
        if time.monotonic() >= deadline:
            raise BadConfig(
                f"broker {shown} (HSX_BROKER_URL) does not answer within {timeout_s:g} s "
                f"({last.__class__.__name__}: {_scrub(last, url)}); no worker was started; fix: start the broker, "
                "or correct HSX_BROKER_URL's host and port (HSX_BROKER_CHECK_TIMEOUT_S sets the wait)"
            )
        time.sleep(min(0.2, max(deadline - time.monotonic(), 0)))


def _scrub(exc: Exception, url: str) -> str:
    """``exc``'s text with the URL's password, should a client library ever echo it, replaced."""
    from urllib.parse import urlsplit

    text = str(exc)
    try:
        password = urlsplit(url).password
    except ValueError:
        password = None
    return text.replace(password, "***") if password else text


def meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in bytes (``MemTotal``, ``MemAvailable``, ...); {} where there is none."""
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                parts = value.split()
                if parts and parts[0].isdigit():
                    out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except OSError:
        pass
    return out


def checkpoint_bytes(settings: Settings) -> int | None:
    """Bytes of the files of ``HSX_MODEL``'s local checkpoint (``hsx.models.checkpoint_files``);
    None for a hub id not on this machine, or no model set. Reads no weight bytes."""
    from hsx.models import checkpoint_files, resolve_model_path

    if not settings.model:
        return None
    try:
        path = Path(resolve_model_path(settings.model, settings.cache_dir))
        if not path.is_dir():
            return None
        return sum(f.stat().st_size for f in checkpoint_files(path)) or None
    except Exception:  # a cause is a hint: never let it stop the launcher
        return None


#: Name of the file a worker process writes in HSX_WORKER_RUNS_DIR once its model is loaded
#: (``workers/app.py``): a death before it happened while loading.
READY_SUFFIX = ".ready"


def write_ready(stem: Path, target) -> None:
    """Write ``<stem>.ready`` (``<runs dir>/<pid>``) once the worker's target is loaded and warmed up:
    its existence tells a death while loading from one while serving (:func:`describe_death`), and
    its JSON (:func:`ready_fields` of ``target``, a ``workers.target.Target``) is what the launcher
    says of the start. Written whole, then renamed, so the launcher never reads half of it.

    Raises:
        OSError: the runs directory cannot be written.
    """
    tmp = stem.with_name(stem.name + READY_SUFFIX + ".tmp")
    tmp.write_text(json.dumps(ready_fields(target)))
    os.replace(tmp, stem.with_name(stem.name + READY_SUFFIX))


def ready_fields(target) -> dict:
    """What a worker's start took, for its ready event: ``load_s`` and ``warmup_s`` (seconds, one
    decimal), ``device``, and ``kernels``: ``"from the store"`` when the warm-up unpacked the store's
    compile cache (``workers/compile_cache.py``), ``"compiled, stored"`` when it compiled them and
    stored the cache, ``"compiled"`` otherwise (no cache, the CPU), None when unknown."""
    cache = getattr(target, "compile_cache", None) or {}
    kernels = ("from the store" if cache.get("restored") else "compiled, stored" if cache.get("saved")
               else "compiled" if getattr(target, "device", None) is not None and target.device.type == "cuda" else None)
    return {"load_s": round(float(target.load_s), 1), "warmup_s": round(float(target.warmup_s), 1),
            "device": str(target.device), "kernels": kernels}


def read_ready(path: Path) -> dict:
    """The fields a worker wrote in its ready file (:func:`write_ready`); {} for an empty or unreadable
    one (a worker of an earlier version touched it empty)."""
    try:
        fields = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return fields if isinstance(fields, dict) else {}


def describe_death(returncode: int, loaded: bool, settings: Settings, memory: dict[str, int] | None = None) -> str:
    """How a worker process died, when, and its likely cause: ``killed by SIGKILL while loading the
    model: likely the kernel's OOM killer: its checkpoint (80.0 GB) is more than the host's available
    memory (41.2 GB of 125.8 GB, /proc/meminfo); ...``.

    ``loaded``: the process had written its ready file. ``memory``: ``/proc/meminfo`` (default:
    read now; after the kill, what the dead process held is free again). A SIGKILL is compared
    with the checkpoint's size; other endings say only how and when.
    """
    how = describe_exit(returncode).split(" (")[0]
    phase = "while serving" if loaded else "while loading the model"
    if returncode != -signal.SIGKILL:
        return f"{how} {phase}"
    memory = meminfo() if memory is None else memory
    size, avail, total = checkpoint_bytes(settings), memory.get("MemAvailable"), memory.get("MemTotal")
    gb = lambda n: f"{n / 1e9:.1f} GB"  # noqa: E731
    if size and avail is not None and total and not loaded:
        if size >= avail:
            cause = (f"likely the kernel's OOM killer: its checkpoint ({gb(size)}) is more than the host's available "
                     f"memory ({gb(avail)} of {gb(total)}, /proc/meminfo MemAvailable); free host memory, start fewer "
                     "workers on this host (HSX_WORKERS_PER_NODE), or see `dmesg | grep -i oom`")
        else:
            cause = (f"by the kernel's OOM killer, a person or a supervisor: its checkpoint ({gb(size)}) is less than the "
                     f"host's available memory now ({gb(avail)} of {gb(total)}, /proc/meminfo MemAvailable), so look at "
                     "`dmesg | grep -i oom` and at what else runs on this host")
    else:
        cause = "sent by a person, a supervisor or the kernel's OOM killer: see `dmesg | grep -i oom`"
        if avail is not None and total:
            cause += f" (host memory available now: {gb(avail)} of {gb(total)})"
    return f"{how} {phase}: {cause}"


def mark_dead_worker(runs_file: Path, host: str, pid: int, how: str, settings: Settings) -> list[str]:
    """Mark the status records of worker process ``pid`` on ``host``, which died, as ``stopped``.

    A worker killed outright cannot write its last record (``workers/heartbeat.py``), which would
    then say ``working`` until someone looked at its age. ``runs_file`` lists the addresses of the
    runs the process wrote records in (one a line, ``<HSX_WORKER_RUNS_DIR>/<pid>.runs``); each
    ``<run>/workers/<host>-<pid>.json`` not already ``stopped`` gets ``state: "stopped"``, no
    batches, ``exit`` (how it ended, e.g. ``killed by SIGKILL``), ``exited_at`` (UTC ISO 8601) and
    ``abandoned`` (the batches it listed); ``updated_at`` keeps the time of its last heartbeat. With
    a broker URL in ``settings``, every claim the process held (the abandoned batches, and the tasks
    its broker presence lists, a prefetched one included) is then put back at the head of the queue
    and its presence marked ``stopped`` (``workers/lease.py``, "A death the launcher saw"), also when
    it had served no run yet (no ``runs_file``). Best effort: a store or broker that fails is logged,
    and the other workers' reclaimers take those batches later. The file is removed. Returns the
    addresses whose record was marked.
    """
    from hsx.layout import worker_key
    from hsx.records import WorkerStatus
    from hsx.store import mask_url, open_store

    try:
        urls = list(dict.fromkeys(line.strip() for line in runs_file.read_text().splitlines() if line.strip()))
    except FileNotFoundError:  # it served no run yet; its presence may still list a task it received
        urls = []
    marked = []
    abandoned_of: dict[str, list[str]] = {}
    name = f"{host}-{pid}"
    key = worker_key(name)
    for url in urls:
        try:
            store = open_store(url, settings, create=False)
            record = WorkerStatus.read(store, name)
            if record is None:
                raise FileNotFoundError(f"no {key}")
            if record.state == "stopped":
                continue
            abandoned = [lease.batch for lease in record.batches]
            record.model_copy(update=dict(
                state="stopped", batches=[], paused_reason=None, paused_since=None, exit=how, abandoned=abandoned,
                exited_at=datetime.now(timezone.utc).isoformat(timespec="seconds"))).write(store)
            marked.append(url)
        except Exception as exc:  # the store may be down, or the record never written: nothing to correct
            log.warning("status record %s of dead worker pid %d in %s not marked stopped: %s: %s",
                        key, pid, mask_url(url), exc.__class__.__name__, exc)
            continue
        if abandoned:
            abandoned_of[url] = abandoned
    if settings.broker_url:
        _reclaim_dead(name, abandoned_of, settings)
    runs_file.unlink(missing_ok=True)
    return marked


def _reclaim_dead(dead: str, batches: dict[str, list[str]], settings: Settings) -> None:
    """Put back now every claim worker ``dead`` held (those its broker presence lists, and
    ``batches``: ``{run address: [batch]}`` from its status records), then mark its presence
    ``stopped`` (``Reclaimer.reclaim_dead``), and a few seconds later the claims nobody lists (delivered
    to it just before it died); a failure only leaves them to the other workers' reclaimers."""
    from hsx.store import mask_url
    from workers.lease import Reclaimer, unlisted_confirm_s

    try:
        # the claims nobody lists are looked at again a few seconds on: those it died before listing
        done = Reclaimer(settings, settings.broker_url, me=f"{socket.gethostname()}-{os.getpid()}").reclaim_dead(
            dead, batches, confirm_unlisted_s=unlisted_confirm_s(settings))
    except Exception as exc:
        log.warning("claims of dead worker %s left to the other workers' reclaimers: %s: %s", dead,
                    exc.__class__.__name__, exc)
        return
    by_run: dict[str, list[str]] = {}
    for r in done:
        by_run.setdefault(r["run_url"], []).append(r["batch"])
    for url, bs in by_run.items():
        log.warning("worker %s died holding %s of %s: put back at the head of the queue", dead, ", ".join(bs),
                    mask_url(url))


#: ``prctl`` option that sends a signal to a process when its parent dies (linux/prctl.h).
PR_SET_PDEATHSIG = 1


def die_with_parent():
    """A ``preexec_fn`` that makes the child get SIGTERM (Celery's warm shutdown) when this launcher
    dies, however it dies (SIGKILL included): Linux ``prctl(PR_SET_PDEATHSIG)``. None where there
    is no ``prctl`` (not Linux), and the launcher's own checks are all there is.

    The signal follows the death of the thread that started the child: the launcher starts its
    children from its main thread."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    # Everything the child runs between fork and exec is made here, in the parent.
    args = (ctypes.c_int(PR_SET_PDEATHSIG), ctypes.c_ulong(int(signal.SIGTERM)), ctypes.c_ulong(0),
            ctypes.c_ulong(0), ctypes.c_ulong(0))
    parent = os.getpid()

    def preexec() -> None:
        prctl(*args)
        if os.getppid() != parent:  # the launcher died before the prctl: no signal would ever come
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


@dataclass(frozen=True)
class RestartPolicy:
    """When a dead worker process is started again (see the module doc and settings.py).

    ``delay_s`` (seconds) doubles with each restart of the same process counted in the last
    ``window_s`` seconds, up to ``max_delay_s``; a death when ``limit`` restarts are already
    counted ends the launcher (exit 1).
    """

    delay_s: float = 1.0
    max_delay_s: float = 60.0
    limit: int = 5
    window_s: float = 600.0

    @classmethod
    def from_settings(cls, settings: Settings) -> "RestartPolicy":
        return cls(settings.worker_restart_delay_s, settings.worker_restart_max_delay_s,
                   settings.worker_restart_limit, settings.worker_restart_window_s)

    def delay(self, recent_restarts: int) -> float:
        """Seconds to wait before the restart that follows ``recent_restarts`` restarts in the window."""
        return min(self.delay_s * 2.0 ** min(recent_restarts, 64), self.max_delay_s)


@dataclass
class WorkerSlot:
    """One worker process the launcher keeps running: its name, environment, and restart history."""

    name: str
    env: dict[str, str]
    cmd: list[str]
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    restarts: deque = field(default_factory=deque)
    """monotonic times of the deaths that were followed by a restart, oldest first."""
    restart_at: float | None = None
    terminated: bool = False
    """SIGTERM sent to the current process (sent once: Celery's warm shutdown needs it once)."""
    ready_said: bool = False
    """The current process's ready event was written (its ready file seen)."""
    gpus: tuple[str, ...] = ()
    """The GPU ids it is pinned to (its CUDA_VISIBLE_DEVICES); () for a CPU worker."""
    keep_fds: tuple[int, ...] = ()
    """Lock files it inherits (:class:`HostLocks`): its name and GPUs stay taken while it lives."""
    hung_s: float | None = None
    """Seconds without a beat after which this launcher killed the current process (None: it did not)."""

    def start(self) -> None:
        """Start the process. Raises OSError when it cannot be started (fork or exec failed)."""
        self.restart_at = None
        self.terminated = False
        self.ready_said = False
        self.hung_s = None
        self.proc = subprocess.Popen(self.cmd, env=self.env, preexec_fn=die_with_parent(), pass_fds=self.keep_fds)
        self.started_at = time.monotonic()

    def terminate(self) -> None:
        if self.alive() and not self.terminated:
            self.proc.send_signal(signal.SIGTERM)
            self.terminated = True

    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None


def gpu_groups(gpus: list[str], per_worker: int) -> list[list[str]]:
    """The visible GPUs as consecutive groups of ``per_worker`` (``HSX_GPUS_PER_WORKER``), in order.

    Consecutive ids share a switch or an NVLink island on most nodes, and the order is the one
    CUDA_VISIBLE_DEVICES gives. ``per_worker`` 1: one group per GPU.

    Raises:
        BadConfig: ``per_worker`` > 1 with no GPU visible, or the GPUs' count is not a multiple
            of it; the message names both values, the rule and the fix.
    """
    if per_worker == 1:
        return [[g] for g in gpus]
    if not gpus:
        raise BadConfig(f"HSX_GPUS_PER_WORKER={per_worker}: a worker of {per_worker} GPUs needs GPUs, and none is visible "
                        "(no CUDA device, or CUDA_VISIBLE_DEVICES is empty); fix: HSX_GPUS_PER_WORKER=1, or set "
                        f"HSX_DEVICE=cpu explicitly for a group of {per_worker} gloo ranks on the CPU (tests, no GPU)")
    if len(gpus) % per_worker:
        fits = [k for k in range(1, len(gpus) + 1) if len(gpus) % k == 0]
        raise BadConfig(
            f"HSX_GPUS_PER_WORKER={per_worker} does not divide the {len(gpus)} visible GPUs ({','.join(gpus)}): each worker "
            f"takes {per_worker} GPUs and none may be left over; fix: HSX_GPUS_PER_WORKER={' or '.join(map(str, fits))}, "
            f"or set CUDA_VISIBLE_DEVICES to a multiple of {per_worker} GPUs")
    return [gpus[i:i + per_worker] for i in range(0, len(gpus), per_worker)]


def plan_slots(settings: Settings, env: dict[str, str], count: int | None, loglevel: str) -> tuple[list[WorkerSlot], list[str]]:
    """The worker processes to run and the GPUs: one per group of ``HSX_GPUS_PER_WORKER`` visible GPUs
    (:func:`gpu_groups`; one per GPU by default) unless ``count`` / HSX_WORKERS_PER_NODE.

    A worker of one GPU is named ``gpu<id>``, a worker of a group ``gpu<first id>x<K>``
    (``gpu4x2`` holds GPUs 4 and 5); each child's CUDA_VISIBLE_DEVICES is its group and its
    HSX_GPUS_PER_WORKER the group size. With ``HSX_DEVICE=cpu`` set explicitly, a K > 1 makes
    CPU workers of K gloo ranks each (``cpu0x2``; ``workers/group.py``).

    Raises:
        BadConfig: from :func:`gpu_groups`.
    """
    per_worker = settings.gpus_per_worker
    if settings.device == "cpu":  # set explicitly: CPU workers, of K gloo ranks each when K > 1
        gpus = []  # and no look for GPUs (without NVML that imports torch: ~2 CPU s of the launcher's start)
        groups = []
    else:
        gpus = visible_gpus(env)
        groups = gpu_groups(gpus, per_worker)
    n = count or settings.workers_per_node or max(1, len(groups))
    slots = []
    for i in range(n):
        child_env = dict(env)
        if groups:
            group = groups[i % len(groups)]
            child_env["CUDA_VISIBLE_DEVICES"] = ",".join(group)
            child_env["HSX_GPUS_PER_WORKER"] = str(per_worker)
            name = f"gpu{group[0]}" + (f"x{per_worker}" if per_worker > 1 else "") + (f"-{i // len(groups)}" if n > len(groups) else "")
        else:
            name = f"cpu{i}" + (f"x{per_worker}" if per_worker > 1 else "")
            if per_worker > 1:
                child_env["HSX_GPUS_PER_WORKER"] = str(per_worker)
        slots.append(WorkerSlot(name, child_env, worker_command(settings, name, loglevel),
                                gpus=tuple(groups[i % len(groups)]) if groups else ()))
    return slots, gpus


def locks_dir() -> Path:
    """The directory of this host's launcher locks (:class:`HostLocks`), one per user:
    ``<temp dir>/hsx-<uid>/launchers`` (the temp dir is ``TMPDIR``'s, else ``/tmp``).

    Raises:
        OSError: it cannot be created.
    """
    path = Path(tempfile.gettempdir()) / f"hsx-{os.getuid()}" / "launchers"
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


class HostLocks:
    """The host-local locks of one launcher: its workers' Celery node names and the GPUs it pins.

    A lock is ``flock`` on a file of :func:`locks_dir` that holds ``{"pid", "worker"}``. The kernel
    releases it when every process holding the file open is gone: the launcher and the children it
    passes it to (:attr:`WorkerSlot.keep_fds`), so a worker of a killed launcher that is still
    finishing its batch keeps its name and GPU taken. No file is ever stale: a lock held by nobody
    is free.

    A node name is locked per broker (``broker_url``, password left out) and host name: Celery
    names clash only among the workers of one broker, so launchers on other brokers (each
    ``producer run`` has its own) keep ``cpu0``. A GPU is marked per launcher (one file each, named
    by its pid), so that every launcher sees every other that uses it.
    """

    #: suffixes tried after a name that is taken: ``cpu0-1`` ... ``cpu0-999``.
    MAX_SUFFIX = 999

    def __init__(self, broker_url: str | None, directory: Path | None = None):
        from hsx.storeurl import mask_url

        self.dir = directory or locks_dir()
        self.broker = hashlib.sha256(f"{socket.gethostname()} {mask_url(broker_url or '')}".encode()).hexdigest()[:12]
        self.fds: dict[int, Path] = {}
        """Every lock held: fd -> its file."""
        self._gpu_fds: dict[str, int] = {}

    def node_name(self, name: str) -> tuple[str, int, dict | None]:
        """The first of ``name``, ``name-1``, ``name-2``... that no other launcher of this host and
        broker holds, locked: ``(name, lock fd, the holder of name, or None when it was free)``.

        Raises:
            BadConfig: every suffix up to :attr:`MAX_SUFFIX` is taken.
        """
        first_holder = None
        k = 0
        while k <= self.MAX_SUFFIX:
            candidate = name if k == 0 else f"{name}-{k}"
            path = self.dir / f"node.{self.broker}.{candidate}.lock"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            if _lock(fd):
                if not _same_file(fd, path):  # its holder removed it as it let go: take the path anew
                    os.close(fd)
                    continue
                _say(fd, candidate)
                self.fds[fd] = path
                return candidate, fd, first_holder
            if k == 0:
                first_holder = _holder(fd)
            os.close(fd)
            k += 1
        raise BadConfig(f"worker names {name} to {name}-{self.MAX_SUFFIX} are all taken on this host by other launchers "
                        f"of the same broker (lock files in {self.dir}); fix: stop some of them")

    def pin_gpu(self, gpu: str, worker: str) -> tuple[int, list[dict]]:
        """Mark GPU ``gpu`` as used by this launcher (once, whatever the number of its workers on it):
        ``(lock fd, the other launchers of this host that use it: [{"pid", "worker"}])``."""
        if gpu in self._gpu_fds:
            return self._gpu_fds[gpu], []
        prefix = f"gpu.{re.sub(r'[^A-Za-z0-9-]', '_', gpu)}."
        others = []
        for path in sorted(self.dir.glob(prefix + "*.lock")):
            try:
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:  # removed by another launcher's look
                continue
            try:
                if not _lock(fd):
                    others.append(_holder(fd))
                elif _same_file(fd, path):
                    path.unlink()  # its launcher and workers are gone
            finally:
                os.close(fd)
        while True:  # a file of its own (never one a dead launcher left): every launcher that uses the GPU is seen
            path = self.dir / f"{prefix}{os.getpid()}-{os.urandom(4).hex()}.lock"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            if _lock(fd) and _same_file(fd, path):  # not removed by another's look before the lock
                break
            os.close(fd)
        _say(fd, worker)
        self.fds[fd] = path
        self._gpu_fds[gpu] = fd
        return fd, others

    def sweep(self) -> None:
        """Remove the node-name files nobody holds (a launcher killed outright leaves its own)."""
        for path in self.dir.glob("node.*.lock"):
            try:
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                if _lock(fd) and _same_file(fd, path):
                    path.unlink()
            finally:
                os.close(fd)

    def close(self) -> None:
        """Let go of every lock and remove its file (called once the workers are gone): a name of a
        broker that is gone leaves no file behind. Another launcher that opened the file meanwhile
        sees that it was removed (:func:`_same_file`) and takes the path anew."""
        for fd, path in self.fds.items():
            try:
                if _same_file(fd, path):
                    path.unlink()
            except OSError:
                pass
            os.close(fd)
        self.fds.clear()
        self._gpu_fds.clear()


def _lock(fd: int) -> bool:
    """Take ``fd``'s exclusive lock if nobody holds it; False when somebody does."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (not removed, nor made anew, since)."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def _say(fd: int, worker: str) -> None:
    """Write who holds the lock of ``fd``: this launcher's pid and the worker name."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"pid": os.getpid(), "worker": worker}).encode(), 0)


def _holder(fd: int) -> dict:
    """Who holds the lock of ``fd`` (:func:`_say`); ``{}`` when it has not said yet."""
    try:
        fields = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return fields if isinstance(fields, dict) else {}


def claim_host_locks(slots: list[WorkerSlot], locks: HostLocks, settings: Settings, loglevel: str) -> None:
    """Give each of ``slots`` a node name no other launcher of this host and broker holds (renaming
    ``cpu0`` to ``cpu0-1`` when it is taken, said at INFO), and warn about each GPU another launcher
    of this host already pins. The slots' ``keep_fds`` get their locks.

    Raises:
        BadConfig: from :meth:`HostLocks.node_name`.
    """
    host = socket.gethostname()
    warned: set[str] = set()
    locks.sweep()
    for slot in slots:
        name, fd, holder = locks.node_name(slot.name)
        if name != slot.name:
            log.info("worker name %s@%s is taken on this host by launcher pid %s (same broker): this one is %s@%s",
                     slot.name, host, (holder or {}).get("pid", "?"), name, host)
            slot.name, slot.cmd = name, worker_command(settings, name, loglevel)
        fds = [fd]
        for gpu in slot.gpus:
            gpu_fd, others = locks.pin_gpu(gpu, name)
            fds.append(gpu_fd)
            if others and gpu not in warned:
                warned.add(gpu)
                who = ", ".join(f"launcher pid {o.get('pid', '?')} (its worker {o.get('worker', '?')})" for o in others)
                log.warning("GPU %s is already used by another launcher on this host: %s; worker %s loads a model on it "
                            "too, and the two share its memory and compute (out of memory, or each at half speed); fix: "
                            "stop the other launcher, or give each its own GPUs (CUDA_VISIBLE_DEVICES)", gpu, who, name)
        slot.keep_fds = tuple(fds)


def launch(settings: Settings, *, count: int | None = None, loglevel: str = "INFO", grace_s: float = 600.0,
           exit_with_parent: int | None = None, policy: RestartPolicy | None = None, events: Path | None = None) -> int:
    """Start the workers and keep them running until a signal arrives or they exit; returns an exit code.

    Returns 0 after a requested stop (a signal, the parent gone) or when every worker exited 0 by
    itself; 1 when a worker died more often than ``policy`` allows (the others are stopped first).

    ``exit_with_parent``: a pid (``producer run``'s); when that process is gone, the workers are
    stopped as on SIGTERM (warm shutdown), so that a killed ``run`` leaves no worker behind.

    ``events``: a file that gets one JSON line per worker death, as it is seen (``producer run``
    prints them): ``worker``, ``pid``, ``host``, ``exit`` (:func:`describe_death`), ``ran_s``,
    ``action`` (``restart``, ``gave_up``, ``not_restarted`` or ``stopping``), ``restart_in_s``,
    ``restarts``, ``limit``, ``window_s``, ``at`` (UTC ISO 8601). With ``HSX_MODEL`` set, also one line
    per worker process whose target is loaded and warmed up: ``action`` ``ready``, ``worker``, ``pid``,
    ``host``, ``ran_s`` (since its start), ``load_s``, ``warmup_s``, ``device``, ``kernels``
    (:func:`ready_fields`), ``at``.
    """
    policy = policy or RestartPolicy.from_settings(settings)
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="hsx-worker-runs-") as own_dir:
        runs_dir = listed_runs_dir() or Path(own_dir)
        env[RUNS_DIR_ENV] = str(runs_dir)
        return _supervise(settings, env, runs_dir, count, loglevel, grace_s, exit_with_parent, policy, events)


def _supervise(settings: Settings, env: dict[str, str], runs_dir: Path, count: int | None, loglevel: str, grace_s: float,
               exit_with_parent: int | None, policy: RestartPolicy, events: Path | None = None) -> int:
    """The body of :func:`launch`: start the children, then watch them until none is left."""
    def event(slot: WorkerSlot, pid: int | None, how: str, ran_s: float, action: str, restart_in_s: float | None) -> None:
        if events is None:
            return
        line = {"worker": slot.name, "pid": pid, "host": socket.gethostname(), "exit": how, "ran_s": round(ran_s, 1),
                "action": action, "restart_in_s": restart_in_s, "restarts": len(slot.restarts), "limit": policy.limit,
                "window_s": policy.window_s, "at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        try:
            with open(events, "a") as f:
                f.write(json.dumps(line) + "\n")
        except OSError as exc:
            log.warning("death of worker %s not written to %s: %s", slot.name, events, exc)

    def ready(slot: WorkerSlot, now: float) -> None:
        """Say (log, and an event line with ``action: ready``) a worker whose target is loaded and warmed up."""
        slot.ready_said = True
        pid = slot.proc.pid
        fields = read_ready(runs_dir / f"{pid}{READY_SUFFIX}")
        ran_s = round(now - slot.started_at, 1)
        log.info("worker %s (pid %d) ready after %.1f s%s", slot.name, pid, ran_s,
                 f" (target loaded in {fields['load_s']} s, warm-up {fields['warmup_s']} s)" if "load_s" in fields else "")
        if events is None:
            return
        line = {"worker": slot.name, "pid": pid, "host": socket.gethostname(), "action": "ready", "ran_s": ran_s,
                **{k: fields.get(k) for k in ("load_s", "warmup_s", "device", "kernels")},
                "at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        try:
            with open(events, "a") as f:
                f.write(json.dumps(line) + "\n")
        except OSError as exc:
            log.warning("ready event of worker %s not written to %s: %s", slot.name, events, exc)

    marking: list[threading.Thread] = []
    slots, gpus = plan_slots(settings, env, count, loglevel)
    locks = None
    try:
        locks = HostLocks(settings.broker_url)
        claim_host_locks(slots, locks, settings, loglevel)
    except OSError as exc:  # no temp dir to lock in: names as planned (they may clash with another launcher's)
        log.warning("worker names and GPUs not checked against other launchers of this host: %s", exc)
    state = {"stopping_at": None, "signals": 0, "gave_up": False}
    was_parent = exit_with_parent == os.getppid()

    def stop() -> None:
        if state["stopping_at"] is None:
            state["stopping_at"] = time.monotonic()
        for s in slots:
            s.restart_at = None  # a stop cancels pending restarts
            s.terminate()

    def kill_all() -> None:
        for s in slots:
            if s.alive():
                s.proc.kill()

    def on_signal(signum, _frame):
        state["signals"] += 1
        if state["signals"] == 1:
            stop()
        else:  # second signal: do not wait any longer
            kill_all()

    def exited(slot: WorkerSlot, now: float) -> None:
        proc, slot.proc = slot.proc, None
        ready = runs_dir / f"{proc.pid}{READY_SUFFIX}"
        if slot.hung_s is not None:
            how = (f"killed by this launcher: no heartbeat for {slot.hung_s:.0f} s (HSX_LEASE_S {settings.lease_s:g}), "
                   "hung: stopped (SIGSTOP), or stuck where its heartbeat thread cannot run")
        else:
            how = describe_exit(proc.returncode) if proc.returncode == 0 else describe_death(proc.returncode, ready.exists() or not settings.model, settings)
        ready.unlink(missing_ok=True)
        (runs_dir / f"{proc.pid}{BEAT_SUFFIX}").unlink(missing_ok=True)
        if proc.returncode != 0:  # it could not write its last status record: write it for it (store I/O: a thread)
            t = threading.Thread(target=mark_dead_worker, name=f"mark-{proc.pid}", daemon=True,
                                 args=(runs_dir / f"{proc.pid}.runs", socket.gethostname(), proc.pid, how, settings))
            t.start()
            marking.append(t)
        ended(slot, f"worker {slot.name} (pid {proc.pid})", how, proc.returncode, now - slot.started_at, now, proc.pid)

    def ended(slot: WorkerSlot, who: str, how: str, returncode: int, ran_s: float, now: float, pid: int | None = None) -> None:
        """Log how the process ended and decide: nothing (a stop, exit 0), a restart, or giving up."""
        if state["stopping_at"] is not None:
            log.info("%s %s while stopping", who, how)
            if returncode != 0:
                event(slot, pid, how, ran_s, "stopping", None)
            return
        if returncode == 0:
            log.warning("%s %s after %.1f s without this launcher asking it to (a SIGTERM sent to it, "
                        "'celery control shutdown'): not restarted", who, how, ran_s)
            return
        while slot.restarts and slot.restarts[0] <= now - policy.window_s:
            slot.restarts.popleft()
        if len(slot.restarts) >= policy.limit:
            log.error("%s %s after %.1f s; giving up: %d restart(s) of it within %g s already "
                      "(HSX_WORKER_RESTART_LIMIT=%d, HSX_WORKER_RESTART_WINDOW_S=%g); stopping the other workers",
                      who, how, ran_s, len(slot.restarts), policy.window_s, policy.limit, policy.window_s)
            state["gave_up"] = True
            event(slot, pid, how, ran_s, "gave_up", None)
            stop()
            return
        delay_s = policy.delay(len(slot.restarts))
        slot.restarts.append(now)
        slot.restart_at = now + delay_s
        log.warning("%s %s after %.1f s; restarting it in %g s (restart %d of at most %d within %g s)",
                    who, how, ran_s, delay_s, len(slot.restarts), policy.limit, policy.window_s)
        event(slot, pid, how, ran_s, "restart", delay_s)

    signal.signal(signal.SIGINT, on_signal)  # before the first child: a signal now stops what was started
    signal.signal(signal.SIGTERM, on_signal)
    def start(slot: WorkerSlot, now: float) -> None:
        try:
            slot.start()
        except OSError as exc:  # fork or exec failed (memory, process limit): a death like any other
            slot.proc = None
            ended(slot, f"worker {slot.name}", f"could not be started ({exc})", -1, 0.0, now)

    try:
        for slot in slots:
            if state["stopping_at"] is None:
                start(slot, time.monotonic())
        log.info("started %d worker process(es) on %s: %s", sum(s.alive() for s in slots),
                 "GPUs " + ",".join(gpus) if gpus else "CPU", ", ".join(f"{s.name} (pid {s.proc.pid})" for s in slots if s.proc))
        while True:
            now = time.monotonic()
            for slot in slots:
                # Poll every child each time (reaping it), not only until the first live one.
                if slot.proc is not None and slot.proc.poll() is not None:
                    exited(slot, now)
                elif (slot.proc is not None and not slot.ready_said and settings.model
                      and (runs_dir / f"{slot.proc.pid}{READY_SUFFIX}").exists()):
                    ready(slot, now)
                elif slot.proc is not None and slot.hung_s is None and state["stopping_at"] is None:
                    silent_s = beat_age_s(runs_dir, slot.proc.pid)
                    if silent_s is not None and silent_s > settings.lease_s:
                        # Alive but silent past its lease: the fleet counts it lost, and with no other
                        # worker its batches would wait for it for ever. Killed, it is restarted and its
                        # batches put back as for any death.
                        slot.hung_s = silent_s
                        log.error("worker %s (pid %d) wrote no heartbeat for %.0f s (HSX_LEASE_S %g): hung; killing it",
                                  slot.name, slot.proc.pid, silent_s, settings.lease_s)
                        slot.proc.kill()
                if slot.restart_at is not None and now >= slot.restart_at and state["stopping_at"] is None:
                    start(slot, now)
                    if slot.proc is not None:
                        log.info("worker %s restarted (pid %d)", slot.name, slot.proc.pid)
                if state["stopping_at"] is not None:
                    slot.terminate()  # one started while the stop came in (a signal lands between any two lines)
            if not any(s.alive() or s.restart_at is not None for s in slots):
                break
            if exit_with_parent and state["stopping_at"] is None and not _alive(exit_with_parent, was_parent):
                log.warning("the process that started us (pid %d) is gone; stopping", exit_with_parent)
                stop()
            if state["stopping_at"] is not None and time.monotonic() - state["stopping_at"] > grace_s:
                kill_all()
            time.sleep(POLL_S)
    except BaseException as exc:
        # A bug in this loop (or a signal handler's) must not leave the workers running with
        # nobody to restart or stop them: stop them as on SIGTERM, then fail loudly.
        log.error("the launcher's loop crashed (%s: %s): stopping its workers", exc.__class__.__name__, exc,
                  exc_info=not isinstance(exc, (KeyboardInterrupt, SystemExit)))
        stop_children(slots, grace_s)
        raise
    for t in marking:
        t.join(MARK_TIMEOUT_S)
    if locks is not None:
        locks.close()
    return 1 if state["gave_up"] else 0


def beat_age_s(runs_dir: Path, pid: int) -> float | None:
    """Seconds since worker ``pid`` last touched its beat file (``workers/heartbeat.py``
    :data:`~workers.heartbeat.BEAT_SUFFIX`), by this host's clock; None before its first beat."""
    try:
        return time.time() - (runs_dir / f"{pid}{BEAT_SUFFIX}").stat().st_mtime
    except OSError:
        return None


def stop_children(slots: list[WorkerSlot], grace_s: float) -> None:
    """SIGTERM every live child (warm shutdown), wait up to ``grace_s`` seconds for them to exit,
    then SIGKILL what is left; never raises (it runs when something else already went wrong)."""
    deadline = time.monotonic() + grace_s
    for slot in slots:
        try:
            slot.restart_at = None
            slot.terminate()
        except Exception:  # already gone
            pass
    while time.monotonic() < deadline and any(_polled_alive(s) for s in slots):
        time.sleep(POLL_S)
    for slot in slots:
        try:
            if _polled_alive(slot):
                slot.proc.kill()
                slot.proc.wait(10)
        except Exception:
            pass


def _polled_alive(slot: WorkerSlot) -> bool:
    try:
        return slot.proc is not None and slot.proc.poll() is None
    except Exception:
        return False


def _alive(pid: int, was_parent: bool) -> bool:
    # A parent that dies leaves us reparented (to init or a subreaper): no race with pid reuse.
    if was_parent:
        return os.getppid() == pid
    return pid_alive(pid)


def main(argv: list[str] | None = None) -> int:
    """``python -m workers``: check the settings and the broker, then :func:`launch`.

    Raises:
        BadSettings: a bad ``HSX_*`` value (nothing was started).
        BadConfig: no broker URL, or the broker does not answer, or ``HSX_GPUS_PER_WORKER`` cannot
            split ``HSX_MODEL`` (``workers.group.check_group``), or K GPUs per worker with no GPU
            visible and no explicit ``HSX_DEVICE=cpu`` (nothing was started).
    """
    parser = Parser(prog="python -m workers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=None, help="worker processes (default: one per visible GPU, one on CPU)")
    parser.add_argument("--gpus-per-worker", type=int, default=None, metavar="K",
                        help="GPUs per worker process: one worker per group of K visible GPUs (HSX_GPUS_PER_WORKER, default 1)")
    parser.add_argument("--loglevel", default="INFO")
    parser.add_argument("--grace", type=float, default=600.0, help="seconds to let running batches finish after Ctrl-C / SIGTERM")
    parser.add_argument("--exit-with-parent", type=int, default=None, metavar="PID",
                        help="stop the workers (warm shutdown) when process PID is gone (producer run passes its own)")
    parser.add_argument("--events", default=None, metavar="FILE",
                        help="append one JSON line per worker death, and one per worker ready (HSX_MODEL loaded and warmed "
                             "up), to FILE (producer run prints them as they happen)")
    parser.add_argument("--allow-slow-kernels", action="store_true",
                        help="run a Gated DeltaNet model on CUDA without the fla kernels (slow; refused otherwise)")
    args = parser.parse_args(argv)
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)  # Celery's own line format, so that the two read alike
        handler.setFormatter(logging.Formatter("[%(asctime)s: %(levelname)s/launcher] workers: %(message)s"))
        log.addHandler(handler)
        log.propagate = False
    level = logging.getLevelName(args.loglevel.upper())  # an int for a known level name, else a string
    log.setLevel(level if isinstance(level, int) else logging.INFO)
    if args.allow_slow_kernels:
        os.environ["HSX_ALLOW_SLOW_KERNELS"] = "true"  # the children read it through Settings
        get_settings.cache_clear()
    if args.gpus_per_worker is not None:
        os.environ["HSX_GPUS_PER_WORKER"] = str(args.gpus_per_worker)  # validated by Settings, inherited by the children
        get_settings.cache_clear()
    settings = get_settings()  # BadSettings names the variable, the value and the rule
    if settings.gpus_per_worker > 1 and settings.model:
        from workers.group import check_group

        check_group(settings.model, settings)  # a K the model cannot be split into: refused before any process starts
    if not settings.broker_url:
        raise BadConfig(NO_BROKER)
    check_broker(settings.broker_url, settings.broker_check_timeout_s)
    return launch(settings, count=args.count, loglevel=args.loglevel, grace_s=args.grace, exit_with_parent=args.exit_with_parent,
                  events=Path(args.events) if args.events else None)
