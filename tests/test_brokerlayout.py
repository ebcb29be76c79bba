"""The contract of ``hsx/brokerlayout.py`` with kombu's Redis layout, on a real valkey: every function
is held against messages that real Celery sent and real kombu consumers took (and died holding). A
kombu upgrade that moves a queue list, a priority key or the claims fails here, not in a fleet."""

from __future__ import annotations

import time

import pytest

from deadclaims import take_and_die
from hsx.brokerlayout import (UNACKED_INDEX_KEY, Claim, Lengths, claims, declare_queue, decode_message, drop_claims, is_claimed, lengths,
                              messages_by_run, queue_keys, queued_of, remove_queued, restore_claim, waiting)
from hsx.queue import EXTRACT_TASK, make_celery, send_batches
from hsx.records import BatchSummary
from settings import Settings

pytestmark = pytest.mark.timeout(120)

QUEUE = "gpu"

@pytest.fixture
def settings(broker):
    return Settings(_env_file=None, broker_url=broker.url, queue=QUEUE)


def _send(settings, broker, run_url: str, batches: list[str]) -> dict[str, str]:
    summaries = [BatchSummary(batch=b, num_samples=1, num_tokens=8) for b in batches]
    return send_batches(settings, broker.url, run_url, run_url.rsplit("/", 1)[-1], summaries)


def _send_task(settings, broker, name: str, args: list, task_id: str, priority: int | None = None) -> None:
    app = make_celery(settings, broker.url)
    try:
        app.send_task(name, args=args, task_id=task_id, queue=settings.queue, priority=priority)
    finally:
        app.close()


def _take_and_die(broker, count: int) -> list[str]:
    """A kombu consumer that takes ``count`` messages and is SIGKILLed holding them; their task ids."""
    return take_and_die(broker.url, QUEUE, count)


def test_the_queue_s_lists_are_its_name_then_one_per_priority_step(client, settings, broker):
    """A message sent with a priority lands in one of the step lists, not the queue's own; waiting counts both."""
    _send_task(settings, broker, EXTRACT_TASK, ["/r/a", "b0"], "plain")
    _send_task(settings, broker, EXTRACT_TASK, ["/r/a", "b1"], "urgent", priority=9)
    keys = queue_keys(QUEUE)
    assert keys[0] == QUEUE and len(keys) == 4
    assert [client.llen(k) for k in keys].count(1) == 2 and client.llen(QUEUE) == 1
    assert waiting(client, QUEUE) == 2
    assert queued_of(client, QUEUE) == {"/r/a": {"b0": 1, "b1": 1}}


def test_lengths_count_waiting_messages_and_claims_without_reading_one(client, settings, broker):
    _send(settings, broker, "/r/a", ["b0", "b1", "b2"])
    _send_task(settings, broker, EXTRACT_TASK, ["/r/a", "b3"], "p", priority=6)
    assert lengths(client, QUEUE) == Lengths(waiting=4, claimed=0)
    _take_and_die(broker, 1)
    assert lengths(client, QUEUE) == Lengths(waiting=3, claimed=1)
    assert lengths(client, "another-queue") == Lengths(waiting=0, claimed=1), "kombu keeps one claims hash per broker"


def test_queued_of_counts_each_run_s_batches_in_chunks_and_skips_other_tasks_and_non_json(client, settings, broker):
    _send(settings, broker, "/r/a", ["b0", "b1", "b0"])
    _send(settings, broker, "/r/b", ["b0"])
    _send_task(settings, broker, "other.task", ["/r/a", "b9"], "other")
    client.lpush(QUEUE, b"\x80\x04 not json: a pickle would run code")
    expected = {"/r/a": {"b0": 2, "b1": 1}, "/r/b": {"b0": 1}}
    assert queued_of(client, QUEUE) == expected
    assert queued_of(client, QUEUE, chunk=2) == expected
    assert queued_of(client, QUEUE, "/r/b") == {"/r/b": {"b0": 1}}


def test_remove_queued_takes_a_run_s_messages_from_every_priority_step_and_nothing_else(client, settings, broker):
    _send(settings, broker, "/r/a", [f"b{i}" for i in range(5)])
    _send_task(settings, broker, EXTRACT_TASK, ["/r/a", "b9"], "urgent", priority=9)
    _send(settings, broker, "/r/b", ["b0", "b1"])
    _send_task(settings, broker, "other.task", ["/r/a", "b0"], "other")
    assert remove_queued(client, QUEUE, "/r/a", chunk=2) == 6
    assert queued_of(client, QUEUE) == {"/r/b": {"b0": 1, "b1": 1}}
    assert waiting(client, QUEUE) == 3, "the other task's message stays"


