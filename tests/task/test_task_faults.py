"""A task under faults of its lock Redis, its broker or its own lock_key: a late or refused reply, a
lost lock, a frozen child, a stopped server, a visibility timeout, a raising key. Each ends in a
state and a log line that say what happened, never in a body run unlocked or run twice. One
section each, numbered as below.

Every scenario runs against real redis-servers and real Celery workers. Where the lock
Redis must be stopped while the broker keeps working, the locks live on a private
server of the test's own (``fresh_redis``) and the broker and results on ``redis_server``.

1. an acquire answered later than ttl/3 is given back and re-sent, never trusted;
2. a lost lock is reported before Redis could have let it expire; a too-short lock_ttl
   warns when the task's settings are resolved;
3. a prefork child frozen past its lock's TTL sees the loss at its first look, and the
   loss is announced once (one lock_lost, one ERROR line);
4. no "work again" WARNING while the lock Redis is still stopped;
5. a release that Redis refuses (WRONGTYPE) keeps the task's success;
6. permanent refusals (wrong password, not a Redis) fail at once and say what to fix;
   an unreachable Redis is retried as "unreachable", not as "lock busy";
7. an acks_late task held past the visibility timeout is delivered O(1) times;
8. a raising lock_key callable fails the task with LockKeyError;
9. only true redeliveries are dropped: eager reuse of an id, a re-applied frozen chord
   and a chain sent then applied eagerly all run.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from _apps import make_app
from _task_support import TIMEOUT, Runs, TaskEvents, assert_no_overlap, locked
from celery import chain, chord, group
from celery.signals import task_failure, task_prerun, task_retry

from celery_singleton_lock import LockBackendRefused, LockBackendUnavailable, LockKeyError
from celery_singleton_lock.engine import timing
from celery_singleton_lock.engine.lock import Lock
from celery_singleton_lock.engine.server import LockServer
from celery_singleton_lock.testing.servers import Monitor, RedisServer, free_port, wait_until
from celery_singleton_lock.watchdog.renewer import Watchdog

pytestmark = pytest.mark.usefixtures("collect_results")

LOGGER = "celery_singleton_lock"
WD_LOGGER = "celery_singleton_lock.watchdog"


def fresh(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def app_on(redis_server: RedisServer, lock_url: str | None = None, **conf):
    """An app on the session's server with a queue of its own (no other test's worker takes its
    messages), its locks at ``lock_url`` if given."""
    app = make_app(redis_server, task_default_queue=fresh("q"), **conf)
    if lock_url is not None:
        app.conf.singleton_lock_url = lock_url
    return app


@contextmanager
def catching(sig, app) -> Iterator[list[dict]]:
    """Every ``sig`` sent by a task of ``app``, as the keyword arguments it was sent with."""
    got: list[dict] = []

    def receiver(sender=None, **kwargs):
        if getattr(sender, "app", None) is app:
            got.append({"sender": sender, **kwargs})

    sig.connect(receiver, weak=False)
    try:
        yield got
    finally:
        sig.disconnect(receiver)


def records(caplog, logger: str, *parts: str, level: int = logging.DEBUG) -> list[str]:
    return [
        r.getMessage() for r in list(caplog.records)
        if r.name == logger and r.levelno >= level and all(p in r.getMessage() for p in parts)
    ]


# -- 1. an acquire answered too late is not trusted -----------------------------------------


@pytest.mark.timeout(30)
def test_acquire_answered_after_a_third_of_the_ttl_is_given_back(fresh_redis):
    """LockServer.acquire while Redis is frozen for longer than ttl/3: the reply arrives (the
    lock was set, with a fresh TTL), but it is released and LockBackendUnavailable raised."""
    server = LockServer.from_url(fresh_redis.url(2))
    warm = server.acquire(fresh("warm"), 3.0)  # connection open, scripts loaded: only the pause delays
    assert isinstance(warm, Lock)
    ttl = 3.0

    def frozen_acquire(name: str, pause: float):
        fresh_redis.pause()
        timer = threading.Timer(pause, fresh_redis.resume)
        timer.start()
        started = time.monotonic()
        try:
            return server.acquire(name, ttl, owner_id="late-owner"), time.monotonic() - started
        finally:
            timer.join()
            if fresh_redis.paused:
                fresh_redis.resume()

    # a pause well under ttl/3 is fine: the lock is taken and trusted
    quick, _ = frozen_acquire(fresh("quick"), 0.2)
    assert isinstance(quick, Lock) and server.holder(quick.key) is not None

    name = fresh("late")
    with pytest.raises(LockBackendUnavailable) as info:
        frozen_acquire(name, 1.6)  # > ttl / 3 = 1 s
    message = str(info.value)
    assert "reply came after" in message and "third of the lock's ttl of 3s" in message, message
    # given back: nobody holds it, and the next acquire gets it at once
    assert server.holder(name) is None
    assert isinstance(server.acquire(name, ttl), Lock)


@pytest.mark.timeout(90)
@pytest.mark.long
def test_task_whose_acquire_answers_late_is_resent_and_runs_later_alone(redis_server, fresh_redis, run_worker):
    """The lock Redis frozen 5 s (ttl 3) while a task arrives: its acquire returns on SIGCONT, too
    late. It must not run on that lock: RETRY (LockBackendUnavailable naming the lateness), then
    a proper run; a duplicate sent 3.5 s after SIGCONT (when the untrusted lock would have
    expired in Redis) is skipped, never run beside it."""
    app = app_on(redis_server, fresh_redis.url(2))
    runs = Runs()

    @locked(app, lock_key=["k"], lock_ttl=3, name="faults.late_acquire")
    def job(self, k, seconds):
        run = runs.begin(k, self.request.id)
        try:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                time.sleep(0.02)
        finally:
            runs.end(run)
        return self.request.id

    server = job.lock_server()
    server.release(server.acquire(fresh("warm"), 3))  # the worker's server: connected, scripts loaded
    k = fresh("late")
    with catching(task_prerun, app) as arrived, catching(task_retry, app) as retries, \
            run_worker(app, pool="threads", concurrency=4):
        fresh_redis.pause()
        paused_at = time.monotonic()
        try:
            first = job.apply_async((k, 5.0))
            wait_until(lambda: any(a["task_id"] == first.id for a in arrived), 10, what="the task to arrive")
            time.sleep(max(0.0, paused_at + 5.0 - time.monotonic()))  # the outage lasts 5 s
        finally:
            fresh_redis.resume()
        resumed_wall, resumed_at = time.time(), time.monotonic()
        # RETRY, stored with the reason: Redis answered too late to be trusted
        wait_until(lambda: retries, 10, what="the retry")
        state = wait_until(lambda: first.state == "RETRY" and first, 10, what="the RETRY state")
        assert isinstance(state.info, LockBackendUnavailable), state.info
        assert "reply came after" in str(state.info)
        [retry] = retries
        assert retry["request"].id == first.id and isinstance(retry["reason"].exc, LockBackendUnavailable)
        # the duplicate, when the untrusted lock would have expired in Redis
        time.sleep(max(0.0, resumed_at + 3.5 - time.monotonic()))
        dup = job.apply_async((k, 0.1))
        assert first.get(timeout=TIMEOUT) == first.id
        wait_until(lambda: dup.state == "REVOKED", TIMEOUT, what="the duplicate to be skipped")
    [run] = runs.of(k)  # the body ran once, and only for the re-sent task
    assert run.task_id == first.id and run.start >= resumed_wall
    assert not runs.of(k, dup.id)
    assert_no_overlap([(r.start, r.end) for r in runs.of(k)])


# -- 2. a loss is reported before Redis could expire the lock ---------------------------------


@pytest.mark.timeout(90)
@pytest.mark.long
def test_watchdog_reports_a_loss_before_the_lock_could_expire_in_redis(fresh_redis):
    """Redis frozen under a tracked lock (ttl 3): on_lost (what fires lock_lost) must run before
    confirmed_at + ttl, the earliest moment Redis could let the lock go. Four rounds, the freeze
    at a random point of the renewal period. The test thread never reads ``lock.lost`` before
    the callback fired (reading it would report the loss itself)."""
    server = LockServer.from_url(fresh_redis.url(2))
    dog = Watchdog()
    ttl = 3.0
    try:
        for round_ in range(4):
            fired = threading.Event()
            seen: dict[str, float] = {}

            def on_lost(lock, reason, seen=seen, fired=fired):
                seen["at"], seen["confirmed_at"] = time.monotonic(), lock.confirmed_at
                fired.set()

            lock = server.acquire(fresh(f"wd-loss-{round_}"), ttl, owner_id=f"owner-{round_}")
            assert isinstance(lock, Lock)
            acquired = lock.confirmed_at
            dog.track(lock, on_lost)
            wait_until(lambda lock=lock, acquired=acquired: lock.confirmed_at > acquired, ttl, what="a renewal")
            time.sleep(random.uniform(0, ttl / 3))  # freeze anywhere in the renewal period
            fresh_redis.pause()
            try:
                assert fired.wait(ttl + 5), f"round {round_}: no loss reported"
            finally:
                fresh_redis.resume()
            early = seen["confirmed_at"] + ttl - seen["at"]
            assert early > 0, f"round {round_}: reported {-early:.3f}s after the lock could have expired"
            assert lock.lost and lock not in dog
    finally:
        dog.shutdown()


@pytest.mark.timeout(30)
def test_lock_ttl_below_the_shortest_safe_ttl_warns_when_settings_resolve(app, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    shortest = timing.shortest_safe_ttl()

    @locked(app, lock_ttl=round(shortest / 2, 2), name="faults.too_short")
    def too_short(self):
        return None

    @locked(app, lock_ttl=round(shortest + 2, 2), name="faults.long_enough")
    def long_enough(self):
        return None

    too_short.lock_settings()
    long_enough.lock_settings()
    [warning] = records(caplog, LOGGER, "faults.too_short", level=logging.WARNING)
    assert "lock_ttl" in warning and "shorter than the watchdog can keep safely" in warning, warning
    assert not records(caplog, LOGGER, "faults.long_enough", level=logging.WARNING)


# -- 3. a frozen prefork child sees its loss at once, announced once -------------------------


def _started(worker_app, key: str, tag: str) -> dict | None:
    for raw in worker_app.journal.lrange(f"started:lost_probe:{key}", 0, -1):
        entry = json.loads(raw)
        if entry["tag"] == tag:
            return entry
    return None


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.long
def test_frozen_prefork_child_sees_its_lost_lock_at_first_look_and_it_is_announced_once(
    worker_app, worker_processes, redis_server
):
    """A prefork child holding a lock (ttl 2) is SIGSTOPped 6 s while a successor takes the key.
    On SIGCONT its first read of self.lock.lost is True and ensure() raises LockLost; lock_lost
    fires once and one ERROR "was LOST" line is logged. Two rounds."""
    worker = worker_processes(pool="prefork", concurrency=2).wait_ready(60)
    task = worker_app.lost_probe
    locks = LockServer(redis_server.client(2))
    for round_ in range(2):
        key = fresh(f"frozen-{round_}")
        name = task.lock_key_for((key, "stopped"))
        stopped = task.apply_async((key, "stopped"))
        entry = wait_until(lambda key=key: _started(worker_app, key, "stopped"), 30, what="the holder to start")
        pid = entry["pid"]
        assert entry["id"] == stopped.id and pid in worker.children()
        assert locks.holder(name).owner_id == stopped.id
        os.kill(pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        try:
            wait_until(lambda name=name: locks.holder(name) is None, 10, what="the frozen child's lock to expire")
            successor = task.apply_async((key, "successor"))
            entry2 = wait_until(lambda key=key: _started(worker_app, key, "successor"), 30, what="the successor")
            assert entry2["pid"] != pid and locks.holder(name).owner_id == successor.id
            time.sleep(max(0.0, frozen_at + 6.0 - time.monotonic()))  # the freeze lasts 6 s
        finally:
            os.kill(pid, signal.SIGCONT)
        out = stopped.get(timeout=TIMEOUT)
        assert out["pid"] == pid
        assert out["first_read"] is True, out
        assert out["ensure"] == "LockLost", out
        worker_app.journal.set(f"gate:{key}:successor", 1)
        assert successor.get(timeout=TIMEOUT)["lost"] is False
        line = f"held by {stopped.id} was LOST"
        wait_until(lambda line=line: line in worker.log(), 10, what="the ERROR line")
        signals = [json.loads(s) for s in worker_app.journal.lrange(f"lost_signal:{stopped.id}", 0, -1)]
        assert len(signals) == 1, signals
        assert signals[0]["key"] == name and signals[0]["pid"] == pid
        assert worker.log().count(line) == 1, worker.log()[-3000:]
        assert not worker_app.journal.exists(f"lost_signal:{successor.id}")


# -- 4. no recovery WARNING while Redis is still stopped --------------------------------------


@pytest.mark.timeout(60)
def test_no_recovery_warning_while_redis_is_still_stopped(fresh_redis, caplog):
    """A lock forgotten while its renewal round is in flight during an outage is neither a
    success nor a failure: it must not make the watchdog log "work again"."""
    caplog.set_level(logging.WARNING, logger=WD_LOGGER)
    server = LockServer.from_url(fresh_redis.url(2))
    dog = Watchdog()
    ttl = 3.0
    try:
        lock = server.acquire(fresh("wd-outage"), ttl, owner_id="outage")
        dog.track(lock)
        fresh_redis.pause()
        try:
            wait_until(lambda: records(caplog, WD_LOGGER, "failed; retrying"), ttl, what="the failure WARNING")
            # forget it while a renewal round of it is in flight (the round that misreported)
            wait_until(lambda: lock in dog._in_flight, ttl / 2, 0.002, "a renewal round in flight")
            dog.forget(lock)
            with pytest.raises(TimeoutError):
                wait_until(lambda: records(caplog, WD_LOGGER, "work again"), 3.0, what="a recovery WARNING")
            assert fresh_redis.paused
        finally:
            fresh_redis.resume()
        # a renewal that really succeeds is a recovery, and says so once
        again = server.acquire(fresh("wd-after"), ttl, owner_id="after")
        dog.track(again)
        wait_until(lambda: records(caplog, WD_LOGGER, "work again"), ttl + 2, what="the recovery WARNING")
        assert len(records(caplog, WD_LOGGER, "work again")) == 1
    finally:
        dog.shutdown()


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


# -- 7. redeliveries are not amplified ----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.long
def test_acks_late_task_held_past_the_visibility_timeout_is_delivered_o1_times(
    worker_app, worker_processes, redis_server
):
    """acks_late, visibility timeout 2 s, kombu restoring unacked messages every second: a task
    holding its key 10 s is redelivered meanwhile. Those copies must not bounce in a re-send
    loop: a handful of deliveries, the body once, SUCCESS, and nothing left in the key's line."""
    worker = worker_processes(pool="prefork", concurrency=2, env={"CSL_ACKS_LATE": "1", "CSL_VISIBILITY": "2"})
    worker.wait_ready(60)
    task = worker_app.redelivery_probe
    key = fresh("redeliv")
    result = task.apply_async((key, 10.0))
    assert result.get(timeout=60)["key"] == key
    journal = worker_app.journal

    def deliveries() -> list[dict]:
        return [json.loads(d) for d in journal.lrange(f"deliveries:{result.id}", 0, -1)]

    # a few seconds more: no copy keeps coming back after the end either
    count = len(deliveries())
    with pytest.raises(TimeoutError):
        wait_until(lambda: len(deliveries()) > count, 3.0, what="another delivery")
    seen = deliveries()
    assert any(d["redelivered"] for d in seen), seen  # the broker did redeliver it while it ran
    assert len(seen) <= 4, f"{len(seen)} deliveries of one task id: {seen}"
    assert journal.llen(f"runs:redelivery_probe:{key}") == 1  # the body ran once
    assert result.state == "SUCCESS"
    name = task.lock_key_for((key, 10.0))
    locks = redis_server.client(2)
    assert not locks.exists(name, name + ":q", name + ":w"), (
        locks.lrange(name + ":q", 0, -1), locks.hkeys(name + ":w"),
    )
    assert "LOST" not in worker.log()


