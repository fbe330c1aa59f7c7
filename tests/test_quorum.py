"""Quorum mode: a Redlock majority over 5 independent redis-servers, with fencing tokens that only rise.

Every server is a private one on a free loopback port, with no persistence, stopped by PID.
Exclusion and fencing must hold with 2 servers stopped (SIGSTOP), with 2 servers restarted
empty mid-run, and in a randomised history of many holders (each grant's interval and token
recorded, then checked for overlap and order, Jepsen-style). With 3 servers down, an acquire
is "unreachable", never a lock.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from contextlib import ExitStack

import pytest
from celery import Celery

from celery_singleton_lock import LockBackendUnavailable, LockedTask, LockLost, held
from celery_singleton_lock.lock import Holder, Lock
from celery_singleton_lock.quorum import QuorumLockServer
from celery_singleton_lock.servers import from_settings
from celery_singleton_lock.testing import RedisServer, wait_until

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]


@pytest.fixture(scope="module")
def masters():
    with ExitStack() as stack:
        servers = [stack.enter_context(RedisServer()) for _ in range(5)]
        yield servers
        for s in servers:
            if s.paused:
                s.resume()


@pytest.fixture
def quorum(masters):
    for s in masters:
        if s.paused:
            s.resume()
        if s.proc is None:
            s.start()
        s.client(2).flushdb()  # our private servers only
    q = from_settings(";".join(s.url(2) for s in masters), redis_options={"socket_timeout": 0.5})
    assert isinstance(q, QuorumLockServer) and q.majority == 3
    yield q
    q.close()


def name() -> str:
    return f"q-{uuid.uuid4().hex[:10]}"


class History:
    """Grant intervals and tokens of one key's holders, checked for overlap and token order."""

    def __init__(self) -> None:
        self.grants: list[tuple[float, float, int]] = []
        self._lock = threading.Lock()

    def hold(self, lock: Lock, seconds: float) -> None:
        start = time.monotonic()
        time.sleep(seconds)
        lock.ensure()  # still ours by the clock when the hold ends: the interval really was held
        with self._lock:
            self.grants.append((start, time.monotonic(), lock.fencing_token))

    def check(self) -> None:
        ordered = sorted(self.grants)
        for (s1, e1, t1), (s2, e2, t2) in zip(ordered, ordered[1:], strict=False):
            assert e1 <= s2, f"two holders overlapped: [{s1}, {e1}] and [{s2}, {e2}]"
            assert t1 < t2, f"a later holder got a token not above the earlier one's: {t1} then {t2}"


def take(q: QuorumLockServer, key: str, ttl: float = 5.0, deadline: float = 10.0) -> Lock:
    def attempt() -> Lock | None:
        try:
            got = q.acquire(key, ttl)
        except LockBackendUnavailable:
            return None
        return got if isinstance(got, Lock) else None

    return wait_until(attempt, deadline, 0.01, f"{key} to be taken")


def test_a_majority_grants_and_a_minority_does_not(quorum, masters):
    key = name()
    lock = quorum.acquire(key, 5, owner_id="task-1")
    assert isinstance(lock, Lock) and lock.fencing_token > 0
    values = [m.client(2).get(lock.key) for m in masters]
    assert sum(1 for v in values if v and v.startswith(lock.token.encode())) >= 3
    other = quorum.acquire(key, 5, owner_id="task-2")
    assert isinstance(other, Holder) and other.owner_id == "task-1"
    assert quorum.release(lock)
    # the release returns once a majority answered; the other members follow within moments,
    # well before the 5 s TTL could delete the key for them
    wait_until(lambda: all(not m.client(2).exists(lock.key) for m in masters), 2.0, 0.01,
               "every member to drop the released key")
    again = quorum.acquire(key, 5)
    assert isinstance(again, Lock) and again.fencing_token > lock.fencing_token
    assert quorum.release(again)


def test_two_servers_stopped_exclusion_and_fencing_hold(quorum, masters):
    key = name()
    history = History()
    masters[0].pause()
    masters[3].pause()
    try:
        for _ in range(15):
            lock = take(quorum, key)
            history.hold(lock, 0.01)
            assert quorum.release(lock)
        # contenders at once: one at a time, tokens rising
        errors: list[BaseException] = []

        def contend() -> None:
            try:
                for _ in range(5):
                    lock = take(quorum, key)
                    history.hold(lock, 0.005)
                    quorum.release(lock)
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=contend) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
    finally:
        masters[0].resume()
        masters[3].resume()
    assert len(history.grants) == 30
    history.check()


def test_two_servers_restarted_empty_mid_run(quorum, masters):
    key = name()
    history = History()
    for round_ in range(10):
        lock = take(quorum, key)
        history.hold(lock, 0.01)
        assert quorum.release(lock)
        if round_ == 4:
            masters[1].restart()  # no persistence: its lock and fencing floor are gone
            masters[2].restart()
    assert len(history.grants) == 10
    history.check()


def test_three_servers_down_is_unreachable_never_a_lock(quorum, masters):
    for m in masters[:3]:
        m.pause()
    try:
        with pytest.raises(LockBackendUnavailable, match="majority"):
            quorum.acquire(name(), 5)
    finally:
        for m in masters[:3]:
            m.resume()


