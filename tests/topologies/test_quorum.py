"""Quorum mode: a Redlock majority over 5 independent redis-servers, with fencing tokens that only rise.

Every server is a private one on a free loopback port, with no persistence, stopped by PID.
Exclusion and fencing must hold with 2 servers stopped (SIGSTOP), with 2 servers restarted
empty mid-run, and in a randomised history of many holders (each grant's interval and token
recorded, then checked for overlap and order, Jepsen-style). With 3 servers down, an acquire
is "unreachable", never a lock. Real workers on a quorum are in test_quorum_workers.py; the
members' fan-out, what operators see of them and their clocks in test_quorum_members.py.
"""

from __future__ import annotations

import random
import threading
import time
import uuid

import pytest
from _quorum_support import History, name, take

from celery_singleton_lock import LockBackendUnavailable, LockLost, held
from celery_singleton_lock.engine.lock import Holder, Lock, Release
from celery_singleton_lock.testing.servers import RedisServer, wait_until

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow, pytest.mark.usefixtures("collect_results")]


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


@pytest.mark.parametrize("run", range(3))
def test_a_released_lock_never_lingers_after_a_paused_minority_and_an_empty_restart(quorum, masters, run):
    """The paused-minority sequence: 2 members paused (SIGSTOP) and used through, then resumed; 3 calls
    of one key in turn; the OTHER 2 members restarted empty; 3 more calls in turn. Each call takes the
    key: a paused member runs an acquire sent to it before it froze, then that lock's release (never
    skipped, never first on another connection), so no finished call's lock lingers there to be
    counted, beside 2 young members, as held against the next calls."""
    key = name()
    tokens: list[int] = []

    def call(ttl: float = 30.0) -> None:
        def attempt() -> Lock | None:  # unreachable: tried again, as a task is re-sent
            try:
                got = quorum.acquire(key, ttl, owner_id=f"call-{len(tokens)}")
            except LockBackendUnavailable:
                return None
            assert isinstance(got, Lock), f"call {len(tokens)} was refused as a duplicate: {got!r}"
            return got

        got = wait_until(attempt, 15.0, 0.05, f"call {len(tokens)} to take the key")
        tokens.append(got.fencing_token)
        time.sleep(0.2)  # the body
        assert quorum.release(got).status is Release.DELETED

    masters[0].pause()
    masters[1].pause()
    try:
        for _ in range(3):
            call()
            time.sleep(0.05)
    finally:
        masters[0].resume()
        masters[1].resume()
    for _ in range(3):
        call()
        time.sleep(0.05)
    masters[3].restart()  # no persistence: empty
    masters[4].restart()
    for _ in range(3):
        call()
        time.sleep(0.05)
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens), f"fencing tokens rise: {tokens}"
    wait_until(lambda: all(not m.client(2).exists(key) for m in masters), 3.0, 0.02,
               "no member to keep a released lock")


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
@pytest.mark.long
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
    # a renewal answered by a majority (on a loaded host a member may answer late once: the next one
    # counts; what this test holds is the line below, every holder renewed, the restarted ones too)
    wait_until(lambda: quorum.renew_many([lock]) == [True], 10.0, 0.05, "a majority to confirm a renewal")
    # the renewal returns at a majority; the other members follow within moments
    wait_until(lambda: all(m.client(2).pttl(lock.key) > 29_500 for m in holders), 0.4, 0.01,
               "the renewal on every member that holds the key")
    assert any(m in holders for m in masters[1:3]), "a restarted member holds the key too"
    assert quorum.release(lock)


def test_two_messages_with_one_lost_attempts_token_never_both_hold_the_lock(quorum):
    """(quorum mode) An attempt whose replies were lost left its lock on the
    masters under token T. The re-send carrying T takes it back, under a new token; a broker
    redelivery of that same message (also carrying T) then finds the key held, not granted twice."""
    name = f"q-{uuid.uuid4().hex[:10]}"
    orphan = quorum.acquire(name, 30, owner_id="job", token="t" * 32)
    assert isinstance(orphan, Lock)
    first = quorum.acquire(name, 30, owner_id="job", token="a" * 32, retake="t" * 32)
    assert isinstance(first, Lock) and first.token == "a" * 32
    second = quorum.acquire(name, 30, owner_id="job", token="b" * 32, retake="t" * 32)
    assert not isinstance(second, Lock), "two messages carrying one token both hold the lock"
    assert quorum.release(first).status is Release.DELETED


def test_the_quorum_drift_allowance_survives_the_watchdog(quorum):
    """Redlock's drift allowance (DRIFT x ttl) is part of a quorum lock's deadline also once the
    watchdog tracks it and sets its own margin (before: the watchdog's margin replaced it)."""
    from celery_singleton_lock.topologies.quorum import DRIFT
    from celery_singleton_lock.watchdog.renewer import Watchdog

    dog = Watchdog()
    lock = take(quorum, name(), ttl=10.0)
    try:
        dog.track(lock)
        watchdog_margin = dog.margin(lock.ttl)
        assert lock.margin == watchdog_margin
        assert lock.deadline == pytest.approx(lock.confirmed_at + 10.0 - watchdog_margin - DRIFT * 10.0)
    finally:
        dog.forget(lock)
        dog.shutdown()
        quorum.release(lock)
