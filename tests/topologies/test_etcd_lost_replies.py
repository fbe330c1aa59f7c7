"""A reply lost on the way back from etcd, through real prefork workers: the lock server (etcd) runs
the call, and the fault proxy in front of it drops the reply and resets the connection.

The workers run tests/apps/slot_faults_app.py with their locks on a private etcd member, reached
through the proxy (CSL_LOCK_URL); broker, results and journal on a private Redis.
"""

from __future__ import annotations

import os
import signal

import pytest
from _clusters import new_key, runs, started, state_of, worker_cluster
from _etcd_servers import running_etcd
from _fault_proxy import FaultProxy

from celery_singleton_lock.engine import line as queue
from celery_singleton_lock.testing.servers import wait_until
from celery_singleton_lock.topologies.etcd import EtcdLockServer
from celery_singleton_lock.topologies.etcd_line import waiter_key
from celery_singleton_lock.topologies.etcd_session import b64
from celery_singleton_lock.worker import revoke

pytestmark = pytest.mark.timeout(120)

TIMEOUT = 40


@pytest.fixture(scope="module")
def etcd_env(tmp_path_factory):
    """One worker node (its revoke look is the only one: a second node's look could find the waiter
    before the first's lost leave ran), its locks on etcd behind the fault proxy."""
    with running_etcd(members=1) as cluster, pytest.MonkeyPatch.context() as patch:
        proxy = FaultProxy(cluster.members[0].client_port)
        patch.setenv("CSL_LOCK_URL", f"etcd://127.0.0.1:{proxy.port}")
        etcd = EtcdLockServer.from_url(cluster.url())
        try:
            with worker_cluster("slot_faults_app", tmp_path_factory.mktemp("etcd"), nodes=1) as module:
                module.proxy, module.etcd = proxy, etcd
                yield module
        finally:
            etcd.close()
            proxy.close()


def _leave_armed(env, hold: float) -> tuple:
    """A holder of a new key for ``hold`` s and a waiter parked behind it on etcd, the proxy armed to
    lose the reply of that waiter's leave (a txn that deletes the waiter's key: its base64 is in the
    request): (key, lock key, holder, waiter)."""
    k = new_key()
    holder = env.inline.delay(k, hold, "holder")
    started(env, k)
    waiter = env.inline.delay(k, 0.1, "waiter")
    lock_key = env.inline.lock_key_for((k,), {})
    wait_until(lambda: queue.line(env.etcd, lock_key) == [waiter.id], TIMEOUT, what="the waiter to park")
    env.proxy.arm(b64(waiter_key(lock_key, "1", queue.entry_for(waiter.id))).encode(), 1)
    return k, lock_key, holder, waiter


def test_a_revoked_waiter_whose_leave_reply_is_lost_ends_revoked(etcd_env):
    """A waiter parked on etcd is revoked; the worker's leave (a txn that deletes the waiter and puts its
    tombstone) runs, and its reply is lost. The look is tried again 2 s later, when the waiter is gone
    from every line: it used to find nothing, and the waiter stayed WAITING for ever. It finds the
    tombstone its first try left (it names the look), stores REVOKED, and the line moves on."""
    env = etcd_env
    k, lock_key, holder, waiter = _leave_armed(env, 3.0)
    waiter.revoke()
    wait_until(lambda: state_of(waiter) == "REVOKED", TIMEOUT, what="the revoked waiter to end REVOKED")
    assert env.proxy.dropped, "the leave's reply was not lost: the test did not run its fault"
    after = env.inline.delay(k, 0.1, "after")
    holder.get(timeout=TIMEOUT)
    after.get(timeout=TIMEOUT)
    assert sorted(r["tag"] for r in runs(env, k)) == ["after", "holder"]  # the waiter never ran


def test_a_revoked_waiter_ends_revoked_when_the_worker_whose_leave_ran_stops_before_it_asks_again(etcd_env):
    """The worker's leave of a revoked waiter runs, its reply is lost, and the worker stops before it
    asks again (stopped here, as a worker killed would be). Another worker's look (run here, the same
    function a worker's revoke watch runs) comes after: it used to find nothing (the waiter had left its
    line), and the waiter stayed WAITING for ever. Every worker's look carries the same request id, and
    the tombstone the leave left names it: the later look finds the key, stores REVOKED, and the waiter
    never runs."""
    env = etcd_env
    dropped = len(env.proxy.dropped)
    k, lock_key, holder, waiter = _leave_armed(env, 2.0)
    waiter.revoke()
    wait_until(lambda: len(env.proxy.dropped) > dropped, TIMEOUT, what="the worker's leave to lose its reply")
    os.kill(env.workers[0].pid, signal.SIGSTOP)  # before its look is tried again (2 s later)
    try:
        assert revoke.take_out(env.inline.app, revoke.Look(waiter.id)) == [lock_key]
        assert state_of(waiter) == "REVOKED"
    finally:
        os.kill(env.workers[0].pid, signal.SIGCONT)
    after = env.inline.delay(k, 0.1, "after")
    holder.get(timeout=TIMEOUT)
    after.get(timeout=TIMEOUT)
    assert sorted(r["tag"] for r in runs(env, k)) == ["after", "holder"]  # the waiter never ran
