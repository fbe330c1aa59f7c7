"""The watchdog against real redis-servers, without Celery: LockServer + Watchdog. Here: the lost
path (a deleted key, a key taken by another owner, a paused Redis, a refused chunk, a starved
watchdog) and the renewal schedule; one thread per process and never a renewal after a release are
in test_watchdog_threads.py.

Timing assertions are correctness deadlines derived from the TTL, with room
for a loaded 2-core machine; none of them is a speed assertion.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time

import pytest
from _watchdog_support import (
    LOST_LOGGER,
    SLACK,
    WD_LOGGER,
    SlowRedis,
    owns,
    renewals,
    renewed_after,
)

from celery_singleton_lock.engine import notify
from celery_singleton_lock.engine.lock import Lock
from celery_singleton_lock.engine.server import LockServer
from celery_singleton_lock.exceptions import LockLost
from celery_singleton_lock.testing.servers import Monitor, wait_until
from celery_singleton_lock.watchdog.renewer import Watchdog

# -- the lost path -------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_deleted_key_is_lost_within_a_third_of_the_ttl_plus_a_tick(fresh_redis, server, wd, caplog):
    ttl = 1.5
    client = fresh_redis.client(2)
    lock = server.acquire("wd-deleted", ttl, owner_id="task-deleted")
    calls: list[tuple[Lock, str]] = []
    fired = threading.Event()

    def on_lost(lost_lock: Lock, reason: str) -> None:
        calls.append((lost_lock, reason))
        fired.set()

    wd.track(lock, on_lost)
    renewed_after(lock, lock.confirmed_at, ttl)  # it is being renewed
    lock.ensure()  # fine while held
    with caplog.at_level(logging.WARNING, logger=WD_LOGGER):
        assert client.delete(lock.key) == 1
        deleted_at = time.monotonic()
        assert fired.wait(ttl * 3), "the deletion was never noticed"
        noticed = time.monotonic() - deleted_at
    assert lock.lost
    assert noticed <= ttl / 3 + wd.tick + SLACK, noticed
    with pytest.raises(LockLost) as info:
        lock.ensure()
    assert info.value.key == lock.key and "owner" in info.value.reason
    assert len(calls) == 1 and calls[0][0] is lock and "owner" in calls[0][1]
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR and r.name == LOST_LOGGER]
    assert len(errors) == 1 and lock.key in errors[0].getMessage() and "task-deleted" in errors[0].getMessage()
    assert lock not in wd  # not renewed again
    # no renewal is ever sent for it again, and forgetting it later reports nothing twice
    with Monitor(fresh_redis) as mon:
        other = server.acquire("wd-deleted-other", ttl)
        wd.track(other)
        renewed_after(other, other.confirmed_at, ttl * 2)
        renewed_after(other, other.confirmed_at, ttl * 2)
        assert renewals(mon, other.key) and not renewals(mon, lock.key)
    wd.forget(lock)
    assert len(calls) == 1
    assert len([r for r in caplog.records if r.levelno >= logging.ERROR and r.name == LOST_LOGGER]) == 1
    wd.forget(other)
    server.release(other)


@pytest.mark.timeout(60)
def test_key_taken_by_another_owner_is_lost(fresh_redis, server, wd):
    ttl = 1.5
    lock = server.acquire("wd-taken", ttl)
    wd.track(lock)
    assert lock.fencing_token  # (read while held: a fresh lock's token is drawn on first read)
    fresh_redis.client(2).delete(lock.key)
    thief = server.acquire("wd-taken", 30)
    assert isinstance(thief, Lock) and thief.fencing_token > lock.fencing_token
    wait_until(lambda: lock.lost, ttl + SLACK + 2, what="the loss")
    assert "owner" in (lock.lost_reason or "")
    assert owns(fresh_redis.client(2), thief)  # the renewal did not touch the new owner's lock
    server.release(thief)


@pytest.mark.timeout(60)
def test_paused_redis_lock_lost_locally_then_watchdog_recovers(fresh_redis, server, redis_server, wd, caplog):
    ttl = 1.5
    other_server = LockServer.from_url(redis_server.url(2))  # another Redis, never paused
    a = server.acquire("wd-paused-a", ttl, owner_id="task-a")
    b = other_server.acquire(f"wd-paused-b-{os.getpid()}-{time.time()}", ttl, owner_id="task-b")
    lost_at: dict[str, float] = {}
    wd.track(a, lambda lock, reason: lost_at.setdefault(lock.key, time.monotonic()))
    wd.track(b, lambda lock, reason: lost_at.setdefault(lock.key, time.monotonic()))
    thread = wd.thread
    renewed_after(a, a.confirmed_at, ttl)
    with caplog.at_level(logging.WARNING, logger=WD_LOGGER):
        fresh_redis.pause()
        paused_at = time.monotonic()
        try:
            wait_until(lambda: a.lost, ttl + SLACK + 3, what="the paused lock to be declared lost")
            notify.drain()  # on_lost (which fills lost_at) runs on the reporter thread, just after
            assert fresh_redis.paused  # declared lost while Redis still says nothing
            assert a.confirmed_at < paused_at
            deadline = a.deadline  # the local deadline: last confirmed send + ttl - margin
            assert lost_at[a.key] - paused_at <= ttl + SLACK
            assert deadline <= lost_at[a.key] <= deadline + wd.tick + 2 * wd.socket_timeout + SLACK
            assert "not confirmed" in (a.lost_reason or "")
            # meanwhile the lock on the healthy server kept being renewed, on time
            b_confirmed = b.confirmed_at
            renewed_after(b, b_confirmed, ttl / 3 + wd.tick + SLACK)
            # stay paused for longer than the ttl
            while time.monotonic() < paused_at + ttl + 0.5:
                assert not b.lost
                time.sleep(0.1)
        finally:
            fresh_redis.resume()
        assert thread.is_alive() and wd.thread is thread  # the thread never died
        assert not b.lost and owns(redis_server.client(2), b)
        # after the pause: a new lock on the server that was paused is renewed again
        c = server.acquire("wd-paused-c", ttl, owner_id="task-c")
        wd.track(c)
        start = time.monotonic()
        while time.monotonic() < start + 2 * ttl:
            assert not c.lost and not b.lost
            time.sleep(0.1)
        assert owns(fresh_redis.client(2), c) and owns(redis_server.client(2), b)
        assert time.monotonic() - c.confirmed_at < ttl
        assert thread.is_alive() and wd.thread is thread
    assert a.key in lost_at and len(lost_at) == 1
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR and r.name == LOST_LOGGER]
    assert len(errors) == 1 and a.key in errors[0].getMessage()
    # the outage is reported without flooding the log: it starts, and it ends
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == WD_LOGGER]
    assert 1 <= len(warnings) <= 4, warnings
    assert any("work again" in w for w in warnings), warnings
    for lock in (b, c):
        wd.forget(lock)
        lock.server.release(lock)


@pytest.mark.timeout(60)
def test_a_refused_chunk_does_not_take_the_others_down(fresh_redis, server, caplog):
    ttl, chunk = 1.5, 2
    dog = Watchdog(chunk=chunk)
    client = fresh_redis.client(2)
    try:
        locks = [server.acquire(f"wd-chunk-{i}", ttl) for i in range(10)]
        for lock in locks:
            dog.track(lock)
        renewed_after(locks[-1], locks[-1].confirmed_at, ttl)
        bad = locks[3]
        # someone overwrites one lock key with a hash: the renewal script fails on it (WRONGTYPE)
        client.delete(bad.key)
        client.hset(bad.key, "x", "1")
        wait_until(lambda: bad.lost, ttl + SLACK + 2, what="the overwritten lock to be lost")
        assert "WRONGTYPE" in (bad.lost_reason or ""), bad.lost_reason
        start = time.monotonic()
        while time.monotonic() < start + ttl:
            assert not any(lock.lost for lock in locks if lock is not bad)
            time.sleep(0.1)
        assert all(owns(client, lock) for lock in locks if lock is not bad)
        for lock in locks:
            dog.forget(lock)
            if lock is not bad:
                server.release(lock)
    finally:
        dog.shutdown()


# -- the schedule --------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_renewal_runs_ttl_over_3_from_the_send_on_a_fixed_schedule(fresh_redis, server, wd):
    ttl = 1.5  # ttl/3 = 0.5 s = 5 ticks of 0.1 s
    period = math.ceil(ttl / 3 / wd.tick - 1e-9) * wd.tick
    warm = server.acquire("wd-warm", ttl)  # the scripts loaded: an EVALSHA answered NOSCRIPT is no renewal
    assert isinstance(warm, Lock) and server.renew(warm) and server.release(warm)
    with Monitor(fresh_redis) as mon, SlowRedis(fresh_redis, busy=0.06, every=0.15):
        # (replies, renewals included, come up to ~60 ms late: batch latency must not stretch the period)
        sent_wall = time.time()
        lock = server.acquire("wd-schedule", ttl)
        wd.track(lock)
        count = 8
        wait_until(lambda: len(renewals(mon, lock.key)) >= count, count * period + 5, 0.1, "renewals")
        times = [when for when, _ in renewals(mon, lock.key)][:count]
    wd.forget(lock)
    server.release(lock)
    first = times[0] - sent_wall
    # the first renewal: TTL/3 after the acquire was sent, never before, at most a tick (and noise) after
    assert ttl / 3 - 0.02 <= first <= ttl / 3 + wd.tick + SLACK / 2, first
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    # each one at most TTL/3 (rounded up to the tick) after the one before, give or take wake-up noise
    assert all(g <= period + 0.3 for g in gaps), gaps
    # and a fixed period: no drift accumulates from batch latency or late wake-ups
    span = times[-1] - times[0]
    assert abs(span - (count - 1) * period) <= 0.3, (span, (count - 1) * period, gaps)


@pytest.mark.timeout(30)
def test_a_starved_watchdog_reports_the_loss_honestly(server, caplog):
    """A watchdog thread that does not get to run (as under gevent with a CPU-bound task) cannot
    renew; `.lost` still tells the truth the moment the deadline passes, and the loss is
    reported once (ERROR line and callback), whoever notices it first."""
    dog = Watchdog()
    ttl = 1.0
    lock = server.acquire("wd-starved", ttl, owner_id="task-starved")
    calls = []
    try:
        with caplog.at_level(logging.WARNING, logger=WD_LOGGER):
            with dog._cond:  # hold the watchdog's mutex: its thread cannot run a round
                dog.track(lock, lambda lost, reason: calls.append(reason))
                assert not lock.lost
                wait_until(lambda: time.monotonic() > lock.deadline, 5, what="the deadline to pass")
                assert lock.lost  # the clock says so, though the watchdog could not run
                time.sleep(0.5)  # the starvation under test, not a synchronisation
            dog.forget(lock)
            notify.drain()
        assert len(calls) == 1
        assert "not confirmed" in calls[0], calls[0]
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR and r.name == LOST_LOGGER]
        assert len(errors) == 1 and lock.key in errors[0].getMessage()
        with pytest.raises(LockLost):
            lock.ensure()
    finally:
        dog.shutdown()
        server.release(lock)
