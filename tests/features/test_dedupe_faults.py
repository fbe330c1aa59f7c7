"""Coalesce and lock_publish under faults, through the real prefork workers of the dedupe tests'
module fixture (``env``, features/conftest.py): no merged or joined call is left WAITING or PENDING
for ever, none fires its link twice, and no publish joins a call that does not exist or has ended.

The faults: a plain ``held()`` block on the key, a merged message delivered twice, a merged call
revoked, the lock Redis losing its data, the waiter's run killed, merged records outlived by a long
run or by a late turn, a retried waiter revoked, and a reply lost at publish."""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest
from _clusters import runs, started, state_of
from _dedupe_support import TIMEOUT, worker_child_of
from _fault_proxy import FaultProxy

from celery_singleton_lock import held
from celery_singleton_lock.testing.servers import wait_until

pytestmark = pytest.mark.timeout(240)


def _key() -> str:
    return uuid.uuid4().hex[:12]


def _links(env, to: str) -> int:
    return int(env.journal.llen("links:" + to))


def _settled_count(env, to: str, within: float = 4.0) -> int:
    """Links fired for ``to`` once they stop changing (polled with a deadline)."""
    deadline = time.monotonic() + within
    seen = _links(env, to)
    while time.monotonic() < deadline:
        time.sleep(0.1)
        seen = max(seen, _links(env, to))
    return seen


def _holder_and_waiter(env, key, seconds=3.0):
    holder = env.refresh.delay(key, seconds, "holder")
    started(env, key)
    first = env.refresh.delay(key, 0.0, "first")
    wait_until(lambda: state_of(first) == "WAITING", TIMEOUT, what="the first duplicate to park")
    return holder, first


def test_join_while_a_plain_held_block_holds_the_key_returns_no_bogus_result(env):
    """A publish while a plain held() block holds the key (no owner id: the lock's owner is null,
    cjson.null in the PUBLISH script, which is truthy) joins nobody: never a task id "None", whose
    AsyncResult would stay PENDING for ever."""
    key = _key()
    with held(env.joined.lock_server(), env.joined.lock_key_for((key,), {}), ttl=10):
        result = env.joined.delay(key, 0.0, "after-held")
    assert result.id != "None", "joined a call that does not exist: PENDING forever"


def test_a_merged_message_delivered_twice_fires_its_link_once(env):
    """A merged message delivered twice (the broker redelivers it when its ack was lost: a crash or
    a visibility timeout between PARK and the ack) is one merged call: settle() fires its link once.
    Here the same message (same task id, same link) is delivered twice."""
    key = _key()
    holder, first = _holder_and_waiter(env, key)
    tid = str(uuid.uuid4())
    for _ in range(2):
        m = env.refresh.apply_async((key, 0.0, "m"), task_id=tid, link=env.echo_tag.s("dup-" + key))
        wait_until(lambda m=m: state_of(m) == "WAITING", TIMEOUT, what="the merged call to wait")
    time.sleep(0.5)  # the second delivery is processed (state already WAITING)
    holder.get(timeout=TIMEOUT)
    assert first.get(timeout=TIMEOUT)["tag"] == "m"
    wait_until(lambda: _links(env, "dup-" + key) >= 1, TIMEOUT, what="the merged call's link")
    assert _settled_count(env, "dup-" + key) == 1


def test_a_revoked_merged_call_does_not_succeed_or_fire_its_link(env):
    """revoke() of a merged call takes it out although it waits in no line of its own (revoke.take_out):
    the waiter's run later neither marks it SUCCESS nor sends its link."""
    key = _key()
    holder, first = _holder_and_waiter(env, key)
    m = env.refresh.apply_async((key, 0.0, "m"), link=env.echo_tag.s("rev-" + key))
    wait_until(lambda: state_of(m) == "WAITING", TIMEOUT, what="the merged call to wait")
    m.revoke()
    time.sleep(1.0)  # the broadcast reaches both nodes
    holder.get(timeout=TIMEOUT)
    first.get(timeout=TIMEOUT)
    assert _settled_count(env, "rev-" + key) == 0 and state_of(m) != "SUCCESS"


