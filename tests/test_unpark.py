"""Parked messages come back by themselves (issue 19, item 1): a message a worker could not serve
(``hsx:<queue>:parked``) is sent again by the reclaimer of a worker that serves it and has not refused
it (``workers/lease.py``, :meth:`Reclaimer.unpark`); one of a deleted or cancelled run is dropped.
"""

from __future__ import annotations

import json
import shutil

import pytest

from clusters import assert_complete, copy_plan, wait_done, wait_log
from jobfixtures import wait_until

from hsx.broker import EmbeddedBroker, redis_client
from hsx.brokerlayout import queued_of
from hsx.fleet import Parked, park, read_parked
from hsx.records import Cancelled
from settings import Settings
from workers.lease import Reclaimer

QUEUE = "gpu"
LEASE = dict(lease_s=6, reclaim_interval_s=1)


def test_a_parked_message_comes_back_from_a_worker_that_serves_it_and_only_from_one(tmp_path, template):
    """Entries refused by this worker, or of a run outside its roots, stay parked; the others are
    taken once (a second worker looking after finds nothing) and are queued again; one of a
    cancelled run and one of a deleted run are dropped."""
    with EmbeddedBroker(tmp_path / "broker") as broker:
        settings = Settings(_env_file=None, broker_url=broker.url, store_url=str(tmp_path / "out"), **LEASE)
        client = redis_client(broker.url)
        good = copy_plan(template, str(tmp_path / "out" / "a"), settings)
        cancelled = copy_plan(template, str(tmp_path / "out" / "c"), settings)
        Cancelled(by="test").write(cancelled)
        deleted = copy_plan(template, str(tmp_path / "out" / "d"), settings)
        shutil.rmtree(tmp_path / "out" / "d")
        elsewhere = str(tmp_path / "elsewhere" / "run")
        b = [x["batch"] for x in json.loads(good.read("plan/batches.json"))]
        for url, batch, refused in [(good.url, b[0], ["w-1"]), (good.url, b[1], ["me"]), (cancelled.url, b[0], ["w-1"]),
                                    (deleted.url, b[0], ["w-1"]), (elsewhere, b[0], ["w-1"])]:
            park(client, QUEUE, Parked(run_url=url, batch=batch, reason="NotServed: test", refused_by=refused))
        me, other = Reclaimer(settings, broker.url, me="me"), Reclaimer(settings, broker.url, me="other")
        back = me.unpark()
        assert [(x["run_url"], x["batch"]) for x in back] == [(good.url, b[0])] and back[0]["parked_by"] == ["w-1"]
        assert queued_of(client, QUEUE) == {good.url: {b[0]: 1}}
        left = {(p.run_url, p.batch) for p in read_parked(client, QUEUE)}
        assert left == {(good.url, b[1]), (elsewhere, b[0])}, "refused by me, and outside my roots: still parked"
        assert [x["batch"] for x in other.unpark()] == [b[1]], "another worker takes the one 'me' refused"
        assert {(p.run_url, p.batch) for p in read_parked(client, QUEUE)} == {(elsewhere, b[0])}


def test_a_parked_message_of_a_batch_the_plan_lacks_is_dropped_not_sent(tmp_path, template, caplog):
    """Messages are sent again from the plan's batch summaries: one naming a batch the run's plan does
    not hold (no worker would run it) is dropped with a line, its neighbour of the plan comes back."""
    with EmbeddedBroker(tmp_path / "broker") as broker:
        settings = Settings(_env_file=None, broker_url=broker.url, store_url=str(tmp_path / "out"), **LEASE)
        client = redis_client(broker.url)
        good = copy_plan(template, str(tmp_path / "out" / "a"), settings)
        first = json.loads(good.read("plan/batches.json"))[0]["batch"]
        for batch in (first, "b999999"):
            park(client, QUEUE, Parked(run_url=good.url, batch=batch, reason="NotServed: test", refused_by=["w-1"]))
        with caplog.at_level("WARNING", logger="workers.lease"):
            back = Reclaimer(settings, broker.url, me="me").unpark()
        assert [x["batch"] for x in back] == [first]
        assert queued_of(client, QUEUE) == {good.url: {first: 1}} and read_parked(client, QUEUE) == []
        assert "parked batch b999999 of" in caplog.text and "the run's plan has no such batch" in caplog.text


@pytest.mark.timeout(110)
def test_a_message_parked_by_a_worker_that_does_not_serve_its_root_runs_when_one_that_does_starts(
        template, cluster, tmp_path):
    """A run enqueued under a root the first worker does not serve: each message is parked (the
    worker stays up and serves on); a second worker whose HSX_ALLOWED_STORES names that root starts
    and, with no command typed, the parked messages come back and the run completes exactly once."""
    other_root = tmp_path / "other"
    run_store = copy_plan(template, str(other_root), cluster.settings)
    total = len(json.loads(run_store.read("plan/batches.json")))
    first = cluster.worker("first", **LEASE)
    cluster.enqueue_all(run_store)
    client = redis_client(cluster.broker.url)
    wait_until(lambda: client.hlen(f"hsx:{QUEUE}:parked") == total and client.llen(QUEUE) == 0, 60,
               "every message parked by the first worker")
    assert "parked" in wait_log(first, "parked (this worker cannot serve it")
    assert first.proc.poll() is None
    cluster.worker("second", allowed_stores=str(other_root), **LEASE)
    wait_done(run_store, 80)
    assert_complete(run_store)
    assert "came back from parked" in cluster.workers[1].log()
    assert "'status': 'done'" not in first.log(), "the worker that does not serve the root ran none of it"
    wait_until(lambda: client.hlen(f"hsx:{QUEUE}:parked") == 0, 20, "nothing left parked")
