"""Whose lock is whose, and what an execution does with its own: eager nesting never deadlocks, bad
watchdog settings fail before any lock, servers are told apart by their credentials, a forked child
never releases its parent's lock, nothing interrupts a release half-way, a slow lock_lost receiver
costs no healthy lock, each budget has its own counter, a re-send retakes its own orphan lock,
.ensure() and the watchdog share one deadline, a release is retried within bounds, and
``duplicate_skipped`` names every policy. One section each.

Everything runs against a real redis-server (private, on a free port) and, where a worker is
involved, a real Celery worker; faults are real too (SIGSTOP of the lock Redis, a real fork, ACL
users), except that the tests of an interrupted release inject one exception into one call (an
asynchronous exception landing at a chosen point cannot be produced on demand).

Timing bounds here are deadlines for "does not hang", far below what a hang would take (minutes,
a lock TTL of 30 s, ~30 s of release retries), never benchmarks.
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
import threading
import time
import uuid

import pytest
from _apps import make_app
from _task_support import RESTORE_FAST, TIMEOUT, Gates, Runs, TaskEvents, locked, redeliver
from celery.signals import before_task_publish, task_prerun

from celery_singleton_lock import LockError, LockServer, SelfDeadlock, held
from celery_singleton_lock.delivery import config as csl_config
from celery_singleton_lock.delivery.headers import described
from celery_singleton_lock.engine.addresses import redact_url
from celery_singleton_lock.engine.lock import Lock
from celery_singleton_lock.testing.servers import Monitor, RedisServer, wait_until
from celery_singleton_lock.watchdog.process import get_watchdog
from celery_singleton_lock.watchdog.renewer import Watchdog

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("collect_results")]


def within(seconds: float, fn, *args, **kwargs):
    """Run ``fn`` in a daemon thread; its value, or AssertionError if it is not done in ``seconds``.

    A hang (an eager self-deadlock) must fail the test, not hang the suite.
    """
    box: dict = {}

    def target() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # handed to the test's thread
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise AssertionError(f"{getattr(fn, '__name__', fn)} did not finish within {seconds}s (deadlock?)")
    if "error" in box:
        raise box["error"]
    return box["value"], time.monotonic() - started


def messages(caplog, level: int = logging.WARNING) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= level]


# -- eager mode never deadlocks on itself --------------------------------------------------------


@pytest.mark.timeout(20)
def test_eager_replace_with_same_task_and_key_runs_reentrantly(redis_server, caplog):
    """Celery's eager replace() reuses the task id: the replacement runs at once under the
    caller's lock and its value comes back; nothing is re-queued, and the key is free after."""
    caplog.set_level(logging.INFO, logger="celery_singleton_lock")
    app = make_app(redis_server)
    seen = []

    @locked(app, lock_key=["k"], on_duplicate="retry")
    def step(self, k, stage):
        seen.append((stage, self.request.id, self.lock.token, self.lock.fencing_token))
        if stage == "first":
            return self.replace(step.s(k, "second"))
        return f"replaced:{k}"

    k = f"k-{uuid.uuid4().hex[:8]}"
    result, _ = within(15, step.apply, (k, "first"))
    assert result.state == "SUCCESS", result.traceback
    assert result.result == f"replaced:{k}"
    assert [s[0] for s in seen] == ["first", "second"]  # the replacement did run, once
    (_, id1, token1, fence1), (_, id2, token2, fence2) = seen
    assert id1 == id2  # the same task id (what made it wait for itself)
    assert (token1, fence1) == (token2, fence2)  # under the caller's lock, not a new one
    assert not any("re-queued" in m for m in messages(caplog, logging.INFO))
    assert redis_server.client(2).get(step.lock_key_for((k, "x"))) is None  # released by the caller


@pytest.mark.timeout(20)
def test_eager_nested_duplicate_fails_at_once_with_self_deadlock(redis_server):
    """Under task_always_eager, deduct.delay(sku) from inside deduct with the same key and
    on_duplicate="retry" can never get the lock: it fails AT ONCE with SelfDeadlock (a LockError)
    naming the key and the holder, instead of backing off for ~17 minutes."""
    # the default back-off (1 s doubling to 30 s, 50 tries): ~17 minutes, were the duplicate backed off
    app = make_app(redis_server, task_always_eager=True)
    app.conf.update(singleton_lock_retry_backoff=1.0, singleton_lock_retry_backoff_max=30.0)
    inner = {}

    @locked(app, lock_key=["sku"], on_duplicate="retry")
    def deduct(self, sku, qty):
        if qty == 2:
            nested = deduct.delay(sku, 1)
            inner.update(state=nested.state, result=nested.result, holder=self.request.id)
        return qty

    sku = f"sku-{uuid.uuid4().hex[:8]}"
    outer, took = within(15, deduct.delay, sku, 2)
    assert outer.state == "SUCCESS" and outer.result == 2  # the caller itself is unharmed
    assert inner["state"] == "FAILURE"
    error = inner["result"]
    assert isinstance(error, SelfDeadlock) and isinstance(error, LockError)
    key = deduct.lock_key_for((sku, 1))
    assert error.key == key and error.holder_task_id == inner["holder"]
    assert key in str(error) and inner["holder"] in str(error)
    assert took < 5.0  # "at once": no back-off (the first back-off alone is 0.5-1 s, all of them ~17 min)


