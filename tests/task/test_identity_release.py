"""What an execution does with its own lock on the way out: a forked child never releases its
parent's lock, nothing interrupts a release half-way (the lock is forgotten first, or the safety net
cleans up), and a release is retried within bounds (singleton_lock_release_timeout). One section each.

Against a real redis-server (private, on a free port) and real faults (a real fork, SIGSTOP of the
lock Redis), except that the tests of an interrupted release inject one exception into one call (an
asynchronous exception landing at a chosen point cannot be produced on demand).

Timing bounds here are deadlines for "does not hang", never benchmarks.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import uuid

import pytest
from _apps import make_app
from _task_support import TaskEvents, locked, messages, within

from celery_singleton_lock import LockServer, held
from celery_singleton_lock.engine.lock import Lock
from celery_singleton_lock.testing.servers import Monitor, RedisServer, wait_until
from celery_singleton_lock.watchdog.process import get_watchdog
from celery_singleton_lock.watchdog.renewer import Watchdog

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("collect_results")]


# -- a forked child never releases its parent's lock ---------------------------------------------


class ChildUnwinds(Exception):
    pass


def _unwind_in_child(how: str) -> None:
    if how == "exit":
        sys.exit(3)
    raise ChildUnwinds("the child fails inside the parent's locked block")


def _wait_child(pid: int, timeout: float = 15.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, 9)  # our own child, by its pid
    os.waitpid(pid, 0)
    raise AssertionError(f"forked child {pid} did not end within {timeout}s")


CHILD_DONE = 7  # the child's exit code once it has unwound (whatever unwinding raised)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("how", ["raise", "exit"])
def test_forked_child_unwinding_through_held_leaves_the_parents_lock(redis_server, how):
    """A process holds a lock via held() and forks; the child raises (or sys.exit()s) inside
    the block and so unwinds through held(): the parent still holds the lock afterwards (its token
    in Redis, its watchdog renewing it) and releases it itself."""
    server = LockServer.from_url(redis_server.url(2))
    locks = redis_server.client(2)
    name = f"fork-{uuid.uuid4().hex[:8]}"
    parent = os.getpid()
    try:
        with held(server, name, ttl=10) as lock:
            before = locks.get(lock.key)
            pid = os.fork()
            if pid == 0:
                _unwind_in_child(how)
            assert _wait_child(pid) == CHILD_DONE
            after = locks.get(lock.key)
            assert after is not None and after == before, "the child released (or changed) the parent's lock"
            assert after.decode().startswith(lock.prefix)
            assert lock in get_watchdog() and not lock.lost
            lock.ensure()
        assert lock.released and locks.get(lock.key) is None  # the parent released it
    except ChildUnwinds:
        assert os.getpid() != parent
    finally:
        if os.getpid() != parent:
            os._exit(CHILD_DONE)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("how", ["raise", "exit"])
def test_forked_child_unwinding_through_a_task_leaves_the_parents_lock(redis_server, how):
    """The same through LockedTask.__call__: the body forks, the child raises (or exits),
    which runs the task's release in the child; the parent's lock stays, and the parent releases."""
    app = make_app(redis_server)
    locks = redis_server.client(2)
    parent = os.getpid()

    @locked(app, lock_key=["k"])
    def forking(self, k, how):
        lock = self.lock
        before = locks.get(lock.key)
        pid = os.fork()
        if pid == 0:
            _unwind_in_child(how)
        code = _wait_child(pid)
        after = locks.get(lock.key)
        return {"code": code, "same": after == before and after is not None, "tracked": lock in get_watchdog(),
                "lost": lock.lost, "key": lock.key}

    try:
        result = forking.apply((f"k-{uuid.uuid4().hex[:8]}", how))
    finally:
        if os.getpid() != parent:
            os._exit(CHILD_DONE)
    assert result.state == "SUCCESS", result.traceback
    out = result.result
    assert out["code"] == CHILD_DONE
    assert out["same"], "the child released (or changed) the parent's lock"
    assert out["tracked"] and not out["lost"]
    assert locks.get(out["key"]) is None  # released by the parent, at its own end


# -- the lock is forgotten before anything can interrupt the release -------------------------------


class AsyncTimeout(BaseException):
    """Like gevent.Timeout: a BaseException that lands wherever the code happens to be."""


def lock_keeping_job(redis_server: RedisServer, fresh_redis: RedisServer) -> tuple:
    """A task with a 1.5 s lock TTL whose locks live on ``fresh_redis``; it keeps each lock it held: (the
    task, the list of its locks)."""
    app = make_app(redis_server)
    app.conf.singleton_lock_url = fresh_redis.url(2)
    held_locks: list[Lock] = []

    @locked(app, lock_key=["k"], lock_ttl=1.5)
    def job(self, k):
        held_locks.append(self.lock)
        return k

    return job, held_locks


def _renewals_of(mon: Monitor, key: str) -> list[list[str]]:
    return [w for w in mon.commands() if w and w[0].upper() == "EVALSHA" and key in w]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("fault", ["SoftTimeLimitExceeded", "AsyncTimeout"])
def test_exception_inside_the_release_leaves_the_lock_forgotten(fresh_redis, redis_server, monkeypatch, fault):
    """An exception raised from inside the release step (a soft time limit, a gevent-style
    Timeout) must not leave the lock tracked: the watchdog no longer holds it, and no renewal of
    its key is ever sent again (it expires by its TTL)."""
    from billiard.exceptions import SoftTimeLimitExceeded

    exc_type = SoftTimeLimitExceeded if fault == "SoftTimeLimitExceeded" else AsyncTimeout
    job, held_locks = lock_keeping_job(redis_server, fresh_redis)
    real_release = LockServer.release
    fired = []

    def release_once_interrupted(server, lock, **kwargs):
        if held_locks and lock is held_locks[0] and not fired:
            fired.append(lock)
            raise exc_type("interrupted inside the release")
        return real_release(server, lock, **kwargs)

    monkeypatch.setattr(LockServer, "release", release_once_interrupted)
    with Monitor(fresh_redis) as mon:
        if exc_type is AsyncTimeout:
            with pytest.raises(AsyncTimeout):
                job.apply(("a",))
        else:
            job.apply(("a",))
        assert fired, "the injected fault never fired: the scenario did not run"
        lock = held_locks[0]
        assert lock not in get_watchdog()
        mon.clear()
        # the key lives on until its TTL (the release never reached Redis); no renewal may extend it
        wait_until(lambda: fresh_redis.client(2).pttl(lock.key) == -2, 5, 0.05, "the key to expire by its ttl")
        time.sleep(0.6)  # one more renewal period (ttl/3): nothing may come late
        mon.sync()
        assert _renewals_of(mon, lock.key) == []


@pytest.mark.timeout(30)
def test_exception_before_forget_completes_is_cleaned_up_by_the_safety_net(fresh_redis, redis_server, monkeypatch):
    """An asynchronous exception hits before forget() is done: the handle stays on the request until
    forget() has returned, so the safety net (task_postrun) still finds it, forgets and releases it,
    and no renewal is sent after (the watchdog would otherwise renew the lock for ever)."""
    from billiard.exceptions import SoftTimeLimitExceeded

    job, held_locks = lock_keeping_job(redis_server, fresh_redis)
    real_forget = Watchdog.forget
    fired = []

    def forget_once_interrupted(wd, lock):
        if held_locks and lock is held_locks[0] and not fired:
            fired.append(lock)
            raise SoftTimeLimitExceeded("interrupted while forgetting the lock")
        return real_forget(wd, lock)

    monkeypatch.setattr(Watchdog, "forget", forget_once_interrupted)
    with Monitor(fresh_redis) as mon:
        result = job.apply(("a",))
        assert fired, "the injected fault never fired: the scenario did not run"
        assert result.state == "FAILURE" and isinstance(result.result, SoftTimeLimitExceeded)
        lock = held_locks[0]
        assert lock not in get_watchdog()
        assert fresh_redis.client(2).get(lock.key) is None  # released by the safety net, not left to expire
        mon.clear()
        time.sleep(1.2)  # two renewal periods (ttl/3)
        mon.sync()
        assert _renewals_of(mon, lock.key) == []


# -- release retries, within bounds ----------------------------------------------------------------


def _release_app(redis_server: RedisServer, lock_redis: RedisServer, release_timeout: float = 0.5):
    app = make_app(redis_server, singleton_lock_release_timeout=release_timeout)
    app.conf.singleton_lock_url = lock_redis.url(2)  # a lock Redis of its own: only it stalls
    marks: dict = {}

    @locked(app, lock_key=["k"], lock_ttl=30)
    def job(self, k, stall):
        marks["key"] = self.lock.key
        if stall:  # stall the lock Redis right as the body ends: the release goes into a frozen server
            lock_redis.pause()
            if stall < 10:
                threading.Timer(stall, lock_redis.resume).start()
        marks["body_end"] = time.monotonic()
        return k

    warm = job.apply(("warm", 0))  # the release twin's connection is open
    assert warm.state == "SUCCESS" and warm.result == "warm", warm.traceback
    return app, job, marks


@pytest.mark.timeout(20)
def test_release_retry_after_a_late_first_try_reports_the_lock_deleted(fresh_redis, redis_server, caplog):
    """The first release try times out but Redis runs it late (it deletes the lock); the
    second try then finds the key gone. That lock was ours and is deleted: lock_released says
    deleted=True, and there is no "no longer held" WARNING."""
    caplog.set_level(logging.WARNING, logger="celery_singleton_lock")
    # a 1 s release timeout and a 1.5 s stall: the resume lands half a second from either edge
    app, job, marks = _release_app(redis_server, fresh_redis, release_timeout=1.0)
    with TaskEvents(app) as rec:
        result = job.apply(("k", 1.5))  # frozen past the first try's 1 s timeout, not the second's
        assert result.state == "SUCCESS" and result.result == "k", result.traceback
    try_failed = [m for m in messages(caplog) if "releasing lock" in m and "try 1 of 2" in m]
    assert try_failed, "the first release try did not time out: the scenario did not run"
    released = rec.of("lock_released", task_id=result.id)
    assert [e.kwargs["deleted"] for e in released] == [True]
    assert not any("no longer held" in m for m in messages(caplog)), messages(caplog)
    assert fresh_redis.client(2).get(marks["key"]) is None


@pytest.mark.timeout(20)
def test_stalled_lock_redis_holds_a_task_end_at_most_two_release_timeouts(fresh_redis, redis_server, caplog):
    """The lock Redis stalls as the body ends and stays stalled: the release gives up after
    about 2 x singleton_lock_release_timeout (0.5 s), and the task ends with its own outcome,
    instead of waiting ~30 s of 10 s socket timeouts."""
    caplog.set_level(logging.WARNING, logger="celery_singleton_lock")
    app, job, marks = _release_app(redis_server, fresh_redis)
    try:
        with TaskEvents(app) as rec:
            result, _ = within(15, job.apply, ("k", 60))  # stays frozen until we resume it
            ended = time.monotonic()
    finally:
        fresh_redis.resume()
    assert result.state == "SUCCESS" and result.result == "k", result.traceback
    held_up = ended - marks["body_end"]
    assert held_up < 2 * 0.5 + 0.8, f"the release held the task's end for {held_up:.2f}s"
    assert [e.kwargs["deleted"] for e in rec.of("lock_released", task_id=result.id)] == [False]
    assert any("could not be released" in m for m in messages(caplog))
