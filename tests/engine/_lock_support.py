"""The lock engine tests' shared helpers (tests/engine/test_lock*.py): the locks' database, fresh
key names, a LockServer on a private redis-server, and counting the commands an operation sends."""

from __future__ import annotations

import secrets
import uuid

from celery_singleton_lock.engine.lock import Lock
from celery_singleton_lock.engine.server import LockServer
from celery_singleton_lock.testing.servers import RedisServer

DB = 2  # the locks' database in the fixtures' layout


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
