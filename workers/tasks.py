"""Celery tasks. Thin on purpose: ids in, the batch job (workers/extract.py) does the work."""

from __future__ import annotations

from core.queue import EXTRACT_TASK
from settings import get_settings
from workers.app import app
from workers.extract import extract_batch as _extract_batch
from workers.extract import record_failure


@app.task(name=EXTRACT_TASK, acks_late=True, reject_on_worker_lost=True)
def extract_batch(run_url: str, batch: str) -> dict:
    """Extract batch ``batch`` of the run stored at ``run_url``; no-op if its marker exists."""
    settings = get_settings()
    try:
        return _extract_batch(run_url, batch, settings)
    except Exception as exc:
        record_failure(run_url, batch, exc, settings)
        raise
