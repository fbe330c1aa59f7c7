"""The watchdog against real redis-servers, without Celery: LockServer + Watchdog.

Timing assertions are correctness deadlines derived from the TTL, with room
for a loaded 2-core machine; none of them is a speed assertion.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import random
import select
import signal
import threading
import time

import pytest

from celery_singleton_lock.engine import notify
from celery_singleton_lock.engine.fresh import RELEASE_FRESH
from celery_singleton_lock.engine.lock import Lock
from celery_singleton_lock.engine.scripts import RELEASE, RENEW_MANY
from celery_singleton_lock.engine.server import LockServer
from celery_singleton_lock.exceptions import LockError, LockLost
from celery_singleton_lock.testing.servers import Monitor, RedisServer, wait_until
from celery_singleton_lock.watchdog.process import get_watchdog, shutdown_watchdog
from celery_singleton_lock.watchdog.renewer import Watchdog

RENEW_SHA = hashlib.sha1(RENEW_MANY.encode()).hexdigest()
RELEASE_SHAS = {hashlib.sha1(script.encode()).hexdigest() for script in (RELEASE, RELEASE_FRESH)}
SLACK = 1.0  # seconds of scheduling noise we tolerate on a loaded machine (never a speed claim)
WD_LOGGER = "celery_singleton_lock.watchdog"
LOST_LOGGER = "celery_singleton_lock"  # the ERROR line of a loss: the handle logs it, wherever it was found


@pytest.fixture
def server(fresh_redis: RedisServer) -> LockServer:
    return LockServer.from_url(fresh_redis.url(2))


@pytest.fixture
def wd():
    dog = Watchdog()
    yield dog
    dog.shutdown()


def renewals(mon: Monitor, key: str | None = None) -> list[tuple[float, list[str]]]:
    """(server time, keys) of every renewal EVALSHA the monitor saw, optionally only those naming ``key``."""
    mon.sync()
    out = []
    for when, _db, words, _client in list(mon._records):  # the records keep MONITOR's timestamps
        if len(words) > 3 and words[0].upper() == "EVALSHA" and words[1] == RENEW_SHA:
            keys = words[3 : 3 + int(words[2])]
            if key is None or key in keys:
                out.append((when, keys))
    return out


BUSY_SCRIPT = "local n = 0 for i = 1, tonumber(ARGV[1]) do n = n + i end return 1"
"""A script that keeps the server busy for ARGV[1] loop turns (TIME cannot time it: Valkey freezes
TIME within a script), so the turns for a given time are measured against the server first."""


class SlowRedis:
    """Make a server answer late: a busy script of ``busy`` seconds every ``every`` seconds."""

    def __init__(self, server: RedisServer, busy: float = 0.06, every: float = 0.15) -> None:
        self.client = server.client(2)
        self.busy, self.every = busy, every
        turns = 1_000_000
        started = time.perf_counter()
        self.client.eval(BUSY_SCRIPT, 0, turns)  # the server's speed, measured first
        self.turns = max(1, int(turns * busy / max(time.perf_counter() - started, 1e-6)))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.client.eval(BUSY_SCRIPT, 0, self.turns)

    def __enter__(self) -> SlowRedis:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self.client.close()


def owns(redis_client, lock: Lock) -> bool:
    value = redis_client.get(lock.key)
    return value is not None and value.decode().startswith(lock.prefix)


def renewed_after(lock: Lock, since: float, timeout: float) -> None:
    wait_until(lambda: lock.confirmed_at > since, timeout, what=f"a renewal of {lock.key}")


# -- one thread, one round trip per tick per server ---------------------------------


@pytest.mark.timeout(90)
def test_thousand_locks_one_thread_batched_renewals_all_alive(fresh_redis, server):
    ttl, chunk, n = 1.5, 300, 1000
    dog = Watchdog(chunk=chunk)
    client = fresh_redis.client(2)
    try:
        with Monitor(fresh_redis) as mon:
            before = set(threading.enumerate())
            count_before = threading.active_count()
            locks = []
            for i in range(n):
                lock = server.acquire(f"wd-many-{i}", ttl, owner_id=f"owner-{i}")
                assert isinstance(lock, Lock)
                dog.track(lock)
                locks.append(lock)
            tracked_at = time.monotonic()
            assert len(dog) == n
            new_threads = set(threading.enumerate()) - before
            assert new_threads == {dog.thread}, new_threads
            assert threading.active_count() <= count_before + 1

            mon.clear()
            batches_before = dog.batches
            window_start = time.monotonic()
            # the property under test is "alive after 3 x TTL": let that time pass, checking as we go
            while time.monotonic() < tracked_at + 3 * ttl:
                assert not any(lock.lost for lock in locks)
                assert set(threading.enumerate()) - before == {dog.thread}
                time.sleep(0.25)
            seen = renewals(mon)
            batches = dog.batches - batches_before
            window = time.monotonic() - window_start

            pipe = client.pipeline(transaction=False)
            for lock in locks:
                pipe.get(lock.key)
            values = pipe.execute()
            # every lock still held by its own token after 3 x TTL, none reported lost
            held = [v is not None and v.decode().startswith(lock.prefix) for v, lock in zip(values, locks, strict=True)]
            assert all(held)
            assert not any(lock.lost for lock in locks)
            assert all(time.monotonic() - lock.confirmed_at < ttl for lock in locks)

        # Round trips: each batch is one pipeline of ceil(keys/chunk) EVALSHAs to this one server,
        # and there is at most one batch per tick (here: one server, no failures).
        evalshas = len(seen)
        keys_renewed = sum(len(keys) for _, keys in seen)
        assert all(len(keys) <= chunk for _, keys in seen)
        assert batches >= 1 and keys_renewed >= n * 2  # every lock renewed at least twice in the window
        assert batches <= window / dog.tick + 2, (batches, window)
        assert batches <= evalshas <= batches + keys_renewed / chunk, (batches, evalshas, keys_renewed)
        # MONITOR's view: renewal commands come in bursts (one pipeline each, executed back to
        # back), never more bursts than batches. Batches are a tick apart; a pipeline's commands
        # a few ms (more where the server was preempted between two of them: a busy CI machine
        # once split one at a 15 ms threshold), so a gap of half a tick tells two batches apart
        bursts = 0
        last = -1.0
        for when, _keys in seen:
            if when - last > dog.tick / 2:
                bursts += 1
            last = when
        assert 1 <= bursts <= batches, (bursts, batches)
        assert evalshas < keys_renewed / 50  # nowhere near one command per lock
        for lock in locks:
            dog.forget(lock)
        assert len(dog) == 0
    finally:
        dog.shutdown()
    assert not dog.alive


@pytest.mark.timeout(60)
def test_one_watchdog_per_process_and_a_forked_child_starts_its_own(fresh_redis, server):
    shutdown_watchdog()
    parent_dog = get_watchdog()
    assert get_watchdog() is parent_dog and parent_dog.pid == os.getpid()
    lock = server.acquire("wd-fork-parent", 1.5)
    parent_dog.track(lock)
    try:
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report, then leave without running the parent's cleanup
            code = 1
            try:
                child_dog = get_watchdog()
                child_server = LockServer.from_url(fresh_redis.url(2))
                child_lock = child_server.acquire("wd-fork-child", 0.9)
                child_dog.track(child_lock)
                first = child_lock.confirmed_at
                wait_until(lambda: child_lock.confirmed_at > first, 5)
                fine = (
                    child_dog is not parent_dog
                    and child_dog.pid == os.getpid()
                    and len(child_dog) == 1  # the parent's lock is not the child's to renew
                    and not child_lock.lost
                )
                child_dog.forget(child_lock)
                child_server.release(child_lock)
                child_dog.shutdown()
                os.write(write_fd, b"ok" if fine else b"bad")
                code = 0
            finally:
                os._exit(code)
        os.close(write_fd)
        ready, _, _ = select.select([read_fd], [], [], 20)
        answer = os.read(read_fd, 16) if ready else b""
        os.close(read_fd)
        if not answer:
            os.kill(pid, signal.SIGKILL)  # our own child, by PID
        _, status = os.waitpid(pid, 0)
        assert answer == b"ok" and os.waitstatus_to_exitcode(status) == 0
        assert get_watchdog() is parent_dog and parent_dog.alive and lock in parent_dog
    finally:
        parent_dog.forget(lock)
        server.release(lock)
        shutdown_watchdog()
    assert not parent_dog.alive
    assert get_watchdog() is not parent_dog  # a new one after a shutdown
    shutdown_watchdog()


@pytest.mark.timeout(30)
def test_shutdown_joins_the_thread_and_refuses_new_locks(server, caplog):
    dog = Watchdog()
    lock = server.acquire("wd-shutdown", 1.5)
    dog.track(lock)
    thread = dog.thread
    assert thread is not None and thread.is_alive()
    with caplog.at_level(logging.INFO, logger=WD_LOGGER):
        dog.shutdown()
    assert not thread.is_alive()
    assert any("still held" in r.getMessage() for r in caplog.records)  # says what it leaves behind
    assert any("stopped" in r.getMessage() for r in caplog.records)
    other = server.acquire("wd-shutdown-2", 1.5)
    with pytest.raises(LockError):
        dog.track(other)
    dog.forget(lock)  # harmless after the shutdown
    server.release(lock)
    server.release(other)
    with pytest.raises(ValueError, match="already released"):
        Watchdog().track(other)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "options, bad",
    [({"tick": 0}, "0"), ({"tick": "0.1"}, "'0.1'"), ({"chunk": 0}, "0"), ({"socket_timeout": -1}, "-1")],
)
def test_bad_options_raise_naming_the_value(options, bad):
    with pytest.raises(ValueError) as info:
        Watchdog(**options)
    assert bad in str(info.value) and next(iter(options)) in str(info.value)


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


# -- never a renewal after a release -------------------------------------------------------


@pytest.mark.timeout(60)
def test_no_renewal_ever_follows_a_release(fresh_redis, server, wd):
    ttl = 1.2
    locks = [server.acquire(f"wd-release-{i}", ttl) for i in range(200)]
    keep = server.acquire("wd-release-keep", ttl)
    for lock in locks:
        wd.track(lock)
    wd.track(keep)
    forgotten_at: dict[Lock, float] = {}
    with Monitor(fresh_redis) as mon, SlowRedis(fresh_redis, busy=0.04, every=0.1):
        # (replies come late, so rounds stay in flight long: a forget() that did not wait would show)
        renewed_after(locks[-1], locks[-1].confirmed_at, ttl)
        rng = random.Random(4)
        order = locks[:]
        rng.shuffle(order)
        errors: list[BaseException] = []

        def let_go(part: list[Lock]) -> None:
            try:
                for lock in part:
                    wd.forget(lock)  # synchronous: waits out a round that holds it
                    forgotten_at[lock] = lock.confirmed_at
                    assert server.release(lock)  # still ours: it was renewed until now
                    time.sleep(rng.uniform(0, 0.02))  # spread the releases over many ticks
            except BaseException as exc:
                errors.append(exc)

        workers = [threading.Thread(target=let_go, args=(order[i::2],)) for i in range(2)]
        for t in workers:
            t.start()
        for t in workers:
            t.join(30)
        assert not errors, errors
        # a few more TTLs, in which the kept lock is renewed and the released ones never
        for _ in range(3):
            renewed_after(keep, keep.confirmed_at, ttl)
        time.sleep(ttl)
        mon.sync()
        records = [words for _, _, words, _ in list(mon._records)]
    released_at: dict[str, int] = {}
    renewed_at: dict[str, list[int]] = {}
    for i, words in enumerate(records):
        if len(words) > 3 and words[0].upper() == "EVALSHA":
            keys = words[3 : 3 + int(words[2])]
            if words[1] in RELEASE_SHAS:  # (a fresh lock's release is the short RELEASE_FRESH)
                released_at[keys[0]] = i
            elif words[1] == RENEW_SHA:
                for key in keys:
                    renewed_at.setdefault(key, []).append(i)
    assert set(released_at) == {lock.key for lock in locks}
    assert len(renewed_at.get(keep.key, [])) >= 3
    late = {key: idx for key, idx in released_at.items() if any(r > idx for r in renewed_at.get(key, []))}
    assert not late, f"renewed after release: {late}"
    # and no renewal reply came back after forget() returned: nothing was in flight any more
    assert all(lock.confirmed_at == forgotten_at[lock] for lock in locks)
    assert all(lock.key in renewed_at for lock in locks)  # the monitor did see their renewals before
    wd.forget(keep)
    server.release(keep)


# -- the schedule --------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_renewal_runs_ttl_over_3_from_the_send_on_a_fixed_schedule(fresh_redis, server, wd):
    ttl = 1.5  # ttl/3 = 0.5 s = 5 ticks of 0.1 s
    period = math.ceil(ttl / 3 / wd.tick - 1e-9) * wd.tick
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
