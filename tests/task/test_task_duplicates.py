"""Duplicates never run beside their holder: skip (REVOKED at once), retry (waits in the key's
line and is handed the key in turn), backoff (re-sent with back-off, on a budget of its own),
raise (FAILURE with DuplicateTask).

In-process workers on the threads pool (one worker, 4 threads) and the solo pool (two
workers), where a gate decides when the holder ends; then real prefork subprocesses,
where bodies record their intervals in Redis and duplicates are fired all at once.
"""

from __future__ import annotations

import gc
import threading
import time
import uuid

import pytest
from _apps import make_app
from _backends import backend_of, lock_store
from _task_support import (
    TIMEOUT,
    EagerLine,
    Gates,
    Runs,
    TaskEvents,
    assert_no_overlap,
    in_process_worker,
    load_worker_app,
    locked,
    start_worker_process,
)
from celery.exceptions import TaskRevokedError

from celery_singleton_lock import DuplicateSkipped, DuplicateTask, LockContended, LockWaitTimeout
from celery_singleton_lock.engine import line as queue
from celery_singleton_lock.testing.servers import wait_until

pytestmark = [pytest.mark.timeout(150), pytest.mark.usefixtures("collect_results")]


class Env:
    pass


@pytest.fixture(scope="module", params=[("threads", "redis"), ("solo", "redis"), ("threads", "etcd")],
                ids=lambda p: "-".join(p))
def env(request, redis_server):
    backend, etcd_url = backend_of(request)
    url, store = lock_store(backend, redis_server, etcd_url)
    # a queue of its own: the module's worker must not take the prefork tests' messages
    app = make_app(redis_server, task_default_queue=f"q-{uuid.uuid4().hex[:8]}", singleton_lock_url=url)
    e = Env()
    e.app, e.pool, e.runs, e.gates, e.backend = app, request.param[0], Runs(), Gates(), backend
    e.locks = store

    def make(name, policy, **opts):
        @locked(app, lock_key=["k"], on_duplicate=policy, name=f"dup.{name}", **opts)
        def body(self, k, tag):
            return e.runs.gated(k, self.request.id, tag, e.gates, retries=self.request.retries)

        return body

    # a big contention budget where the test decides when the holder ends (a slow machine must
    # not spend it); a small one where spending it is the point
    e.skip, e.raise_ = make("skip", "skip"), make("raise", "raise")
    e.retry = make("retry", "retry")
    e.retry_short_wait = make("retry_short_wait", "retry", lock_max_wait=1.0)
    e.backoff_budget = make("backoff_budget", "backoff", lock_max_retries=2)
    e.backoff_no_own_retries = make("backoff_no_own", "backoff", max_retries=0, lock_max_retries=10_000)
    with in_process_worker(app, e.gates, pool=e.pool, concurrency=4 if e.pool == "threads" else 1):
        yield e


class EagerHolder(threading.Thread):
    """The holder as an eager run (``apply``) in a thread of this process.

    A solo worker runs one task at a time, and two in-process workers would share
    kombu's global event loop; so on the solo pool the holder runs beside the worker.
    """

    def __init__(self, task, k):
        super().__init__(daemon=True)
        self.task, self.k, self.id, self.result = task, k, str(uuid.uuid4()), None

    def run(self):
        self.result = self.task.apply((self.k, "holder"), task_id=self.id)

    def ready(self):
        return not self.is_alive()

    def get(self, timeout):
        self.join(timeout)
        assert not self.is_alive(), "the holder did not finish"
        return self.result.get()


def start_holder(env, task, k):
    if env.pool == "threads":
        holder = task.delay(k, "holder")
    else:
        holder = EagerHolder(task, k)
        holder.start()
    [run] = env.runs.wait_started(k)
    assert run.task_id == holder.id
    return holder


def refused_duplicate(env, task, prefix: str, raises: type[Exception], state: str):
    """A gated holder of a new key, running, and a duplicate that failed with ``raises`` and ended in
    ``state`` while it ran: (the key's name, its lock key, the holder, the duplicate, its exception)."""
    k = f"{prefix}-{uuid.uuid4().hex[:8]}"
    key = task.lock_key_for((k, "x"), {})
    holder = start_holder(env, task, k)
    dup = task.delay(k, "dup")
    with pytest.raises(raises) as info:
        dup.get(timeout=TIMEOUT)
    assert not holder.ready()  # answered while the holder still runs: no waiting on it
    assert dup.state == state
    return k, key, holder, dup, info.value