# -- bad watchdog settings fail before any lock --------------------------------------------------


@pytest.mark.timeout(20)
def test_bad_watchdog_setting_fails_the_first_execution_before_any_lock(fresh_redis, redis_server):
    """singleton_lock_watchdog_tick="0.1" (a str): the FIRST execution fails with a ValueError
    naming the setting and the value, and no lock is ever taken (nothing reaches the lock Redis)."""
    app = make_app(redis_server, singleton_lock_watchdog_tick="0.1")
    app.conf.singleton_lock_url = fresh_redis.url(2)  # a lock Redis of this test alone: all its traffic is ours
    ran = []

    @locked(app, lock_key=["k"])
    def job(self, k):
        ran.append(k)
        return k

    with Monitor(fresh_redis) as mon:
        result, _ = within(15, job.apply, ("a",))
        mon.sync()
        sent = mon.commands()
    assert result.state == "FAILURE"
    error = result.result
    assert isinstance(error, ValueError), repr(error)
    assert "singleton_lock_watchdog_tick" in str(error) and "'0.1'" in str(error)
    assert ran == []
    assert not any(w[0].upper() in ("EVALSHA", "EVAL", "SET") for w in sent), sent  # no acquire, no release
    assert not any("job" in word for w in sent for word in w), sent
    assert fresh_redis.client(2).dbsize() == 0


@pytest.mark.timeout(20)
def test_get_watchdog_with_other_options_warns_once_and_returns_the_running_one(caplog):
    """One watchdog per process: asking for other options returns the running one and logs
    one WARNING per distinct set of options (not per call, and none for the same options)."""
    caplog.set_level(logging.WARNING)
    wd = get_watchdog()
    odd_tick = round(wd.tick + 0.001 + secrets.randbelow(10_000) / 1e7, 7)  # options nobody asked for yet
    odd_chunk = wd.chunk + 1 + secrets.randbelow(10_000)
    assert get_watchdog(tick=odd_tick) is wd
    assert get_watchdog(tick=odd_tick) is wd
    assert get_watchdog(chunk=odd_chunk) is wd
    assert get_watchdog(**wd.options) is wd  # the running options: no warning
    warnings = [m for m in messages(caplog) if "watchdog already runs with" in m]
    assert len(warnings) == 2, warnings
    assert repr(odd_tick) in warnings[0] and str(odd_chunk) in warnings[1]
    assert wd.tick != odd_tick and wd.chunk != odd_chunk  # the running one is untouched


# -- servers told apart by their credentials, not by the redacted URL -----------------------------


@pytest.mark.timeout(30)
def test_credentials_tell_servers_and_watchdog_twins_apart(fresh_redis, redis_server):
    """Two lock URLs that differ only in their credentials (two ACL users, each allowed only
    its own keys) redact to the same text, yet get two LockServers from config.server_for, and
    the watchdog renews each lock through a twin of its OWN server: had one user's connection
    renewed the other's lock, Redis would refuse (NOPERM) and the lock would be lost."""
    admin = fresh_redis.client()
    secret = {user: secrets.token_hex(8) for user in ("alice", "bob")}
    for user, password in secret.items():
        admin.execute_command("ACL", "SETUSER", user, "on", f">{password}", f"~{user}:*", "+@all")
    admin.execute_command("ACL", "LOG", "RESET")
    lock_db = fresh_redis.client(2)
    urls = {user: f"redis://127.0.0.1:{fresh_redis.port}/2?username={user}&password={password}"
            for user, password in secret.items()}
    assert redact_url(urls["alice"]) == redact_url(urls["bob"])  # what a cache keyed by the redacted URL saw

    tasks, seen = {}, {}
    for user, url in urls.items():
        app = make_app(redis_server, singleton_lock_prefix=user)
        app.conf.singleton_lock_url = url

        @locked(app, lock_key=["k"], lock_ttl=2.0, name=f"identity.creds_{user}")
        def hold(self, k, seconds, _user=user):
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:  # several renewals (every ttl/3), each on the right account
                if self.lock.lost:
                    break
                time.sleep(0.05)
            seen[_user] = (self.lock.key, self.lock.lost, self.lock.lost_reason, lock_db.pttl(self.lock.key))
            self.lock.ensure()
            return _user

        tasks[user] = hold

    servers = {user: task.lock_server() for user, task in tasks.items()}
    assert servers["alice"] is not servers["bob"]
    assert csl_config.server_for(tasks["alice"].lock_settings()) is servers["alice"]  # and each is stable
    for user, server in servers.items():
        assert server.client.connection_pool.connection_kwargs.get("username") == user

    threads = {user: threading.Thread(target=lambda t=task: seen.setdefault(t.name, t.apply(("x", 3.5))))
               for user, task in tasks.items()}
    for thread in threads.values():
        thread.start()
    for thread in threads.values():
        thread.join(20)
    for user, task in tasks.items():
        result = seen[task.name]
        assert result.state == "SUCCESS", result.traceback
        key, lost, reason, pttl = seen[user]
        assert key.startswith(f"{user}:") and not lost, reason
        assert pttl > 0
    denied = admin.execute_command("ACL", "LOG")
    assert denied == [], denied  # no command ever ran under the other user's account


