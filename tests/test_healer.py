"""The healer of lost messages (``workers/lease.py``, :meth:`Reclaimer.heal`): a planned batch that is
neither done, failed, queued, claimed, held nor parked for ``HSX_LEASE_S`` (broker clock) is enqueued
again by the one elected worker, with a reclaim record saying why; a wiped broker heals with no command.

The first tests drive one :class:`Reclaimer` against a real embedded broker and a real store; the last
wipes the broker (``FLUSHALL``) under real ``celery -A workers worker`` processes in the middle of a run.
"""

from __future__ import annotations

import json
import shutil
import time

import pytest

from clusters import HOLD_S, assert_complete, copy_plan, wait_done, wait_log
from jobfixtures import wait_until

from hsx.broker import EmbeddedBroker, redis_client
from hsx.brokerlayout import UNACKED_KEY, queued_of
from hsx.fleet import (Parked, batch_field, broker_time, healer_key, known_runs, park, register_runs,
                       unaccounted_key)
from hsx.queue import send_batches
from hsx.records import BatchSummary, Cancelled, Failure, done_batches
from settings import Settings
from workers import lease
from workers.lease import Reclaimer

QUEUE = "gpu"
LEASE_S = 6


def _reclaims(run_store) -> list[dict]:
    return [json.loads(run_store.read(k)) for k in run_store.list("reclaims/")]


@pytest.fixture
def fleet(tmp_path, template):
    """An embedded broker, a run copied from the template under ``tmp/out`` and registered on the
    queue, and a healer serving ``tmp/out``."""
    with EmbeddedBroker(tmp_path / "broker") as broker:
        settings = Settings(_env_file=None, broker_url=broker.url, store_url=str(tmp_path / "out"), lease_s=LEASE_S,
                            reclaim_interval_s=1)
        run_store = copy_plan(template, str(tmp_path / "out"), settings)
        client = redis_client(broker.url)
        register_runs(client, QUEUE, [run_store.url])
        yield settings, broker, client, run_store, Reclaimer(settings, broker.url, me="healer-1")


def _look(healer, client):
    client.delete(healer_key(QUEUE))  # a new election for each look of the test
    elected, healed = healer.heal()
    assert elected
    return healed


def _noted(client, run_url) -> dict[str, float]:
    raw = client.hgetall(unaccounted_key(QUEUE))
    return {k.decode().split("\n", 1)[1]: float(v) for k, v in raw.items() if k.decode().startswith(run_url + "\n")}


def _summary(batch: str) -> BatchSummary:
    """A batch's summary as send_batches takes it (the message carries only the name)."""
    return BatchSummary(batch=batch, num_samples=1, num_tokens=8)


def _age(client, run_url, batches, seconds):
    """Make the healer's notes of ``batches`` ``seconds`` older (as if that much broker time had passed)."""
    for b in batches:
        fld = batch_field(run_url, b)
        client.hset(unaccounted_key(QUEUE), fld, repr(float(client.hget(unaccounted_key(QUEUE), fld)) - seconds))


def test_a_batch_lost_for_the_lease_is_enqueued_again_once_with_a_record_and_accounted_ones_never(fleet):
    """Every planned batch of a registered run with nothing on the broker is noted; those queued,
    parked or failed meanwhile are not enqueued and their notes go; the rest, once noted for the
    lease, are enqueued again once (a ``lost`` reclaim record each); the next look finds them queued."""
    settings, broker, client, run_store, healer = fleet
    batches = [b["batch"] for b in json.loads(run_store.read("plan/batches.json"))]
    assert len(batches) >= 4
    url = run_store.url
    assert _look(healer, client) == []
    assert set(_noted(client, url)) == set(batches), "every batch noted at first sight, none enqueued yet"
    queued, parked, failed = batches[0], batches[1], batches[2]
    send_batches(settings, broker.url, url, "r", [_summary(queued)])
    park(client, QUEUE, Parked(run_url=url, batch=parked, reason="test", refused_by=["w"]))
    Failure(batch=failed, error="FidelityError: test").write(run_store)
    _age(client, url, batches, LEASE_S + 1)
    healed = _look(healer, client)
    lost = sorted(set(batches) - {queued, parked, failed})
    assert sorted(h["batch"] for h in healed) == lost
    assert _noted(client, url) == {}, "the enqueued ones' notes and the accounted ones' notes are gone"
    assert queued_of(client, QUEUE)[url] == {b: 1 for b in [queued, *lost]}
    records = _reclaims(run_store)
    assert sorted(r["batch"] for r in records) == lost
    assert all(r["why"].startswith("lost: neither done, queued, claimed nor parked for") and r["by"] == "healer-1"
               and r["delivery_tag"].startswith("lost-") for r in records), records
    now = broker_time(client)
    assert all(abs(r["at_unix"] - now) < 30 for r in records), "record times are the broker's clock"
    assert _look(healer, client) == [] and _noted(client, url) == {}, "queued now: nothing lost, nothing noted"


