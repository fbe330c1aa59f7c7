"""A task under faults of its lock Redis: a late reply, a lost lock, a frozen child, a stopped
server. Each ends in a state and a log line that say what happened, never in a body run unlocked or
run twice. One section each, numbered as below; refused calls are in test_task_refusals.py, the
broker's and lock_key's faults in test_task_delivery_faults.py.

Every scenario runs against real redis-servers and real Celery workers. Where the lock
Redis must be stopped while the broker keeps working, the locks live on a private
server of the test's own (``fresh_redis``) and the broker and results on ``redis_server``.

1. an acquire answered later than ttl/3 is given back and re-sent, never trusted;
2. a lost lock is reported before Redis could have let it expire; a too-short lock_ttl
   warns when the task's settings are resolved;
3. a prefork child frozen past its lock's TTL sees the loss at its first look, and the
   loss is announced once (one lock_lost, one ERROR line);
4. no "work again" WARNING while the lock Redis is still stopped.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import threading
import time

import pytest
from _faults_support import LOGGER, WD_LOGGER, app_on, catching, fresh, records
from _task_support import TIMEOUT, Runs, assert_no_overlap, locked
from celery.signals import task_prerun, task_retry

from celery_singleton_lock import LockBackendUnavailable
from celery_singleton_lock.engine import timing
from celery_singleton_lock.engine.lock import Lock
from celery_singleton_lock.engine.server import LockServer
from celery_singleton_lock.testing.servers import wait_until
from celery_singleton_lock.watchdog.renewer import Watchdog

pytestmark = pytest.mark.usefixtures("collect_results")


# -- 1. an acquire answered too late is not trusted -----------------------------------------


@pytest.mark.timeout(30)
def test_acquire_answered_after_a_third_of_the_ttl_is_given_back(fresh_redis):
    """LockServer.acquire while Redis is frozen for longer than ttl/3: the reply arrives (the
    lock was set, with a fresh TTL), but it is released and LockBackendUnavailable raised."""
    server = LockServer.from_url(fresh_redis.url(2))
    warm = server.acquire(fresh("warm"), 3.0)  # connection open, scripts loaded: only the pause delays
    assert isinstance(warm, Lock)
    ttl = 3.0

    def frozen_acquire(name: str, pause: float):
        fresh_redis.pause()
        timer = threading.Timer(pause, fresh_redis.resume)
        timer.start()
        started = time.monotonic()
        try:
            return server.acquire(name, ttl, owner_id="late-owner"), time.monotonic() - started
        finally:
            timer.join()
            if fresh_redis.paused:
                fresh_redis.resume()

    # a pause well under ttl/3 is fine: the lock is taken and trusted
    quick, _ = frozen_acquire(fresh("quick"), 0.2)
    assert isinstance(quick, Lock) and server.holder(quick.key) is not None

    name = fresh("late")
    with pytest.raises(LockBackendUnavailable) as info:
        frozen_acquire(name, 1.6)  # > ttl / 3 = 1 s
    message = str(info.value)
    assert "reply came after" in message and "third of the lock's ttl of 3s" in message, message
    # given back: nobody holds it, and the next acquire gets it at once
    assert server.holder(name) is None
    assert isinstance(server.acquire(name, ttl), Lock)


@pytest.mark.timeout(90)
@pytest.mark.long
def test_task_whose_acquire_answers_late_is_resent_and_runs_later_alone(redis_server, fresh_redis, run_worker):
    """The lock Redis frozen 5 s (ttl 3) while a task arrives: its acquire returns on SIGCONT, too
    late. It must not run on that lock: RETRY (LockBackendUnavailable naming the lateness), then
    a proper run; a duplicate sent 3.5 s after SIGCONT (when the untrusted lock would have
    expired in Redis) is skipped, never run beside it."""
    app = app_on(redis_server, fresh_redis.url(2))
    runs = Runs()

    @locked(app, lock_key=["k"], lock_ttl=3, name="faults.late_acquire")
    def job(self, k, seconds):
        run = runs.begin(k, self.request.id)
        try:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                time.sleep(0.02)
        finally:
            runs.end(run)
        return self.request.id

    server = job.lock_server()
    server.release(server.acquire(fresh("warm"), 3))  # the worker's server: connected, scripts loaded
    k = fresh("late")
    with catching(task_prerun, app) as arrived, catching(task_retry, app) as retries, \
            run_worker(app, pool="threads", concurrency=4):
        fresh_redis.pause()
        paused_at = time.monotonic()
        try:
            first = job.apply_async((k, 5.0))
            wait_until(lambda: any(a["task_id"] == first.id for a in arrived), 10, what="the task to arrive")
            time.sleep(max(0.0, paused_at + 5.0 - time.monotonic()))  # the outage lasts 5 s
        finally:
            fresh_redis.resume()
        resumed_wall, resumed_at = time.time(), time.monotonic()
        # RETRY, stored with the reason: Redis answered too late to be trusted
        wait_until(lambda: retries, 10, what="the retry")
        state = wait_until(lambda: first.state == "RETRY" and first, 10, what="the RETRY state")
        assert isinstance(state.info, LockBackendUnavailable), state.info
        assert "reply came after" in str(state.info)
        [retry] = retries
        assert retry["request"].id == first.id and isinstance(retry["reason"].exc, LockBackendUnavailable)
        # the duplicate, when the untrusted lock would have expired in Redis
        time.sleep(max(0.0, resumed_at + 3.5 - time.monotonic()))
        dup = job.apply_async((k, 0.1))
        assert first.get(timeout=TIMEOUT) == first.id
        wait_until(lambda: dup.state == "REVOKED", TIMEOUT, what="the duplicate to be skipped")
    [run] = runs.of(k)  # the body ran once, and only for the re-sent task
    assert run.task_id == first.id and run.start >= resumed_wall
    assert not runs.of(k, dup.id)
    assert_no_overlap([(r.start, r.end) for r in runs.of(k)])


# -- 2. a loss is reported before Redis could expire the lock ---------------------------------


@pytest.mark.timeout(90)
@pytest.mark.long
def test_watchdog_reports_a_loss_before_the_lock_could_expire_in_redis(fresh_redis):
    """Redis frozen under a tracked lock (ttl 3): on_lost (what fires lock_lost) must run before
    confirmed_at + ttl, the earliest moment Redis could let the lock go. Four rounds, the freeze
    at a random point of the renewal period. The test thread never reads ``lock.lost`` before
    the callback fired (reading it would report the loss itself)."""
    server = LockServer.from_url(fresh_redis.url(2))
    dog = Watchdog()
    ttl = 3.0
    try:
        for round_ in range(4):
            fired = threading.Event()
            seen: dict[str, float] = {}

            def on_lost(lock, reason, seen=seen, fired=fired):
                seen["at"], seen["confirmed_at"] = time.monotonic(), lock.confirmed_at
                fired.set()

            lock = server.acquire(fresh(f"wd-loss-{round_}"), ttl, owner_id=f"owner-{round_}")
            assert isinstance(lock, Lock)
            acquired = lock.confirmed_at
            dog.track(lock, on_lost)
            wait_until(lambda lock=lock, acquired=acquired: lock.confirmed_at > acquired, ttl, what="a renewal")
            time.sleep(random.uniform(0, ttl / 3))  # freeze anywhere in the renewal period
            fresh_redis.pause()
            try:
                assert fired.wait(ttl + 5), f"round {round_}: no loss reported"
            finally:
                fresh_redis.resume()
            early = seen["confirmed_at"] + ttl - seen["at"]
            assert early > 0, f"round {round_}: reported {-early:.3f}s after the lock could have expired"
            assert lock.lost and lock not in dog
    finally:
        dog.shutdown()


@pytest.mark.timeout(30)
def test_lock_ttl_below_the_shortest_safe_ttl_warns_when_settings_resolve(app, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    shortest = timing.shortest_safe_ttl()

    @locked(app, lock_ttl=round(shortest / 2, 2), name="faults.too_short")
    def too_short(self):
        return None

    @locked(app, lock_ttl=round(shortest + 2, 2), name="faults.long_enough")
    def long_enough(self):
        return None

    too_short.lock_settings()
    long_enough.lock_settings()
    [warning] = records(caplog, LOGGER, "faults.too_short", level=logging.WARNING)
    assert "lock_ttl" in warning and "shorter than the watchdog can keep safely" in warning, warning
    assert not records(caplog, LOGGER, "faults.long_enough", level=logging.WARNING)


# -- 3. a frozen prefork child sees its loss at once, announced once -------------------------


def _started(worker_app, key: str, tag: str) -> dict | None:
    for raw in worker_app.journal.lrange(f"started:lost_probe:{key}", 0, -1):
        entry = json.loads(raw)
        if entry["tag"] == tag:
            return entry
    return None


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.long
def test_frozen_prefork_child_sees_its_lost_lock_at_first_look_and_it_is_announced_once(
    worker_app, worker_processes, redis_server
):
    """A prefork child holding a lock (ttl 2) is SIGSTOPped 6 s while a successor takes the key.
    On SIGCONT its first read of self.lock.lost is True and ensure() raises LockLost; lock_lost
    fires once and one ERROR "was LOST" line is logged. Two rounds."""
    worker = worker_processes(pool="prefork", concurrency=2).wait_ready(60)
    task = worker_app.lost_probe
    locks = LockServer(redis_server.client(2))
    for round_ in range(2):
        key = fresh(f"frozen-{round_}")
        name = task.lock_key_for((key, "stopped"))
        stopped = task.apply_async((key, "stopped"))
        entry = wait_until(lambda key=key: _started(worker_app, key, "stopped"), 30, what="the holder to start")
        pid = entry["pid"]
        assert entry["id"] == stopped.id and pid in worker.children()
        assert locks.holder(name).owner_id == stopped.id
        os.kill(pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        try:
            wait_until(lambda name=name: locks.holder(name) is None, 10, what="the frozen child's lock to expire")
            successor = task.apply_async((key, "successor"))
            entry2 = wait_until(lambda key=key: _started(worker_app, key, "successor"), 30, what="the successor")
            assert entry2["pid"] != pid and locks.holder(name).owner_id == successor.id
            time.sleep(max(0.0, frozen_at + 6.0 - time.monotonic()))  # the freeze lasts 6 s
        finally:
            os.kill(pid, signal.SIGCONT)
        out = stopped.get(timeout=TIMEOUT)
        assert out["pid"] == pid
        assert out["first_read"] is True, out
        assert out["ensure"] == "LockLost", out
        worker_app.journal.set(f"gate:{key}:successor", 1)
        assert successor.get(timeout=TIMEOUT)["lost"] is False
        line = f"held by {stopped.id} was LOST"
        wait_until(lambda line=line: line in worker.log(), 10, what="the ERROR line")
        signals = [json.loads(s) for s in worker_app.journal.lrange(f"lost_signal:{stopped.id}", 0, -1)]
        assert len(signals) == 1, signals
        assert signals[0]["key"] == name and signals[0]["pid"] == pid
        assert worker.log().count(line) == 1, worker.log()[-3000:]
        assert not worker_app.journal.exists(f"lost_signal:{successor.id}")


# -- 4. no recovery WARNING while Redis is still stopped --------------------------------------


@pytest.mark.timeout(60)
def test_no_recovery_warning_while_redis_is_still_stopped(fresh_redis, caplog):
    """A lock forgotten while its renewal round is in flight during an outage is neither a
    success nor a failure: it must not make the watchdog log "work again"."""
    caplog.set_level(logging.WARNING, logger=WD_LOGGER)
    server = LockServer.from_url(fresh_redis.url(2))
    dog = Watchdog()
    ttl = 3.0
    try:
        lock = server.acquire(fresh("wd-outage"), ttl, owner_id="outage")
        dog.track(lock)
        fresh_redis.pause()
        try:
            wait_until(lambda: records(caplog, WD_LOGGER, "failed; retrying"), ttl, what="the failure WARNING")
            # forget it while a renewal round of it is in flight (the round that misreported)
            wait_until(lambda: lock in dog._in_flight, ttl / 2, 0.002, "a renewal round in flight")
            dog.forget(lock)
            with pytest.raises(TimeoutError):
                wait_until(lambda: records(caplog, WD_LOGGER, "work again"), 3.0, what="a recovery WARNING")
            assert fresh_redis.paused
        finally:
            fresh_redis.resume()
        # a renewal that really succeeds is a recovery, and says so once
        again = server.acquire(fresh("wd-after"), ttl, owner_id="after")
        dog.track(again)
        wait_until(lambda: records(caplog, WD_LOGGER, "work again"), ttl + 2, what="the recovery WARNING")
        assert len(records(caplog, WD_LOGGER, "work again")) == 1
    finally:
        dog.shutdown()
