"""The slot-waiter fault tests' shared helpers (tests/line/test_slot_faults.py,
test_slot_fault_replies.py): waiting until calls wait in their worker slots, and the checks that each
call ran once and no late twin ran after a quiet spell."""

from __future__ import annotations

import time

from _clusters import new_key, runs, started, starts

from celery_singleton_lock.engine import layout
from celery_singleton_lock.testing.servers import wait_until

TIMEOUT = 40
QUIET = 2.0  # after the last expected run: long enough for a late twin (a re-send, a recovered copy) to run


def in_slot(env, task, key, count=1):
    """At least ``count`` entries of ``key``'s line wait in a worker slot (their slot mark lives)."""
    lock_key = task.lock_key_for((key,), {})
    client = env.locks.client(2)
    try:
        entries = client.hkeys(layout.waiters(lock_key))
        return sum(client.exists(layout.blocking(lock_key, e.decode())) for e in entries) >= count
    finally:
        client.close()


def _waiting_in_its_slot(env, task, hold: float, seconds: float) -> tuple:
    """A holder of a new key for ``hold`` s, started, and a duplicate of ``seconds`` waiting in its worker
    slot behind it: (the key, the holder, the duplicate)."""
    k = new_key()
    holder = task.delay(k, hold, "holder")
    started(env, k)
    dup = task.delay(k, seconds, "dup")
    wait_until(lambda: in_slot(env, task, k), TIMEOUT, what="the duplicate to wait in its slot")
    return k, holder, dup


def once_each(env, key, calls, tags):
    """Every call ran exactly once (by task id), nothing else ran, and no two bodies overlapped."""
    done = runs(env, key)
    by_id = {}
    for r in done:
        by_id.setdefault(r["id"], []).append(r)
    twice = {i: [(r["tag"], r["headers"], r["pid"]) for r in rs] for i, rs in by_id.items() if len(rs) > 1}
    assert not twice, f"a call ran more than once: {twice}"
    assert sorted(r["tag"] for r in done) == sorted(tags), done
    assert set(by_id) == {c.id for c in calls}, done
    return done


def quiet_then_check(env, key, count):
    """No run beyond ``count`` shows up in QUIET seconds (a late twin)."""
    time.sleep(QUIET)
    assert len(starts(env, key)) == count, [(s["tag"], s["headers"]) for s in starts(env, key)]
