"""The lock engine's errors: a bad TTL before any I/O, an unreachable Redis without the password,
releases that failed or timed out, a whole TTL unconfirmed, a foreign value, closed connections."""

from __future__ import annotations

import pickle
import re
import secrets
import time
import traceback
import uuid

import pytest
from _lock_support import DB, new_name, server_for, warm
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_singleton_lock.engine.addresses import redact_url
from celery_singleton_lock.engine.lock import Lock, Release, check_ttl, slot_safe
from celery_singleton_lock.engine.server import LockServer
from celery_singleton_lock.exceptions import LockBackendRefused, LockBackendUnavailable, LockError, LockLost
from celery_singleton_lock.testing.servers import free_port, wait_until

pytestmark = pytest.mark.timeout(60)


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
