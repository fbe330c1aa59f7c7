"""Every call to the lock Redis is safe to send twice: a reply lost after Redis ran the call, the
client's second send answers as the first did.

A fault proxy sits between the client and a private redis-server. Armed for one script, it lets
Redis run the call, drops the reply and resets the connection; the client then sends the call again
on a new connection. Each test sets up the same state twice, runs the call once cleanly and once
with its reply lost, and checks that both answer the same, and that Redis ends in the same state.
Each also checks that the fault did happen (the proxy dropped the reply), so none passes vacuously.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from _fault_proxy import FaultProxy, sha_of

from celery_singleton_lock.engine import dedupe, layout, line_scripts, scripts
from celery_singleton_lock.engine import line as queue
from celery_singleton_lock.engine.lock import Handoff, Lock, Release, Verdict, slot_safe
from celery_singleton_lock.engine.server import LockServer
from celery_singleton_lock.testing.servers import RedisServer, wait_until

pytestmark = pytest.mark.timeout(60)

DB = 2


class Pair:
    """A private redis-server, a client straight to it, and one through the fault proxy."""

    def __init__(self, server: RedisServer, proxy: FaultProxy) -> None:
        self.proxy = proxy
        self.direct = LockServer.from_url(server.url(DB))
        self.faulty = LockServer.from_url(proxy.url(DB))
        self.sent: list[Handoff] = []
        for client in (self.direct, self.faulty):
            client.send_handoff = self._record

    def _record(self, server: LockServer, handoff: Handoff) -> bool:
        self.sent.append(handoff)
        return True

    def close(self) -> None:
        self.direct.close()
        self.faulty.close()


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    with RedisServer() as server:
        proxy = FaultProxy(server.port)
        both = Pair(server, proxy)
        try:
            yield both
        finally:
            both.close()
            proxy.close()


def twice(pair: Pair, script: str, scenario: Callable[[LockServer, str], Any], keys: int = 0) -> tuple[Any, Any]:
    """``scenario`` on a fresh key, cleanly; then on another fresh key with ``script``'s reply lost
    once (only a call of it with ``keys`` keys, if given). Both answers, the fault checked to have happened."""
    clean = scenario(pair.faulty, f"clean-{uuid.uuid4().hex}")
    pattern = sha_of(script, keys)
    pair.proxy.arm(pattern, 1)
    lost = scenario(pair.faulty, f"lost-{uuid.uuid4().hex}")
    assert pair.proxy.left(pattern) == 0, "the reply was not dropped: the test did not run its fault"
    return clean, lost


def holder_and_waiter(pair: Pair, name: str, wait: float = 30.0) -> tuple[Lock, str]:
    """A lock held (straight, no fault) and a task waiting in line behind it."""
    held = pair.direct.acquire(name, 10, owner_id="holder")
    assert isinstance(held, Lock)
    entry = queue.new_entry()
    assert queue.park(pair.direct, name, entry, kind="t", wait=wait, ttl=10, owner_id="waiter",
                      message=b"the waiter's message").place == 1
    return held, entry


def test_a_claim_sent_twice_still_takes_the_key(pair):
    """A waiter handed the key claims it (ACQUIRE with its entry); the reply is lost and the claim sent
    again. The second send found the key held by the waiter's own token and answered "entry gone": the
    call was dropped as already run, and never ran."""
    def claim(server: LockServer, name: str) -> Any:
        held, entry = holder_and_waiter(pair, name)
        released = pair.direct.release(held)
        assert [(h.what, h.entry) for h in released.handoffs] == [("run", entry)]
        got = server.acquire(name, 10, owner_id="waiter", entry=entry)
        return type(got).__name__ if isinstance(got, Lock) else got

    clean, lost = twice(pair, scripts.ACQUIRE, claim)
    assert clean == "Lock"
    assert lost == clean, f"a claim sent twice answered {lost!r}, not the first send's {clean!r}"
    assert lost is not Verdict.ENTRY_GONE


def test_a_publish_sent_twice_publishes(pair):
    """``lock_publish="join"``: a PUBLISH whose reply is lost is sent again and found its own mark, so
    the call joined a phantom (a task never published), and so did every publish of the key after it."""
    def publish(server: LockServer, name: str) -> Any:
        return dedupe.mark(server, name, "the-call", 60_000)

    clean, lost = twice(pair, dedupe.PUBLISH, publish)
    assert clean is None  # nothing else marked: publish it
    assert lost is None, f"a publish sent twice joined {lost!r} instead of publishing"


def test_a_sweep_sent_twice_still_names_the_expired_waiter(pair):
    """A waiter past its deadline is named "expired" by SWEEP, for the caller to fail it. That reply
    lost and SWEEP sent again, the second found nothing to expire: the waiter stayed WAITING for ever."""
    def sweep(server: LockServer, name: str) -> Any:
        _, entry = holder_and_waiter(pair, name, wait=0.001)
        key = layout.waiters(slot_safe(name))
        wait_until(lambda: _server_ms(pair) > _deadline(pair, key, entry), timeout=5)
        pair.sent.clear()
        _, handoffs = queue.sweep(server, name)
        return sorted((h.what, h.owner_id) for h in handoffs), sorted((h.what, h.owner_id) for h in pair.sent)

    clean, lost = twice(pair, line_scripts.SWEEP, sweep)
    assert clean == ([("expired", "waiter")], [("expired", "waiter")])
    assert lost == clean


def test_a_release_sent_twice_is_not_a_lost_lock(pair):
    """RELEASE hands the key to the next waiter; its reply lost and RELEASE sent again, the second found
    the key reserved for that waiter and answered -1: the task was reported LOST, and the waiter it had
    been handed to was sent a whole reservation late."""
    def release(server: LockServer, name: str) -> Any:
        holder = server.acquire(name, 10, owner_id="holder")  # (taken through the server that releases)
        assert isinstance(holder, Lock)
        entry = queue.new_entry()
        assert queue.park(pair.direct, name, entry, kind="t", wait=30, ttl=10, owner_id="waiter",
                          message=b"m").place == 1
        pair.sent.clear()
        released = server.release(holder)
        return released.status, [(h.what, h.entry == entry) for h in released.handoffs], len(pair.sent)

    clean, lost = twice(pair, scripts.RELEASE, release, keys=5)  # the whole RELEASE (the fresh path answers 0)
    assert clean == (Release.DELETED, [("run", True)], 1)
    assert lost == clean, f"a release sent twice answered {lost!r}, not {clean!r}"


def test_an_operators_release_sent_twice_still_hands_the_key_on(pair):
    """``celery locks release`` sends the holder's own RELEASE in its name. Its reply lost and sent again,
    the second send must answer as the first (released, the key handed to the waiter, its turn sent
    once), not "another holds it" (the key is reserved for the waiter by then)."""
    from celery_singleton_lock.engine.lock import Forced

    def force(server: LockServer, name: str) -> Any:
        holder = pair.direct.acquire(name, 10, owner_id="holder")
        assert isinstance(holder, Lock)
        entry = queue.new_entry()
        assert queue.park(pair.direct, name, entry, kind="t", wait=30, ttl=10, owner_id="waiter",
                          message=b"m").place == 1
        pair.sent.clear()
        done = server.force_release(slot_safe(name))
        return (done.status, done.value.startswith(holder.prefix.encode()),
                [(h.what, h.entry == entry) for h in done.handoffs], len(pair.sent))

    clean, lost = twice(pair, scripts.RELEASE, force, keys=5)
    assert clean == (Forced.RELEASED, True, [("run", True)], 1)
    assert lost == clean, f"an operator's release sent twice answered {lost!r}, not {clean!r}"


def test_a_leave_sent_twice_still_passes_the_key_on(pair):
    """A waiter the key was reserved for leaves (it gave up): LEAVE passes the key to the next one. That
    reply lost and LEAVE sent again, the second found the entry gone: nothing was passed on, and the next
    waiter was not sent."""
    def leave(server: LockServer, name: str) -> Any:
        held, first = holder_and_waiter(pair, name)
        second = queue.new_entry()
        assert queue.park(pair.direct, name, second, kind="t", wait=30, ttl=10, owner_id="second",
                          message=b"m").place == 2
        pair.direct.release(held)  # reserved for the first now
        pair.sent.clear()
        left = queue.leave(server, name, first)
        return left, sorted((h.what, h.owner_id) for h in pair.sent)

    clean, lost = twice(pair, line_scripts.LEAVE, leave)
    assert clean == (True, [("run", "second")])
    assert lost == clean


def test_only_scripts_safe_to_send_twice_are_sent_twice(pair):
    """The release of an uncontended lock is not kept, so the client never sends it twice: its reply
    lost, the caller is told the server was unreachable (the task's release then tries again with a full
    RELEASE that knows its first try), rather than a second send answering "not ours"."""
    from celery_singleton_lock.exceptions import LockBackendUnavailable

    name = f"fresh-{uuid.uuid4().hex}"
    lock = pair.faulty.acquire(name, 10, owner_id="holder")
    assert isinstance(lock, Lock) and lock.fresh, "the fresh path was not taken: the test proves nothing"
    pattern = sha_of(scripts.RELEASE, keys=2)  # its fresh path: the lock and its line
    pair.proxy.arm(pattern, 1)
    with pytest.raises(LockBackendUnavailable):
        pair.faulty.release(lock)
    assert pair.proxy.left(pattern) == 0
    assert pair.faulty.release(lock, again=True).status in (Release.GONE, Release.DELETED)  # (releasing counts both)
    assert not pair.direct.client.exists(name)


def _server_ms(pair: Pair) -> int:
    secs, micros = pair.direct.client.time()
    return int(secs) * 1000 + int(micros) // 1000


def _deadline(pair: Pair, waiters: str, entry: str) -> int:
    record = pair.direct.client.hget(waiters, entry)
    assert record is not None
    return layout.Waiter.parse(record).deadline_ms


def test_a_fresh_acquire_sent_twice_takes_the_key(pair):
    """A fresh acquire (ACQUIRE's fresh path) sent twice finds the key held by its own token: it answers "taken" with
    the first send's fence, not "held by another"."""
    def take(server: LockServer, name: str) -> Any:
        got = server.acquire(name, 10, owner_id="one")
        return type(got).__name__, isinstance(got, Lock) and got.fencing_token > 0

    clean, lost = twice(pair, scripts.ACQUIRE, take)
    assert clean == ("Lock", True)
    assert lost == clean, f"a fresh acquire sent twice answered {lost!r}"
