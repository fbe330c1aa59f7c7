"""What only the etcd backend has: its URL, the one-lease session and its single keep-alive, a lost
lease losing every lock on it at once, and fencing by create revision across a leader change.

Against private etcd processes (tests/_etcd_servers.py): one member for the session
(``etcd_server``), and a 3-member cluster of the test's own for the leader change. The contract
tests shared with Redis are parametrized over the backend in their own files (tests/_backends.py).
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from _etcd_servers import running_etcd

from celery_singleton_lock import held
from celery_singleton_lock.engine.lock import Forced, Holder, Lock, Release
from celery_singleton_lock.exceptions import LockBackendRefused, LockBackendUnavailable, LockLost
from celery_singleton_lock.testing.servers import wait_until
from celery_singleton_lock.topologies.etcd import VERIFY_UP_TO, EtcdLockServer
from celery_singleton_lock.topologies.etcd_session import parse_etcd_url
from celery_singleton_lock.topologies.servers import from_settings, shared
from celery_singleton_lock.topologies.urls import lock_source, topology
from celery_singleton_lock.watchdog.renewer import Watchdog

pytestmark = pytest.mark.timeout(90)


def new_name() -> str:
    return f"etcd:{uuid.uuid4().hex[:12]}"


# -- the URL (pure) ----------------------------------------------------------------------------------


def test_url_with_several_endpoints_tls_and_credentials():
    parsed = parse_etcd_url("etcds://app:s3cr%40t@h1:2379,[::1]:2380,h3:2381?timeout=2.5&ca_cert=/ca.pem")
    assert parsed["endpoints"] == [("h1", 2379), ("::1", 2380), ("h3", 2381)]
    assert parsed["protocol"] == "https" and parsed["timeout"] == 2.5 and parsed["ca_cert"] == "/ca.pem"
    assert (parsed["user"], parsed["password"]) == ("app", "s3cr@t")
    assert "s3cr" not in parsed["url"] and parsed["url"].startswith("etcds://app:***@h1:2379")
    assert topology("etcd://h:2379") == "etcd"
    assert lock_source({"singleton_lock_url": "etcd://h1:2379,h2:2379"}) == ("etcd://h1:2379,h2:2379",
                                                                             "singleton_lock_url")


@pytest.mark.parametrize("url, bad", [
    ("etcd://u:pw@h1", "'h1' is not host:port"),
    ("etcd://h1:2379,", "'(empty)' is not host:port"),
    ("etcd://h1:99999", "'h1:99999' is not host:port"),
    ("etcd://u:pw@h1:2379?timeout=soon", "timeout='soon'"),
    ("etcd://h1:2379?tls=1", "unknown option(s) tls"),
    ("etcd://u:pw@h1:2379/2", "a path ('/2')"),
])
def test_a_bad_url_names_the_bad_part_and_never_the_password(url, bad):
    with pytest.raises(ValueError) as info:
        parse_etcd_url(url)
    assert bad in str(info.value) and "pw" not in str(info.value)


def test_an_unreachable_cluster_is_unavailable_with_the_password_redacted():
    from celery_singleton_lock.testing.servers import free_port

    server = from_settings(f"etcd://app:hunter2@127.0.0.1:{free_port()},127.0.0.1:{free_port()}?timeout=1")
    with pytest.raises(LockBackendUnavailable) as info:
        server.acquire(new_name(), 5)
    assert "hunter2" not in str(info.value) and "app:***@" in str(info.value)


# -- against one etcd -----------------------------------------------------------------------------------


def test_one_keep_alive_per_round_however_many_locks(etcd_server):
    """300 locks of one process hang on one lease: the session's round is ONE keep-alive (plus, for
    few locks only, one txn of reads), and every lock takes its confirmation as its own."""
    server = EtcdLockServer.from_url(etcd_server.url())
    locks = [server.acquire(new_name(), 4, owner_id=f"t{i}") for i in range(300)]
    assert all(isinstance(lock, Lock) for lock in locks)
    [session] = server.sessions()
    assert len(session.locks) == 300 and all(lock.shared is session for lock in locks)
    time.sleep(1.5)  # past a third of the TTL (a period): the next round keeps the lease alive
    before = session.keepalives  # (taking 300 locks on a slow machine may have kept it alive already)
    assert session.keep(locks, 5.0) == (True, []) and session.keepalives == before + 1
    assert {lock.confirmed_at for lock in locks} == {session.confirmed_at}
    assert server.renew_many(locks) == [True] * 300 and session.keepalives == before + 1  # confirmed just now
    for lock in locks:
        assert server.release(lock)


def test_a_small_session_round_reads_its_keys_and_finds_one_deleted_from_outside(etcd_server):
    server = EtcdLockServer.from_url(etcd_server.url())
    locks = [server.acquire(new_name(), 4) for _ in range(3)]
    [session] = server.sessions()
    operator = EtcdLockServer.from_url(etcd_server.url())
    assert operator.force_release(locks[1].key)[0] is Forced.RELEASED  # an operator's release
    assert session.keep(locks, 5.0) == (True, [locks[1]])
    assert server.renew_many(locks) == [True, False, True]
    for lock in (locks[0], locks[2]):
        assert server.release(lock)


def test_the_watchdog_keeps_many_locks_with_one_keep_alive_per_period(etcd_server):
    server = EtcdLockServer.from_url(etcd_server.url())
    watchdog = Watchdog(tick=0.05)
    try:
        locks = [server.acquire(new_name(), 3) for _ in range(200)]
        for lock in locks:
            watchdog.track(lock)
        [session] = server.sessions()
        wait_until(lambda: session.keepalives >= 3, 10, 0.05, "three keep-alive periods")
        assert not any(lock.lost for lock in locks)
        assert session.keepalives <= 4  # ~one per TTL/3 (3 s lease): not one per lock, nor per tick
    finally:
        for lock in locks:
            watchdog.forget(lock)
            server.release(lock)
        watchdog.shutdown()


def test_the_watchdog_keeps_a_session_on_one_timer_and_finds_an_outside_delete(etcd_server):
    """The watchdog schedules the session, not its locks (one timer for 50 locks), and its round
    still reads a small session's keys: a lock deleted by an operator is found lost and untracked."""
    server = EtcdLockServer.from_url(etcd_server.url())
    watchdog = Watchdog(tick=0.05)
    lost = threading.Event()
    locks = [server.acquire(new_name(), 3) for _ in range(50)]
    try:
        for lock in locks:
            watchdog.track(lock, on_lost=lambda lock, reason: lost.set())
        assert len(watchdog) == 50 and len(watchdog._wheel) + len(watchdog._in_flight) == 1  # the session
        [session] = server.sessions()
        EtcdLockServer.from_url(etcd_server.url()).force_release(locks[7].key)
        assert lost.wait(10), "the round after the delete found it"
        assert locks[7].lost and locks[7] not in watchdog and len(watchdog) == 49
        wait_until(lambda: session.keepalives >= 2, 10, 0.05, "two keep-alive periods")
        assert not any(lock.lost for i, lock in enumerate(locks) if i != 7)
    finally:
        for lock in locks:
            watchdog.forget(lock)
            server.release(lock)
        assert len(watchdog._wheel) == 0  # the last lock forgotten takes the session's timer
        watchdog.shutdown()