def holder_ran_alone(env, k: str, holder) -> None:
    """The holder still runs (its gate is shut); once its gate opens it ends, and no other body of ``k``
    ran."""
    assert not holder.ready()
    env.gates.open(k)
    assert holder.get(timeout=TIMEOUT) == "holder"
    assert [r.task_id for r in env.runs.of(k)] == [holder.id]


def test_skip_is_revoked_at_once_and_never_runs(env, rec):
    k, key, holder, dup, exc = refused_duplicate(env, env.skip, "skip", TaskRevokedError, "REVOKED")
    assert key in str(exc) and holder.id in str(exc), str(exc)
    # the holder, named in a structured way too (the result backend rebuilds the error by its class)
    assert isinstance(exc, DuplicateSkipped), type(exc)
    assert exc.holder_task_id == holder.id and exc.key == key
    [event] = rec.wait_for("duplicate_skipped", task_id=dup.id)
    assert event.key == key and (event.holder_task_id, event.policy) == (holder.id, "skip")
    holder_ran_alone(env, k, holder)  # the duplicate's body never ran
    rec.wait_for("lock_released", task_id=holder.id)
    assert env.locks.exists(key) == 0


def test_raise_fails_with_duplicate_task(env, rec):
    k, key, holder, dup, exc = refused_duplicate(env, env.raise_, "raise", DuplicateTask, "FAILURE")
    assert exc.key == key and exc.holder_task_id == holder.id
    assert rec.wait_for("duplicate_skipped", task_id=dup.id)[0].policy == "raise"
    holder_ran_alone(env, k, holder)


def test_retry_waits_in_line_and_runs_in_turn_after_the_holder(env, rec):
    """"retry": each duplicate parks in the key's line (state WAITING, no worker slot held, no
    re-sends) and is handed the key in the order it came, right after the holder."""
    k = f"retry-{uuid.uuid4().hex[:8]}"
    key = env.retry.lock_key_for((k, "x"), {})
    holder = start_holder(env, env.retry, k)
    dups = []
    for i in range(3):  # one at a time, so the order they found the key held is known
        dups.append(env.retry.delay(k, f"dup{i}"))
        rec.wait_for("duplicate_skipped", task_id=dups[-1].id)
    for i, dup in enumerate(dups):
        assert dup.state == "WAITING" and not dup.ready()
        assert dup.info == {"key": key, "place": i + 1, "holder": holder.id, "entry": queue.entry_for(dup.id)}
    assert not holder.ready() and len(env.runs.of(k)) == 1
    assert env.retry.app.backend.get_task_meta(holder.id)["status"] != "WAITING"
    env.gates.open(k)
    assert holder.get(timeout=TIMEOUT) == "holder"
    assert [d.get(timeout=TIMEOUT) for d in dups] == ["dup0", "dup1", "dup2"]
    runs = sorted(env.runs.of(k), key=lambda r: r.start)
    assert [r.task_id for r in runs] == [holder.id, *(d.id for d in dups)]  # first come, first served
    assert_no_overlap([(r.start, r.end) for r in runs])
    assert all(r.info["retries"] == 0 for r in runs)  # waiting is not the task's own retry
    for dup in dups:  # one park each: no polling
        [event] = rec.of("duplicate_skipped", task_id=dup.id)
        assert (event.holder_task_id, event.policy) == (holder.id, "retry")
    wait_until(lambda: not env.locks.exists(key, key + ":q", key + ":w"), TIMEOUT, what="nothing left")


def test_a_line_that_does_not_move_ends_in_lock_wait_timeout(env, rec):
    """lock_max_wait bounds a wait: past it the waiter FAILS with LockWaitTimeout (never a silent
    PENDING or WAITING), and the holder is untouched."""
    k = f"stuck-{uuid.uuid4().hex[:8]}"
    key = env.retry_short_wait.lock_key_for((k, "x"), {})
    holder = start_holder(env, env.retry_short_wait, k)
    dup = env.retry_short_wait.delay(k, "dup")
    rec.wait_for("duplicate_skipped", task_id=dup.id)
    assert dup.state == "WAITING"
    with pytest.raises(LockWaitTimeout) as info:
        dup.get(timeout=TIMEOUT)  # the sweeper times it out once its second in line is over
    assert dup.state == "FAILURE" and info.value.key == key and info.value.max_wait == 1.0
    holder_ran_alone(env, k, holder)


