"""A run's progress, read from the store: plan, markers and failure records. No broker needed."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

from core.marker import MARKERS_PREFIX, done_batches
from core.plan import plan_complete, read_batch_list
from core.runconfig import load_run
from core.store import MissingKey, Store


def read_failures(run_store: Store, done: set[str]) -> dict[str, dict]:
    """Failure records of batches that still have no marker (``failures/<batch>.json``)."""
    out = {}
    for key in run_store.list("failures/"):
        batch = key.rsplit("/", 1)[-1].removesuffix(".json")
        if batch in done:
            continue
        try:
            out[batch] = json.loads(run_store.read(key))
        except (MissingKey, ValueError):
            continue
    return out


def run_status(run_store: Store) -> dict:
    """Progress of the run at ``run_store``: batches, samples and tokens done / planned, failures.

    Raises:
        MissingKey: no run.json there.
    """
    config = load_run(run_store)
    batches = read_batch_list(run_store) if plan_complete(run_store) else []
    done = done_batches(run_store)
    by_name = {b["batch"]: b for b in batches}
    samples_done = sum(by_name[b]["num_samples"] for b in done if b in by_name)
    tokens_done = sum(by_name[b]["num_tokens"] for b in done if b in by_name)
    seconds = []
    keys = [f"{MARKERS_PREFIX}{b}.json" for b in sorted(done)]
    with ThreadPoolExecutor(16) as pool:
        for marker in pool.map(lambda k: json.loads(run_store.read(k)), keys):
            seconds.append(marker.get("seconds", 0.0))
    return {
        "run_id": config.run_id,
        "address": run_store.url,
        "model": config.model_name,
        "planned": bool(batches),
        "batches_total": len(batches),
        "batches_done": len(done & set(by_name)),
        "samples_total": sum(b["num_samples"] for b in batches),
        "samples_done": samples_done,
        "tokens_total": sum(b["num_tokens"] for b in batches),
        "tokens_done": tokens_done,
        "worker_seconds": round(sum(seconds), 3),
        "failures": read_failures(run_store, done),
    }
