"""The watchdog against real redis-servers, without Celery: one thread, one round trip per tick per
server (a thousand locks renewed in batches), one watchdog per process (a forked child starts its
own), a clean shutdown, and never a renewal after a release.

Timing assertions are correctness deadlines derived from the TTL, with room
for a loaded 2-core machine; none of them is a speed assertion.
"""

from __future__ import annotations

import logging
import os
import random
import select
import signal
import threading
import time

import pytest
from _watchdog_support import (
    RELEASE_SHAS,
    RENEW_SHA,
    WD_LOGGER,
    SlowRedis,
    renewals,
    renewed_after,
)

from celery_singleton_lock.engine.lock import Lock
from celery_singleton_lock.engine.server import LockServer
from celery_singleton_lock.exceptions import LockError
from celery_singleton_lock.testing.servers import Monitor, wait_until
from celery_singleton_lock.watchdog.process import get_watchdog, shutdown_watchdog
from celery_singleton_lock.watchdog.renewer import Watchdog

# -- one thread, one round trip per tick per server ---------------------------------


def _track_many(server: LockServer, dog: Watchdog, n: int, ttl: float) -> list[Lock]:
    """``n`` locks acquired (each its own owner) and tracked by ``dog``."""
    locks = []
    for i in range(n):
        lock = server.acquire(f"wd-many-{i}", ttl, owner_id=f"owner-{i}")
        assert isinstance(lock, Lock)
        dog.track(lock)
        locks.append(lock)
    return locks


def _held_by_their_tokens(client, locks: list[Lock]) -> list[bool]:
    """For each lock, whether its key still holds its own token (one pipelined read)."""
    pipe = client.pipeline(transaction=False)
    for lock in locks:
        pipe.get(lock.key)
    values = pipe.execute()
    return [v is not None and v.decode().startswith(lock.prefix) for v, lock in zip(values, locks, strict=True)]


def _check_round_trips(seen: list[tuple[float, list[str]]], batches: int, window: float, tick: float, chunk: int,
                       n: int) -> None:
    """The renewals ``seen`` (MONITOR) in a ``window`` of ``batches`` batches, for ``n`` locks."""
    # Round trips: each batch is one pipeline of ceil(keys/chunk) EVALSHAs to this one server,
    # and there is at most one batch per tick (here: one server, no failures).
    evalshas = len(seen)
    keys_renewed = sum(len(keys) for _, keys in seen)
    assert all(len(keys) <= chunk for _, keys in seen)
    assert batches >= 1 and keys_renewed >= n * 2  # every lock renewed at least twice in the window
    assert batches <= window / tick + 2, (batches, window)
    assert batches <= evalshas <= batches + keys_renewed / chunk, (batches, evalshas, keys_renewed)
    # MONITOR's view: renewal commands come in bursts (one pipeline each, executed back to
    # back), never more bursts than batches. Batches are a tick apart; a pipeline's commands
    # a few ms (more where the server was preempted between two of them: a busy CI machine
    # once split one at a 15 ms threshold), so a gap of half a tick tells two batches apart
    bursts = 0
    last = -1.0
    for when, _keys in seen:
        if when - last > tick / 2:
            bursts += 1
        last = when
    assert 1 <= bursts <= batches, (bursts, batches)
    assert evalshas < keys_renewed / 50  # nowhere near one command per lock


@pytest.mark.timeout(90)
def test_thousand_locks_one_thread_batched_renewals_all_alive(fresh_redis, server):
    ttl, chunk, n = 1.5, 300, 1000
    dog = Watchdog(chunk=chunk)
    client = fresh_redis.client(2)
    try:
        with Monitor(fresh_redis) as mon:
            before = set(threading.enumerate())
            count_before = threading.active_count()
            locks = _track_many(server, dog, n, ttl)
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

            # every lock still held by its own token after 3 x TTL, none reported lost
            assert all(_held_by_their_tokens(client, locks))
            assert not any(lock.lost for lock in locks)
            assert all(time.monotonic() - lock.confirmed_at < ttl for lock in locks)

        _check_round_trips(seen, batches, window, dog.tick, chunk, n)
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
            if words[1] in RELEASE_SHAS:  # (a fresh lock's release too: RELEASE's fresh path)
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
