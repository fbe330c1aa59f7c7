"""The lock engine's scripts and round trips: every operation survives SCRIPT FLUSH and a restart,
a script is loaded where it runs, one command per operation, and renew_many pipelines its chunks.

Against private redis-servers (``any_redis``, ``fresh_redis``), counted by INFO commandstats and MONITOR.
"""

from __future__ import annotations

import math
import secrets
import time

import pytest
from _lock_support import DB, counted, new_name, other_token, server_for, stats_diff, warm

from celery_singleton_lock.engine import exchange
from celery_singleton_lock.engine.lock import Holder, Lock, Release
from celery_singleton_lock.engine.server import LockServer
from celery_singleton_lock.exceptions import LockError
from celery_singleton_lock.testing.servers import Monitor

pytestmark = pytest.mark.timeout(60)


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
    # declared: cluster-safe. A fresh acquire (ACQUIRE's fresh path) touches the lock and its line only
    assert ops["acquire"][0][2:5] == ["2", lock.key, lock.key + ":q"]
    # its release: RELEASE's fresh path, the lock and its line, and one argument (nobody in line)
    assert ops["release"][0][2:] == ["2", lock.key, lock.key + ":q", lock.token + " "]
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


def test_a_new_process_first_call_of_a_script_already_loaded_is_one_evalsha(any_redis):
    """A prefork child or a second process whose scripts another process loaded already: its first
    acquire, renewal and release are one EVALSHA each, with no SCRIPT LOAD before them (the SHA is
    computed in the process; only a NOSCRIPT reply loads the script)."""
    warm(server_for(any_redis))
    new = LockServer.from_url(any_redis.url(DB))  # knows no script yet, as a new process
    with Monitor(any_redis) as mon:
        lock = new.acquire(new_name(), 10)
        assert isinstance(lock, Lock)
        assert new.renew(lock) and new.release(lock)
        mon.sync()
        words = [cmd[0].upper() for cmd in mon.commands()]
    assert words == ["EVALSHA"] * 3
    new.close()


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
