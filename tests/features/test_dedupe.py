"""Dedupe through real prefork workers and a real broker: at publish (``lock_publish``: join, raise),
``on_duplicate="coalesce"`` and ``lock_cooldown``.

Two worker nodes (prefork, 2 children each) run tests/apps/dedupe_app.py on a redis-server of
this module's own; bodies journal what they ran with, so the tests count runs and check that
no two bodies of one key overlapped.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from _clusters import new_key, runs, started, state_of, worker_cluster
from _task_support import assert_no_overlap
from celery import chain

from celery_singleton_lock import AlreadyQueued, duplicate_coalesced, publish_joined
from celery_singleton_lock.engine import layout
from celery_singleton_lock.engine import line as queue
from celery_singleton_lock.engine.lock import Holder
from celery_singleton_lock.testing.servers import wait_until

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 60


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    with worker_cluster("dedupe_app", tmp_path_factory.mktemp("dedupe")) as module:
        yield module


# -- coalesce ------------------------------------------------------------------------------------------


def test_coalesce_burst_runs_once_more_with_the_latest_arguments(env):
    """1 holder of 2 s, then 50 duplicates in about a second: exactly 2 runs in all, the follow-up with
    the latest call's arguments, every AsyncResult resolved to the value of the run that covered it,
    and the chain of a merged call fired once."""
    key = new_key()
    merges = []
    duplicate_coalesced.connect(lambda sender=None, **kw: merges.append(kw), weak=False)  # (client: not sent here)
    holder = env.refresh.delay(key, 2.0, "holder")
    started(env, key)
    burst = [env.refresh.delay(key, 0.0, f"d{i}") for i in range(25)]
    chained = chain(env.refresh.s(key, 0.0, "chained"), env.echo_tag.s("chain-" + key)).delay()
    burst += [env.refresh.delay(key, 0.0, f"d{i}") for i in range(25, 48)]
    time.sleep(0.02)
    wait_until(lambda: all(state_of(r) == "WAITING" for r in burst), TIMEOUT, what="the burst to wait or merge")
    last = env.refresh.delay(key, 0.0, "last")
    wait_until(lambda: state_of(last) == "WAITING", TIMEOUT, what="the last call to merge")
    assert holder.get(timeout=TIMEOUT)["tag"] == "holder"
    values = [r.get(timeout=TIMEOUT) for r in [*burst, last]]
    done = runs(env, key)
    assert len(done) == 2, done
    assert done[0]["tag"] == "holder" and done[1]["tag"] == "last", done
    assert all(v["tag"] == "last" for v in values), values
    assert chained.get(timeout=TIMEOUT)["tag"] == "last"  # the chain's end: fired after the covering run
    assert env.journal.llen("links:chain-" + key) == 1
    assert_no_overlap([(r["start"], r["end"]) for r in done])
    assert all(state_of(r) == "SUCCESS" for r in [*burst, last])


def test_coalesce_failure_fails_every_merged_call_and_calls_its_errbacks(env):
    key = new_key()
    holder = env.refresh_fails.delay(key, 1.5, "holder")
    started(env, key)
    first = env.refresh_fails.delay(key, 0.0, "first")
    wait_until(lambda: state_of(first) == "WAITING", TIMEOUT, what="the first duplicate to park")
    with_errback = env.refresh_fails.apply_async((key, 0.0, "middle"), link_error=env.errback_log.s())
    wait_until(lambda: state_of(with_errback) == "WAITING", TIMEOUT, what="a merge")
    boom = env.refresh_fails.delay(key, 0.0, "boom")
    wait_until(lambda: state_of(boom) == "WAITING", TIMEOUT, what="a merge")
    holder.get(timeout=TIMEOUT)
    for r in (first, with_errback, boom):
        with pytest.raises(ValueError, match="boom"):
            r.get(timeout=TIMEOUT)
    assert [r["tag"] for r in runs(env, key)] == ["holder", "boom"]
    errbacks = wait_until(lambda: [json.loads(e) for e in env.journal.lrange("errbacks", 0, -1)
                                   if json.loads(e)["id"] == with_errback.id], TIMEOUT, what="the errback")
    assert len(errbacks) == 1 and errbacks[0]["exc"] == "ValueError"


# -- cooldown --------------------------------------------------------------------------------------------


def _holder_of(env, key_name):
    locks = env.server.client(2)
    value = locks.get(key_name)
    return None if value is None else Holder.parse(key_name, value, locks.pttl(key_name))


def test_cooldown_skip_skips_within_the_window_then_runs(env):
    key = new_key()
    first = env.cool_skip.delay(key, 0.0, "first")
    assert first.get(timeout=TIMEOUT)["tag"] == "first"
    lock_key = env.cool_skip.lock_key_for((key,), {})
    holder = _holder_of(env, lock_key)
    assert holder is not None and holder.cooldown and holder.owner_id == first.id and 0 < holder.ttl_ms <= 2000
    dup = env.cool_skip.delay(key, 0.0, "dup")
    wait_until(lambda: state_of(dup) == "REVOKED", TIMEOUT, what="the duplicate to be skipped")
    wait_until(lambda: _holder_of(env, lock_key) is None, TIMEOUT, what="the cooldown to end")
    assert env.cool_skip.delay(key, 0.0, "after").get(timeout=TIMEOUT)["tag"] == "after"
    assert [r["tag"] for r in runs(env, key)] == ["first", "after"]


def test_cooldown_retry_runs_when_the_cooldown_ends(env):
    key = new_key()
    first = env.cool_retry.delay(key, 0.0, "first")
    first.get(timeout=TIMEOUT)
    dup = env.cool_retry.delay(key, 0.0, "dup")
    assert dup.get(timeout=TIMEOUT)["tag"] == "dup"
    done = runs(env, key)
    assert [r["tag"] for r in done] == ["first", "dup"]
    assert done[1]["start"] >= done[0]["end"] + 2.0 - 0.05, done  # not before the cooldown ran out


def test_cooldown_coalesce_makes_one_follow_up_after_the_cooldown(env):
    key = new_key()
    env.cool_coalesce.delay(key, 0.0, "first").get(timeout=TIMEOUT)
    dups = []
    for i in range(5):
        dups.append(env.cool_coalesce.delay(key, 0.0, f"d{i}"))
        wait_until(lambda: state_of(dups[-1]) == "WAITING", TIMEOUT, what="the duplicate to wait or merge")
    values = [d.get(timeout=TIMEOUT) for d in dups]
    done = runs(env, key)
    assert [r["tag"] for r in done] == ["first", "d4"], done
    assert all(v["tag"] == "d4" for v in values)
    assert done[1]["start"] >= done[0]["end"] + 2.0 - 0.05


def test_a_failed_run_has_no_cooldown(env):
    key = new_key()
    with pytest.raises(ValueError):
        env.cool_fails.delay(key, "first").get(timeout=TIMEOUT)
    assert _holder_of(env, env.cool_fails.lock_key_for((key,), {})) is None
    with pytest.raises(ValueError):
        env.cool_fails.delay(key, "second").get(timeout=TIMEOUT)
    assert [r["tag"] for r in runs(env, key)] == ["first", "second"]


# -- dedupe at publish -------------------------------------------------------------------------------------


def test_join_from_threads_publishes_one_and_returns_it_to_all(env):
    key = new_key()
    n = 16
    barrier = threading.Barrier(n)
    ids: list[str] = []

    def publish():
        barrier.wait(10)
        ids.append(env.joined.delay(key, 1.0, "t").id)

    threads = [threading.Thread(target=publish) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(ids) == n and len(set(ids)) == 1, ids
    env.joined.AsyncResult(ids[0]).get(timeout=TIMEOUT)
    assert len(runs(env, key)) == 1
    # the call ended: the next publish is a new call
    again = env.joined.delay(key, 0.0, "again")
    assert again.id != ids[0] and again.get(timeout=TIMEOUT)["tag"] == "again"


def test_join_from_processes_publishes_one(env, tmp_path):
    key = new_key()
    go = tmp_path / "go"
    script = (
        "import os, sys, time; sys.path.insert(0, os.environ['TESTS'])\n"
        "from apps.dedupe_app import joined\n"
        f"deadline = time.monotonic() + 30\n"
        f"while not os.path.exists({str(go)!r}) and time.monotonic() < deadline: time.sleep(0.001)\n"
        f"print(joined.delay({key!r}, 1.0, 'p').id)\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, CSL_REDIS_URL_BASE=env.base, TESTS=str(ROOT / "tests"),
                                       PYTHONPATH=str(ROOT)))
             for _ in range(6)]
    time.sleep(1.5)  # let them import (each then waits for the go file, with its own deadline)
    go.write_text("go")
    ids = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len(set(ids)) == 1 and ids[0], ids
    env.joined.AsyncResult(ids[0]).get(timeout=TIMEOUT)
    assert len(runs(env, key)) == 1


def test_join_finds_a_running_call_that_was_sent_without_a_mark(env):
    key = new_key()
    running = env.app.send_task("apps.dedupe_app.joined", (key, 1.5, "sent"))
    started(env, key)
    joined = env.joined.delay(key, 0.0, "late")
    assert joined.id == running.id
    assert joined.get(timeout=TIMEOUT)["tag"] == "sent"


def test_raise_names_the_pending_call_and_pickles(env):
    key = new_key()
    seen = []
    publish_joined.connect(lambda sender=None, **kw: seen.append(kw), weak=False)
    first = env.refused.delay(key, 1.0, "first")
    with pytest.raises(AlreadyQueued) as caught:
        env.refused.delay(key, 0.0, "second")
    assert caught.value.task_id == first.id and first.id in str(caught.value)
    again = pickle.loads(pickle.dumps(caught.value))
    assert (again.key, again.task_id, again.state) == (caught.value.key, first.id, caught.value.state)
    assert any(s["task_id"] == first.id and s["mode"] == "raise" for s in seen)
    first.get(timeout=TIMEOUT)


def test_a_purged_message_frees_the_key_within_lock_publish_ttl(env):
    """The message is lost in the broker (a queue nobody reads, then purged): the mark blocks
    publishes for at most lock_publish_ttl (2 s here), then the key is free."""
    key = new_key()
    queue = f"nowhere-{key}"
    lost = env.refused.apply_async((key, 0.0, "lost"), queue=queue)
    broker = env.server.client(0)
    assert broker.delete(queue) == 1  # purged
    purged_at = time.monotonic()
    with pytest.raises(AlreadyQueued):
        env.refused.delay(key, 0.0, "blocked")
    mark = layout.publish_mark(env.refused.lock_key_for((key,), {}))
    assert env.server.client(2).get(mark).decode() == lost.id

    def publishes():
        try:
            return env.refused.delay(key, 0.0, "freed")
        except AlreadyQueued:
            return None

    freed = wait_until(publishes, 10, 0.05, what="the publish mark to expire")
    assert time.monotonic() - purged_at <= 2.0 + 1.0
    assert freed.get(timeout=TIMEOUT)["tag"] == "freed"


def test_the_mark_goes_when_the_call_starts_and_a_crashed_run_blocks_nothing(env):
    key = new_key()
    first = env.joined.delay(key, 0.5, "first")
    started(env, key)
    mark = layout.publish_mark(env.joined.lock_key_for((key,), {}))
    wait_until(lambda: env.server.client(2).get(mark) is None, TIMEOUT, what="the mark to go at the start")
    assert env.joined.delay(key, 0.0, "dup").id == first.id  # running: joined through the lock
    first.get(timeout=TIMEOUT)
    assert env.joined.delay(key, 0.0, "next").id != first.id


def test_a_call_revoked_while_queued_frees_its_mark(env):
    """Revoked before it started: the worker drops it (task_revoked), and its mark goes with it rather
    than blocking publishes for lock_publish_ttl (600 s for this task)."""
    key = new_key()
    queued = env.joined.apply_async((key, 0.0, "revoked"), countdown=2)
    mark = layout.publish_mark(env.joined.lock_key_for((key,), {}))
    assert env.server.client(2).get(mark).decode() == queued.id
    queued.revoke()
    wait_until(lambda: env.server.client(2).get(mark) is None, TIMEOUT, what="the revoked call's mark to go")
    assert state_of(queued) == "REVOKED" and runs(env, key) == []
    fresh = env.joined.delay(key, 0.0, "fresh")
    assert fresh.id != queued.id and fresh.get(timeout=TIMEOUT)["tag"] == "fresh"


# -- waiting in the worker slot (the hot-key fast path) -----------------------------------------------


def entries(env, key):
    return {e["tag"]: e["entry"] for e in map(json.loads, env.journal.lrange(f"entries:{key}", 0, -1))}


def kept(env, key: str) -> dict[str, list[str]]:
    return {e["tag"]: e.get("kept", []) for e in map(json.loads, env.journal.lrange(f"entries:{key}", 0, -1))}


def test_a_duplicate_handed_the_key_while_it_waits_in_its_slot_runs_there(env):
    """lock_wait_in_slot=1: a duplicate behind a 0.3 s holder is woken by the release and runs in the
    same delivery (no turn message, never WAITING), after the holder, in line order."""
    key = new_key()
    holder = env.in_slot.delay(key, 0.3, "holder")
    started(env, key)
    dups = [env.in_slot.delay(key, 0.05, f"d{i}") for i in range(2)]
    assert holder.get(timeout=TIMEOUT)["tag"] == "holder"
    assert [d.get(timeout=TIMEOUT)["tag"] for d in dups] == ["d0", "d1"]
    done = runs(env, key)
    assert_no_overlap([(r["start"], r["end"]) for r in done])
    assert [r["tag"] for r in done][0] == "holder"
    assert entries(env, key)["d0"] is None  # ran in its own delivery: no turn was sent
    for i, dup in enumerate(dups):  # nor does its process keep its parked message (and look it up each second)
        assert queue.entry_for(dup.id, 0) not in kept(env, key)[f"d{i}"]


def test_a_long_holder_makes_the_slot_waiter_park_and_it_runs_in_its_turn(env):
    key = new_key()
    holder = env.in_slot.delay(key, 2.5, "holder")
    started(env, key)
    dup = env.in_slot.delay(key, 0.0, "late")
    wait_until(lambda: state_of(dup) == "WAITING", TIMEOUT, what="the duplicate to park after its slot wait")
    assert not holder.ready()
    holder.get(timeout=TIMEOUT)
    assert dup.get(timeout=TIMEOUT)["tag"] == "late"
    assert entries(env, key)["late"]  # it came back as its turn's message
    assert_no_overlap([(r["start"], r["end"]) for r in runs(env, key)])


def test_a_slot_waiter_killed_while_it_waits_runs_in_its_turn_from_its_parked_message(env):
    """The worker child waiting in its slot is SIGKILLed (an early-acked message: the broker has no
    copy). Its mark in Redis runs out, the holder's release finds it an ordinary parked task and sends
    its message, and the call runs once, after the holder: nothing is lost."""
    import signal

    from celery_singleton_lock.engine import layout

    key = new_key()
    holder = env.in_slot.delay(key, 3.0, "holder")
    started(env, key)
    dup = env.in_slot.delay(key, 0.0, "dup")
    lock_key = env.in_slot.lock_key_for((key,), {})
    locks = env.server.client(2)

    def waiting_in_slot():
        return any(layout.Waiter.parse(r).state == "b" for r in locks.hvals(layout.waiters(lock_key)))

    wait_until(waiting_in_slot, TIMEOUT, what="the duplicate to wait in its worker slot")

    os.kill(wait_until(lambda: worker_child_of(env, dup.id), TIMEOUT, what="the waiting duplicate's worker child"),
            signal.SIGKILL)
    assert holder.get(timeout=TIMEOUT)["tag"] == "holder"
    wait_until(lambda: state_of(dup) == "SUCCESS", TIMEOUT, what="the killed waiter's call to run in its turn")
    done = runs(env, key)
    assert [r["tag"] for r in done] == ["holder", "dup"], done
    assert_no_overlap([(r["start"], r["end"]) for r in done])


def test_a_slot_waiter_woken_while_stopped_past_the_ttl_gets_its_turn_as_a_message_and_runs_once(env):
    """The worker child waiting in its slot is SIGSTOPped; the holder's release reserves the key for it
    and wakes it while it is stopped; the reservation runs out, and the sweeper sends its turn as a
    message, which another child runs, before the next in line. Resumed, the stopped child claims too
    late (its entry is gone, or taken by its turn's copy) and ends. Every call runs once, in order, and
    none overlap."""
    import signal

    key = new_key()
    holder = env.in_slot_long.delay(key, 2.0, "holder")
    started(env, key)
    lock_key = env.in_slot_long.lock_key_for((key,), {})
    locks = env.server.client(2)

    def in_slot(count):
        return sum(layout.Waiter.parse(r).state == "b" for r in locks.hvals(layout.waiters(lock_key))) >= count

    first = env.in_slot_long.delay(key, 0.0, "first")
    wait_until(lambda: in_slot(1), TIMEOUT, what="the first duplicate to wait in its worker slot")
    child = wait_until(lambda: worker_child_of(env, first.id), TIMEOUT, what="the first duplicate's worker child")
    os.kill(child, signal.SIGSTOP)
    try:
        second = env.in_slot_long.delay(key, 4.0, "second")
        assert holder.get(timeout=TIMEOUT)["tag"] == "holder"
        # the key is reserved for the stopped child; that runs out (TTL 5 s), its turn goes as a message
        wait_until(lambda: "second" in [r["tag"] for r in map(json.loads, env.journal.lrange(f"started:{key}", 0, -1))],
                   TIMEOUT, what="the second duplicate to start after the stopped one's reservation ran out")
    finally:
        os.kill(child, signal.SIGCONT)
    assert second.get(timeout=TIMEOUT)["tag"] == "second"
    assert first.get(timeout=TIMEOUT)["tag"] == "first"
    done = runs(env, key)
    assert [r["tag"] for r in done] == ["holder", "first", "second"], done
    assert_no_overlap([(r["start"], r["end"]) for r in done])
    assert sent_again(env, key)["first"] is None  # (its turn's message ran it: nothing was sent again)


def test_a_slot_waiter_woken_after_a_long_wait_claims_the_key_and_runs_there(env):
    """A wait in the slot longer than a third of the TTL (5 s here): woken, the waiter claims the key
    and runs in the same delivery (nothing is sent again)."""
    key = new_key()
    holder = env.in_slot_long.delay(key, 2.5, "holder")
    started(env, key)
    dup = env.in_slot_long.delay(key, 0.0, "dup")
    assert holder.get(timeout=TIMEOUT)["tag"] == "holder"
    assert dup.get(timeout=TIMEOUT)["tag"] == "dup"
    done = runs(env, key)
    assert [r["tag"] for r in done] == ["holder", "dup"], done
    assert_no_overlap([(r["start"], r["end"]) for r in done])
    assert sent_again(env, key)["dup"] is None  # not sent again: it ran in the delivery that waited


def sent_again(env, key: str) -> dict[str, int | None]:
    return {e["tag"]: e["sent_again"] for e in map(json.loads, env.journal.lrange(f"sent-again:{key}", 0, -1))}


def worker_child_of(env, task_id):
    """The pid of the prefork child running ``task_id`` now (``inspect active``), or None."""
    for tasks in (env.app.control.inspect(timeout=1.0).active() or {}).values():
        for t in tasks:
            if t["id"] == task_id:
                return t["worker_pid"]
    return None