# -- 8. a raising lock_key callable ---------------------------------------------------------------


@pytest.mark.timeout(60)
def test_raising_lock_key_callable_fails_the_task_with_lock_key_error(redis_server, run_worker):
    app = app_on(redis_server)
    runs = Runs()

    def broken_key(x):
        raise ValueError(f"no key for {x!r}")

    @locked(app, lock_key=broken_key, name="faults.broken_key")
    def job(self, x):
        runs.begin(str(x), self.request.id)
        return x

    with catching(task_failure, app) as failures, run_worker(app, pool="threads", concurrency=2):
        result = job.delay(7)
        with pytest.raises(LockKeyError) as info:
            result.get(timeout=TIMEOUT)
    message = str(info.value)
    assert "faults.broken_key" in message and "lock_key" in message, message
    assert "ValueError" in message and "no key for 7" in message, message
    [failure] = failures
    exc = failure["exception"]
    assert isinstance(exc, LockKeyError) and isinstance(exc.__cause__, ValueError)  # chained
    assert runs.all == []


# -- 9. only true redeliveries are dropped ------------------------------------------------------


@pytest.mark.timeout(60)
def test_eager_run_or_fresh_message_reusing_a_finished_task_id_runs(redis_server, run_worker):
    """An acks_late task keeps a done record for its redeliveries; an eager run, or a fresh
    message, under the same task id is new work all the same."""
    app = app_on(redis_server)
    runs = Runs()

    @locked(app, acks_late=True, name="faults.reused_id")
    def job(self, x):
        runs.begin(str(x), self.request.id)
        return [x, self.request.id]

    k = fresh("reuse")
    with run_worker(app, pool="threads", concurrency=2):
        first = job.apply_async((k,))
        assert first.get(timeout=TIMEOUT) == [k, first.id]
        name = job.lock_key_for((k,))
        assert redis_server.client(2).zscore(name + ":d", first.id) is not None  # the done record
        eager = job.apply((k,), task_id=first.id)
        assert eager.state == "SUCCESS" and eager.result == [k, first.id]
        again = job.apply_async((k,), task_id=first.id)
        wait_until(lambda: len(runs.of(k, first.id)) == 3, TIMEOUT, what="the fresh message to run")
        assert again.get(timeout=TIMEOUT) == [k, first.id]
    assert len(runs.of(k, first.id)) == 3


