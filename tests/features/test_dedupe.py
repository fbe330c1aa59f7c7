"""Dedupe through real prefork workers and a real broker: at publish (``lock_publish``: join, raise),
``on_duplicate="coalesce"`` and ``lock_cooldown``. Waiting in the worker slot (``lock_wait_in_slot``)
is in test_dedupe_slot_wait.py.

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
from _clusters import new_key, runs, started, state_of
from _dedupe_support import TIMEOUT
from _task_support import assert_no_overlap
from celery import chain

from celery_singleton_lock import AlreadyQueued, duplicate_coalesced, publish_joined
from celery_singleton_lock.engine import layout
from celery_singleton_lock.engine.lock import Holder
from celery_singleton_lock.testing.servers import wait_until

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[2]


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
        "open(os.environ['READY'], 'w').close()\n"
        f"deadline = time.monotonic() + 30\n"
        f"while not os.path.exists({str(go)!r}) and time.monotonic() < deadline: time.sleep(0.001)\n"
        f"print(joined.delay({key!r}, 2.0, 'p').id)\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, CSL_REDIS_URL_BASE=env.base, TESTS=str(ROOT / "tests"),
                                       PYTHONPATH=str(ROOT), READY=str(tmp_path / f"ready-{i}")))
             for i in range(6)]
    # all imported (each then waits for the go file, with its own deadline): they publish together
    wait_until(lambda: len(list(tmp_path.glob("ready-*"))) == 6, 30, what="the six publishers to import")
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
