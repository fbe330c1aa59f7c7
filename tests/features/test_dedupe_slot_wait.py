"""Waiting in the worker slot (``lock_wait_in_slot``, the hot-key fast path) through real prefork
workers and a real broker: a duplicate handed the key while it waits in its slot runs there; a long
holder makes it park and it runs in its turn; a slot waiter killed, or stopped past the TTL, still
runs once from its parked message.

Two worker nodes (prefork, 2 children each) run tests/apps/dedupe_app.py on a redis-server of
this module's own; bodies journal what they ran with.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from _clusters import new_key, runs, started, state_of
from _dedupe_support import TIMEOUT, worker_child_of
from _task_support import assert_no_overlap

from celery_singleton_lock.engine import layout
from celery_singleton_lock.engine import line as queue
from celery_singleton_lock.testing.servers import wait_until

pytestmark = pytest.mark.timeout(240)


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


def slot_waiters(env, lock_key) -> int:
    """How many of the key's waiters still wait in their worker slot (their slot mark lives)."""
    locks = env.server.client(2)
    return sum(locks.exists(layout.blocking(lock_key, e.decode())) for e in locks.hkeys(layout.waiters(lock_key)))


def waiting_in_slot(env, task, hold: float, tag: str = "dup") -> tuple:
    """A holder of a new key for ``hold`` s, started, and a duplicate (``tag``) waiting in its worker slot
    behind it: (key, lock key, holder, duplicate)."""
    key = new_key()
    holder = task.delay(key, hold, "holder")
    started(env, key)
    dup = task.delay(key, 0.0, tag)
    lock_key = task.lock_key_for((key,), {})
    wait_until(lambda: slot_waiters(env, lock_key) >= 1, TIMEOUT, what="the duplicate to wait in its worker slot")
    return key, lock_key, holder, dup


def _locks_cli(*args: str) -> str:
    """``celery -A apps.dedupe_app locks <args>`` as an operator runs it (the module's servers, from the
    environment the fixture set)."""
    from _apps import ROOT, TESTS

    out = subprocess.run([sys.executable, "-m", "celery", "-A", "apps.dedupe_app", "locks", *args], cwd=TESTS,
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)])})
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_the_locks_commands_show_a_waiter_in_its_worker_slot_as_such(env):
    """``celery locks line`` and ``show`` tell a duplicate waiting in its worker slot from a parked one."""
    _key, lock_key, holder, dup = waiting_in_slot(env, env.in_slot_long, 3.0)
    (row,) = json.loads(_locks_cli("line", lock_key, "--json"))
    assert row["task_id"] == dup.id and row["state"] == "waiting in its worker slot", row
    (entry,) = json.loads(_locks_cli("show", lock_key, "--json"))["line"]
    assert entry["owner"] == dup.id and entry["state"] == "waiting in its worker slot", entry
    assert holder.get(timeout=TIMEOUT)["tag"] == "holder"
    assert dup.get(timeout=TIMEOUT)["tag"] == "dup"


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

    key, _lock_key, holder, dup = waiting_in_slot(env, env.in_slot, 3.0)
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

    key, _lock_key, holder, first = waiting_in_slot(env, env.in_slot_long, 2.0, "first")
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