def test_a_batch_noted_once_and_accounted_since_is_not_enqueued(fleet):
    """A note is kept only while the batch stays unaccounted: one queued between two looks loses
    its note, and so is not enqueued however old the note was."""
    settings, broker, client, run_store, healer = fleet
    url = run_store.url
    first = json.loads(run_store.read("plan/batches.json"))[0]["batch"]
    _look(healer, client)
    _age(client, url, [first], LEASE_S + 1)
    send_batches(settings, broker.url, url, "r", [_summary(first)])
    healed = _look(healer, client)
    assert first not in {h["batch"] for h in healed} and first not in _noted(client, url)
    assert queued_of(client, QUEUE)[url][first] == 1, "still one message of it"


def test_one_healer_per_look_and_none_while_the_queue_is_long(fleet, monkeypatch):
    """Of two workers looking at once, one is elected; with more messages queued than the scan
    bound, the elected one reads no run (nothing noted)."""
    settings, broker, client, run_store, healer = fleet
    other = Reclaimer(settings, broker.url, me="healer-2")
    monkeypatch.setattr(lease, "HEAL_SCAN_MAX", 2)
    send_batches(settings, broker.url, "/elsewhere", "x", [_summary(f"b{i}") for i in range(3)])
    assert [healer.heal()[0], other.heal()[0]] == [True, False]
    assert _noted(client, run_store.url) == {}


def test_a_cancelled_run_is_left_alone_and_a_deleted_or_finished_one_is_forgotten(fleet, tmp_path):
    """cancelled.json: nothing noted, the run stays known. A deleted run (no run.json) leaves the
    queue's set of runs."""
    settings, broker, client, run_store, healer = fleet
    Cancelled(by="test").write(run_store)
    assert _look(healer, client) == [] and _noted(client, run_store.url) == {}
    assert run_store.url in known_runs(client, QUEUE)
    shutil.rmtree(tmp_path / "out" / run_store.url.rsplit("/", 1)[-1])
    assert _look(healer, client) == []
    assert run_store.url not in known_runs(client, QUEUE)


@pytest.mark.timeout(110)
def test_a_wiped_broker_heals_with_no_command_every_batch_marked_once(template, cluster, tmp_path):
    """FLUSHALL on the broker while two workers run a run (one holding a batch): the live workers
    rewrite their presences (naming the run they served), the elected healer finds the batches that
    are neither done, queued, claimed nor held, enqueues them again after the lease, and the run
    completes with no command typed; every batch has one marker and every sample is stored once."""
    run_store = copy_plan(template, str(tmp_path / "out"), cluster.settings)
    fast = dict(lease_s=LEASE_S, reclaim_interval_s=1)  # the cluster sets HSX_HEARTBEAT_S=1
    holder = cluster.worker("holder", wait=False, faults="pause_forward=8", **fast)
    # one batch a second: the queue still holds messages when the holder is seen holding its batch
    # (unpaused, "other" drained a small run's queue before that on a loaded machine)
    other = cluster.worker("other", wait=False, faults="pause_forward=1", **fast)
    holder.wait_ready()
    other.wait_ready()
    client = redis_client(cluster.broker.url)
    cluster.enqueue_all(run_store)
    wait_log(holder, "fault injection: pausing", 60)
    waiting = client.llen(QUEUE)
    client.flushall()
    wiped_at = time.monotonic()
    assert waiting > 0, "the wipe came after every message was taken: nothing to lose"
    assert client.hlen(UNACKED_KEY) == 0 and client.llen(QUEUE) == 0 and not client.smembers(f"hsx:{QUEUE}:runs")
    wait_done(run_store, 80)
    took = time.monotonic() - wiped_at
    assert_complete(run_store)
    lost = [r for r in _reclaims(run_store) if r["why"].startswith("lost:")]
    total = len(json.loads(run_store.read("plan/batches.json")))
    assert len(lost) >= waiting, f"{waiting} messages were lost with the wipe, {len(lost)} healed: {lost}"
    assert len(run_store.list("markers/")) == total, "one marker per batch"
    print(f"healed {len(lost)} lost batch(es); the run completed {took:.1f} s after the wipe")