def test_a_lease_lost_and_granted_anew_loses_the_old_locks_and_keeps_the_new(etcd_server):
    """An acquire finds the session's lease gone (revoked from outside) and grants a new one: the
    watchdog's next round loses and untracks every lock of the old lease, and keeps the new lock."""
    server = EtcdLockServer.from_url(etcd_server.url())
    watchdog = Watchdog(tick=0.05)
    old = [server.acquire(new_name(), 3) for _ in range(VERIFY_UP_TO + 2)]  # too many to read their keys
    fresh = None
    try:
        for lock in old:
            watchdog.track(lock)
        [session] = server.sessions()
        first_lease = session.lease
        EtcdLockServer.from_url(etcd_server.url()).transport.call("/kv/lease/revoke", {"ID": str(first_lease)})
        fresh = server.acquire(new_name(), 3)  # its put names the dead lease: LeaseGone, then a new session
        assert isinstance(fresh, Lock) and fresh.lease != first_lease and session.lease == fresh.lease
        watchdog.track(fresh)
        wait_until(lambda: not any(lock in watchdog for lock in old), 10, 0.05, "the old locks untracked")
        assert all(lock.lost for lock in old) and fresh in watchdog
        before = session.keepalives
        wait_until(lambda: session.keepalives >= before + 2, 10, 0.05, "two periods of the new lease")
        assert not fresh.lost and len(watchdog) == 1 and watchdog.losses == len(old)
    finally:
        for lock in [*old, *([fresh] if isinstance(fresh, Lock) else [])]:
            watchdog.forget(lock)
            server.release(lock)
        watchdog.shutdown()


