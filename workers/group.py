"""A worker of K GPUs (``HSX_GPUS_PER_WORKER=K``): one Celery worker process leads a
tensor-parallel group of K ranks (``workers/parallel.py``) and runs every batch through it.

The Celery worker process is rank 0. Before it loads the target it starts ranks 1..K-1 as child
processes (``python -m workers.follower``: fork+exec, before this process touches CUDA), one per
GPU of its group (CUDA_VISIBLE_DEVICES is the group: rank r binds ``cuda:r``), forms one
``torch.distributed`` group with them (NCCL on GPUs, gloo on the CPU; the rendezvous is a
``TCPStore`` on loopback that rank 0 opens on a free port), and every rank loads its 1/K of the
weights (``load_tensor_parallel``). Every forward of rank 0 afterwards (the warm-up, the memory
probe, each batch) is broadcast to the followers first (``lead_capture``, ``lead_probe``), under
the target's GPU lock, so the ranks' collectives always match. One copy of the states reaches
the host, from rank 0; the queue, leases, markers and backpressure are those of any worker.

**CPU groups (tests).** ``HSX_DEVICE=cpu`` set explicitly with ``HSX_GPUS_PER_WORKER=K`` makes K
gloo ranks on the CPU (``workers/launcher.py`` names the worker ``cpu0xK``): the whole path runs
without a GPU, with fp32 weights. Without GPUs and without ``HSX_DEVICE=cpu``, K > 1 is refused:
a node that should have GPUs and sees none is a misconfiguration, not a request for CPU ranks.

**Lifetimes.** A follower gets SIGKILL when its leader dies, however it dies (``PR_SET_PDEATHSIG``
set by the follower itself at start, then a check that its parent is still the leader that
started it: the window before the ``prctl`` is covered). The signal follows the death of the
*thread* that started the child, so the followers are started from this module's watcher thread,
which lives as long as the process. A follower that exits (a crash, the OOM killer, a kill) breaks
the group: the watcher marks it broken, kills the other followers (a rank blocked in a collective
with the dead one never returns by itself on NCCL; on gloo the survivors' collectives fail at
once), lets the batches inside the group fail with :class:`hsx.errors.GroupBroken` (transient: the
batch goes back to the queue through Celery's retry, ``workers/causes.py``), waits until they
have left (at most :data:`EXIT_GRACE_S`), and exits the process with :data:`GROUP_BROKEN_EXIT`.
The launcher sees a worker death and restarts the whole worker, followers included, with its
usual backoff and restart limit; it also puts back at once every batch the dead process held (a
shard being written by another task thread of the process is lost with it and redone). A forward
that raises on rank 0 breaks the group the same way (the followers may be inside a collective
that rank 0 left).

The process group's timeout is a week (:data:`GROUP_TIMEOUT`): between batches the followers wait
inside a broadcast for the next one, for as long as the queue is empty, and a death is seen by the
watcher (``Popen.poll`` every :data:`POLL_S`), not by a collective's timeout.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta

from hsx.errors import BadConfig, GroupBroken
from settings import Settings

log = logging.getLogger(__name__)

#: exit code of a leader whose group broke (EX_TEMPFAIL): the launcher restarts it as any death.
GROUP_BROKEN_EXIT = 75
#: seconds a broken group's leader waits for the batches inside the group to fail before it exits.
EXIT_GRACE_S = 30.0
#: seconds between two looks at the followers.
POLL_S = 0.2
#: the process group's collective timeout (see the module doc: deaths are seen by the watcher).
GROUP_TIMEOUT = timedelta(days=7)
#: seconds rank 0 waits for the K ranks to meet (each starts Python, imports torch and transformers).
RENDEZVOUS_TIMEOUT = timedelta(minutes=10)


def group_size(settings: Settings) -> int:
    """K, the ranks of one worker's group (``HSX_GPUS_PER_WORKER``); 1: no group."""
    return settings.gpus_per_worker


def group_device(settings: Settings) -> str:
    """``cpu`` for a CPU group (``HSX_DEVICE=cpu`` set explicitly: gloo ranks), else ``cuda``."""
    return "cpu" if (settings.device or "").startswith("cpu") else "cuda"