def test_backoff_budget_exhausted_fails_with_lock_contended(env, rec):
    k, key, holder, dup, exc = refused_duplicate(env, env.backoff_budget, "budget", LockContended, "FAILURE")
    assert exc.key == key and exc.holder_task_id == holder.id
    assert exc.attempts == 3  # the first try and lock_max_retries=2 re-sends
    assert [e.policy for e in rec.of("duplicate_skipped", task_id=dup.id)] == ["backoff"] * 3
    holder_ran_alone(env, k, holder)


def test_backoff_re_sends_do_not_eat_max_retries(env, rec):
    """max_retries=0: the task may never self.retry(), yet it gets its back-off re-sends."""
    k = f"own-{uuid.uuid4().hex[:8]}"
    holder = start_holder(env, env.backoff_no_own_retries, k)
    dup = env.backoff_no_own_retries.delay(k, "dup")
    wait_until(lambda: len(rec.of("duplicate_skipped", task_id=dup.id)) >= 2, TIMEOUT, what="two back-off re-sends")
    # RETRY is stored after the re-send, which may already be running its next attempt
    wait_until(lambda: dup.state == "RETRY", TIMEOUT, what="the RETRY state")
    env.gates.open(k)
    assert holder.get(timeout=TIMEOUT) == "holder"
    assert dup.get(timeout=TIMEOUT) == "dup"
    [run] = env.runs.of(k, dup.id)
    assert run.info["retries"] == 0
    assert_no_overlap([(r.start, r.end) for r in env.runs.of(k)])


# -- prefork subprocesses ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def prefork(redis_server, tmp_path_factory):
    wa = load_worker_app(redis_server)
    for db in (1, 2, 3):
        redis_server.client(db).flushdb()  # our private server; the broker db stays (bindings)
    w = start_worker_process(redis_server, tmp_path_factory.mktemp("dup-prefork"), pool="prefork", concurrency=3)
    try:
        w.wait_ready(60)
        yield wa, w
    finally:
        w.stop()
        gc.collect()


def journal_intervals(wa, name, key):
    out = []
    for raw in wa.journal.lrange(f"runs:{name}:{key}", 0, -1):
        start, end, _pid = raw.decode().split(":")
        out.append((float(start), float(end)))
    return out


def test_prefork_retry_duplicates_run_one_at_a_time(prefork, redis_server):
    wa, _ = prefork
    k = f"pf-retry-{uuid.uuid4().hex[:8]}"
    results = [wa.hold_retry.delay(k, 0.6, "holder")] + [wa.hold_retry.delay(k, 0.2, f"d{i}") for i in range(4)]
    assert sorted(r.get(timeout=60)["tag"] for r in results) == ["d0", "d1", "d2", "d3", "holder"]
    intervals = journal_intervals(wa, "hold_retry", k)
    assert len(intervals) == 5  # every body ran ...
    assert_no_overlap(intervals, "prefork retry bodies")  # ... one at a time
    assert redis_server.client(2).exists(wa.hold_retry.lock_key_for((k, 0, ""), {})) == 0


@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_prefork_skip_and_raise(prefork, redis_server, policy):
    wa, w = prefork
    task = wa.gated_skip if policy == "skip" else wa.gated_raise
    k = f"pf-{policy}-{uuid.uuid4().hex[:8]}"
    key = task.lock_key_for((k,), {})
    locks = redis_server.client(2)
    holder = task.delay(k, "holder", gate=True)  # holds until the test opens gate:<k>
    try:
        wait_until(lambda: locks.exists(key), TIMEOUT, what="the holder to take its lock")
        dups = [task.delay(k, f"d{i}") for i in range(3)]
        for dup in dups:
            expected = TaskRevokedError if policy == "skip" else DuplicateTask
            with pytest.raises(expected) as info:
                dup.get(timeout=TIMEOUT)
            assert key in str(info.value) and holder.id in str(info.value)
            assert dup.state == ("REVOKED" if policy == "skip" else "FAILURE")
        assert not holder.ready()  # every duplicate was answered while the holder ran
    finally:
        wa.journal.set(f"gate:{k}", 1)
    assert holder.get(timeout=TIMEOUT)["tag"] == "holder"
    name = "gated_skip" if policy == "skip" else "gated_raise"
    assert len(journal_intervals(wa, name, k)) == 1  # only the holder's body ran
    wait_until(lambda: not locks.exists(key), TIMEOUT, what="the release")
    if policy == "skip":
        log = w.log()
        assert "is a duplicate" in log and holder.id in log  # logged at INFO
        # and not Celery's "Task ...[id] ignored": the result backend says REVOKED, so does the log
        assert not [line for line in log.splitlines() if any(f"[{d.id}] ignored" in line for d in dups)], log[-3000:]