def test_a_lost_lease_marks_every_lock_on_it_lost_at_once(etcd_server):
    server = EtcdLockServer.from_url(etcd_server.url())
    lost: list[tuple[str, str]] = []
    everyone = threading.Event()
    locks = [server.acquire(new_name(), 3) for _ in range(5)]
    for lock in locks:
        def on_lost(lock, reason):
            lost.append((lock.key, reason))
            if len(lost) == len(locks):
                everyone.set()
        lock.on_lost = on_lost
    [session] = server.sessions()
    other = EtcdLockServer.from_url(etcd_server.url())
    other.transport.call("/kv/lease/revoke", {"ID": str(session.lease)})  # from outside: the lease is gone
    time.sleep(1.2)  # past a third of the TTL (a period): the next round sends a keep-alive
    assert server.renew_many(locks[:1]) == [False]  # one keep-alive finds it gone ...
    assert everyone.wait(10)  # ... and every lock on it is reported lost
    assert all(lock.lost for lock in locks)
    with pytest.raises(LockLost):
        locks[3].ensure()
    assert all("lease" in reason for _, reason in lost)
    fresh = server.acquire(locks[0].key, 3)  # a new session: the key is free again
    assert isinstance(fresh, Lock) and fresh.fencing_token > locks[0].fencing_token
    assert server.release(fresh)


def test_held_on_etcd_waits_by_polling_and_is_renewed(etcd_server):
    name = new_name()
    url = etcd_server.url()
    with held(url, name, 2, owner_id="a") as lock:
        assert isinstance(shared(url).holder(name), Holder)
        time.sleep(2.5)  # past the lease's TTL: it lives on only if the watchdog renewed it
        assert not lock.lost
        lock.ensure()
    with held(url, name, 2, owner_id="b") as again:
        assert again.fencing_token > lock.fencing_token


# -- a 3-member cluster: fencing across a leader change ------------------------------------------------


@pytest.fixture
def etcd_cluster():
    with running_etcd(members=3) as cluster:
        yield cluster


@pytest.mark.slow
def test_fencing_tokens_rise_across_a_leader_kill(etcd_cluster):
    server = EtcdLockServer.from_url(etcd_cluster.url() + "?timeout=2")
    name = new_name()
    fences = []

    def take() -> Lock | None:
        try:
            got = server.acquire(name, 5)
        except LockBackendUnavailable:
            return None
        return got if isinstance(got, Lock) else None

    for _kill in range(3):
        for _ in range(5):
            lock = wait_until(take, 20, 0.1, "a lock")
            fences.append(lock.fencing_token)
            assert server.release(lock)
        leader = etcd_cluster.leader()
        leader.kill()
        etcd_cluster.leader()  # a new one is elected
        etcd_cluster.restart(leader)
    assert all(a < b for a, b in zip(fences, fences[1:], strict=False)), fences


def test_an_attempt_whose_reply_was_lost_is_taken_back_never_left_behind(etcd_server):
    """An acquire whose put ran but whose reply never came (a timeout; a member that failed after
    applying it): the next attempt, given the lost attempt's token (``retake``, as a task passes it),
    or the same token again, gets that very lock (same revision) instead of being refused by it and
    leaving it held on a lease this process keeps alive."""
    server = EtcdLockServer.from_url(etcd_server.url())
    name = new_name()
    lost = server.acquire(name, 5, owner_id="t", token="a" * 32)  # its reply "lost": the caller never saw it
    assert isinstance(lost, Lock)
    again = server.acquire(name, 5, owner_id="t", token="a" * 32)
    assert isinstance(again, Lock) and again.fencing_token == lost.fencing_token
    retaken = server.acquire(name, 5, owner_id="t", token="b" * 32, retake="a" * 32)
    assert isinstance(retaken, Lock) and retaken.token == "b" * 32 and retaken.fencing_token == lost.fencing_token
    assert server.release(lost).status is Release.TAKEN  # the old token no longer holds it
    assert isinstance(server.acquire(name, 5, owner_id="u"), Holder)
    assert server.release(retaken).status is Release.DELETED and server.holder(name) is None


@pytest.fixture
def etcd_with_auth():
    with running_etcd(members=1) as cluster:
        member = cluster.members[0]
        assert member.post("/v3/auth/user/add", {"name": "root", "password": "s3cret"}) is not None
        assert member.post("/v3/auth/user/grant", {"user": "root", "role": "root"}) is not None
        assert member.post("/v3/auth/enable", {}) is not None
        yield cluster


