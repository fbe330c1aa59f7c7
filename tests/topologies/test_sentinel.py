"""Locks behind Redis Sentinel: 1 master, 1 replica, 3 Sentinels, private processes on free loopback
ports, stopped by PID.

What it proves: Celery's ``sentinel://...;sentinel://...`` URL with the master name from the transport
options (ours, or the result backend's / broker's when the URL is inherited) builds a Sentinel
client; the whole task contract passes on it with a real worker; after a forced failover
(``SENTINEL FAILOVER``) the thread-held hot-path connection and the watchdog's twin both reach the
new master (READONLY from the demoted one, NOSCRIPT on the new one) and keep renewing; fencing
tokens keep growing. Overlapping executions across a failover, with and without ``WAIT``, are
measured in test_sentinel_overlaps.py.
"""

from __future__ import annotations

import json
import os
import time
import uuid

import pytest
from _apps import make_app
from _deployments import SentinelDeployment, _role
from _sentinel_support import LOCK_DB, server_for
from _task_support import assert_no_overlap, load_worker_app, start_worker_process
from _topology_support import check_contract
from celery import Celery

from celery_singleton_lock import LockedTask
from celery_singleton_lock.delivery import config
from celery_singleton_lock.engine.lock import Lock, Release, slot_safe
from celery_singleton_lock.engine.scripts import ACQUIRE
from celery_singleton_lock.exceptions import LockBackendUnavailable
from celery_singleton_lock.testing.servers import wait_until
from celery_singleton_lock.topologies import servers
from celery_singleton_lock.topologies.servers import SentinelLockServer
from celery_singleton_lock.watchdog.renewer import Watchdog

pytestmark = [pytest.mark.long, pytest.mark.slow, pytest.mark.timeout(180), pytest.mark.usefixtures("collect_results")]


def test_celery_sentinel_urls_and_transport_options_build_a_sentinel_server(sentinel):
    def resolved(**conf) -> config.LockSettings:
        app = Celery(f"s{uuid.uuid4().hex[:6]}", set_as_current=False)
        app.conf.update(**conf)

        @app.task(base=LockedTask, shared=False, name="sentinel.t")
        def t(a):
            return a

        app.finalize()
        return config.resolve(t)

    own = resolved(singleton_lock_url=sentinel.url(LOCK_DB),
                   singleton_lock_transport_options={"master_name": sentinel.master_name})
    inherited = resolved(result_backend=sentinel.url(LOCK_DB), broker_url="amqp://guest@nowhere//",
                         result_backend_transport_options={"master_name": sentinel.master_name, "other": 1})
    from_broker = resolved(broker_url=sentinel.url(LOCK_DB).split(";"),
                           broker_transport_options={"master_name": sentinel.master_name, "visibility_timeout": 9})
    assert own.transport_options == inherited.transport_options == from_broker.transport_options == {
        "master_name": sentinel.master_name}
    for settings in (own, inherited, from_broker):
        srv = config.server_for(settings)
        assert isinstance(srv, SentinelLockServer)
        lock = srv.acquire(f"cfg-{uuid.uuid4().hex[:6]}", 5)
        assert isinstance(lock, Lock)
        with sentinel.master.client(LOCK_DB) as c:
            assert c.exists(lock.key)
        assert srv.release(lock).status is Release.DELETED
    with pytest.raises(ValueError, match="master_name"):
        servers.from_settings(sentinel.url(LOCK_DB))


def test_the_task_contract_behind_sentinel(sentinel, redis_server):
    app = make_app(redis_server, task_default_queue=f"q-{uuid.uuid4().hex[:8]}")
    app.conf.singleton_lock_url = sentinel.url(LOCK_DB)  # broker and results stay on the plain private Redis
    app.conf.singleton_lock_transport_options = {"master_name": sentinel.master_name}
    check_contract(app)