@pytest.mark.timeout(60)
def test_reapplying_a_frozen_chord_runs_its_header_and_body_again(redis_server, run_worker):
    """After Celery's t/integration test_reapplying_frozen_chord_dispatches_body_again, with
    acks_late LockedTasks: the same task ids again are fresh messages, not redeliveries."""
    app = app_on(redis_server)
    runs = Runs()

    @locked(app, acks_late=True, name="faults.add")
    def add(self, a, b):
        runs.begin(f"add-{a}-{b}", self.request.id)
        return a + b

    @locked(app, acks_late=True, name="faults.tsum")
    def tsum(self, values):
        runs.begin("tsum", self.request.id)
        return sum(values)

    sig = chord(group(add.s(1, 2), add.s(3, 4)), tsum.s())
    sig.freeze()
    with run_worker(app, pool="threads", concurrency=4):
        first = sig.apply_async()
        assert first.get(timeout=TIMEOUT) == 10
        sig.apply_async()
        wait_until(lambda: len(runs.of("tsum")) == 2, TIMEOUT, what="the chord body to run again")
    assert len({r.task_id for r in runs.of("tsum")}) == 1  # the same frozen body id, run twice
    assert len(runs.of("add-1-2")) == len(runs.of("add-3-4")) == 2


@pytest.mark.timeout(60)
def test_chain_sent_then_applied_eagerly_returns_its_value(redis_server, run_worker):
    """After Celery's t/integration test_chain_in_chain_with_args, with acks_late LockedTasks."""
    app = app_on(redis_server)
    runs = Runs()

    @locked(app, acks_late=True, name="faults.identity")
    def identity(self, x):
        runs.begin(f"identity-{x}", self.request.id)
        return x

    c1 = chain(chain(identity.s(), identity.s()))
    with run_worker(app, pool="threads", concurrency=2):
        sent = c1.apply_async(args=(1,))
        assert sent.get(timeout=TIMEOUT) == 1
        assert len(runs.of("identity-1")) == 2
        applied = c1.apply(args=(1,))
        assert applied.get(timeout=TIMEOUT) == 1
    assert len(runs.of("identity-1")) == 4  # the eager run ran both links too
