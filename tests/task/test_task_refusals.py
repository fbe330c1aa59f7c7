"""A task whose lock Redis refuses or cannot be reached: each ends in a state and a log line that say
what happened, never in a body run unlocked. One section each, numbered on from test_task_faults.py:

5. a release that Redis refuses (WRONGTYPE) keeps the task's success;
6. permanent refusals (wrong password, not a Redis) fail at once and say what to fix;
   an unreachable Redis is retried as "unreachable", not as "lock busy".

Against real redis-servers (one with a password), a port that speaks HTTP, and real Celery workers.
"""

from __future__ import annotations

import logging
import socket
import threading
import uuid
from collections.abc import Iterator

import pytest
from _faults_support import LOGGER, app_on, catching, records
from _task_support import TIMEOUT, Runs, TaskEvents, locked
from celery.signals import task_retry

from celery_singleton_lock import LockBackendRefused, LockBackendUnavailable
from celery_singleton_lock.testing.servers import Monitor, RedisServer, free_port

pytestmark = pytest.mark.usefixtures("collect_results")


# -- 5. a refused release keeps the task's success --------------------------------------------


@pytest.mark.timeout(60)
def test_release_refused_by_redis_keeps_the_success(redis_server, run_worker, caplog):
    """The lock key is overwritten with a hash while the body runs: the release meets WRONGTYPE.
    The task still SUCCEEDS with its value; lock_released says deleted=False; a WARNING is logged;
    lock_lost fires (found at release)."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    app = app_on(redis_server)
    locks = redis_server.client(2)
    clobbered_keys: list[str] = []

    @locked(app, lock_ttl=30, name="faults.clobbered")
    def clobbered(self, k):
        key = self.lock.key
        clobbered_keys.append(key)
        locks.delete(key)
        locks.hset(key, "written", "by someone else")
        return f"done {k}"

    try:
        with TaskEvents(app) as rec, run_worker(app, pool="threads"):
            result = clobbered.delay("x")
            assert result.get(timeout=TIMEOUT) == "done x"
            [released] = rec.wait_for("lock_released", task_id=result.id)
        assert result.state == "SUCCESS"
        assert (released.kwargs["state"], released.kwargs["deleted"]) == ("SUCCESS", False)
        assert records(caplog, LOGGER, clobbered_keys[0], "WRONGTYPE", level=logging.WARNING), caplog.text
        lost = rec.of("lock_lost")
        assert [e.task_id for e in lost] == [result.id], lost
        assert "release" in lost[0].kwargs["reason"], lost[0].kwargs["reason"]
    finally:
        if clobbered_keys:
            locks.delete(*clobbered_keys)


# -- 6. permanent refusals fail at once; unreachable is retried as such ------------------------


class PasswordRedis(RedisServer):
    """A private redis-server with ``requirepass``: its own clients (and the readiness ping) log in."""

    def __init__(self, password: str) -> None:
        super().__init__(extra_args=["--requirepass", password])
        self.password = password

    def client(self, db: int = 0, **kwargs):
        kwargs.setdefault("password", self.password)
        return super().client(db, **kwargs)


@pytest.fixture
def http_port() -> Iterator[int]:
    """A tiny TCP server that answers every request like an HTTP server (it is not a Redis)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    conns: list[socket.socket] = []

    def talk(conn: socket.socket) -> None:
        try:
            while conn.recv(65536):
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
        except OSError:
            pass
        finally:
            conn.close()

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conns.append(conn)
            threading.Thread(target=talk, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    yield listener.getsockname()[1]
    listener.close()
    for conn in conns:
        try:
            conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def run_guarded(redis_server, run_worker, lock_url: str, raises: type[Exception], name: str, **conf):
    """One task against a lock Redis that cannot take its lock: (result, its exception (``raises``), the
    task_retry signals, the result backend's commands that name the task, runs)."""
    app = app_on(redis_server, lock_url, **conf)
    runs = Runs()

    @locked(app, name=f"faults.{name}")
    def guarded(self, x):
        runs.begin(str(x), self.request.id)
        return x

    with catching(task_retry, app) as retries, Monitor(redis_server, db=1) as mon, \
            run_worker(app, pool="threads", concurrency=2):
        result = guarded.delay(1)
        with pytest.raises(raises) as info:
            result.get(timeout=TIMEOUT)
        mon.sync()
        stored = [w for w in mon.commands() if any(result.id in arg for arg in w)]
    return result, info.value, retries, stored, runs


def run_refused(redis_server, run_worker, lock_url: str):
    """One task against a lock Redis that refuses: (result, its exception, retries, RETRY stores, runs)."""
    result, exc, retries, stored, runs = run_guarded(redis_server, run_worker, lock_url, LockBackendRefused,
                                                     "refused", singleton_lock_max_retries=3)
    retry_stores = [w for w in stored if any('"RETRY"' in arg for arg in w)]
    return result, exc, retries, retry_stores, runs


@pytest.mark.timeout(60)
def test_wrong_password_fails_at_once_and_says_what_to_fix(redis_server, run_worker):
    secret = f"right-{uuid.uuid4().hex[:6]}"
    wrong = f"wrong-{uuid.uuid4().hex[:6]}"
    with PasswordRedis(secret) as locked_redis:
        url = f"redis://:{wrong}@127.0.0.1:{locked_redis.port}/2"
        result, exc, retries, retry_stores, runs = run_refused(redis_server, run_worker, url)
    assert result.state == "FAILURE"
    message = str(exc)
    assert "check the password" in message, message
    assert wrong not in message and secret not in message and ":***@" in message, message
    assert retries == [] and retry_stores == []  # never RETRY: trying again cannot fix a password
    assert runs.all == []


@pytest.mark.timeout(60)
def test_a_server_that_is_not_redis_fails_at_once_and_says_so(redis_server, run_worker, http_port):
    secret = f"pw-{uuid.uuid4().hex[:6]}"
    url = f"redis://:{secret}@127.0.0.1:{http_port}/2"
    result, exc, retries, retry_stores, runs = run_refused(redis_server, run_worker, url)
    assert result.state == "FAILURE"
    message = str(exc)
    assert "is this the address of a Redis" in message, message
    assert secret not in message and ":***@" in message, message
    assert retries == [] and retry_stores == []
    assert runs.all == []


@pytest.mark.timeout(60)
def test_unreachable_lock_redis_is_retried_as_unreachable_not_as_busy(redis_server, run_worker, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    url = f"redis://127.0.0.1:{free_port()}/2"  # nothing listens there
    result, _, retries, stored, runs = run_guarded(
        redis_server, run_worker, url, LockBackendUnavailable, "unreachable", singleton_lock_max_retries=1,
        singleton_lock_redis_options={"socket_connect_timeout": 1})
    [retry] = retries
    reason = str(retry["reason"])
    assert "unreachable" in reason and "busy" not in reason, reason
    assert isinstance(retry["reason"].exc, LockBackendUnavailable)
    # the stored RETRY carries the LockBackendUnavailable, not a DuplicateTask
    retry_stores = [arg for w in stored for arg in w if '"RETRY"' in arg]
    assert retry_stores and all("LockBackendUnavailable" in s and "DuplicateTask" not in s for s in retry_stores)
    assert records(caplog, LOGGER, result.id, "lock Redis unreachable", level=logging.WARNING)
    assert runs.all == []
