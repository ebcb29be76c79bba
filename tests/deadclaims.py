"""Claims whose ack never comes, made with real parts: a kombu consumer that takes messages from the
broker and is SIGKILLed holding them (as deliveries whose acks a broker's kill -9 lost), listed by
no worker's presence."""

from __future__ import annotations

import subprocess
import sys

TAKE_AND_DIE = """
import os, signal, sys
from kombu import Connection
with Connection(sys.argv[1]) as conn:
    q = conn.SimpleQueue(sys.argv[2])
    for _ in range(int(sys.argv[3])):
        print(q.get(timeout=10).headers["id"], flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # dies holding the deliveries, unacknowledged
"""


def take_and_die(broker_url: str, queue: str, count: int) -> list[str]:
    """Have a consumer take ``count`` messages of ``queue`` and die holding them; their task ids."""
    out = subprocess.run([sys.executable, "-c", TAKE_AND_DIE, broker_url, queue, str(count)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == -9, out.stderr
    return out.stdout.split()


def age_claims(broker_url: str, seconds: float) -> None:
    """Move every claim's delivery time (kombu's ``unacked_index``) ``seconds`` into the past: an ack lost
    a while ago, past the grace a fresh delivery gets before its worker lists it
    (``producer.fleetview.UNLISTED_GRACE_S``)."""
    from hsx.broker import redis_client
    from hsx.brokerlayout import UNACKED_INDEX_KEY

    client = redis_client(broker_url)
    for tag, t in client.zrange(UNACKED_INDEX_KEY, 0, -1, withscores=True):
        client.zadd(UNACKED_INDEX_KEY, {tag: t - seconds})