def check_group(model: str, settings: Settings) -> None:
    """Refuse ``HSX_GPUS_PER_WORKER`` for ``model`` before anything starts (``producer run``,
    ``python -m workers`` with ``HSX_MODEL``, and the worker before it starts its followers).

    Reads the model's config only (no weights, no device). Nothing happens for K = 1.

    Raises:
        BadConfig: the model has no tensor-parallel plan, or K does not divide a size the plan
            splits (attention heads, KV heads, MLP width, ...: ``workers.parallel.check_group_size``);
            the message names the model, K, the size, and the group sizes that work.
    """
    k = group_size(settings)
    if k <= 1:
        return
    from transformers import AutoConfig

    from hsx.models import resolve_model_path
    from workers.parallel import check_group_size

    from hsx.models import hub_kwargs

    path = resolve_model_path(model, settings.cache_dir)
    config = AutoConfig.from_pretrained(path, trust_remote_code=settings.trust_remote_code, **hub_kwargs(path))
    try:
        check_group_size(config, k)
    except BadConfig as exc:
        raise BadConfig(f"HSX_GPUS_PER_WORKER={k} (--gpus-per-worker) refused for model {model!r}: {exc}. "
                        "Nothing was started") from None


def _free_thread_share(k: int) -> None:
    # K ranks of a CPU group share the machine's cores: each takes its share, not all of them.
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // k))