def test_a_failover_is_followed_by_the_hot_path_and_the_watchdog(sentinel):
    """Two processes' worth of servers hold locks through a forced failover: one listens for Sentinel's
    switch announcement (ours), one only reacts to READONLY from the demoted master (redis-py's way).
    Both end on the new master, on the hot path and in the watchdog's renewals, and lose nothing."""
    listening = server_for(sentinel)
    plain = server_for(sentinel)
    plain.follow_switches = False
    held = [srv.acquire(f"fo-{i}-{uuid.uuid4().hex[:6]}", 30, owner_id=f"o{i}")
            for i, srv in enumerate((listening, listening, plain, plain))]
    assert all(isinstance(lock, Lock) for lock in held)
    before = max(lock.fencing_token for lock in held)
    dog = Watchdog()
    for lock in held:
        dog.track(lock)
    old = sentinel.master
    heard = listening._watch.generation
    try:
        new = sentinel.failover()  # promoted; the old master is still a master for a while
        assert new.port != old.port
        wait_until(lambda: listening._watch.generation > heard, 10, 0.02, "the switch announcement")
        moved = listening.acquire(f"moved-{uuid.uuid4().hex[:6]}", 30)
        with new.client(LOCK_DB) as c:
            assert c.exists(moved.key), "the listening server moved at the announcement"
        not_demoted_yet = _role(old) == "master"
        stayed = plain.acquire(f"stayed-{uuid.uuid4().hex[:6]}", 30)
        if not_demoted_yet:  # (on a very slow machine Sentinel may have demoted it already)
            with old.client(LOCK_DB) as o:
                assert o.exists(stayed.key), "redis-py alone stays on the old master until its demotion"
        sentinel.failover_settle(old)  # the old master demoted and caught up as a replica
        # READONLY from the demoted master, then the new master, which has no scripts yet (NOSCRIPT)
        after = plain.acquire(f"after-{uuid.uuid4().hex[:6]}", 30)
        assert isinstance(after, Lock)
        with new.client(LOCK_DB) as c:
            assert c.exists(after.key), "taken on the new master after READONLY"
            assert c.script_exists(plain._shas[ACQUIRE]) == [True]  # a fresh acquire's script
        assert after.fencing_token > before, "tokens keep growing across the failover (one clock here)"
        # every watchdog twin renews on the new master: the TTL there is set again
        with new.client(LOCK_DB) as c:
            wait_until(lambda: all(c.pttl(lock.key) > 25_000 for lock in held), 30, 0.2,
                       "renewals of every held lock on the new master")
        assert all(not lock.lost for lock in held), [lock.lost_reason for lock in held]
        for lock in (moved, after):
            assert lock.server.release(lock).status is Release.DELETED
        stayed.server.release(stayed)  # on the old master it is gone with the demotion
    finally:
        for lock in held:
            dog.forget(lock)
        dog.shutdown()
    assert all(lock.server.release(lock).status is Release.DELETED for lock in held), "released on the new master"
    listening.close()
    plain.close()


def test_a_read_cut_short_leaves_no_reply_behind_for_the_next_acquire(sentinel):
    """A timeout mid-read (the master frozen past the socket timeout) drops the thread's held
    connection. redis-py's Sentinel connection keeps it (``disconnect_on_error=False``), and the
    late reply of the cut-short acquire ("taken, fence N") was then read as the NEXT acquire's:
    a key somebody else holds looked taken, and two holders ran."""
    other = server_for(sentinel)
    mine = server_for(sentinel, redis_options={"socket_timeout": 0.2})
    tag = uuid.uuid4().hex[:6]
    theirs = other.acquire(f"theirs-{tag}", 30)
    warm = mine.acquire(f"warm-{tag}", 30)  # the held connection is open and the script loaded
    assert isinstance(theirs, Lock) and isinstance(warm, Lock)
    master = sentinel.master
    master.pause()  # (well under Sentinel's down-after: no failover)
    try:
        with pytest.raises(LockBackendUnavailable):
            mine.acquire(f"cut-{tag}", 30)
    finally:
        master.resume()
    with master.client(LOCK_DB) as c:  # the frozen master ran the acquire once thawed: its reply is sent
        wait_until(lambda: c.exists(slot_safe(f"cut-{tag}")), 5, 0.02, "the cut-short acquire to run")
    seen = mine.acquire(f"theirs-{tag}", 30)
    assert not isinstance(seen, Lock), "a held key read as taken: a stale reply was read as this one's"
    assert seen.fencing_token == theirs.fencing_token
    with master.client(LOCK_DB) as c:
        c.delete(slot_safe(f"cut-{tag}"))
    for lock in (theirs, warm):
        assert lock.server.release(lock).status is Release.DELETED
    other.close()
    mine.close()