@pytest.mark.xfail(strict=True, reason="a known limit (docs/how-to/dedupe.md): merged calls live only in the lock "
                   "Redis; the sweeper re-sends parked messages after a data loss, not merged ones")
@pytest.mark.long
def test_merged_calls_survive_a_lock_redis_data_loss(env):
    """Parked waiters are remembered by the sweeper and re-parked after Redis loses its data; the
    messages merged into them (K:m:<entry>) are not, and were acked: the merged call stays WAITING
    forever although its waiter runs."""
    key = _key()
    holder, first = _holder_and_waiter(env, key, seconds=4.0)
    m = env.refresh.delay(key, 0.0, "m")
    wait_until(lambda: state_of(m) == "WAITING", TIMEOUT, what="the merged call to wait")
    env.server.client(2).flushdb()  # the lock db only: a restart without persistence
    holder.get(timeout=TIMEOUT)
    first.get(timeout=TIMEOUT)
    wait_until(lambda: state_of(m) != "WAITING", 30, what="the merged call to leave WAITING")


def _follow_up_running(env, key, seconds):
    """A holder, a parked first duplicate and a call merged into it (the follow-up runs ``seconds``
    with its arguments); returns (first, merged) once the follow-up has started."""
    holder = env.refresh.delay(key, 1.0, "holder")
    started(env, key)
    first = env.refresh.delay(key, 0.0, "first")
    wait_until(lambda: state_of(first) == "WAITING", TIMEOUT, what="the first duplicate to park")
    m = env.refresh.delay(key, seconds, "slow")  # merged: the follow-up runs with these arguments
    wait_until(lambda: state_of(m) == "WAITING", TIMEOUT, what="the merged call to wait")
    holder.get(timeout=TIMEOUT)
    started(env, key, 2)
    return first, m


def test_merged_calls_do_not_stay_waiting_when_their_waiter_run_is_killed(env):
    """The waiter's run has taken its merged calls into memory when its worker child dies (SIGKILL, no
    acks_late): the waiter ends FAILURE (WorkerLostError), and its merged calls still leave WAITING."""
    key = _key()
    first, m = _follow_up_running(env, key, 30.0)

    pid = wait_until(lambda: worker_child_of(env, first.id), TIMEOUT, what="the follow-up's worker child")
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: state_of(first) == "FAILURE", TIMEOUT, what="the follow-up to fail (WorkerLostError)")
    assert not runs(env, key)[1:], "the follow-up did not finish"
    wait_until(lambda: state_of(m) != "WAITING", 30, what="the merged call to leave WAITING")


def test_merged_calls_are_settled_when_their_records_expired_during_a_long_run(env):
    """The merged calls' records live the waiter's deadline plus ten minutes from the merge; a covering
    run that outlives them still settles its merged calls at its end (SUCCESS), never leaves them
    WAITING. (Their expiry is made here by deleting them once the covering run has started.)"""
    from celery_singleton_lock.engine import layout

    key = _key()
    first, m = _follow_up_running(env, key, 2.0)  # the covering run has taken its merged calls
    calls = layout.merged(env.refresh.lock_key_for((key,), {}), first.id)
    assert env.server.client(2).delete(calls) == 1, "no merged records to expire: the test proves nothing"
    assert first.get(timeout=TIMEOUT)["tag"] == "slow"
    wait_until(lambda: state_of(m) != "WAITING", 10, what="the merged call to leave WAITING")
    assert state_of(m) == "SUCCESS"