def test_auth_user_and_password_and_a_wrong_password_is_refused_without_showing_it(etcd_with_auth):
    endpoint = etcd_with_auth.members[0].endpoint
    server = from_settings(f"etcd://root:s3cret@{endpoint}")
    lock = server.acquire(new_name(), 5, owner_id="t")
    assert isinstance(lock, Lock) and server.renew(lock) and server.release(lock)
    with pytest.raises(LockBackendRefused, match="user name is empty"):  # no credentials: a refusal to fix
        from_settings(f"etcd://{endpoint}").acquire(new_name(), 5)
    with pytest.raises(LockBackendRefused, match="authentication failed") as info:
        from_settings(f"etcd://root:wrong@{endpoint}").acquire(new_name(), 5)
    assert "wrong" not in str(info.value) and "root:***@" in str(info.value)


def test_a_forked_child_gets_its_own_connections_and_session(etcd_server):
    """A prefork child inherits the server object: it talks on connections and a lease of its own,
    and never releases or renews its parent's lock."""
    import os

    server = EtcdLockServer.from_url(etcd_server.url())
    parent_lock = server.acquire(new_name(), 5)
    assert isinstance(parent_lock, Lock)
    [parent_session] = server.sessions()
    pid = os.fork()
    if pid == 0:  # the child: any failure is its exit status
        code = 1
        try:
            mine = server.acquire(new_name(), 5)
            ok = (isinstance(mine, Lock) and server.release(parent_lock).status is Release.NOT_HERE
                  and server.renew_many([parent_lock]) == [False] and server.sessions()[0].lease != parent_session.lease
                  and server.release(mine).status is Release.DELETED)
            code = 0 if ok else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert server.renew(parent_lock) and server.release(parent_lock).status is Release.DELETED


@pytest.mark.slow
def test_an_acquire_that_lands_late_never_leaves_a_lock_behind(etcd_cluster):
    """An acquire sent to a member that is paused times out; the key is taken, used and released
    through the other members; then the member resumes and the old put may land, late (it did, in
    the cluster test's history). Without a guard that put holds the key on a lease its process keeps
    alive for its other locks, forever. A retry naming the lost attempt (``retake``, as a task's
    re-send does) tombs it first, so it lands on nothing; without such a retry, the process settles
    its attempts in doubt on its next acquire or renewal round: the key it took late is deleted.
    Whether Go's gateway still applies a request whose client left is its business, so the landing
    is played here deterministically: the very txn the lost attempt sent, sent again."""
    from celery_singleton_lock.engine import layout
    from celery_singleton_lock.engine.lock import slot_safe
    from celery_singleton_lock.topologies.etcd_txn import _compare_create, _put, _value, not_tombed

    paused, *others = etcd_cluster.members
    late = EtcdLockServer.from_url(f"etcd://{paused.endpoint}?timeout=1")
    rest = EtcdLockServer.from_url("etcd://" + ",".join(m.endpoint for m in others))
    assert isinstance(late.acquire(new_name(), 5), Lock)  # connected, with a session kept for other locks
    session = late.session(5)
    for retry_names_it in (False, True):
        name, token = new_name(), uuid.uuid4().hex
        paused.pause()
        try:
            with pytest.raises(LockBackendUnavailable):
                late.acquire(name, 5, token=token, retake="")
            lock = rest.acquire(name, 5, retake=token if retry_names_it else "")
            assert isinstance(lock, Lock) and rest.release(lock)
        finally:
            paused.resume()
        wait_until(paused.healthy, 20, 0.1, "the paused member back")
        key = slot_safe(name)
        landing = rest.transport.txn(  # the lost attempt's txn, applied late
            [_compare_create(layout.etcd_lock(key), 0), not_tombed(key, token)],
            [_put(layout.etcd_lock(key), _value(token, session.ttl, None), session.lease)], [], key)
        if retry_names_it:
            assert not landing.get("succeeded"), "the retry tombed the lost attempt: it lands on nothing"
        else:  # landed: played here, or the real one already did (then the played one found it held)
            assert rest.holder(name).raw.startswith(token + " "), landing
            late.renew_many([])  # the next renewal round settles the attempt in doubt
        assert rest.holder(name) is None
        assert isinstance(rest.acquire(name, 5), Lock)
