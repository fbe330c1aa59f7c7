"""Slot waiters (``lock_wait_in_slot``) under faults, through real prefork workers and a real broker:
a busy queue, the lock Redis restarted empty while a waiter waits in its slot, and a waiter killed
right after it was handed the key. Replies lost or faulted at UNBLOCK and at a claim are in
test_slot_fault_replies.py.

Two worker nodes (prefork, 2 children each) run tests/apps/slot_faults_app.py. Broker and results
live on one redis-server; the locks on another (so it can restart empty without losing the broker).
Bodies journal each start and end: the tests count runs per call and check that no two bodies of
one key overlapped.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from _clusters import new_key, runs, started, starts
from _slot_faults_support import QUIET, TIMEOUT, _waiting_in_its_slot, in_slot, once_each, quiet_then_check
from _task_support import assert_no_overlap

from celery_singleton_lock.testing.servers import wait_until

ROOT = Path(__file__).resolve().parents[2]


def assert_arrival_order(env, key, done, margin=0.05):
    """The bodies ran in the order their calls were first delivered (each parked, or took the free key,
    within moments of its first delivery), for calls first delivered more than ``margin`` s apart."""
    first = {}
    for d in map(json.loads, env.journal.lrange(f"delivered:{key}", 0, -1)):
        first.setdefault(d["id"], d["at"])
    ran = sorted(done, key=lambda r: r["start"])
    for i, a in enumerate(ran):
        for b in ran[i + 1:]:
            assert first[b["id"]] > first[a["id"]] - margin, (
                f"{b['tag']} (first delivered {first[b['id']]:.3f}) ran after {a['tag']} (first delivered "
                f"{first[a['id']]:.3f}): out of arrival order: {[r['tag'] for r in ran]}")


# -- 1. a busy queue -------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_slot_waiters_under_a_busy_queue_each_run_once_without_overlap(env):
    """Two hot keys whose duplicates arrive through a queue kept deep with other work (2 nodes x 2
    children): they wait in their slots, some are handed the key there, some park and come back as
    turns (or as a short hold's send-ahead). Every call runs once; no two bodies of a key overlap."""
    keys = [new_key() for _ in range(2)]
    holders = [env.slot.delay(k, 3.0, "holder") for k in keys]
    for k in keys:
        started(env, k)
    fillers = [env.filler.delay(0.1) for _ in range(30)]
    dups = {k: [] for k in keys}
    for i in range(6):
        for k in keys:
            dups[k].append(env.slot.delay(k, 0.3, f"d{i}"))
        fillers += [env.filler.delay(0.1) for _ in range(12)]
    for h in holders:
        assert h.get(timeout=TIMEOUT)["tag"] == "holder"
    depth_seen = env.server.client(0).llen("celery")
    for k in keys:
        assert [d.get(timeout=TIMEOUT)["tag"] for d in dups[k]] == [f"d{i}" for i in range(6)]
    for f in fillers:
        f.get(timeout=TIMEOUT)
    for k, h in zip(keys, holders, strict=True):
        done = once_each(env, k, [h, *dups[k]], ["holder", *(f"d{i}" for i in range(6))])
        assert_no_overlap([(r["start"], r["end"]) for r in done], f"the bodies of {k}")
    print("\n[slot-faults] busy queue:", {k: [(r["tag"], r["headers"]) for r in runs(env, k)] for k in keys},
          "queue depth at the end of the holders:", depth_seen)
    handed_in_slot = sum(1 for k in keys for r in runs(env, k) if r["tag"] != "holder" and not r["headers"])
    assert handed_in_slot >= 1, "no duplicate ran in its slot: the slot path was not exercised"
    quiet_then_check(env, keys[0], 7)
    assert len(starts(env, keys[1])) == 7


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_burst_on_one_hot_key_behind_a_busy_queue_runs_each_call_once_in_turn(env):
    """More duplicates of one key than there are worker slots, with short bodies, behind and among a
    backlog: the slot waiters are handed the key one after another, the rest park, and short holds send
    the next parked one ahead of its turn (to wait in a slot). Every call runs once, none overlap."""
    k = new_key()
    false_losses = sum(w.log().count("lost their place") for w in env.workers)
    holder = env.slot.delay(k, 0.5, "holder")
    started(env, k)
    fillers = [env.filler.delay(0.05) for _ in range(20)]
    dups = []
    for i in range(8):
        dups.append(env.slot.delay(k, 0.4, f"d{i}"))
        fillers += [env.filler.delay(0.05) for _ in range(3)]
    assert holder.get(timeout=TIMEOUT)["tag"] == "holder"
    assert sorted(d.get(timeout=TIMEOUT)["tag"] for d in dups) == sorted(f"d{i}" for i in range(8))
    for f in fillers:
        f.get(timeout=TIMEOUT)
    done = once_each(env, k, [holder, *dups], ["holder", *(f"d{i}" for i in range(8))])
    assert_no_overlap([(r["start"], r["end"]) for r in done])
    print("\n[slot-faults] burst:", [(r["tag"], sorted(r["headers"])) for r in done])
    print("[slot-faults] deliveries:", [(d["tag"], round(d["at"] % 100, 3), sorted(d["headers"]))
                                        for d in map(json.loads, env.journal.lrange(f"delivered:{k}", 0, -1))])
    assert_arrival_order(env, k, done)
    quiet_then_check(env, k, 9)
    # nothing was lost, so no sweeper may have taken a place for lost: a copy sent ahead that claims the
    # key in its slot leaves the tombstone the process that first parked its entry looks for
    assert sum(w.log().count("lost their place") for w in env.workers) == false_losses, "a sweeper saw a loss"


# -- 2. the lock Redis restarted empty while a waiter waits in its slot ------------------------------


def _restart_empty(env, down: float) -> None:
    env.locks.stop()
    time.sleep(down)
    env.locks.start()


def _restart_while_in_slot(env, down: float, task=None) -> None:
    task = task or env.slot_long
    k, holder, dup = _waiting_in_its_slot(env, task, 3.0, 0.3)
    _restart_empty(env, down)
    assert holder.get(timeout=TIMEOUT)["tag"] == "holder"
    try:
        assert dup.get(timeout=TIMEOUT)["tag"] == "dup"
    finally:
        print("\n[slot-faults] runs:", [(r["tag"], r["headers"]) for r in runs(env, k)])
    wait_until(lambda: len(runs(env, k)) >= 2, TIMEOUT, what="both runs to end")
    quiet_then_check(env, k, 2)
    once_each(env, k, [holder, dup], ["holder", "dup"])
    assert len(runs(env, k)) == 2, runs(env, k)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_lock_redis_restarted_empty_while_a_waiter_waits_in_its_slot_runs_it_once(env):
    """A quick empty restart (no downtime to speak of): the waiter's BLPOP breaks, its UNBLOCK finds
    no record (UNKNOWN); its process's sweeper sends the lost park again. It runs once."""
    _restart_while_in_slot(env, down=0.0)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_lock_redis_down_then_back_empty_while_a_waiter_waits_in_its_slot_runs_it_once(env):
    """The lock Redis is down for 2 s, then back empty: the waiter cannot end its wait (UNBLOCK fails),
    so it ends as parked, and its process's sweeper sends the lost park again once Redis is back. The
    call must run once, and never end FAILURE."""
    _restart_while_in_slot(env, down=2.0)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_lock_redis_restarted_empty_with_a_slow_slot_resend_runs_the_waiter_once(env):
    """The lock Redis is down 0.3 s (so the waiter's UNBLOCK fails and it ends as parked), then back
    empty, with a task whose re-sends are slow (lock_retry_backoff 4 s): the sweeper's recovered copy of
    the lost park runs the call, once."""
    _restart_while_in_slot(env, down=0.3, task=env.slot_slow_resend)


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.long
def test_lock_data_lost_under_a_waiter_still_blocked_in_its_slot_runs_it_once_and_keeps_its_result(env):
    """The lock Redis loses its data (FLUSHDB of the private lock db: what a restart empty does to the
    data, without breaking the waiter's BLPOP connection) while a waiter blocks in its slot (5 s). Its
    process's sweeper sends the lost park again at once and that copy runs the call; the waiter, still
    in its slot, then ends its wait: its UNBLOCK finds no record (UNKNOWN). The call must run once, and
    its SUCCESS must stay (a WAITING stored over it would leave result.get() hanging)."""
    k, holder, dup = _waiting_in_its_slot(env, env.slot_long, 1.0, 0.3)
    waiting_since = time.time()
    client = env.locks.client(2)
    try:
        client.flushdb()
    finally:
        client.close()
    assert holder.get(timeout=TIMEOUT)["tag"] == "holder"
    assert dup.get(timeout=TIMEOUT)["tag"] == "dup"
    once_each(env, k, [holder, dup], ["holder", "dup"])
    # the original delivery's slot wait (5 s from when it parked) has ended by now, plus a margin
    time.sleep(max(0.0, waiting_since + 5.0 + 1.0 - time.time()))
    quiet_then_check(env, k, 2)
    meta = dup.backend.get_task_meta(dup.id, cache=False)
    assert meta["status"] == "SUCCESS", f"the finished call's stored state was overwritten: {meta}"


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.long
def test_lock_data_lost_then_the_recovered_copy_waits_in_a_slot_beside_the_original_runs_it_once(env):
    """Default TTL (30 s). A waiter blocks in its slot (5 s); the lock data is lost (FLUSHDB of the
    private lock db: the waiter's BLPOP connection stays up); a newcomer takes the now free key. The
    waiter's process sends its lost park again; that recovered copy finds the key held, parks under
    the SAME entry id (entry_for(task id, retries)) and waits in a slot too. The newcomer's release
    reserves the key for that entry and pushes one wake-up to the shared list, where the ORIGINAL
    delivery (blocked there since before the loss, so first in Redis's BLPOP order) reads it and claims
    the key; the recovered copy's wait then ends with its place gone. The call must run once, and no two
    bodies of the key may overlap (its 4 s body outlasts the rest of the recovered copy's slot wait)."""
    task = env.slot_ttl30
    k, holder, dup = _waiting_in_its_slot(env, task, 0.5, 4.0)
    client = env.locks.client(2)
    try:
        client.flushdb()
    finally:
        client.close()
    newcomer = task.delay(k, 2.0, "newcomer")
    wait_until(lambda: "newcomer" in [s["tag"] for s in starts(env, k)], TIMEOUT, what="the newcomer to take the key")
    try:
        wait_until(lambda: in_slot(env, task, k), TIMEOUT, what="the recovered copy to wait in a slot")
        assert holder.get(timeout=TIMEOUT)["tag"] == "holder"
        assert newcomer.get(timeout=TIMEOUT)["tag"] == "newcomer"
        assert dup.get(timeout=TIMEOUT)["tag"] == "dup"
        time.sleep(QUIET + 5.0)  # (the original delivery's slot wait, 5 s, ends meanwhile)
    finally:
        print("\n[slot-faults] runs:", [(r["tag"], r["headers"], r["pid"], round(r["start"] % 100, 3),
                                          round(r["end"] % 100, 3), r["lost"]) for r in runs(env, k)])
    done = once_each(env, k, [holder, newcomer, dup], ["holder", "newcomer", "dup"])
    after_loss = [r for r in done if r["tag"] != "holder"]  # (the holder's lock went with the data)
    assert_no_overlap([(r["start"], r["end"]) for r in after_loss], "the bodies after the loss")


# -- 3. a waiter killed right after it was handed the key ---------------------------------------------


def _handed_waiter_killed(env, task, hold: float) -> tuple:
    """A holder of a new key for ``hold`` s; a duplicate waiting in its slot behind it, which SIGKILLs its
    own process once handed the key (apps/slot_faults_app.py's hook); a second call after it. Once the
    kill happened: (the key, the holder, the killed duplicate, the second call)."""
    k = new_key()
    holder = task.delay(k, hold, "holder")
    started(env, k)
    env.journal.sadd("kill-handed", k)
    dup = task.delay(k, 0.2, "dup")
    wait_until(lambda: in_slot(env, task, k), TIMEOUT, what="the duplicate to wait in its slot")
    second = task.delay(k, 0.2, "second")
    wait_until(lambda: env.journal.llen(f"killed:{k}") == 1, TIMEOUT, what="the handed waiter to be killed")
    return k, holder, dup, second


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_acks_late_waiter_killed_after_the_hand_off_before_its_body_runs_once(env):
    """acks_late + reject_on_worker_lost: the slot waiter is SIGKILLed right after it claimed the key the
    release reserved for it (before its body). The key stays held by the dead waiter's token until the TTL; the
    broker delivers the message again, and it runs once, after the holder; the next waiter runs after
    it. No call is lost or doubled, no bodies overlap."""
    k, holder, dup, second = _handed_waiter_killed(env, env.slot_late, 1.0)
    assert holder.get(timeout=TIMEOUT)["tag"] == "holder"
    assert dup.get(timeout=TIMEOUT)["tag"] == "dup"
    assert second.get(timeout=TIMEOUT)["tag"] == "second"
    done = once_each(env, k, [holder, dup, second], ["holder", "dup", "second"])
    assert_no_overlap([(r["start"], r["end"]) for r in done])
    killed = json.loads(env.journal.lindex(f"killed:{k}", 0))
    print("\n[slot-faults] killed at", killed["at"], [(r["tag"], r["start"], r["headers"]) for r in done])
    assert killed["id"] == dup.id
    [ran] = [r for r in done if r["id"] == dup.id]
    assert ran["start"] >= killed["at"]  # (its only run came after the kill)
    quiet_then_check(env, k, 3)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_early_ack_waiter_killed_after_the_hand_off_frees_the_key_for_the_next(env):
    """Early ack: the killed waiter's call is lost as a Celery task killed mid-run is (documented:
    WorkerLostError), but the key it was handed is not: it runs out with the TTL and the next waiter
    runs, once, with no overlap."""
    from celery.exceptions import WorkerLostError

    k, holder, dup, second = _handed_waiter_killed(env, env.slot, 0.5)
    assert holder.get(timeout=TIMEOUT)["tag"] == "holder"
    with pytest.raises(WorkerLostError):
        dup.get(timeout=TIMEOUT)
    assert second.get(timeout=TIMEOUT)["tag"] == "second"
    done = once_each(env, k, [holder, second], ["holder", "second"])
    assert_no_overlap([(r["start"], r["end"]) for r in done])
    killed = json.loads(env.journal.lindex(f"killed:{k}", 0))
    [ran] = [r for r in done if r["id"] == second.id]
    assert ran["start"] >= killed["at"] + 2.0  # the dead waiter's lock ran out first (TTL 3 s)