def test_merged_calls_live_as_long_as_their_waiters_reservation(env):
    """The merged calls (K:m:<entry>) live at least as long as the key stays reserved for their waiter:
    CONFIRM keeps it reserved for a handed waiter up to turn_timeout (300 s), however deep the queue,
    so a waiter handed near its deadline whose copy waits long in the queue (or an EXPIRED copy behind
    busy workers) still finds them; else they would stay WAITING for ever and "latest wins" would run
    the old arguments."""
    from celery_singleton_lock.engine import layout
    from celery_singleton_lock.engine import line as queue
    from celery_singleton_lock.engine.server import LockServer

    server = LockServer.from_url(f"{env.base}/2")
    key = f"merged:{{{uuid.uuid4().hex}}}"
    holder = server.acquire(key, 5, owner_id="holder")
    w1 = queue.entry_for("w1")
    assert queue.park(server, key, w1, kind="t", wait=2, ttl=5, owner_id="w1", message=b"1", merge=True).place == 1
    assert queue.park(server, key, queue.entry_for("w2"), kind="t", wait=2, ttl=5, owner_id="w2",
                      message=b"2", merge=True).found is queue.Park.MERGED
    server.release(holder, succeeded=True)  # w1's turn (before its deadline)
    assert server.confirm(key, w1)  # its copy was sent: the key stays reserved up to turn_timeout
    client = env.server.client(2)
    assert client.pttl(layout.merged(key, "w1")) >= client.pttl(key), "merged calls expire before the turn"


def test_revoking_a_retried_waiter_sends_its_merged_calls_again(env):
    """Revoking a waiter that parked as a retry (request.retries > 0: its entry is
    entry_for(task_id, retries), not entry_for(task_id)) finds its merged calls under that entry and
    sends them again: they run, never stay WAITING."""
    key = _key()
    holder = env.refresh.delay(key, 3.0, "holder")
    started(env, key)
    waiter = env.refresh.apply_async((key, 0.0, "w"), retries=1)  # as self.retry() sends it
    wait_until(lambda: state_of(waiter) == "WAITING", TIMEOUT, what="the retried call to park")
    m = env.refresh.delay(key, 0.0, "m")
    wait_until(lambda: state_of(m) == "WAITING", TIMEOUT, what="the merged call to wait")
    meta = m.backend.get_task_meta(m.id, cache=False)["result"]
    assert meta.get("merged_into") == waiter.id, meta
    waiter.revoke()
    holder.get(timeout=TIMEOUT)
    wait_until(lambda: state_of(m) != "WAITING", 30, what="the merged call to be sent again and run")


def test_a_lost_reply_at_publish_leaves_no_mark_that_outlives_its_call(env):
    """The PUBLISH script ran (the mark is set for the new id) but its reply was lost: the call is
    published still MARKED, so its delivery deletes the mark, and the next publish of the key is a
    new call. A mark outliving its call would have every publish for lock_publish_ttl (600 s) join the
    finished call: no run, a stale result."""
    from celery_singleton_lock.engine import dedupe, layout
    from celery_singleton_lock.engine.server import LockServer

    key = _key()
    proxy = FaultProxy(env.server.port)
    task = env.app.tasks[env.joined.name]
    lossy = LockServer.from_url(f"redis://127.0.0.1:{proxy.port}/2", socket_timeout=1.0)
    try:
        dedupe.mark(lossy, "warm:{x}", "x", 1000)  # the PUBLISH script loaded, the connection up
        proxy.swallowing.set()
        task.__dict__["_singleton_lock_server"] = lossy
        first = task.delay(key, 0.0, "first")
    finally:
        task.__dict__.pop("_singleton_lock_server", None)
        proxy.close()
    assert first.get(timeout=TIMEOUT)["tag"] == "first"  # it ran and ended
    mark = layout.publish_mark(task.lock_key_for((key,), {}))
    time.sleep(0.5)
    assert env.server.client(2).get(mark) is None, "the finished call's publish mark is still there"
    again = task.delay(key, 0.0, "again")
    assert again.id != first.id, "a publish joined a call that ended: stale for lock_publish_ttl"