class Group:
    """Rank 0's side of a worker's group: the followers, the process group, and its health.

    Made by :meth:`start`; :meth:`lead` runs one batch through the group; :attr:`broken` says why
    the group is gone (None while it is whole).
    """

    def __init__(self, size: int, backend: str, model: str):
        self.size, self.backend, self.model = size, backend, model
        self.followers: list[subprocess.Popen] = []
        self.broken: str | None = None
        self._cond = threading.Condition()
        self._inside = 0  # batches inside the group now (lead sections)
        self._failing = 0  # batches that failed with GroupBroken and have not finished their task yet
        self._spawned = threading.Event()
        self._spawn_error: BaseException | None = None
        self._watcher: threading.Thread | None = None

    # --- start ---------------------------------------------------------------------------------

    @classmethod
    def start(cls, model: str, settings: Settings) -> "Group":
        """Start ranks 1..K-1 for ``model`` and join them in one process group (this process: rank 0).

        Call it before this process initialises CUDA (the followers are started with fork+exec
        anyway). Blocks until the K ranks have met (at most :data:`RENDEZVOUS_TIMEOUT`); a follower
        that dies meanwhile makes this process exit (see the module doc).

        Raises:
            BadConfig: :func:`check_group` refuses K for the model.
            OSError: a follower could not be started.
        """
        import torch
        import torch.distributed as dist

        check_group(model, settings)
        k = group_size(settings)
        device = group_device(settings)
        group = cls(k, "gloo" if device == "cpu" else "nccl", model)
        if device == "cpu":
            _free_thread_share(k)
        store = dist.TCPStore("127.0.0.1", 0, k, is_master=True, timeout=RENDEZVOUS_TIMEOUT, wait_for_workers=False)
        group._watcher = threading.Thread(target=group._watch, args=(store.port, settings), name="hsx-group", daemon=True)
        group._watcher.start()
        group._spawned.wait()
        if group._spawn_error is not None:
            raise group._spawn_error
        if device != "cpu":
            torch.cuda.set_device(0)  # rank 0 of the group's GPUs (CUDA_VISIBLE_DEVICES); after the followers' fork+exec
        # transformers' tp_plan reads LOCAL_RANK to bind the device (transformers/distributed/utils.py l. 241)
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(k))
        log.info("group of %d ranks (%s): followers %s; waiting for them to meet on 127.0.0.1:%d", k, group.backend,
                 ", ".join(f"rank {r + 1} pid {p.pid}" for r, p in enumerate(group.followers)), store.port)
        dist.init_process_group(group.backend, store=store, rank=0, world_size=k, timeout=GROUP_TIMEOUT)
        try:
            from celery.signals import task_postrun

            task_postrun.connect(group._task_finished, weak=False)
        except ImportError:
            pass
        return group

    def _follower_command(self, rank: int, port: int) -> list[str]:
        return [sys.executable, "-m", "workers.follower", "--rank", str(rank), "--world", str(self.size),
                "--port", str(port), "--backend", self.backend, "--model", self.model, "--leader", str(os.getpid())]

    # --- the watcher ---------------------------------------------------------------------------

    def _watch(self, port: int, settings: Settings) -> None:
        # This thread starts the followers: their PR_SET_PDEATHSIG follows its life, the process's.
        try:
            for rank in range(1, self.size):
                self.followers.append(subprocess.Popen(self._follower_command(rank, port), env=dict(os.environ)))
        except BaseException as exc:
            self._spawn_error = exc
            for p in self.followers:
                p.kill()
        finally:
            self._spawned.set()
        if self._spawn_error is not None:
            return
        while self.broken is None:
            dead = self._dead_follower()
            if dead is not None:
                self.fail(dead)
            time.sleep(POLL_S)
        self._exit()

    def _dead_follower(self, wait_s: float = 0.0) -> str | None:
        """How the first follower that exited ended, looking for up to ``wait_s`` seconds (a
        collective that fails on rank 0 usually means that a peer just died); None if all live."""
        from hsx.processes import describe_exit

        deadline = time.monotonic() + wait_s
        while True:
            for rank, p in enumerate(self.followers, start=1):
                if p.poll() is not None:
                    return f"follower rank {rank} of {self.size} (pid {p.pid}) {describe_exit(p.returncode)}"
            if time.monotonic() >= deadline:
                return None
            time.sleep(min(POLL_S / 4, max(0.0, deadline - time.monotonic())))

    def fail(self, reason: str) -> None:
        """Mark the group broken (once; later reasons are only logged): the watcher then stops it
        and exits the process (module doc)."""
        with self._cond:
            if self.broken is not None:
                log.warning("group already broken (%s); also: %s", self.broken, reason)
                return
            self.broken = reason
            self._cond.notify_all()
        log.error("tensor-parallel group broken: %s. Every batch in this worker fails as transient (back to the queue) "
                  "and the worker exits (code %d) so that the launcher restarts the whole group", reason, GROUP_BROKEN_EXIT)

    def _exit(self) -> None:
        for p in self.followers:  # a survivor may be blocked in a collective with the dead rank
            if p.poll() is None:
                p.kill()
        deadline = time.monotonic() + EXIT_GRACE_S
        with self._cond:
            while (self._inside or self._failing) and time.monotonic() < deadline:
                self._cond.wait(max(0.0, min(POLL_S, deadline - time.monotonic())))
            left = self._inside + self._failing
        if left:
            log.error("%d batch(es) still inside the broken group after %g s: exiting anyway (the launcher puts them "
                      "back)", left, EXIT_GRACE_S)
        log.error("exiting (code %d): the group of %d ranks is broken (%s)", GROUP_BROKEN_EXIT, self.size, self.broken)
        for handler in logging.getLogger().handlers + log.handlers:
            with contextlib.suppress(Exception):
                handler.flush()
        sys.stderr.flush()
        os._exit(GROUP_BROKEN_EXIT)

    def _task_finished(self, **_kwargs) -> None:
        # Celery's task_postrun: a batch that failed with GroupBroken has had its retry sent.
        with self._cond:
            if self._failing:
                self._failing -= 1
                self._cond.notify_all()

    # --- batches -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def section(self):
        """Around one use of the group by rank 0 (a broadcast and its forward).

        Raises:
            GroupBroken: the group is broken already, or what ran inside raised (the ranks'
                collectives may be unmatched now: the group is marked broken).
        """
        with self._cond:
            if self.broken is not None:
                self._failing += 1
                raise GroupBroken(f"the worker's tensor-parallel group is broken ({self.broken}); the worker is "
                                  "exiting and the launcher restarts its group: the batch goes back to the queue")
            self._inside += 1
        try:
            yield
        except BaseException as exc:
            self.fail(self.broken or self._dead_follower(wait_s=1.0) or f"a forward failed on rank 0 ({exc.__class__.__name__}: {str(exc)[:300]}), so the "
                      "followers may wait in a collective it left")
            with self._cond:
                self._failing += 1
            raise GroupBroken(f"the worker's tensor-parallel group broke during this batch ({self.broken}); the worker "
                              "exits and the launcher restarts its group: the batch goes back to the queue") from exc
        finally:
            with self._cond:
                self._inside -= 1
                self._cond.notify_all()

    def lead(self, model, rows, selection, *, store_dtype, host_buffer=None):
        """:func:`workers.parallel.lead_capture` inside :meth:`section`; returns its ``PendingCapture``.

        Raises:
            GroupBroken: see :meth:`section`.
        """
        from workers.parallel import lead_capture

        with self.section():
            return lead_capture(model, rows, selection, store_dtype=store_dtype, host_buffer=host_buffer)

    def probe(self, model) -> int | None:
        """:func:`workers.parallel.lead_probe` inside :meth:`section`."""
        from workers.parallel import lead_probe

        with self.section():
            return lead_probe(model)
