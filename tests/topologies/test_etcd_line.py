"""The waiting line on etcd (topologies/etcd_line.py), through the engine's own calls against a private
etcd member: FIFO by create revision, the release's two steps and what moves a line when a step never
came (the next acquirer, the sweeper), claims and their identity, deadlines, and leaving.

The same line under real Celery workers (every SIGKILL point, redeliveries) runs in test_handoff.py,
test_line_recovery.py and test_task_*.py, parametrized over the backend; a leader change in
test_etcd_cluster.py.
"""

from __future__ import annotations

import time
import uuid

import pytest
from _etcd_servers import running_etcd

from celery_singleton_lock.engine import layout
from celery_singleton_lock.engine import line as lines
from celery_singleton_lock.engine.lock import Holder, Lock, Verdict
from celery_singleton_lock.testing.servers import wait_until
from celery_singleton_lock.topologies.etcd import EtcdLockServer
from celery_singleton_lock.topologies.etcd_session import b64
from celery_singleton_lock.watchdog.renewer import Watchdog

pytestmark = pytest.mark.timeout(90)

MESSAGE = b"application/json\nutf-8\n{}"


@pytest.fixture(scope="module")
def own_etcd():
    """A member of this module's own: no other test's sweeper (they sweep every line of their etcd)
    hands these lines on."""
    with running_etcd(members=1) as cluster:
        yield cluster


@pytest.fixture
def server(own_etcd):
    """An etcd lock server whose hand-offs are recorded instead of published."""
    srv = EtcdLockServer.from_url(own_etcd.url())
    srv.sent = []
    srv.send_handoff = lambda _srv, handoff: srv.sent.append(handoff) is None
    yield srv
    srv.close()


def new_name() -> str:
    return f"line:{uuid.uuid4().hex[:12]}"


def park(server, name, owner, *, wait=60.0, first=False, again=False, redelivered=False, entry=None):
    return lines.park(server, name, entry or lines.entry_for(owner), kind="t", wait=wait, ttl=30, owner_id=owner,
                      message=MESSAGE, first=first, again=again, redelivered=redelivered)


def test_waiters_are_handed_the_key_in_the_order_they_parked(server):
    name = new_name()
    holder = server.acquire(name, 30, owner_id="holder")
    assert isinstance(holder, Lock)
    assert [park(server, name, f"w{i}").place for i in range(3)] == [1, 2, 3]
    assert lines.line(server, name) == ["w0", "w1", "w2"]
    fresh = server.acquire(name, 30, owner_id="newcomer")
    assert isinstance(fresh, Holder) and fresh.owner_id == "holder"
    ran, fences = [], [holder.fencing_token]
    lock = holder
    for _ in range(3):
        released = server.release(lock)
        assert released and [h.what for h in released.handoffs] == ["run"]
        [turn] = server.sent
        server.sent.clear()
        # nobody jumps the reserved key: neither a newcomer nor another waiter's copy
        assert isinstance(server.acquire(name, 30, owner_id="newcomer"), Holder)
        lock = server.acquire(name, 30, owner_id=turn.owner_id, entry=turn.entry)
        assert isinstance(lock, Lock), lock
        ran.append(turn.owner_id)
        fences.append(lock.fencing_token)
        # a second copy of the same turn finds its entry gone: it never runs twice
        assert server.acquire(name, 30, owner_id=turn.owner_id, entry=turn.entry) is Verdict.ENTRY_GONE
    assert ran == ["w0", "w1", "w2"] and fences == sorted(set(fences))
    assert server.release(lock) and server.sent == []
    assert isinstance(server.acquire(name, 30, owner_id="newcomer"), Lock)


def test_a_copy_of_a_claimed_turn_finds_its_entry_gone(server):
    name = new_name()
    holder = server.acquire(name, 30, owner_id="holder")
    park(server, name, "w")
    server.release(holder)
    [turn] = server.sent
    lock = server.acquire(name, 30, owner_id="w", entry=turn.entry)
    assert isinstance(lock, Lock)
    server.release(lock)
    assert server.acquire(name, 30, owner_id="w", entry=turn.entry) is Verdict.ENTRY_GONE
    # and a broker redelivery of its parked message finds the tombstone: its turn was taken
    assert park(server, name, "w", redelivered=True, entry=turn.entry) == lines.Parked(lines.Park.TOOK_ITS_TURN)


