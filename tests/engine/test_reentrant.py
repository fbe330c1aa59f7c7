"""Reentrancy (celery_singleton_lock.engine.reentry): the same owner taking the same key again, in the same
thread, nests on the one lock; another owner, or the same owner id in another thread, does not.

All against a private redis-server (tests/conftest.py); the task tests run real in-process workers
and eager calls.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from _apps import make_app
from _task_support import TIMEOUT, locked

from celery_singleton_lock import LockContended, LockError, LockLost, LockServer, SelfDeadlock, held
from celery_singleton_lock.testing.servers import Monitor, wait_until

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("collect_results")]


def new_name() -> str:
    return f"re:{uuid.uuid4().hex[:12]}"


def tried_in_another_thread(*args, **kwargs) -> str | None:
    """``held(*args, **kwargs)`` tried in a thread of its own: "entered" when it took the lock, "refused"
    when it raised LockContended (None when the thread did not end in time)."""
    box: dict[str, str] = {}

    def attempt() -> None:
        try:
            with held(*args, **kwargs):
                box["got"] = "entered"
        except LockContended:
            box["got"] = "refused"

    t = threading.Thread(target=attempt)
    t.start()
    t.join(TIMEOUT)
    return box.get("got")


# -- plain code: held(...) ------------------------------------------------------------------------


def test_nested_depth_three_one_lock_no_round_trip_then_another_owner_gets_it(lock_backend, redis_server):
    url = lock_backend.url
    name = new_name()
    locks = lock_backend.store
    with held(url, name, 10, owner_id="job-1") as outer:
        assert outer.depth == 1
        outer_fence = outer.fencing_token  # (read while held: a fresh lock's token is drawn on first read)
        with Monitor(redis_server, db=2) as mon:  # (on etcd: nothing to see on the Redis either)
            with held(url, name, 10, owner_id="job-1") as middle:
                with held(url, name, 10, owner_id="job-1") as inner:
                    assert inner is middle is outer  # one lock: .lost, .ensure(), .fencing_token are its own
                    assert inner.depth == 3
                    inner.ensure()
                assert outer.depth == 2
            mon.sync()
            # re-entering and leaving cost no round trip (a sweeper's look at the waiting index, from a
            # sweeper an earlier test in this process started on the same Redis, is not this lock's)
            assert [c for c in mon.commands() if not any("{waiting}" in w for w in c)] == []
        assert outer.depth == 1
        # still held after the nested exits: another owner is refused, and waits in vain
        assert locks.get(outer.key).decode().startswith(outer.token + " ")
        with pytest.raises(LockContended):
            with held(url, name, 10, owner_id="job-2"):
                pass
        # another owner elsewhere waits in line, in vain while we hold it
        assert tried_in_another_thread(url, name, 10, owner_id="job-2", wait=0.3) == "refused"
    assert locks.get(outer.key) is None  # the outermost exit released it
    with held(url, name, 10, owner_id="job-2") as other:
        assert other is not outer and other.depth == 1
        assert other.fencing_token > outer_fence


def test_threads_with_the_same_owner_id_do_not_reenter(lock_backend):
    """Two threads under one owner id are two executions: the second waits like anyone else,
    and gets a lock of its own once the first lets go."""
    url = lock_backend.url
    name = new_name()
    taken, release, box = threading.Event(), threading.Event(), {}

    def first():
        with held(url, name, 10, owner_id="job-1") as lock:
            box["first"], box["fence"] = lock, lock.fencing_token
            taken.set()
            release.wait(TIMEOUT)

    t = threading.Thread(target=first)
    t.start()
    assert taken.wait(TIMEOUT)
    try:
        with pytest.raises(LockContended):
            with held(url, name, 10, owner_id="job-1"):
                pass
        with pytest.raises(LockError, match="not held by this thread"):
            with box["first"].reenter():
                pass

        def let_go():
            time.sleep(0.3)
            release.set()

        started = time.monotonic()  # before the thread starts: its 0.3 s count from no later than here
        threading.Thread(target=let_go).start()
        with held(url, name, 10, owner_id="job-1", wait=TIMEOUT) as mine:
            waited = time.monotonic() - started
            assert mine is not box["first"] and mine.depth == 1
            assert mine.token != box["first"].token and mine.fencing_token > box["fence"]
        assert waited >= 0.2  # it really waited for the other thread
    finally:
        release.set()
        t.join(TIMEOUT)


def test_another_owner_in_the_same_thread_does_not_reenter(lock_backend):
    """Only the same owner nests: another owner id, or an anonymous held(), in the very thread
    that holds the key is refused, or waits out its ``wait`` and is refused then; the outer
    lock is untouched."""
    url = lock_backend.url
    name = new_name()
    with held(url, name, 10, owner_id="job-1") as outer:
        with pytest.raises(LockContended) as info:
            with held(url, name, 10, owner_id="job-2"):
                pass
        assert info.value.holder_task_id == "job-1"
        started = time.monotonic()
        with pytest.raises(LockContended):
            with held(url, name, 10, owner_id="job-2", wait=0.4):
                pass
        assert time.monotonic() - started >= 0.4  # it did wait, in line
        with pytest.raises(LockContended):  # anonymous: an owner of its own
            with held(url, name, 10):
                pass
        assert outer.depth == 1 and not outer.lost
        assert lock_backend.store.get(outer.key).decode().startswith(outer.token + " ")
    assert lock_backend.store.get(outer.key) is None


def test_same_redis_through_another_url_is_the_same_lock(redis_server):
    """The registry knows servers by URL; a differently spelt URL of the same Redis is recognised
    by the token Redis answers with (one round trip), and nests all the same."""
    name = new_name()
    with held(redis_server.url(2), name, 10, owner_id="job-1") as outer:
        with held(redis_server.url(2) + "?socket_timeout=5", name, 10, owner_id="job-1") as inner:
            assert inner is outer and outer.depth == 2
    assert redis_server.client(2).get(outer.key) is None


def test_a_lost_lock_cannot_be_reentered(lock_backend):
    url = lock_backend.url
    name = new_name()
    with held(url, name, 2, owner_id="job-1") as outer:
        lock_backend.store.delete(outer.key)  # from outside
        wait_until(lambda: outer.lost, 5, 0.05, "the watchdog to find the lock gone")
        with pytest.raises(LockLost):
            with held(url, name, 2, owner_id="job-1"):
                pass
        with pytest.raises(LockLost):
            with outer.reenter():
                pass
        assert outer.depth == 1


# -- tasks ------------------------------------------------------------------------------------------


def test_task_body_reenters_its_own_lock_and_releases_once(redis_server, run_worker):
    """In a worker: held(..., owner_id=self.request.id) on the task's own key (through its server or
    its URL) and self.lock.reenter() are the task's lock, nested; another owner is refused; the key
    is free once the task returns."""
    app = make_app(redis_server, task_default_queue=f"q-{uuid.uuid4().hex[:8]}")
    url = redis_server.url(2)

    @locked(app, lock_key=["k"], lock_ttl=20)
    def job(self, k):
        lock = self.lock
        out = {"key": lock.key}
        with held(self.lock_server(), lock.key, owner_id=self.request.id) as again:
            out["same"] = again is lock
            with held(url, lock.key, owner_id=self.request.id) as thrice:
                out["depth3"] = thrice.depth
                with lock.reenter() as four:
                    out["depth4"] = four.depth
            try:
                with held(url, lock.key, owner_id="someone-else"):
                    out["other"] = "ran"
            except LockContended:
                out["other"] = "refused"
        out["depth_after"] = lock.depth
        out["fence"] = lock.fencing_token
        return out

    with run_worker(app, pool="threads", concurrency=2):
        result = job.delay(f"k-{uuid.uuid4().hex[:8]}").get(timeout=TIMEOUT)
    assert result["same"] is True
    assert (result["depth3"], result["depth4"], result["depth_after"]) == (3, 4, 1)
    assert result["other"] == "refused"
    assert redis_server.client(2).get(result["key"]) is None
    # and a new owner gets it at once, as a new lock
    with held(url, result["key"], owner_id="later") as later:
        assert later.fencing_token > result["fence"]


def test_nested_apply_of_the_same_key_reenters_only_with_the_same_task_id(redis_server, run_worker):
    """The decision for task-level reentrancy: inside the body, ``self.apply(args)`` of the same key is
    another execution (a new task id): it fails at once with SelfDeadlock, whatever the policy.
    ``self.apply(args, task_id=self.request.id)`` is the same owner: it runs at once under the
    caller's lock (depth 2, the same token), which only the caller releases. Both in a worker and
    under apply() (eager)."""
    app = make_app(redis_server, task_default_queue=f"q-{uuid.uuid4().hex[:8]}")

    @locked(app, lock_key=["k"], lock_ttl=20, on_duplicate="retry")
    def step(self, k, nested=""):
        lock = self.lock
        if nested:
            return {"depth": lock.depth, "token": lock.token, "id": self.request.id}
        same = step.apply((k, "same"), task_id=self.request.id)
        other = step.apply((k, "other"))
        return {
            "token": lock.token, "id": self.request.id, "key": lock.key, "depth_after": lock.depth,
            "same_state": same.state, "same": same.result if same.state == "SUCCESS" else repr(same.result),
            "other_state": other.state, "other_error": repr(other.result),
            "other_is_deadlock": isinstance(other.result, SelfDeadlock),
            "held_during": redis_server.client(2).get(lock.key) is not None,
        }

    def check(result):
        assert result["same_state"] == "SUCCESS", result
        assert result["same"] == {"depth": 2, "token": result["token"], "id": result["id"]}
        assert result["depth_after"] == 1 and result["held_during"]
        assert result["other_state"] == "FAILURE" and result["other_is_deadlock"], result["other_error"]
        assert redis_server.client(2).get(result["key"]) is None  # released once, by the outermost

    k = f"k-{uuid.uuid4().hex[:8]}"
    check(step.apply((k,)).get(timeout=TIMEOUT))  # eager outer
    with run_worker(app, pool="threads", concurrency=2):
        check(step.delay(k).get(timeout=TIMEOUT))  # outer in a worker, nested calls eager


def test_a_task_lock_is_not_reentered_from_another_thread_of_its_body(redis_server, run_worker):
    """A thread the body starts is not the execution: with the task's id it takes the key like any
    other owner (refused while the task holds it)."""
    app = make_app(redis_server, task_default_queue=f"q-{uuid.uuid4().hex[:8]}")

    @locked(app, lock_key=["k"], lock_ttl=20)
    def spawn(self, k):
        return tried_in_another_thread(LockServer.from_url(redis_server.url(2)), self.lock.key,
                                       owner_id=self.request.id)

    with run_worker(app, pool="threads", concurrency=2):
        assert spawn.delay(f"k-{uuid.uuid4().hex[:8]}").get(timeout=TIMEOUT) == "refused"