# -- a forked child never releases its parent's lock ---------------------------------------------


class ChildUnwinds(Exception):
    pass


def _unwind_in_child(how: str) -> None:
    if how == "exit":
        sys.exit(3)
    raise ChildUnwinds("the child fails inside the parent's locked block")


def _wait_child(pid: int, timeout: float = 15.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, 9)  # our own child, by its pid
    os.waitpid(pid, 0)
    raise AssertionError(f"forked child {pid} did not end within {timeout}s")


CHILD_DONE = 7  # the child's exit code once it has unwound (whatever unwinding raised)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("how", ["raise", "exit"])
def test_forked_child_unwinding_through_held_leaves_the_parents_lock(redis_server, how):
    """A process holds a lock via held() and forks; the child raises (or sys.exit()s) inside
    the block and so unwinds through held(): the parent still holds the lock afterwards (its token
    in Redis, its watchdog renewing it) and releases it itself."""
    server = LockServer.from_url(redis_server.url(2))
    locks = redis_server.client(2)
    name = f"fork-{uuid.uuid4().hex[:8]}"
    parent = os.getpid()
    try:
        with held(server, name, ttl=10) as lock:
            before = locks.get(lock.key)
            pid = os.fork()
            if pid == 0:
                _unwind_in_child(how)
            assert _wait_child(pid) == CHILD_DONE
            after = locks.get(lock.key)
            assert after is not None and after == before, "the child released (or changed) the parent's lock"
            assert after.decode().startswith(lock.prefix)
            assert lock in get_watchdog() and not lock.lost
            lock.ensure()
        assert lock.released and locks.get(lock.key) is None  # the parent released it
    except ChildUnwinds:
        assert os.getpid() != parent
    finally:
        if os.getpid() != parent:
            os._exit(CHILD_DONE)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("how", ["raise", "exit"])
def test_forked_child_unwinding_through_a_task_leaves_the_parents_lock(redis_server, how):
    """The same through LockedTask.__call__: the body forks, the child raises (or exits),
    which runs the task's release in the child; the parent's lock stays, and the parent releases."""
    app = make_app(redis_server)
    locks = redis_server.client(2)
    parent = os.getpid()

    @locked(app, lock_key=["k"])
    def forking(self, k, how):
        lock = self.lock
        before = locks.get(lock.key)
        pid = os.fork()
        if pid == 0:
            _unwind_in_child(how)
        code = _wait_child(pid)
        after = locks.get(lock.key)
        return {"code": code, "same": after == before and after is not None, "tracked": lock in get_watchdog(),
                "lost": lock.lost, "key": lock.key}

    try:
        result = forking.apply((f"k-{uuid.uuid4().hex[:8]}", how))
    finally:
        if os.getpid() != parent:
            os._exit(CHILD_DONE)
    assert result.state == "SUCCESS", result.traceback
    out = result.result
    assert out["code"] == CHILD_DONE
    assert out["same"], "the child released (or changed) the parent's lock"
    assert out["tracked"] and not out["lost"]
    assert locks.get(out["key"]) is None  # released by the parent, at its own end


# -- the lock is forgotten before anything can interrupt the release -------------------------------


class AsyncTimeout(BaseException):
    """Like gevent.Timeout: a BaseException that lands wherever the code happens to be."""


def lock_keeping_job(redis_server: RedisServer, fresh_redis: RedisServer) -> tuple:
    """A task with a 1.5 s lock TTL whose locks live on ``fresh_redis``; it keeps each lock it held: (the
    task, the list of its locks)."""
    app = make_app(redis_server)
    app.conf.singleton_lock_url = fresh_redis.url(2)
    held_locks: list[Lock] = []

    @locked(app, lock_key=["k"], lock_ttl=1.5)
    def job(self, k):
        held_locks.append(self.lock)
        return k

    return job, held_locks


