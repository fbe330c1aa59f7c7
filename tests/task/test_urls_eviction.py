"""The lock URL's eviction-policy check (section 4 of the lock URL's tests): a ``maxmemory-policy``
other than ``noeviction`` gets one warning per URL and process; one round trip for many threads;
a CONFIG renamed away, refused by an ACL, or a server unreachable is silent.

Nothing here connects to 127.0.0.1:6379: URLs are compared as strings, turned into clients
without connecting (``connection_kwargs``, ``make_connection()``), or point at private servers.
"""

from __future__ import annotations

import logging
import threading
import uuid

import pytest
import redis
from _urls_support import (
    SECRET,
    _no_celery_env,  # noqa: F401 (autouse: no CELERY_* from a developer's shell)
    )

from celery_singleton_lock.testing.servers import RedisServer, free_port
from celery_singleton_lock.topologies import servers

pytestmark = pytest.mark.timeout(60)


# -- 4. the eviction policy -----------------------------------------------------------------------


@pytest.fixture
def warnings_(caplog):
    caplog.set_level(logging.WARNING, logger="celery_singleton_lock")

    def policy_warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records
                if r.levelno == logging.WARNING and "maxmemory-policy" in r.getMessage()]
    return policy_warnings


def config_gets(server) -> int:
    """CONFIG GET calls so far (Redis 7 counts subcommands apart; 6.2 counts all CONFIG calls)."""
    stats = server.commandstats()
    return stats.get("config|get", stats.get("config", 0))


def unique_url(server: RedisServer, db: int = 0, password: str | None = None) -> str:
    """A URL nobody else in this process has checked (the memo is per URL and process)."""
    auth = f":{password}@" if password else ""
    return f"redis://{auth}127.0.0.1:{server.port}/{db}?client_name=t{uuid.uuid4().hex[:8]}"


def test_noeviction_is_silent(fresh_redis, warnings_):
    fresh_redis.client().config_set("maxmemory-policy", "noeviction")
    url = unique_url(fresh_redis)
    with redis.Redis.from_url(url) as client:
        assert servers.check_eviction_policy(client, url) == "noeviction"
    assert warnings_() == []


@pytest.mark.parametrize("policy", ["allkeys-lru", "volatile-ttl"])
def test_an_evicting_policy_warns_once(fresh_redis, warnings_, policy):
    fresh_redis.client().config_set("maxmemory-policy", policy)
    fresh_redis.client().config_set("requirepass", SECRET)  # this private server only
    url = unique_url(fresh_redis, db=2, password=SECRET)
    authed = RedisAuthed(fresh_redis)
    with redis.Redis.from_url(url) as client:
        before = config_gets(authed)
        assert servers.check_eviction_policy(client, url) == policy
        assert servers.check_eviction_policy(client, url) == policy  # remembered: no second round trip
        assert config_gets(authed) == before + 1
    lines = warnings_()
    assert len(lines) == 1, lines
    assert policy in lines[0] and "noeviction" in lines[0] and f"127.0.0.1:{fresh_redis.port}/2" in lines[0]
    assert SECRET not in lines[0] and ":***@" in lines[0]


class RedisAuthed:
    """commandstats of a server that now wants a password (helper for the test above)."""

    def __init__(self, server: RedisServer) -> None:
        self.server = server

    def commandstats(self) -> dict[str, int]:
        with self.server.client(password=SECRET) as c:
            stats = c.info("commandstats")
        return {name.split("_", 1)[1].lower(): int(v["calls"]) for name, v in stats.items()}


def test_many_threads_one_round_trip_one_warning(fresh_redis, warnings_):
    fresh_redis.client().config_set("maxmemory-policy", "allkeys-lfu")
    url = unique_url(fresh_redis)
    before = config_gets(fresh_redis)
    barrier = threading.Barrier(8)
    results: list[str | None] = []

    def check() -> None:
        with redis.Redis.from_url(url) as client:
            barrier.wait(10)
            results.append(servers.check_eviction_policy(client, url))

    threads = [threading.Thread(target=check) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert results == ["allkeys-lfu"] * 8
    assert config_gets(fresh_redis) == before + 1
    assert len(warnings_()) == 1


def test_config_renamed_away_is_silent(warnings_):
    """Managed Redis often disables CONFIG; the policy here would warn if it could be read."""
    with RedisServer(extra_args=["--rename-command", "CONFIG", "", "--maxmemory-policy", "allkeys-lru"]) as server:
        url = unique_url(server)
        with redis.Redis.from_url(url) as client:
            with pytest.raises(redis.ResponseError):
                client.config_get("maxmemory-policy")  # the server really refuses it
            assert servers.check_eviction_policy(client, url) is None
            assert servers.check_eviction_policy(client, url) is None
    assert warnings_() == []


def test_config_refused_by_acl_is_silent(fresh_redis, warnings_):
    admin = fresh_redis.client()
    admin.config_set("maxmemory-policy", "allkeys-lru")
    admin.execute_command("ACL", "SETUSER", "locker", "on", ">lockerpw", "~*", "+@all", "-config")
    url = f"redis://locker:lockerpw@127.0.0.1:{fresh_redis.port}/0?client_name=acl{uuid.uuid4().hex[:6]}"
    with redis.Redis.from_url(url) as client:
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.config_get("maxmemory-policy")
        assert servers.check_eviction_policy(client, url) is None
    assert warnings_() == []


def test_unreachable_is_silent_and_asked_again_later(warnings_):
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0?client_name=down{uuid.uuid4().hex[:6]}"
    with redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1) as client:
        assert servers.check_eviction_policy(client, url) is None  # nothing listens
        with RedisServer(port=port, extra_args=["--maxmemory-policy", "allkeys-random"]) as server:
            assert server.port == port
            assert servers.check_eviction_policy(client, url) == "allkeys-random"  # not remembered as None
    assert len(warnings_()) == 1
