"""One watchdog, many locks: a slow lock_lost receiver costs no healthy lock (receivers run off the
renewal thread), and .ensure() and the watchdog agree on one deadline.

Against a real redis-server (private, on a free port), stopped by SIGSTOP where it must not answer.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from celery_singleton_lock import LockServer
from celery_singleton_lock.engine.lock import Lock
from celery_singleton_lock.testing.servers import wait_until
from celery_singleton_lock.watchdog.renewer import Watchdog

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("collect_results")]


# -- slow lock_lost receivers run off the renewal thread ------------------------------------------


@pytest.mark.timeout(30)
def test_slow_lost_lock_receiver_does_not_cost_a_healthy_lock(fresh_redis):
    """Two locks renewed by one watchdog; one is deleted from outside (lost) and its on_lost
    callback (what fires lock_lost) takes 2.5 s, longer than the other lock's TTL. The other lock
    keeps being renewed during and after, and is never lost."""
    server = LockServer.from_url(fresh_redis.url(2))
    wd = Watchdog()
    tag = uuid.uuid4().hex[:8]
    doomed = server.acquire(f"doomed-{tag}", 2.0)
    healthy = server.acquire(f"healthy-{tag}", 2.0)
    assert isinstance(doomed, Lock) and isinstance(healthy, Lock)
    paging, paged = threading.Event(), threading.Event()
    healthy_lost: list[str] = []

    def pager(lock, reason):  # a slow receiver: a pager call
        paging.set()
        time.sleep(2.5)
        paged.set()

    try:
        wd.track(doomed, pager)
        wd.track(healthy, lambda lock, reason: healthy_lost.append(reason))
        fresh_redis.client(2).delete(doomed.key)
        assert paging.wait(5), "the deleted lock was never reported lost"
        confirmations = {healthy.confirmed_at}
        until = None
        while until is None or time.monotonic() < until:
            assert not healthy.lost, healthy.lost_reason
            confirmations.add(healthy.confirmed_at)
            if until is None and paged.is_set():
                until = time.monotonic() + 1.5  # and after the receiver returned
            time.sleep(0.05)
        assert healthy_lost == [] and not healthy.lost
        assert len(confirmations) >= 5, "the healthy lock was not renewed while the receiver ran"
        assert fresh_redis.client(2).pttl(healthy.key) > 0
        healthy.ensure()
    finally:
        wd.forget(healthy)
        wd.shutdown()
        server.release(healthy)


# -- .ensure() and the watchdog use one deadline --------------------------------------------------


@pytest.mark.timeout(30)
def test_ensure_and_the_watchdog_agree_on_the_deadline(fresh_redis):
    """Two locks tracked by a watchdog whose Redis stops answering. One is polled with
    ensure() from the task's side, the other is left to the watchdog: ensure() starts raising at
    lock.deadline (confirmed + ttl - margin), not at the full TTL, and the watchdog reports the
    other at its deadline too, within a tick or two (plus its one blocked round)."""
    from celery_singleton_lock import LockLost

    server = LockServer.from_url(fresh_redis.url(2))
    wd = Watchdog(tick=0.1, socket_timeout=0.25)
    tag = uuid.uuid4().hex[:8]
    ttl = 3.0
    polled = server.acquire(f"polled-{tag}", ttl)
    watched = server.acquire(f"watched-{tag}", ttl)
    reported: list[float] = []
    try:
        wd.track(polled)
        wd.track(watched, lambda lock, reason: reported.append(time.monotonic()))
        assert polled.deadline == polled.confirmed_at + ttl - wd.margin(ttl)
        assert wd.margin(ttl) > 0.3  # far enough from the full ttl to tell the two apart
        fresh_redis.pause()
        raised_at = None
        while time.monotonic() < polled.confirmed_at + ttl + 1:
            try:
                polled.ensure()
            except LockLost:
                raised_at = time.monotonic()
                break
            time.sleep(0.005)
        wait_until(lambda: reported, 3, 0.01, "the watchdog to report its lock lost")
    finally:
        if fresh_redis.paused:
            fresh_redis.resume()
        wd.shutdown()
    tick = wd.tick
    assert raised_at is not None, "ensure() never raised"
    assert polled.deadline <= raised_at <= polled.deadline + 2 * tick, (raised_at - polled.deadline)
    assert raised_at < polled.confirmed_at + ttl - 0.3  # not the full ttl
    # the watchdog checks deadlines on every tick; one round may be blocked for a socket timeout
    lag = reported[0] - watched.deadline
    assert -0.01 <= lag <= wd.socket_timeout + 2 * tick, lag
    assert reported[0] < watched.confirmed_at + ttl
