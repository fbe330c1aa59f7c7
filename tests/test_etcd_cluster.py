"""A 3-member etcd cluster under real workers: the leader SIGKILLed mid-run, then a member (the
new leader) paused with SIGSTOP and resumed with SIGCONT.

Two worker nodes x 2 prefork children run tasks on 3 keys (``in_line``: on_duplicate="retry",
which backs off on etcd); bodies journal their start, end and fencing token in the test Redis.
The history must show every call SUCCESS, each body once, no two bodies of a key at once, and
fencing tokens (the key's create revision) strictly rising per key across the leader changes.
"""

from __future__ import annotations

import json
import random
import time
import uuid

import pytest
from _task_support import assert_no_overlap, load_worker_app, start_worker_process

from celery_singleton_lock.testing.etcd_servers import NO_ETCD, EtcdCluster, find_etcd, wait_healthy
from celery_singleton_lock.testing.servers import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture
def cluster():
    if find_etcd() is None:
        pytest.skip(NO_ETCD)
    started = EtcdCluster(members=3).start()
    try:
        yield started
    finally:
        for member in started.members:
            member.resume()  # never leave a paused process behind
        started.stop()


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
        try:
            wait_until(lambda: all(c.state in ("SUCCESS", "FAILURE", "REVOKED") for c in calls), 120, 0.2,
                       "every call to end")
        except TimeoutError:
            raise AssertionError(f"not ended: {[(c.id, c.state) for c in calls if not c.ready()][:10]}; "
                                 f"faults: {faults}") from None
    finally:
        for member in cluster.members:
            member.resume()
        for w in nodes:
            w.stop()
    assert [c.state for c in calls].count("SUCCESS") == len(calls), \
        [(c.id, c.state, c.result) for c in calls if c.state != "SUCCESS"][:10]
    ran = 0
    for k in keys:
        events = [json.loads(x) for x in wa.journal.lrange(f"journaled:{k}", 0, -1)]
        starts = [e for e in events if e["event"] == "start"]
        ends = {e["id"]: e for e in events if e["event"] == "end"}
        assert len({e["id"] for e in starts}) == len(starts), f"{k}: a body ran twice"
        assert set(ends) == {e["id"] for e in starts}, f"{k}: every body that started ended"
        assert_no_overlap([(e["at"], ends[e["id"]]["at"]) for e in starts], f"bodies of {k}")
        fences = [e["fence"] for e in sorted(starts, key=lambda e: e["at"])]
        assert all(a < b for a, b in zip(fences, fences[1:], strict=False)), f"{k}: fencing tokens rise: {fences}"
        ran += len(starts)
    assert ran == len(calls)  # every call's body ran, once
    print(f"\n[etcd cluster] {len(calls)} calls on {len(keys)} keys; faults: {faults}")