def test_a_release_that_never_handed_on_is_moved_on_by_the_next_acquirer(server):
    """The release's first step ran (the key deleted) and its second never did (the releaser died):
    a newcomer finds waiters in line, parks behind them and hands the key to the first itself."""
    name = new_name()
    holder = server.acquire(name, 30, owner_id="holder")
    park(server, name, "w0")
    server.transport.call("/kv/deleterange", {"key": b64(layout.etcd_lock(holder.key))})  # step one only
    late = server.acquire(name, 30, owner_id="late")
    assert isinstance(late, Holder) and late.queued  # nobody jumps the line
    assert park(server, name, "late").place == 2
    assert [(h.what, h.owner_id) for h in server.sent] == [("run", "w0")]
    assert lines.line(server, name) == ["w0", "late"]


def test_the_sweeper_moves_a_line_whose_holder_died_and_times_out_a_waiter_past_its_deadline(server, own_etcd):
    name = new_name()
    other = EtcdLockServer.from_url(own_etcd.url())  # the holder's process
    holder = other.acquire(name, 30, owner_id="holder")
    assert isinstance(holder, Lock)
    park(server, name, "patient")
    park(server, name, "hasty", wait=0.2)
    [session] = other.sessions()
    session.revoke(other.transport)  # the holder's process died: its lease, and the lock, are gone
    assert server.holder(name) is None
    # until "hasty"'s deadline has passed (a clock the waiter carries: this host's, ms), as read from its record
    [deadline_ms] = [w.record.deadline_ms for w in server.waiting.records(name)[0] if w.record.owner == "hasty"]
    wait_until(lambda: time.time() * 1000 > deadline_ms, 5, 0.01, '"hasty"\'s deadline to pass')
    made = server.waiting.sweep_all(lambda key: True)
    assert made == 1
    assert sorted((h.what, h.owner_id) for h in server.sent) == [("expired", "hasty"), ("run", "patient")]
    assert lines.line(server, name) == ["patient"]  # handed, until its copy claims
    server.sent.clear()
    lock = server.acquire(name, 30, owner_id="patient", entry=lines.entry_for("patient"))
    assert isinstance(lock, Lock)
    server.release(lock)

    def indexed() -> bool:
        server.waiting.sweep_all(lambda key: True)  # a key's look is lent for a second or two
        return bool(server.transport.call("/kv/range", {"key": b64(layout.ETCD_WAITING + lock.key)}).get("kvs"))

    wait_until(lambda: not indexed(), 10, 0.2, "an empty line to leave the sweepers' index")


def test_a_turn_whose_message_never_came_is_sent_again_when_its_reservation_runs_out(server):
    name = new_name()
    holder = server.acquire(name, 30, owner_id="holder")
    lines.park(server, name, lines.entry_for("w"), kind="t", wait=60, ttl=1, owner_id="w", message=MESSAGE)
    server.send_handoff = lambda _srv, _h: False  # never published (the releaser died): no confirm
    server.release(holder)
    assert isinstance(server.acquire(name, 30, owner_id="other"), Holder)  # reserved for w
    server.send_handoff = lambda _srv, handoff: server.sent.append(handoff) is None
    wait_until(lambda: server.waiting.sweep_all(lambda key: True) == 1, 10, 0.2, "the reservation to run out")
    [again] = server.sent
    assert (again.what, again.owner_id) == ("run", "w")
    assert isinstance(server.acquire(name, 30, owner_id="w", entry=again.entry), Lock)


def test_a_waiter_that_leaves_while_the_key_is_reserved_for_it_passes_it_on(server):
    name = new_name()
    holder = server.acquire(name, 30, owner_id="holder")
    park(server, name, "w0")
    park(server, name, "w1")
    server.release(holder)
    assert [h.owner_id for h in server.sent] == ["w0"]
    assert lines.leave(server, name, lines.entry_for("w0")) is True
    assert [h.owner_id for h in server.sent] == ["w0", "w1"]
    assert server.acquire(name, 30, owner_id="w0", entry=lines.entry_for("w0")) is Verdict.ENTRY_GONE


def test_a_parked_copy_of_the_holder_is_dropped_when_the_holder_succeeds(server):
    name = new_name()
    holder = server.acquire(name, 30, owner_id="task-1")
    entry = lines.entry_for("task-1")
    assert lines.park(server, name, entry, kind="s", wait=60, ttl=30, owner_id="task-1", message=MESSAGE,
                      first=True).place == 1
    park(server, name, "other")
    released = server.release(holder, succeeded=True)
    assert [h.owner_id for h in released.handoffs] == ["other"]  # the copy never runs
    assert lines.line(server, name) == ["other"]