def test_the_watchdog_keeps_a_quorum_lock_and_loses_it_without_a_majority(quorum, masters):
    key = name()
    with held(quorum, key, ttl=2.0) as lock:
        time.sleep(3.0)  # past the ttl: renewed on every member by the watchdog
        lock.ensure()
        assert all(0 < m.client(2).pttl(lock.key) <= 2000 for m in masters)
        for m in masters[:3]:  # the renewals can no longer reach a majority
            m.client(2).delete(lock.key)
        wait_until(lambda: lock.lost, 5, what="the quorum lock to be lost")
        with pytest.raises(LockLost):
            lock.ensure()


@pytest.mark.timeout(180)
def test_randomised_history_with_faults(quorum, masters):
    """Jepsen-style: 4 threads take the key at random; servers are stopped, resumed and
    restarted at random meanwhile. Every grant's interval and token go in the history."""
    rng = random.Random(20261123)
    key = name()
    history = History()
    stop = time.monotonic() + 12
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        r = random.Random(seed)
        try:
            while time.monotonic() < stop:
                try:
                    lock = quorum.acquire(key, 2.0)
                except LockBackendUnavailable:
                    time.sleep(0.02)
                    continue
                if not isinstance(lock, Lock):
                    time.sleep(r.uniform(0.001, 0.02))
                    continue
                try:
                    history.hold(lock, r.uniform(0.0, 0.03))
                except LockLost:
                    pass  # not recorded: the holder found out before it claimed the interval
                finally:
                    try:
                        quorum.release(lock)
                    except LockBackendUnavailable:
                        pass
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    down: list[RedisServer] = []
    while time.monotonic() < stop:
        time.sleep(rng.uniform(0.3, 0.8))
        if down and rng.random() < 0.6:
            down.pop().resume()
        elif len(down) < 2:  # a minority at a time
            victim = rng.choice([m for m in masters if m not in down])
            if rng.random() < 0.3:
                victim.restart()
            else:
                victim.pause()
                down.append(victim)
    for m in down:
        m.resume()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert len(history.grants) >= 20, len(history.grants)
    history.check()


def test_a_locked_task_on_a_quorum_runs_once_and_duplicates_back_off(masters, run_worker):
    for s in masters:
        if s.paused:
            s.resume()
    broker = masters[0]
    app = Celery(f"q{uuid.uuid4().hex[:6]}", broker=broker.url(0), backend=broker.url(1), set_as_current=False)
    app.conf.update(
        singleton_lock_url=[s.url(3) for s in masters], singleton_lock_retry_backoff=0.05,
        singleton_lock_retry_backoff_max=0.2, worker_hijack_root_logger=False, broker_connection_retry_on_startup=True,
    )
    runs: list[tuple[float, float]] = []
    gate = threading.Event()

    @app.task(base=LockedTask, bind=True, shared=False, lock_key=["k"], on_duplicate="retry")
    def job(self, k, tag):
        start = time.monotonic()
        if tag == "holder":
            assert gate.wait(30)
        runs.append((start, time.monotonic()))
        return self.lock.fencing_token

    with run_worker(app, pool="threads", concurrency=4):
        holder = job.delay("x", "holder")
        wait_until(lambda: any(m.client(3).keys("*job*") for m in masters), 20, what="the holder's lock")
        dup = job.delay("x", "dup")
        wait_until(lambda: dup.state == "RETRY", 20, what="the duplicate to back off")  # no line in quorum mode
        gate.set()
        first, second = holder.get(timeout=30), dup.get(timeout=30)
    assert second > first
    (s1, e1), (s2, e2) = sorted(runs)
    assert e1 <= s2


def test_renewals_reach_a_member_restarted_empty(quorum, masters):
    """A member restarted without data has lost its scripts too: the renewal pipeline reloads
    RENEW_MANY there (NOSCRIPT) instead of counting that member as failed for good."""
    warm = take(quorum, name())
    assert quorum.renew_many([warm]) == [True]  # every member has loaded the scripts, RENEW_MANY too
    assert quorum.release(warm)
    masters[1].restart()
    masters[2].restart()
    lock = take(quorum, name(), ttl=30.0)
    holders = [m for m in masters if m.client(2).get(lock.key)]
    time.sleep(1.0)  # let the TTL run down (below 29 s), so a renewal shows in PTTL
    assert quorum.renew_many([lock]) == [True]
    # the renewal returns at a majority; the other members follow within moments
    wait_until(lambda: all(m.client(2).pttl(lock.key) > 29_500 for m in holders), 0.4, 0.01,
               "the renewal on every member that holds the key")
    assert any(m in holders for m in masters[1:3]), "a restarted member holds the key too"
    assert quorum.release(lock)


def test_two_messages_with_one_lost_attempts_token_never_both_hold_the_lock(quorum):
    """(issue 17, Major 4, quorum mode) An attempt whose replies were lost left its lock on the
    masters under token T. The re-send carrying T takes it back, under a new token; a broker
    redelivery of that same message (also carrying T) then finds the key held, not granted twice."""
    name = f"q-{uuid.uuid4().hex[:10]}"
    orphan = quorum.acquire(name, 30, owner_id="job", token="t" * 32)
    assert isinstance(orphan, Lock)
    first = quorum.acquire(name, 30, owner_id="job", token="a" * 32, retake="t" * 32)
    assert isinstance(first, Lock) and first.token == "a" * 32
    second = quorum.acquire(name, 30, owner_id="job", token="b" * 32, retake="t" * 32)
    assert not isinstance(second, Lock), "two messages carrying one token both hold the lock"
    assert quorum.release(first).status == 1
