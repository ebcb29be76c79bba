"""``python -m workers.follower``: rank 1..K-1 of a worker's tensor-parallel group (``workers/group.py``).

Started by the group's leader (the Celery worker process, rank 0) with fork+exec; never by hand.
It sets ``PR_SET_PDEATHSIG`` to SIGKILL first (it has nothing to flush: the leader holds every
batch's state), checks that its parent is still the leader that started it, joins the process
group through the leader's ``TCPStore`` on loopback, loads its 1/K of the target
(``load_tensor_parallel``, the same dtype and kernels as the leader), then follows the leader's
broadcasts (``workers.parallel.follow``) until told to stop or killed. It reads the same
``HSX_*`` settings as its leader (its environment is the leader's). Logs go to stderr, the
leader's log.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys


def _die_with_leader(leader: int) -> None:
    """SIGKILL this process when the thread that started it ends (Linux ``prctl``); exit now if the
    leader is already gone (it died before the ``prctl``: no signal would ever come)."""
    if sys.platform.startswith("linux"):
        import ctypes

        from workers.launcher import PR_SET_PDEATHSIG

        ctypes.CDLL(None, use_errno=True).prctl(ctypes.c_int(PR_SET_PDEATHSIG), ctypes.c_ulong(int(signal.SIGKILL)),
                                                ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))
    if os.getppid() != leader:
        sys.exit(f"follower: the leader (pid {leader}) is gone before this rank started; exiting")


def main(argv: list[str] | None = None) -> int:
    """Run one follower rank; returns 0 after the leader's stop (it is usually killed with its leader)."""
    parser = argparse.ArgumentParser(prog="python -m workers.follower", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--port", type=int, required=True, help="the leader's TCPStore port on 127.0.0.1")
    parser.add_argument("--backend", choices=["gloo", "nccl"], required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--leader", type=int, required=True, help="the leader's pid")
    args = parser.parse_args(argv)
    _die_with_leader(args.leader)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"[%(asctime)s: %(levelname)s/rank{args.rank}] %(name)s: %(message)s")
    log = logging.getLogger("workers.follower")

    import torch
    import torch.distributed as dist

    from hsx.models import resolve_model_path, safetensors_only
    from settings import get_settings
    from workers.group import GROUP_TIMEOUT, RENDEZVOUS_TIMEOUT, _free_thread_share
    from workers.parallel import follow, load_tensor_parallel
    from workers.target import _set_load_threads, run_rows_as_sequences

    settings = get_settings()
    os.environ.update(RANK=str(args.rank), LOCAL_RANK=str(args.rank), WORLD_SIZE=str(args.world))
    if args.backend == "nccl":
        torch.cuda.set_device(args.rank)  # CUDA_VISIBLE_DEVICES is the group: rank r is its r-th GPU
    else:
        _free_thread_share(args.world)
    store = dist.TCPStore("127.0.0.1", args.port, args.world, is_master=False, timeout=RENDEZVOUS_TIMEOUT)
    dist.init_process_group(args.backend, store=store, rank=args.rank, world_size=args.world, timeout=GROUP_TIMEOUT)
    path = resolve_model_path(args.model, settings.cache_dir)
    _set_load_threads(settings.load_threads)
    model = load_tensor_parallel(path, dtype=torch.bfloat16 if args.backend == "nccl" else torch.float32,
                                 use_safetensors=safetensors_only(path, settings.allow_pickle_checkpoints),
                                 trust_remote_code=settings.trust_remote_code)
    run_rows_as_sequences(model)  # the leader's kernels (the values do not depend on it; the speed does)
    log.info("rank %d of %d loaded %s (%s); following rank 0", args.rank, args.world, args.model, args.backend)
    from workers import faults

    followed = follow(model, lambda n: faults.hooks().pause("follow", f"{n} (rank {args.rank}, pid {os.getpid()})"))
    log.info("rank %d: stopped by rank 0 after %d batches", args.rank, followed)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