def test_a_parked_entry_parks_once_and_its_copy_claims_its_reservation(server):
    name = new_name()
    holder = server.acquire(name, 30, owner_id="holder")
    assert park(server, name, "w").place == 1
    assert park(server, name, "w").found is lines.Park.ALREADY  # a redelivery of the parked message
    server.release(holder)
    assert park(server, name, "w", again=True, first=True) == lines.Parked(lines.Park.CLAIM)


@pytest.mark.long
def test_one_keep_alive_per_period_for_locks_taken_at_different_moments(server):
    """Locks taken a little over half a period apart fall due at different ticks (each took a fresh
    keep-alive when it was taken); they share the lease's one keep-alive per period (they used to
    send about one and three quarters)."""
    watchdog = Watchdog(tick=0.05)
    locks = []
    try:
        for _ in range(3):
            for _ in range(20):
                lock = server.acquire(new_name(), 3)
                watchdog.track(lock)
                locks.append(lock)
            time.sleep(0.55)
        [session] = server.sessions()
        time.sleep(2.0)  # settled
        before, started = session.keepalives, time.monotonic()
        time.sleep(6.0)  # fault-free window: six periods of one second
        periods = (time.monotonic() - started) / 1.0
        assert not any(lock.lost for lock in locks)
        assert session.keepalives - before <= periods + 1
    finally:
        for lock in locks:
            watchdog.forget(lock)
            server.release(lock)
        watchdog.shutdown()


def test_a_revoked_task_leaves_every_line_it_waits_in(server):
    """``AsyncResult.revoke()`` of a waiting task (revoke.py) takes it out of every etcd line; if a key
    was reserved for it, the key passes on."""
    first, second = new_name(), new_name()
    holder = server.acquire(first, 30, owner_id="holder")
    assert isinstance(holder, Lock)
    park(server, first, "doomed")
    park(server, first, "kept")
    server.release(holder)  # the first key is now reserved for "doomed"
    other = server.acquire(second, 30, owner_id="holder")
    park(server, second, "doomed")
    server.sent.clear()
    left = server.waiting.remove("doomed")
    assert sorted(left) == sorted([holder.key, other.key])
    assert lines.line(server, first) == ["kept"] and lines.line(server, second) == []
    assert [(h.what, h.owner_id) for h in server.sent] == [("run", "kept")]  # the reserved key passed on
    server.release(other)


def test_a_revoke_whose_leave_reply_was_lost_still_finds_the_key_it_left(server, own_etcd):
    """A revoke takes a waiter out (the leave's txn runs), and the reply is lost: the look fails. The
    revoke looks again with the same request id, and by then the waiter is gone from every line. It
    used to find nothing (so its task was never stored REVOKED and stayed WAITING for ever); the
    tombstone its first try left names the request id, so the look answers with that key, and the
    line moves on."""
    from _fault_proxy import FaultProxy

    from celery_singleton_lock.exceptions import LockBackendUnavailable

    name = new_name()
    holder = server.acquire(name, 30, owner_id="holder")
    assert isinstance(holder, Lock)
    park(server, name, "doomed")
    park(server, name, "kept")
    server.release(holder)  # reserved for "doomed": its leave must pass the key on
    proxy = FaultProxy(own_etcd.members[0].client_port)
    behind = EtcdLockServer.from_url(f"etcd://127.0.0.1:{proxy.port}")
    behind.sent = []
    behind.send_handoff = lambda _srv, handoff: behind.sent.append(handoff) is None
    try:
        proxy.arm(b"/v3/kv/txn", 1)
        with pytest.raises(LockBackendUnavailable):
            behind.waiting.remove("doomed", "look-1")
        assert proxy.dropped == [b"/v3/kv/txn"], "the leave's reply was not lost: the test did not run its fault"
        assert lines.line(server, name) == ["kept"], "the lost leave did not run"
        assert behind.waiting.remove("doomed", "look-1") == [holder.key]
        assert [(h.what, h.owner_id) for h in behind.sent] == [("run", "kept")]  # the key passed on
        assert behind.waiting.remove("doomed", "look-2") == []  # another look: nothing of it left
    finally:
        behind.close()
        proxy.close()