def test_an_unplanned_failover_under_a_running_holder_through_real_workers(redis_server, tmp_path):
    """A real worker (prefork, 2 children) locks on Sentinel with min_replicas=1; the broker is a
    Redis of its own. A holder runs a 4 s body; duplicates arrive every 0.2 s; the master is
    SIGKILLed 1 s into the body. The holder keeps its lock on the promoted replica (its acquire
    was acknowledged by one), duplicates meanwhile are skipped or, while no master answers, sent
    again until one does; once the holder ends a duplicate runs. No two bodies overlap, and the
    fencing token rises."""
    wa = load_worker_app(redis_server)
    k = f"unplanned-{uuid.uuid4().hex[:8]}"
    with SentinelDeployment(replicas=2, sentinels=3) as deployment:
        conf = {"singleton_lock_transport_options": deployment.transport_options, "singleton_lock_min_replicas": 1,
                "singleton_lock_replica_timeout": 0.5, "singleton_lock_retry_backoff": 0.2,
                "singleton_lock_retry_backoff_max": 0.5}
        worker = start_worker_process(redis_server, tmp_path, concurrency=2, env={
            "CSL_LOCK_URL": deployment.url(LOCK_DB), "CSL_EXTRA_CONF": json.dumps(conf)})
        try:
            worker.wait_ready(90)
            holder = wa.journaled.delay(k, 4.0, "holder")
            wait_until(lambda: wa.journal.llen(f"journaled:{k}") >= 1, 60, 0.02, "the holder to start")
            dups = []
            for i in range(40):
                dups.append(wa.journaled.delay(k, 0.2, f"d{i}"))
                if i == 5:
                    deployment.kill_master()
                time.sleep(0.2)
            assert holder.get(timeout=60)["tag"] == "holder"
            ended = ("SUCCESS", "REVOKED", "FAILURE")
            try:
                wait_until(lambda: all(d.state in ended for d in dups), 90, 0.1, "every duplicate to end")
            except TimeoutError:
                raise AssertionError(f"not ended: {[(d.id, d.state) for d in dups if d.state not in ended]}; "
                                     f"worker log: {worker.log()[-3000:]}") from None
            # each ends SUCCESS when it ran, REVOKED when skipped; none fails
            assert {d.state for d in dups} <= {"SUCCESS", "REVOKED"}, [(d.id, d.state, d.result) for d in dups]
        finally:
            worker.stop()
    log = [json.loads(x) for x in wa.journal.lrange(f"journaled:{k}", 0, -1)]
    starts = {e["id"]: e for e in log if e["event"] == "start"}
    ends = {e["id"]: e for e in log if e["event"] == "end"}
    assert holder.id in ends, "the holder's body ran to its end"
    ran = [d for d in dups if d.state == "SUCCESS"]
    assert ran, "a duplicate ran once the holder ended"
    assert set(starts) == set(ends) == {holder.id, *(d.id for d in ran)}, "each body that started ended, once"
    assert_no_overlap([(starts[i]["at"], ends[i]["at"]) for i in starts], "bodies of one key")
    fences = [starts[i]["fence"] for i in sorted(starts, key=lambda i: starts[i]["at"])]
    assert fences == sorted(fences) and len(set(fences)) == len(fences), f"fencing tokens rise: {fences}"


def test_parks_lost_in_a_failover_to_a_lagging_replica_are_sent_again():
    """A task parks while the replica is cut off (frozen, its link dropped by the master), so the park
    reaches only the master; the master is then SIGKILLed and Sentinel promotes the replica, which
    never got it. The index and its epoch were replicated before: the epoch says nothing changed.
    The parking process's sweeper still sends the lost park again, marked recovered, soon after its
    client reaches the new master: it keeps its backup copy whatever the epoch says (else the task
    would stay WAITING)."""
    import signal

    from celery_singleton_lock.engine import line as queue
    from celery_singleton_lock.engine import sweeper as sweeping
    from celery_singleton_lock.engine.lock import slot_safe

    with SentinelDeployment(replicas=1, sentinels=3) as dep:
        server = server_for(dep)
        index = queue.index_key(f"p{uuid.uuid4().hex[:6]}")
        name = f"lagging-{uuid.uuid4().hex[:6]}"
        key = slot_safe(name)
        sent: list = []
        server.send_handoff = lambda srv, handoff: sent.append(handoff) or True
        sweeper = sweeping.Sweeper(interval=0.2)
        try:
            holder = server.acquire(name, 60, owner_id="holder")
            assert isinstance(holder, Lock)
            sweeper.watch(server, index)
            wait_until(lambda: sweeper._watched.get((server, index)), 10, 0.05, "the sweeper to learn the epoch")
            [replica] = dep.replicas
            wait_until(lambda: replica.client(LOCK_DB).exists(key, index + ":epoch") == 2, 10, 0.05,
                       "the replica to have the lock and the epoch")
            old = dep.master
            replica.pause()  # it lags: frozen, and its link dropped, so nothing more reaches it
            old.client().client_kill_filter(_type="replica")
            entry = queue.new_entry()
            assert queue.park(server, name, entry, kind="t", wait=120, ttl=5, owner_id="waiter",
                              message=b"msg").place == 1
            sweeper.remember(server, name, entry, "waiter", 5, b"msg")
            os.kill(old.pid, signal.SIGKILL)  # our own redis-server, by PID
            replica.resume()
            lost_at = time.monotonic()
            wait_until(lambda: [h for h in sent if h.entry == entry], 60, 0.05, "the lost park to be sent again")
            took = time.monotonic() - lost_at
            [again] = [h for h in sent if h.entry == entry]
            assert again.what == "recovered" and again.owner_id == "waiter" and again.message == b"msg"
            assert dep.master.port == replica.port and not dep.master.client(LOCK_DB).hexists(key + ":w", entry)
            print(f"\n[sentinel] master killed -> lost park sent again after {took:.2f} s")
        finally:
            sweeper.stop()
            server.close()