def test_a_dead_consumer_s_delivery_is_a_claim_naming_its_run_batch_task_and_delivery_time(client, settings, broker):
    sent = _send(settings, broker, "/r/a", ["b0", "b1"])
    before = time.time()
    [task_id] = _take_and_die(broker, 1)
    [claim] = claims(client)
    assert isinstance(claim, Claim) and claim.task_id == task_id == sent["b0"], "the first sent is the first taken"
    assert (claim.run_url, claim.batch) == ("/r/a", "b0")
    assert before - 5 < claim.delivered_at < time.time() + 5, "kombu's score is the consumer's wall clock"
    assert is_claimed(client, claim.tag) and not is_claimed(client, "no-such-tag")


def test_claims_leave_out_other_tasks(client, settings, broker):
    _send_task(settings, broker, "other.task", ["/r/a", "b0"], "other")
    _take_and_die(broker, 1)
    assert claims(client) == [] and lengths(client, QUEUE).claimed == 1


def test_dropped_claims_are_forgotten_as_an_ack_would_and_not_queued_again(client, settings, broker):
    _send(settings, broker, "/r/a", ["b0", "b1", "b2"])
    _take_and_die(broker, 2)
    tags = [c.tag for c in claims(client)]
    drop_claims(client, tags[:1])
    assert [c.tag for c in claims(client)] == tags[1:]
    drop_claims(client, [*tags, "no-such-tag"])  # a missing tag is nothing to do
    assert claims(client) == [] and lengths(client, QUEUE) == Lengths(waiting=1, claimed=0)
    assert client.zcard(UNACKED_INDEX_KEY) == 0, "the delivery-time index is emptied with the hash"


def test_a_restored_claim_is_the_next_message_taken_once_with_the_same_task_id(client, settings, broker):
    sent = _send(settings, broker, "/r/a", ["b0", "b1", "b2"])
    _take_and_die(broker, 1)
    [claim] = claims(client)
    assert restore_claim(broker.url, QUEUE, claim.tag) is True
    assert restore_claim(broker.url, QUEUE, claim.tag) is False, "restored twice"
    assert claims(client) == [] and lengths(client, QUEUE) == Lengths(waiting=3, claimed=0)
    _, raw = client.brpop(QUEUE, timeout=5)  # kombu's consumers BRPOP: this is what a worker takes next
    assert decode_message(raw) == (EXTRACT_TASK, sent["b0"], ["/r/a", "b0"])


def test_a_claim_restored_after_the_broker_lost_its_bindings_still_reaches_the_queue(client, settings, broker):
    """kombu routes a restore through the queue's binding; a broker that lost it would drop the message."""
    _send(settings, broker, "/r/a", ["b0"])
    _take_and_die(broker, 1)
    [claim] = claims(client)
    client.delete(*client.keys("_kombu.binding.*"))
    assert restore_claim(broker.url, QUEUE, claim.tag)
    assert queued_of(client, QUEUE) == {"/r/a": {"b0": 1}}


def test_declare_queue_makes_a_send_after_a_wipe_reach_the_queue(client, settings, broker):
    declare_queue(broker.url, QUEUE)
    assert client.smembers(f"_kombu.binding.{QUEUE}")
    client.flushdb()
    declare_queue(broker.url, QUEUE)
    assert client.smembers(f"_kombu.binding.{QUEUE}")


def test_messages_by_run_counts_waiting_and_claimed_messages_and_marks_others(client, settings, broker):
    _send(settings, broker, "/r/a", ["b0", "b1", "b2"])
    _send(settings, broker, "/r/b", ["b0"])
    _take_and_die(broker, 1)
    client.lpush(QUEUE, b"not json")
    assert messages_by_run(client, QUEUE) == {"/r/a": 3, "/r/b": 1, "?": 1}


def test_decode_message_reads_json_only():
    assert decode_message(b"\x80\x04 pickle") == (None, None, [])
    assert decode_message('{"content-type": "application/x-python-serialize", "body": "x"}') == (None, None, [])
