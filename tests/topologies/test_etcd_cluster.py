"""A 3-member etcd cluster under real workers: the leader SIGKILLed mid-run, then a member (the
new leader) paused with SIGSTOP and resumed with SIGCONT.

Two worker nodes x 2 prefork children run tasks on 3 keys (``in_line``: on_duplicate="retry",
each duplicate waiting in the key's line); bodies journal their start, end and fencing token in the test Redis.
The history must show every call SUCCESS, each body once, no two bodies of a key at once, and
fencing tokens (the key's create revision) strictly rising per key across the leader changes.
"""

from __future__ import annotations

import json
import random
import time
import uuid

import pytest
from _etcd_servers import running_etcd, wait_healthy
from _task_support import assert_no_overlap, load_worker_app, start_worker_process
from _topology_support import each_body_once, every_call_ends, every_call_succeeded

from celery_singleton_lock.engine import line as lines
from celery_singleton_lock.exceptions import LockError
from celery_singleton_lock.testing.servers import wait_until
from celery_singleton_lock.topologies.etcd import EtcdLockServer

pytestmark = [pytest.mark.long, pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture
def cluster():
    with running_etcd(members=3) as started:
        yield started


def test_real_workers_on_three_members_through_a_leader_kill_and_a_pause(cluster, redis_server, tmp_path):
    wa = load_worker_app(redis_server)
    conf = {"singleton_lock_retry_backoff": 0.05, "singleton_lock_retry_backoff_max": 0.3,
            "singleton_lock_max_retries": 100000, "singleton_lock_redis_options": {"timeout": 1.0}}
    env = {"CSL_LOCK_URL": cluster.url(), "CSL_EXTRA_CONF": json.dumps(conf)}
    nodes = [start_worker_process(redis_server, tmp_path, concurrency=2, env=env, name=f"etcd{i}")
             for i in range(2)]
    rng = random.Random(20261125)
    keys = [f"etcd-{uuid.uuid4().hex[:6]}-{i}" for i in range(3)]
    calls: list = []
    faults: list[str] = []

    def send_for(seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for _ in range(2):
                calls.append(wa.in_line.delay(rng.choice(keys), 0.05, f"c{len(calls)}"))
            time.sleep(rng.uniform(0.15, 0.35))

    try:
        for w in nodes:
            w.wait_ready(90)
        send_for(3.0)
        wait_until(lambda: any(c.state == "SUCCESS" for c in calls), 60, 0.1, "a first call to succeed")
        leader = cluster.leader()
        leader.kill()  # SIGKILL, mid-run
        faults.append(f"kill leader {leader.name}")
        send_for(3.0)
        cluster.restart(leader)
        faults.append(f"restart {leader.name}")
        send_for(2.0)
        paused = cluster.leader()
        paused.pause()  # SIGSTOP the (new) leader
        faults.append(f"pause {paused.name}")
        send_for(3.0)
        paused.resume()
        faults.append(f"resume {paused.name}")
        wait_healthy(cluster)
        send_for(2.0)
        every_call_ends(calls, faults)
    finally:
        for member in cluster.members:
            member.resume()
        for w in nodes:
            w.stop()
    every_call_succeeded(calls)
    ran = 0
    for k in keys:
        starts, _ = each_body_once(wa, k)
        ran += len(starts)
    assert ran == len(calls)  # every call's body ran, once
    print(f"\n[etcd cluster] {len(calls)} calls on {len(keys)} keys; faults: {faults}")


def test_a_waiting_line_keeps_its_order_across_a_leader_change(cluster, redis_server, tmp_path):
    """Waiters parked behind a held key (on_duplicate="retry") are served in the order they parked,
    though the leader is SIGKILLed while they wait and the new leader is paused while the line
    drains: the line is keys ordered by create revision, which Raft keeps across leader changes."""
    wa = load_worker_app(redis_server)
    conf = {"singleton_lock_redis_options": {"timeout": 1.0}}
    env = {"CSL_LOCK_URL": cluster.url(), "CSL_EXTRA_CONF": json.dumps(conf)}
    nodes = [start_worker_process(redis_server, tmp_path, concurrency=2, env=env, name=f"line{i}")
             for i in range(2)]
    server = EtcdLockServer.from_url(cluster.url())
    k = f"order-{uuid.uuid4().hex[:6]}"
    key = wa.in_line.lock_key_for((k,), {})
    faults: list[str] = []
    try:
        for w in nodes:
            w.wait_ready(90)
        holder = wa.in_line.delay(k, 0.0, "holder", True)  # holds the key until the gate opens
        wait_until(lambda: wa.journal.llen(f"journaled:{k}") >= 1, 60, 0.05, "the holder to start")
        waiters = []
        for i in range(6):  # one at a time, so the order they parked in is known
            waiters.append(wa.in_line.delay(k, 0.05, f"w{i}"))
            wait_until(lambda n=i + 1: len(lines.line(server, key)) == n, 60, 0.05, f"waiter {i} to park")
        assert lines.line(server, key) == [w.id for w in waiters]
        leader = cluster.leader()
        leader.kill()  # SIGKILL while the line waits
        faults.append(f"kill leader {leader.name}")
        wait_until(lambda: _line_or_none(server, key) == [w.id for w in waiters], 30, 0.2,
                   "the line to read the same from the surviving members")
        cluster.restart(leader)
        faults.append(f"restart {leader.name}")
        wa.journal.set(f"gate:{k}", 1)
        wait_until(lambda: sum(1 for w in waiters if w.state == "SUCCESS") >= 2, 60, 0.05, "the line to move")
        paused = cluster.leader()
        paused.pause()  # SIGSTOP the new leader while the line drains
        faults.append(f"pause {paused.name}")
        time.sleep(1.5)  # fault injection: the pause's length, not a synchronisation
        paused.resume()
        faults.append(f"resume {paused.name}")
        wait_until(lambda: all(c.ready() for c in [holder, *waiters]), 120, 0.1, "every call to end")
    finally:
        for member in cluster.members:
            member.resume()
        for w in nodes:
            w.stop()
    assert [c.state for c in [holder, *waiters]] == ["SUCCESS"] * 7, faults
    events = [json.loads(x) for x in wa.journal.lrange(f"journaled:{k}", 0, -1)]
    starts = sorted((e for e in events if e["event"] == "start"), key=lambda e: e["at"])
    ends = {e["id"]: e for e in events if e["event"] == "end"}
    assert [e["id"] for e in starts] == [holder.id, *(w.id for w in waiters)], f"served in park order; {faults}"
    assert_no_overlap([(e["at"], ends[e["id"]]["at"]) for e in starts], f"bodies of {k}")
    fences = [e["fence"] for e in starts]
    assert all(a < b for a, b in zip(fences, fences[1:], strict=False)), f"fencing tokens rise: {fences}"
    wait_until(lambda: _line_or_none(server, key) == [], 30, 0.2, "the line to be empty")


def _line_or_none(server, key):
    try:
        return lines.line(server, key)
    except LockError:
        return None