def _renewals_of(mon: Monitor, key: str) -> list[list[str]]:
    return [w for w in mon.commands() if w and w[0].upper() == "EVALSHA" and key in w]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("fault", ["SoftTimeLimitExceeded", "AsyncTimeout"])
def test_exception_inside_the_release_leaves_the_lock_forgotten(fresh_redis, redis_server, monkeypatch, fault):
    """An exception raised from inside the release step (a soft time limit, a gevent-style
    Timeout) must not leave the lock tracked: the watchdog no longer holds it, and no renewal of
    its key is ever sent again (it expires by its TTL)."""
    from billiard.exceptions import SoftTimeLimitExceeded

    exc_type = SoftTimeLimitExceeded if fault == "SoftTimeLimitExceeded" else AsyncTimeout
    job, held_locks = lock_keeping_job(redis_server, fresh_redis)
    real_release = LockServer.release
    fired = []

    def release_once_interrupted(server, lock, **kwargs):
        if held_locks and lock is held_locks[0] and not fired:
            fired.append(lock)
            raise exc_type("interrupted inside the release")
        return real_release(server, lock, **kwargs)

    monkeypatch.setattr(LockServer, "release", release_once_interrupted)
    with Monitor(fresh_redis) as mon:
        if exc_type is AsyncTimeout:
            with pytest.raises(AsyncTimeout):
                job.apply(("a",))
        else:
            job.apply(("a",))
        assert fired, "the injected fault never fired: the scenario did not run"
        lock = held_locks[0]
        assert lock not in get_watchdog()
        mon.clear()
        # the key lives on until its TTL (the release never reached Redis); no renewal may extend it
        wait_until(lambda: fresh_redis.client(2).pttl(lock.key) == -2, 5, 0.05, "the key to expire by its ttl")
        time.sleep(0.6)  # one more renewal period (ttl/3): nothing may come late
        mon.sync()
        assert _renewals_of(mon, lock.key) == []


@pytest.mark.timeout(30)
def test_exception_before_forget_completes_is_cleaned_up_by_the_safety_net(fresh_redis, redis_server, monkeypatch):
    """An asynchronous exception hits before forget() is done: the handle stays on the request until
    forget() has returned, so the safety net (task_postrun) still finds it, forgets and releases it,
    and no renewal is sent after (the watchdog would otherwise renew the lock for ever)."""
    from billiard.exceptions import SoftTimeLimitExceeded

    job, held_locks = lock_keeping_job(redis_server, fresh_redis)
    real_forget = Watchdog.forget
    fired = []

    def forget_once_interrupted(wd, lock):
        if held_locks and lock is held_locks[0] and not fired:
            fired.append(lock)
            raise SoftTimeLimitExceeded("interrupted while forgetting the lock")
        return real_forget(wd, lock)

    monkeypatch.setattr(Watchdog, "forget", forget_once_interrupted)
    with Monitor(fresh_redis) as mon:
        result = job.apply(("a",))
        assert fired, "the injected fault never fired: the scenario did not run"
        assert result.state == "FAILURE" and isinstance(result.result, SoftTimeLimitExceeded)
        lock = held_locks[0]
        assert lock not in get_watchdog()
        assert fresh_redis.client(2).get(lock.key) is None  # released by the safety net, not left to expire
        mon.clear()
        time.sleep(1.2)  # two renewal periods (ttl/3)
        mon.sync()
        assert _renewals_of(mon, lock.key) == []


# -- slow lock_lost receivers run off the renewal thread ------------------------------------------


@pytest.mark.timeout(30)
def test_slow_lost_lock_receiver_does_not_cost_a_healthy_lock(fresh_redis):
    """Two locks renewed by one watchdog; one is deleted from outside (lost) and its on_lost
    callback (what fires lock_lost) takes 2.5 s, longer than the other lock's TTL. The other lock
    keeps being renewed during and after, and is never lost."""
    server = LockServer.from_url(fresh_redis.url(2))
    wd = Watchdog()
    tag = uuid.uuid4().hex[:8]
    doomed = server.acquire(f"doomed-{tag}", 2.0)
    healthy = server.acquire(f"healthy-{tag}", 2.0)
    assert isinstance(doomed, Lock) and isinstance(healthy, Lock)
    paging, paged = threading.Event(), threading.Event()
    healthy_lost: list[str] = []

    def pager(lock, reason):  # a slow receiver: a pager call
        paging.set()
        time.sleep(2.5)
        paged.set()

    try:
        wd.track(doomed, pager)
        wd.track(healthy, lambda lock, reason: healthy_lost.append(reason))
        fresh_redis.client(2).delete(doomed.key)
        assert paging.wait(5), "the deleted lock was never reported lost"
        confirmations = {healthy.confirmed_at}
        until = None
        while until is None or time.monotonic() < until:
            assert not healthy.lost, healthy.lost_reason
            confirmations.add(healthy.confirmed_at)
            if until is None and paged.is_set():
                until = time.monotonic() + 1.5  # and after the receiver returned
            time.sleep(0.05)
        assert healthy_lost == [] and not healthy.lost
        assert len(confirmations) >= 5, "the healthy lock was not renewed while the receiver ran"
        assert fresh_redis.client(2).pttl(healthy.key) > 0
        healthy.ensure()
    finally:
        wd.forget(healthy)
        wd.shutdown()
        server.release(healthy)


