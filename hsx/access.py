"""Which store roots a worker serves: ``HSX_STORE_URL`` plus the allow-list ``HSX_ALLOWED_STORES``.

A task message names the run it is for by its store URL (``producer/enqueue.py``); anyone who can
write to the broker can send one. A worker therefore checks that URL against the roots it is
configured for **before any store call** (``workers/extract.py``), so a task naming another
directory or bucket creates nothing, reads nothing and loads no model there.

Comparison is of normalised, resolved roots, segment by segment:

- local: ``os.path.realpath`` of both (``~`` expanded, relative paths against the worker's
  working directory, symlinks followed, so a link inside a root that points outside it is
  outside), then a path-prefix test by whole components (``/data/out2`` is not under
  ``/data/out``);
- S3: the same bucket, and the root's prefix segments a prefix of the URL's (``s3://b/runs2`` is not
  under ``s3://b/runs``); a URL with an empty, ``.`` or ``..`` segment is refused outright. The
  endpoint is the worker's own (``HSX_S3_ENDPOINT_URL``), never the message's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hsx.errors import BadConfig
from hsx.storeurl import StoreURL, mask_url, parse_store_url

if TYPE_CHECKING:
    from settings import Settings


class Refused(BadConfig):
    """A worker refuses a task whose message is at fault: its run address is not a store URL, or its
    batch is not a batch name. Raised before anything is touched; the message is dropped."""


class NotServed(Refused):
    """A task for a run this worker does not serve: outside the store roots it serves, or planned for
    another model than its ``HSX_MODEL``. Raised before anything is touched. The message is good for
    a worker configured for it, so this worker stops taking tasks (like a permanent error, with the
    fix in its log and in ``status``) and the message goes back to the queue: one misconfigured
    worker must not drain a run's queue (``workers/causes.py``)."""


class ModelNotServed(NotServed):
    """A task for a run planned for another checkpoint than this worker's (its ``HSX_MODEL``, or the
    one it loaded for the run's model name): parked with cause ``model``."""


def normalise(url: str) -> StoreURL:
    """The resolved :class:`hsx.storeurl.StoreURL` of a store URL in any form ``open_store`` accepts
    (parsed by :func:`hsx.storeurl.parse_store_url`, with a local path's links followed), without
    touching the filesystem beyond resolving symlinks.

    Raises:
        BadConfig: the URL breaks :func:`hsx.storeurl.parse_store_url`'s rules.
    """
    return parse_store_url(url).resolved()


def allowed_roots(settings: "Settings") -> list[StoreURL]:
    """The roots a worker serves: ``HSX_STORE_URL`` and each entry of ``HSX_ALLOWED_STORES``
    (comma-separated), normalised. Raises BadConfig naming an entry that is not a store URL."""
    urls = [settings.store_url, *[u.strip() for u in (settings.allowed_stores or "").split(",") if u.strip()]]
    roots = []
    for u in urls:
        try:
            roots.append(normalise(u))
        except BadConfig as exc:
            raise BadConfig(f"HSX_STORE_URL / HSX_ALLOWED_STORES entry {mask_url(u)!r}: {exc}") from None
    return roots


def check_run_allowed(run_url: str, settings: "Settings") -> None:
    """Refuse ``run_url`` (a task's run address) unless it lies under one of :func:`allowed_roots`.

    Pure: reads nothing from the store and creates nothing (``realpath`` only resolves the links
    that exist).

    Raises:
        NotServed: the URL is outside every root; Refused: it is not a store URL at all. The
            message names the value, the roots and the fix.
    """
    roots = allowed_roots(settings)
    shown = ", ".join(str(r) for r in roots)
    try:
        root = normalise(run_url)
    except BadConfig as exc:
        raise Refused(f"task run address {mask_url(str(run_url))!r} refused: {exc}; this worker serves runs under "
                      f"{shown} only (HSX_STORE_URL plus HSX_ALLOWED_STORES). Fix: send the run's address as "
                      "producer enqueue writes it; nothing was read or created") from None
    if not any(r.contains(root) for r in roots):
        raise NotServed(
            f"task run address {mask_url(run_url)!r} (resolved: {root}) refused: this worker serves runs under "
            f"{shown} only (HSX_STORE_URL plus HSX_ALLOWED_STORES, compared by whole path segments after "
            "resolving links). Fix: if the run is yours, add its store root to HSX_ALLOWED_STORES "
            "(comma-separated) on the workers and restart them; nothing was read or created there")


__all__ = ["Refused", "NotServed", "ModelNotServed", "normalise", "allowed_roots", "check_run_allowed"]
