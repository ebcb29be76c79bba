"""The worker's marker write settles before it calls a race lost: a real batch job (workers/extract.py,
in-process, the tiny model on the CPU) on an S3 store behind tests/faultproxy.py whose first 8
conditional PUTs of the marker answer 409 ConditionalRequestConflict (more than the store's own
``CONFLICT_RETRIES``). The batch ends ``done`` with its marker naming the shard it wrote, the
shard kept: an unsettled create is retried (hsx/store/retry.py), never taken for another worker's win.
"""

from __future__ import annotations

import json

import pytest

from hsx.records import Marker
from hsx.store import open_store, verify, write_file

pytestmark = pytest.mark.timeout(180)


def test_marker_conflicts_that_outlast_the_stores_retries_end_done_not_lost(small_run, s3_bucket, monkeypatch):
    import hsx.store.s3 as s3_store
    from faultproxy import FaultProxy, Rule, proxied_settings
    from workers.extract import extract_batch

    monkeypatch.setattr(s3_store, "CONFLICT_BACKOFF_S", 0.01)
    run_id = small_run["report"]["run_id"]
    direct = open_store(s3_bucket.url, s3_bucket.settings).child(run_id)
    for path in sorted(small_run["dir"].rglob("*")):
        rel = path.relative_to(small_run["dir"]).as_posix()
        if path.is_file() and (rel == "run.json" or rel.startswith("plan/")):
            write_file(direct, rel, path)
    batch = json.loads(direct.read("plan/batches.json"))[0]["batch"]
    conflicts = Rule(lambda m, p, h: m == "PUT" and "/markers/" in p and h.get("If-None-Match") == "*",
                     ("error", 409, "ConditionalRequestConflict"), times=8)
    proxy = FaultProxy(s3_bucket.settings.s3_endpoint_url, [conflicts]).start()
    try:
        settings = proxied_settings(s3_bucket, proxy, store_url=s3_bucket.url, cache_dir=small_run["cache"], device="cpu",
                                    spool_dir=small_run["dir"].parent.parent / "spool-settled", store_retry_s=60)
        result = extract_batch(f"{s3_bucket.url}/{run_id}", batch, settings)
    finally:
        proxy.stop()
    assert conflicts.hits == 8
    assert result["status"] == "done", result
    marker = Marker.read(direct, batch)
    assert direct.list("shards/") == [marker.shard.key], "the shard the marker names must be the one kept"
    verify(direct, marker.shard.key, marker.shard.bytes, marker.shard.sha256)