# -- eager runs meet a holder too ----------------------------------------------------------------


@pytest.mark.parametrize("store", [False, True])
def test_eager_skip_ends_as_a_worker_skip(app, redis_server, store):
    """The same end state as test_skip_is_revoked_at_once_and_never_runs in a worker: REVOKED,
    get() raises TaskRevokedError naming the key and the holder; stored as REVOKED where eager
    results are stored (task_store_eager_result); an eager chain stops at the skipped step."""
    app.conf.task_store_eager_result = store
    ran = []

    @locked(app, lock_key=["k"])
    def eager_skip(self, k, tag="first"):
        ran.append((k, tag))
        return k

    @locked(app, name=f"after-{uuid.uuid4().hex[:6]}")
    def after(self, value):
        ran.append(("after", value))
        return value

    k = f"eager-skip-{uuid.uuid4().hex[:8]}"
    key = eager_skip.lock_key_for((k,), {})
    assert eager_skip.apply((k,)).get() == k and ran == [(k, "first")], "the body runs while the key is free"
    locks = redis_server.client(2)
    locks.set(key, "e" * 32 + ' 1 {"owner":"the-holder"}', px=60_000)
    try:
        result = eager_skip.apply((k, "dup"))
        assert result.state == "REVOKED"
        with pytest.raises(TaskRevokedError) as info:
            result.get()
        assert key in str(info.value) and "the-holder" in str(info.value), str(info.value)
        assert isinstance(info.value, DuplicateSkipped) and info.value.holder_task_id == "the-holder"
        stored = app.AsyncResult(result.id, backend=app.backend).state
        assert stored == ("REVOKED" if store else "PENDING")
        app.conf.task_always_eager = True
        try:
            with pytest.raises(TaskRevokedError):
                (eager_skip.s(k, "chained") | after.s()).apply_async()
        finally:
            app.conf.task_always_eager = False
        assert ran == [(k, "first")], "neither the duplicate nor the chain after it ran"
    finally:
        locks.delete(key)


@pytest.mark.parametrize("policy", ["skip", "raise", "retry", "backoff"])
def test_eager_duplicate_policies(app, redis_server, policy):
    """apply() locks as well: against a held key, skip ends REVOKED (as in a worker), raise fails
    with DuplicateTask, retry waits in line in place and fails with LockWaitTimeout once
    lock_max_wait is spent, backoff waits in place and fails with LockContended once
    lock_max_retries is spent."""
    ran = []

    @locked(app, lock_key=["k"], on_duplicate=policy, lock_max_retries=2, lock_max_wait=0.5)
    def eager_dup(self, k):
        ran.append(k)
        return k

    k = f"eager-{uuid.uuid4().hex[:8]}"
    key = eager_dup.lock_key_for((k,), {})
    locks = redis_server.client(2)
    locks.set(key, "e" * 32 + ' 1 {"owner":"the-holder"}', px=60_000)  # someone holds it
    try:
        with TaskEvents(app) as rec:
            result = eager_dup.apply((k,))
        assert ran == []
        if policy == "skip":
            assert result.state == "REVOKED" and isinstance(result.result, TaskRevokedError)
        elif policy == "raise":
            assert result.state == "FAILURE" and isinstance(result.result, DuplicateTask)
            assert (result.result.key, result.result.holder_task_id) == (key, "the-holder")
        elif policy == "retry":
            assert result.state == "FAILURE" and isinstance(result.result, LockWaitTimeout)
            assert result.result.key == key
            assert not locks.exists(key + ":q", key + ":w")  # it left the line
        else:
            assert result.state == "FAILURE" and isinstance(result.result, LockContended)
            assert (result.result.key, result.result.holder_task_id, result.result.attempts) == (key, "the-holder", 3)
        assert len(rec.of("duplicate_skipped")) == (3 if policy == "backoff" else 0 if policy == "retry" else 1)
        assert locks.get(key).startswith(b"e" * 32)  # the holder's lock is untouched
    finally:
        locks.delete(key)
    assert eager_dup.apply((k,)).get() == k  # once free, it runs


def test_eager_retry_is_handed_the_key_by_the_release(app, redis_server):
    """An eager "retry" duplicate blocks in line and is woken by the holder's release, not by polling."""
    line = EagerLine(app, redis_server.client(2), "eager-line")
    released_at = time.monotonic()
    assert line.let_go().get() == "waiter"
    ran = line.ran
    assert [tag for tag, _ in ran] == ["holder", "waiter"]
    assert ran[1][1] - released_at < 2.0  # woken by the release (the holder's ttl is 30 s)
