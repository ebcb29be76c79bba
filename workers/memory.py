"""How many padded tokens one forward of the target may hold on this GPU: measured once per worker
after the load (:func:`forward_tokens_that_fit`), used by the single-process target
(``workers/target.py``) and by every rank of a tensor-parallel group (``workers/parallel.py``)."""

from __future__ import annotations

import logging

import torch

from hsx.decoder import decoder_of

log = logging.getLogger("workers.target")


@torch.inference_mode()
def forward_tokens_that_fit(model: torch.nn.Module, *, headroom: float = 0.8, probe_len: int = 2048) -> int | None:
    """Padded tokens per forward that fit this GPU's free memory; None on the CPU (no limit).

    Two bare forwards of 1 and 4 rows of ``probe_len`` tokens give the activation bytes per token
    (the slope of their peak memory, so fixed costs cancel); ``headroom`` of what is free (plus
    what torch's cache holds unused) is divided by it. The headroom covers the captured states
    that finished batches keep on the device until their copies land, and fragmentation. If a
    forward still runs out of memory, the worker halves the limit and runs the batch again
    (``workers/extract.py``).
    """
    param = next(model.parameters())
    device = param.device
    if device.type != "cuda":
        return None
    decoder = decoder_of(model).module
    peaks = []
    try:
        for rows in (1, 4):
            ids = torch.zeros((rows, probe_len), dtype=torch.long, device=device)
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            decoder(input_ids=ids, use_cache=False)
            torch.cuda.synchronize(device)
            peaks.append(torch.cuda.max_memory_allocated(device) - base)
    except torch.OutOfMemoryError:
        peaks.append(None)  # the probe's blocks are given back below, once the exception no longer holds them
    except Exception:  # the probe must not stop a worker: without it, batches run as planned
        log.warning("could not measure activation memory; batches run as planned, in one forward each", exc_info=True)
        return None
    if peaks[-1] is None:
        torch.cuda.empty_cache()
        fit = probe_len if len(peaks) > 1 else probe_len // 2  # one probe row fitted, or not even that
        log.warning("the GPU memory probe ran out of memory: at most %d padded tokens per forward", fit)
        return fit
    per_token = max((peaks[1] - peaks[0]) / (3 * probe_len), 1.0)
    fixed = max(peaks[0] - per_token * probe_len, 0.0)
    free, _total = torch.cuda.mem_get_info(device)
    available = free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    fit = int((available * headroom - fixed) / per_token)
    log.info("activation memory %.1f KiB per token; %.1f GiB available: %s padded tokens per forward",
             per_token / 1024, available / 2**30, f"{fit:,}")
    return max(fit, probe_len)