# -- helpers for the worker tests ---------------------------------------------------------------


class Published:
    """The headers of every message our app publishes (before_task_publish), per task id; ours flattened
    by field (``singleton_lock_backoff``, ``singleton_lock_token``, ...), see :func:`ours`."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.sent: list[dict] = []
        self._lock = threading.Lock()

    def __enter__(self) -> Published:
        before_task_publish.connect(self._on_publish, weak=False)
        return self

    def __exit__(self, *exc) -> None:
        before_task_publish.disconnect(self._on_publish)

    def _on_publish(self, sender=None, headers=None, **_):
        if isinstance(sender, str) and sender.startswith(self.prefix) and headers:
            with self._lock:
                self.sent.append({**headers, **ours(headers)})

    def of(self, task_id: str) -> list[dict]:
        with self._lock:
            return [h for h in self.sent if h.get("id") == task_id]


def ours(headers: dict) -> dict:
    return {f"singleton_lock_{k}": v for k, v in described(headers).items()}  # (one flat dict, by field)


# -- a counter per budget: our back-off re-sends, the task's own retries -------------------------


@pytest.mark.timeout(60)
def test_own_retry_after_backoff_resends_starts_afresh_and_counters_are_separate(redis_server, run_worker):
    """A "backoff" duplicate is re-sent twice while the holder runs, then runs and calls
    self.retry(): the retry message carries no singleton_lock_* header (Celery 5.7 copies custom
    headers into retries), so the retried run starts every budget at 0 (Celery's own retries = 1).
    The back-off counter is its own header: a message that already carries
    singleton_lock_unreachable=49 (of 50) still gets its back-off re-sends, and that header is
    carried along untouched, never counted up by a back-off."""
    queue = f"q-{uuid.uuid4().hex[:8]}"
    app = make_app(redis_server, task_default_queue=queue)
    app.conf.update(singleton_lock_retry_backoff=0.3, singleton_lock_retry_backoff_max=0.6)
    gates, runs = Gates(), Runs()
    prefix = f"identity_counters_{uuid.uuid4().hex[:6]}"

    @locked(app, lock_key=["k"], on_duplicate="backoff", lock_max_retries=50, name=f"{prefix}.job")
    def job(self, k, mode):
        headers = dict(self.request.headers or {})
        run = runs.begin(k, self.request.id, mode=mode, retries=self.request.retries, ours=ours(headers))
        try:
            if mode == "hold":
                gates.wait(k)
            elif self.request.retries == 0:
                raise self.retry(countdown=0.1, max_retries=3)
            return mode
        finally:
            runs.end(run)

    k = f"k-{uuid.uuid4().hex[:8]}"
    with Published(prefix) as published, run_worker(app, pool="threads", concurrency=3):
        holder = job.delay(k, "hold")
        runs.wait_started(k)
        dup = job.apply_async((k, "retry-once"), headers={"singleton_lock_unreachable": 49})
        wait_until(lambda: any(h.get("singleton_lock_backoff") == 2 for h in published.of(dup.id)), TIMEOUT,
                   what="the duplicate's second back-off re-send")
        gates.open(k)
        assert dup.get(timeout=TIMEOUT) == "retry-once"
        assert holder.get(timeout=TIMEOUT) == "hold"

    sends = published.of(dup.id)
    resends = [h for h in sends if h.get("retries", 0) == 0 and "singleton_lock_backoff" in h]
    assert [h["singleton_lock_backoff"] for h in resends] == list(range(1, len(resends) + 1))
    assert len(resends) >= 2
    assert all(h.get("singleton_lock_unreachable") == 49 for h in resends)  # carried, never counted up
    retry = [h for h in sends if h.get("retries") == 1]
    assert len(retry) == 1, sends
    assert not [h for h in retry[0] if h.startswith("singleton_lock_")], f"the retry carries lock headers: {retry[0]}"
    dup_runs = runs.of(k, dup.id)
    assert [(r.info["mode"], r.info["retries"]) for r in dup_runs] == [("retry-once", 0), ("retry-once", 1)]
    first, retried = dup_runs
    assert first.info["ours"].get("singleton_lock_backoff") == len(resends)  # it did come through back-offs
    assert retried.info["ours"] == {}  # every lock budget starts at 0 again


# -- a reply lost on a socket timeout: the re-send retakes its own orphan lock ---------------------


@pytest.mark.timeout(60)
def test_resend_after_a_lost_acquire_reply_retakes_its_orphan_lock(fresh_redis, redis_server, run_worker):
    """The lock Redis (not the broker's) stalls right as a task's acquire is sent: the client
    times out (socket_timeout 0.3 s, no client retries), then Redis wakes and runs the acquire
    late, leaving a lock under the task's own id that nobody holds. The re-sent copy carries that
    attempt's token (header singleton_lock_token) and retakes it: it runs once, at once, far
    sooner than the orphan's lock_ttl of 30 s."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    queue = f"q-{uuid.uuid4().hex[:8]}"
    app = make_app(redis_server, task_default_queue=queue)
    app.conf.singleton_lock_url = fresh_redis.url(2)
    app.conf.singleton_lock_redis_options = {"socket_timeout": 0.3, "retry": Retry(NoBackoff(), 0)}
    runs = Runs()
    prefix = f"identity_orphan_{uuid.uuid4().hex[:6]}"

    @locked(app, lock_key=["k"], lock_ttl=30, name=f"{prefix}.job")
    def job(self, k):
        runs.begin(k, self.request.id, token=self.lock.token)
        return k

    target = str(uuid.uuid4())
    stalled = threading.Event()

    def stall_lock_redis(task_id=None, **_):
        if task_id == target and not stalled.is_set():
            stalled.set()
            fresh_redis.pause()  # the acquire is sent right after this, into a frozen server
            threading.Timer(0.6, fresh_redis.resume).start()

    task_prerun.connect(stall_lock_redis, weak=False)
    try:
        with Published(prefix) as published, run_worker(app, pool="threads", concurrency=2):
            assert job.delay("warm").get(timeout=TIMEOUT) == "warm"  # connections and scripts in place
            with Monitor(fresh_redis, db=2) as mon:
                started = time.monotonic()
                result = job.apply_async(("k",), task_id=target)
                assert result.get(timeout=TIMEOUT) == "k"
                took = time.monotonic() - started
                mon.sync()
                sent = mon.commands()
    finally:
        task_prerun.disconnect(stall_lock_redis)
        if fresh_redis.paused:
            fresh_redis.resume()
    assert stalled.is_set()
    assert [r.task_id for r in runs.of("k")] == [target]  # once
    assert took < 10.0  # at once: not after the orphan's 30 s ttl ran out
    resends = [h for h in published.of(target) if "singleton_lock_token" in h]
    assert resends, "the acquire never timed out: the scenario did not run"
    [lost] = {h["singleton_lock_token"] for h in resends}  # the lost attempt's token, carried
    assert all(h.get("singleton_lock_unreachable", 0) >= 1 for h in resends)
    acquires = [w for w in sent if w[0].upper() in ("EVALSHA", "SET") and any(word.startswith(lost) for word in w)]
    assert len(acquires) >= 2, "the timed-out acquire never ran late on Redis: no orphan to retake"
    # taken back under a new token: no second message carrying the old one can take it back too
    assert runs.of("k")[0].info["token"] != lost


# -- .ensure() and the watchdog use one deadline --------------------------------------------------


@pytest.mark.timeout(30)
def test_ensure_and_the_watchdog_agree_on_the_deadline(fresh_redis):
    """Two locks tracked by a watchdog whose Redis stops answering. One is polled with
    ensure() from the task's side, the other is left to the watchdog: ensure() starts raising at
    lock.deadline (confirmed + ttl - margin), not at the full TTL, and the watchdog reports the
    other at its deadline too, within a tick or two (plus its one blocked round)."""
    from celery_singleton_lock import LockLost

    server = LockServer.from_url(fresh_redis.url(2))
    wd = Watchdog(tick=0.1, socket_timeout=0.25)
    tag = uuid.uuid4().hex[:8]
    ttl = 3.0
    polled = server.acquire(f"polled-{tag}", ttl)
    watched = server.acquire(f"watched-{tag}", ttl)
    reported: list[float] = []
    try:
        wd.track(polled)
        wd.track(watched, lambda lock, reason: reported.append(time.monotonic()))
        assert polled.deadline == polled.confirmed_at + ttl - wd.margin(ttl)
        assert wd.margin(ttl) > 0.3  # far enough from the full ttl to tell the two apart
        fresh_redis.pause()
        raised_at = None
        while time.monotonic() < polled.confirmed_at + ttl + 1:
            try:
                polled.ensure()
            except LockLost:
                raised_at = time.monotonic()
                break
            time.sleep(0.005)
        wait_until(lambda: reported, 3, 0.01, "the watchdog to report its lock lost")
    finally:
        if fresh_redis.paused:
            fresh_redis.resume()
        wd.shutdown()
    tick = wd.tick
    assert raised_at is not None, "ensure() never raised"
    assert polled.deadline <= raised_at <= polled.deadline + 2 * tick, (raised_at - polled.deadline)
    assert raised_at < polled.confirmed_at + ttl - 0.3  # not the full ttl
    # the watchdog checks deadlines on every tick; one round may be blocked for a socket timeout
    lag = reported[0] - watched.deadline
    assert -0.01 <= lag <= wd.socket_timeout + 2 * tick, lag
    assert reported[0] < watched.confirmed_at + ttl


# -- release retries, within bounds ----------------------------------------------------------------


def _release_app(redis_server: RedisServer, lock_redis: RedisServer, release_timeout: float = 0.5):
    app = make_app(redis_server, singleton_lock_release_timeout=release_timeout)
    app.conf.singleton_lock_url = lock_redis.url(2)  # a lock Redis of its own: only it stalls
    marks: dict = {}

    @locked(app, lock_key=["k"], lock_ttl=30)
    def job(self, k, stall):
        marks["key"] = self.lock.key
        if stall:  # stall the lock Redis right as the body ends: the release goes into a frozen server
            lock_redis.pause()
            if stall < 10:
                threading.Timer(stall, lock_redis.resume).start()
        marks["body_end"] = time.monotonic()
        return k

    warm = job.apply(("warm", 0))  # the release twin's connection is open
    assert warm.state == "SUCCESS" and warm.result == "warm", warm.traceback
    return app, job, marks


@pytest.mark.timeout(20)
def test_release_retry_after_a_late_first_try_reports_the_lock_deleted(fresh_redis, redis_server, caplog):
    """The first release try times out but Redis runs it late (it deletes the lock); the
    second try then finds the key gone. That lock was ours and is deleted: lock_released says
    deleted=True, and there is no "no longer held" WARNING."""
    caplog.set_level(logging.WARNING, logger="celery_singleton_lock")
    # a 1 s release timeout and a 1.5 s stall: the resume lands half a second from either edge
    app, job, marks = _release_app(redis_server, fresh_redis, release_timeout=1.0)
    with TaskEvents(app) as rec:
        result = job.apply(("k", 1.5))  # frozen past the first try's 1 s timeout, not the second's
        assert result.state == "SUCCESS" and result.result == "k", result.traceback
    try_failed = [m for m in messages(caplog) if "releasing lock" in m and "try 1 of 2" in m]
    assert try_failed, "the first release try did not time out: the scenario did not run"
    released = rec.of("lock_released", task_id=result.id)
    assert [e.kwargs["deleted"] for e in released] == [True]
    assert not any("no longer held" in m for m in messages(caplog)), messages(caplog)
    assert fresh_redis.client(2).get(marks["key"]) is None


@pytest.mark.timeout(20)
def test_stalled_lock_redis_holds_a_task_end_at_most_two_release_timeouts(fresh_redis, redis_server, caplog):
    """The lock Redis stalls as the body ends and stays stalled: the release gives up after
    about 2 x singleton_lock_release_timeout (0.5 s), and the task ends with its own outcome,
    instead of waiting ~30 s of 10 s socket timeouts."""
    caplog.set_level(logging.WARNING, logger="celery_singleton_lock")
    app, job, marks = _release_app(redis_server, fresh_redis)
    try:
        with TaskEvents(app) as rec:
            result, _ = within(15, job.apply, ("k", 60))  # stays frozen until we resume it
            ended = time.monotonic()
    finally:
        fresh_redis.resume()
    assert result.state == "SUCCESS" and result.result == "k", result.traceback
    held_up = ended - marks["body_end"]
    assert held_up < 2 * 0.5 + 0.8, f"the release held the task's end for {held_up:.2f}s"
    assert [e.kwargs["deleted"] for e in rec.of("lock_released", task_id=result.id)] == [False]
    assert any("could not be released" in m for m in messages(caplog))


# -- duplicate_skipped names every policy ---------------------------------------------------------


@pytest.mark.timeout(60)
def test_duplicate_skipped_is_sent_with_each_policy_name(redis_server, run_worker):
    """The README's promise: duplicate_skipped fires for every way a delivery does not run now,
    with policy = skip, retry, raise, backoff, and redelivery (a real broker redelivery of the
    running task). Each case then ends as its policy says."""
    from celery_singleton_lock import DuplicateTask

    queue = f"q-{uuid.uuid4().hex[:8]}"
    app = make_app(redis_server, task_default_queue=queue, broker_transport_options=RESTORE_FAST)
    gates, runs = Gates(), Runs()

    def body(self, k, gate):
        run = runs.begin(k, self.request.id)
        try:
            if gate:
                gates.wait(k)
            return k
        finally:
            runs.end(run)

    policies = ("skip", "retry", "raise", "backoff")
    tag = uuid.uuid4().hex[:6]
    tasks = {p: locked(app, lock_key=["k"], on_duplicate=p, name=f"identity_dup_{tag}.{p}")(body) for p in policies}
    keys = {p: f"{p}-{tag}" for p in policies}
    with TaskEvents(app) as rec, run_worker(app, pool="threads", concurrency=6):
        holders = {p: tasks[p].delay(keys[p], True) for p in policies}
        for p in policies:
            runs.wait_started(keys[p])
        dups = {p: tasks[p].delay(keys[p], False) for p in policies}
        redeliver(redis_server.client(0), tasks["skip"], (keys["skip"], True), holders["skip"].id, queue)
        got = {p: rec.wait_for("duplicate_skipped", task_id=dups[p].id)[0].policy for p in policies}
        redelivered = rec.wait_for("duplicate_skipped", task_id=holders["skip"].id)[0]
        assert got == {p: p for p in policies}
        assert redelivered.policy == "redelivery"
        assert redelivered.holder_task_id == holders["skip"].id
        gates.open_all()
        for p in policies:
            assert holders[p].get(timeout=TIMEOUT) == keys[p]
        assert dups["retry"].get(timeout=TIMEOUT) == keys["retry"]
        assert dups["backoff"].get(timeout=TIMEOUT) == keys["backoff"]
        with pytest.raises(DuplicateTask):
            dups["raise"].get(timeout=TIMEOUT)
        wait_until(lambda: dups["skip"].state == "REVOKED", TIMEOUT, what="the skipped duplicate to be REVOKED")
    assert [r.task_id for r in runs.of(keys["skip"])] == [holders["skip"].id]  # the redelivered copy never ran


def test_after_a_data_loss_a_recovered_copy_counts_only_another_deliverys_start_as_a_run(app):
    """After the lock Redis lost its data, the sweeper's recovered copy of a waiting call looks in the
    result backend for another delivery's start. A STARTED that the copy stored itself, read by a broker
    redelivery of it (its worker died mid-body), is not another's run: counting it would lose the call."""
    from celery.app.task import Context

    from celery_singleton_lock import LockedTask
    from celery_singleton_lock.delivery import identity
    from celery_singleton_lock.delivery.headers import Turn

    @app.task(base=LockedTask, bind=True)
    def waiting(self):
        return None

    task_id, entry = uuid.uuid4().hex, "e1"

    def request(headers, redelivered=False):
        return Context(id=task_id, headers=headers, delivery_info={"redelivered": redelivered}, is_eager=False)

    recovered = Turn(entry=entry, why="recovered", copy="c1", parked_at=time.time() - 5).header()
    assert not identity.ran_since_park(waiting, request(recovered))  # nothing stored yet
    identity.mark_started(waiting, request(recovered), False)  # the recovered copy starts, then dies
    assert not identity.ran_since_park(waiting, request(recovered, redelivered=True))  # its own start
    another = Turn(entry=entry, why="recovered", copy="c2", parked_at=time.time() - 5).header()
    assert identity.ran_since_park(waiting, request(another, redelivered=True))  # another's

    identity.mark_started(waiting, request(Turn(entry=entry, why="run").header()), False)  # its turn starts (long)
    assert identity.ran_since_park(waiting, request(recovered, redelivered=True))  # a run, whoever asks
    # once a copy holds the key it asks again (the other's whole run may fit between its look and its acquire)
    assert identity.other_copy_ran(waiting, request(recovered))
    assert not identity.other_copy_ran(waiting, request({}))  # (any other delivery: no look at all)


def test_a_final_state_counts_as_the_parked_calls_run_whatever_the_hosts_clocks_say(app):
    """A recovered copy whose entry is gone asks the result backend whether its call ran. A final state
    stored there is its run: parking stored WAITING over anything earlier (a success excepted, which is
    this call's own). No host clock is compared: a parking host whose clock ran an hour ahead of the
    one that stored the result took that run for an older one, and the call ran twice."""
    from celery.app.task import Context

    from celery_singleton_lock import LockedTask
    from celery_singleton_lock.delivery import identity
    from celery_singleton_lock.delivery.headers import Turn

    @app.task(base=LockedTask, bind=True)
    def waiting(self):
        return None

    task_id = uuid.uuid4().hex
    ahead = Turn(entry="e1", why="recovered", copy="c1", parked_at=time.time() + 3600)  # (a host clock an hour ahead)
    copy = Context(id=task_id, headers=ahead.header(),
                   delivery_info={"redelivered": False}, is_eager=False)
    assert not identity.ran_since_park(waiting, copy)  # nothing stored yet
    waiting.backend.store_result(task_id, {"key": "k", "entry": "e1"}, "WAITING", request=copy)
    assert not identity.ran_since_park(waiting, copy)  # still waiting
    waiting.backend.store_result(task_id, 42, "SUCCESS", request=copy)  # its turn ran and ended
    assert identity.ran_since_park(waiting, copy)
