"""Leases do not depend on clocks agreeing (issue 19, item 6): three simulated nodes, one whose wall
clock is 2 minutes ahead and one 2 minutes behind (``time.time`` shifted in their processes, the
monotonic clock untouched: ``clusters.skewed_env``), real ``celery -A workers worker`` processes on
the embedded broker. No batch is reclaimed while its worker lives, however long it runs past the
lease, and a SIGKILLed node's batch is back within the lease plus two looks, not the lease plus the skew.
"""

from __future__ import annotations

import json
import time

import pytest

from clusters import assert_complete, copy_plan, held_batch, skewed_env, wait_done, wait_log
from jobfixtures import wait_until

#: seconds of lease, look and heartbeat of the workers here (the cluster sets HSX_HEARTBEAT_S=1).
LEASE = dict(lease_s=6, reclaim_interval_s=1)
#: how long each batch is held at its forward: past the lease.
HOLD_S = 10
SKEW_S = 120


def _reclaims(run_store) -> list[dict]:
    return [json.loads(run_store.read(k)) for k in run_store.list("reclaims/")]


@pytest.mark.timeout(115)
def test_nodes_with_clocks_two_minutes_off_reclaim_no_live_batch_and_a_dead_node_s_batch_in_time(
        template, cluster, tmp_path):
    """Each of three nodes (clock even, +120 s, -120 s) holds a batch past the lease: none is reclaimed.
    The node ahead is SIGKILLed holding its batch: that batch alone is reclaimed, once, by a live node,
    within lease + confirmation + two looks; the run completes exactly once."""
    run_store = copy_plan(template, str(tmp_path / "out"), cluster.settings)
    base = cluster.env()["PYTHONPATH"]
    faults = f"pause_forward={HOLD_S}"
    nodes = {"even": cluster.worker("even", wait=False, faults=faults, **LEASE),
             "ahead": cluster.worker("ahead", wait=False, faults=faults, os_env=skewed_env(tmp_path, base, SKEW_S),
                                     **LEASE),
             "behind": cluster.worker("behind", wait=False, faults=faults, os_env=skewed_env(tmp_path, base, -SKEW_S),
                                      **LEASE)}
    for w in nodes.values():
        w.wait_ready()
    cluster.enqueue_all(run_store)
    held = {name: held_batch(wait_log(w, "fault injection: pausing", 60)) for name, w in nodes.items()}
    time.sleep(LEASE["lease_s"] + 1.5)  # every node's batch now held past the lease, each node looking every second
    assert _reclaims(run_store) == [], "a live node's batch was reclaimed"
    victim = held["ahead"]
    killed_at = time.monotonic()
    nodes["ahead"].kill()
    wait_until(lambda: any(r["batch"] == victim for r in _reclaims(run_store)), 60, "the dead node's batch reclaimed")
    took = time.monotonic() - killed_at
    # lease (6) + stale confirmation (2 heartbeats) + two looks (1.2 s each) - the time already held, plus load slack
    assert took < LEASE["lease_s"] + 12, f"reclaimed {took:.1f} s after the kill"
    wait_done(run_store, 80)
    reclaims = _reclaims(run_store)
    assert [r["batch"] for r in reclaims] == [victim], reclaims
    assert not reclaims[0]["by"].endswith(f"-{nodes['ahead'].proc.pid}")
    assert_complete(run_store)
    print(f"the dead node's batch was reclaimed {took:.1f} s after the kill")
