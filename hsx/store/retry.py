"""Retrying a store call that failed for a transient reason: exponential backoff with full jitter.

botocore already retries each S3 request a few times (``hsx.store.s3.S3_MAX_ATTEMPTS``, about half a minute
against a server that refuses connections). This is the outer loop on top, bounded by a total
time (``HSX_STORE_RETRY_S``), so that an S3 outage of minutes does not fail a batch whose shard
sits safely in the spool: each attempt that fails with ``StoreError.transient`` is logged at
WARNING and tried again after ``uniform(0, min(cap, base * 2**n))`` seconds (full jitter: many
workers retrying at once do not hammer the server in step). Anything else is raised at once.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Callable, TypeVar

from hsx.errors import StoreError

log = logging.getLogger(__name__)

T = TypeVar("T")

#: first backoff ceiling (seconds); it doubles per failed attempt up to :data:`BACKOFF_CAP_S`.
BACKOFF_BASE_S = 1.0
#: largest wait between two attempts (seconds).
BACKOFF_CAP_S = 30.0


def backoff_s(attempt: int, *, base_s: float = BACKOFF_BASE_S, cap_s: float = BACKOFF_CAP_S, rng=random) -> float:
    """Seconds to wait after failed attempt number ``attempt`` (0-based): full jitter,
    ``uniform(0, min(cap_s, base_s * 2**attempt))``."""
    return rng.uniform(0.0, min(cap_s, base_s * (2 ** min(attempt, 30))))


def retry_transient(fn: Callable[[], T], what: str, *, total_s: float, base_s: float = BACKOFF_BASE_S,
                    cap_s: float = BACKOFF_CAP_S, sleep=time.sleep, clock=time.monotonic) -> T:
    """Call ``fn()`` until it returns, retrying :class:`StoreError` with ``transient=True` for up to
    ``total_s`` seconds (wall clock, counted from the first call).

    ``what`` names the operation in the log (``"store shard b000012"``). Returns ``fn``'s result.

    Raises:
        StoreError: the last transient error once ``total_s`` has passed (its message says how
            long and how many attempts), or at once any non-transient one.
        Exception: whatever else ``fn`` raises, at once.
    """
    start = clock()
    attempt = 0
    while True:
        try:
            return fn()
        except StoreError as exc:
            if not exc.transient:
                raise
            elapsed = clock() - start
            wait = backoff_s(attempt, base_s=base_s, cap_s=cap_s)
            if elapsed + wait > total_s:
                if attempt == 0 and total_s <= 0:
                    raise
                raise StoreError(f"{what}: still failing after {attempt + 1} attempts over {elapsed:.0f} s "
                                 f"(HSX_STORE_RETRY_S={total_s:g}): {exc}", transient=True) from exc
            log.warning("%s failed (attempt %d, %.0f s so far), retrying in %.1f s: %s", what, attempt + 1, elapsed, wait, exc)
            sleep(wait)
            attempt += 1
