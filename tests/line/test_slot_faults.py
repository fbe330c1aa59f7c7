"""Slot waiters (``lock_wait_in_slot``) under faults, through real prefork workers and a real broker:
a busy queue, the lock Redis restarted empty while a waiter waits in its slot, and a waiter killed
right after it was handed the key.

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
from _clusters import new_key, runs, started, starts, state_of
from _fault_proxy import sha_of
from _task_support import assert_no_overlap

from celery_singleton_lock.engine import dedupe, layout, line_scripts, scripts
from celery_singleton_lock.testing.servers import wait_until

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 40
QUIET = 2.0  # after the last expected run: long enough for a late twin (a re-send, a recovered copy) to run


def in_slot(env, task, key, count=1):
    """At least ``count`` entries of ``key``'s line wait in a worker slot (state 'b')."""
    lock_key = task.lock_key_for((key,), {})
    client = env.locks.client(2)
    try:
        return sum(layout.Waiter.parse(r).state == "b" for r in client.hvals(layout.waiters(lock_key))) >= count
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


def quiet_then_check(env, key, count):
    """No run beyond ``count`` shows up in QUIET seconds (a late twin)."""
    time.sleep(QUIET)
    assert len(starts(env, key)) == count, [(s["tag"], s["headers"]) for s in starts(env, key)]


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


# -- 4. a reply lost at UNBLOCK (and at the wake-up) --------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_unblock_reply_lost_twice_the_slot_copy_ends_and_the_entry_runs_once_in_its_turn(env):
    """The waiter's slot wait runs out behind a long holder; its UNBLOCK runs in Redis (it is parked
    now) but the reply is lost, twice (the client's own retry too): it ends as parked, and the entry
    runs once, in its turn's message, after the holder."""
    unblock = sha_of(line_scripts.UNBLOCK)
    k, holder, dup = _waiting_in_its_slot(env, env.slot, 2.5, 0.2)
    env.proxy.arm(unblock, 2)
    assert holder.get(timeout=TIMEOUT)["tag"] == "holder"
    assert env.proxy.left(unblock) == 0, "the UNBLOCK replies were not lost: the test did not run its fault"
    assert dup.get(timeout=TIMEOUT)["tag"] == "dup"
    done = once_each(env, k, [holder, dup], ["holder", "dup"])
    assert_no_overlap([(r["start"], r["end"]) for r in done])
    [ran] = [r for r in done if r["tag"] == "dup"]
    assert ran["headers"].get("entry"), ran  # its turn's message ran it
    quiet_then_check(env, k, 2)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_wake_up_and_unblock_replies_lost_the_woken_waiter_runs_once_in_its_turn(env):
    """The release reserves the key for the slot waiter and wakes it; the BLPOP that reads the wake-up
    loses its reply, and so do both tries of the UNBLOCK that follows: the waiter cannot tell it was
    woken, and ends as parked. The reservation runs out and the sweeper sends its turn: the call runs
    once, with no overlap, and the key is not left reserved for nobody (the next call runs)."""
    unblock = sha_of(line_scripts.UNBLOCK)
    k = new_key()
    holder = env.slot.delay(k, 0.6, "holder")
    started(env, k)
    lock_key = env.slot.lock_key_for((k,), {})
    env.proxy.arm(layout.wake(lock_key, "").encode(), 1)  # (its BLPOP names its wake-up list)
    env.proxy.arm(unblock, 2)
    dup = env.slot.delay(k, 0.2, "dup")
    wait_until(lambda: in_slot(env, env.slot, k), TIMEOUT, what="the duplicate to wait in its slot")
    try:
        assert holder.get(timeout=TIMEOUT)["tag"] == "holder"
        assert dup.get(timeout=TIMEOUT)["tag"] == "dup"
    finally:
        print("\n[slot-faults] lost replies:", env.proxy.dropped, [(r["tag"], r["headers"]) for r in runs(env, k)])
    assert env.proxy.left(unblock) == 0, "the UNBLOCK replies were not lost: the test did not run its fault"
    after = env.slot.delay(k, 0.1, "after")
    assert after.get(timeout=TIMEOUT)["tag"] == "after"
    done = once_each(env, k, [holder, dup, after], ["holder", "dup", "after"])
    assert_no_overlap([(r["start"], r["end"]) for r in done])
    [ran] = [r for r in done if r["tag"] == "dup"]
    assert ran["headers"].get("entry"), ran  # its turn's message ran it
    quiet_then_check(env, k, 3)


# -- 5. a turn's claim faulted (a waiter with no slot wait: its turn comes as a message) -------------


def _both_ran_once_in_turn(env, k: str, holder, dup, script: bytes, what: str) -> None:
    """The holder and the duplicate each ran once, in turn, and nothing twice; the fault armed on
    ``script`` (``what``) happened."""
    assert holder.get(timeout=TIMEOUT)["tag"] == "holder"
    assert dup.get(timeout=TIMEOUT)["tag"] == "dup"
    assert env.proxy.left(script) == 0, f"{what} was not faulted: the test did not run its fault"
    done = once_each(env, k, [holder, dup], ["holder", "dup"])
    assert_no_overlap([(r["start"], r["end"]) for r in done])
    quiet_then_check(env, k, 2)


def _turn_with_claim_faulted(env, fault) -> None:
    """A holder, a duplicate parked behind it, and ``fault`` armed on the claim (the full ACQUIRE with
    the waiter's entry) before the holder ends: each call runs once, in turn, and nothing twice."""
    claim = sha_of(scripts.ACQUIRE)
    k = new_key()
    holder = env.inline.delay(k, 1.0, "holder")
    started(env, k)
    dup = env.inline.delay(k, 0.1, "dup")
    lock_key = env.inline.lock_key_for((k,), {})
    wait_until(lambda: env.locks.client(2).llen(layout.line(lock_key)) == 1, TIMEOUT, what="the duplicate to park")
    fault(claim)
    _both_ran_once_in_turn(env, k, holder, dup, claim, "the claim")


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_turns_claim_whose_reply_is_lost_still_runs_the_call(env):
    """Redis ran the claim and its reply was lost; the client sent it again. The second send found the
    key held by the waiter's own token and answered "entry gone": the call was dropped as already run,
    and stayed WAITING for ever."""
    _turn_with_claim_faulted(env, lambda claim: env.proxy.arm(claim, 1))


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_turns_claim_that_meets_a_dead_connection_twice_is_sent_again_as_the_turn(env):
    """The claim never reached Redis, twice (the client's own second send too): the call is sent again.
    That re-send lost its entry, parked as "already parked" and ended; nobody claimed the key reserved
    for it, and the call failed with LockWaitTimeout. The re-send now carries the entry, and claims."""
    _turn_with_claim_faulted(env, lambda claim: env.proxy.refuse(claim, 2))


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_turns_claim_whose_reply_comes_too_late_is_given_back_and_the_call_still_runs(env):
    """The claim took the key, but its reply came after a third of the TTL: the lock is given back (the
    key passes on) and the call sent again, with its entry. That copy finds its entry gone (its first
    try used it): it must not be dropped as "already ran", but wait in line again and run."""
    _turn_with_claim_faulted(env, lambda claim: env.proxy.delay(claim, 1.5, 1))  # (the lock TTL is 3 s)


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("fault", ["refused", "reply_lost"])
def test_a_park_that_fails_twice_is_sent_again_and_runs_once_in_turn(env, fault):
    """The duplicate's PARK fails twice (the client's own second send too): it never reached Redis
    (``refused``), or Redis ran it and the reply was lost (``reply_lost``). The call is sent again, as
    when its acquire cannot reach Redis: it parks (or finds itself parked already) and runs once,
    after the holder. It used to fail with LockBackendUnavailable: a call lost."""
    park = sha_of(line_scripts.PARK)
    k = new_key()
    holder = env.inline.delay(k, 1.0, "holder")
    started(env, k)
    (env.proxy.refuse if fault == "refused" else env.proxy.arm)(park, 2)
    dup = env.inline.delay(k, 0.1, "dup")
    _both_ran_once_in_turn(env, k, holder, dup, park, "the PARK")


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_coalescing_turn_that_cannot_read_its_merged_calls_is_sent_again_and_covers_them(env):
    """A coalescing waiter's turn took the key, then could not read the calls merged into it (the read
    met a dead connection twice): it used to fail with LockBackendUnavailable, the call lost and the
    merged call WAITING for ever. It is sent again, takes the key back, and its run covers both."""
    take = sha_of(dedupe.TAKE_MERGED)
    k = new_key()
    holder = env.merging.delay(k, 1.0, "holder")
    started(env, k)
    lock_key = env.merging.lock_key_for((k,), {})
    waiter = env.merging.delay(k, 0.1, "waiter")
    wait_until(lambda: env.locks.client(2).llen(layout.line(lock_key)) == 1, TIMEOUT, what="the waiter to park")
    merged = env.merging.delay(k, 0.1, "merged")
    wait_until(lambda: (state_of(merged), (merged.backend.get_task_meta(merged.id, cache=False)["result"] or {})
                        .get("merged_into")) == ("WAITING", waiter.id), TIMEOUT, what="the call to merge")
    env.proxy.refuse(take, 2)
    assert holder.get(timeout=TIMEOUT)["tag"] == "holder"
    covering = waiter.get(timeout=TIMEOUT)
    assert merged.get(timeout=TIMEOUT) == covering  # the one run's value, for both calls
    assert env.proxy.left(take) == 0, "the read was not refused: the test did not run its fault"
    done = runs(env, k)
    assert sorted(r["tag"] for r in done) == ["holder", "merged"], done  # one run, with the latest arguments
    assert_no_overlap([(r["start"], r["end"]) for r in done])
    quiet_then_check(env, k, 2)


# -- 6. a slot waiter's claim faulted (woken in its slot, it claims the key reserved for it) ---------


def _slot_with_claim_faulted(env, fault) -> list[dict]:
    """A holder, a duplicate waiting in its worker slot behind it, and ``fault`` armed on the claim
    (the ACQUIRE with the waiter's entry, the next ACQUIRE sent) before the holder ends: each call
    runs once, in turn, nothing twice, and the key is not left reserved for nobody (the next call runs)."""
    claim = sha_of(scripts.ACQUIRE)
    k, holder, dup = _waiting_in_its_slot(env, env.slot, 0.6, 0.1)
    fault(claim)
    assert holder.get(timeout=TIMEOUT)["tag"] == "holder"
    assert dup.get(timeout=TIMEOUT)["tag"] == "dup"
    assert env.proxy.left(claim) == 0, "the claim was not faulted: the test did not run its fault"
    after = env.slot.delay(k, 0.1, "after")
    assert after.get(timeout=TIMEOUT)["tag"] == "after"
    done = once_each(env, k, [holder, dup, after], ["holder", "dup", "after"])
    assert_no_overlap([(r["start"], r["end"]) for r in done])
    quiet_then_check(env, k, 3)
    return done


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_slot_claim_whose_reply_is_lost_still_runs_the_call(env):
    """Redis ran the slot waiter's claim and its reply was lost; the client sent it again, and the
    second send must answer as the first did: the waiter runs, once."""
    _slot_with_claim_faulted(env, lambda claim: env.proxy.arm(claim, 1))


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_slot_claim_that_meets_a_dead_connection_twice_is_sent_again_with_its_entry(env):
    """The slot waiter's claim never reached Redis, twice (the client's own second send too): the call
    is sent again. That re-send carried no entry: it found the key reserved for its own entry, parked
    anew, and the key stayed reserved for nobody until the reservation ran out. The re-send now
    carries its entry, and claims at once."""
    done = _slot_with_claim_faulted(env, lambda claim: env.proxy.refuse(claim, 2))
    by_tag = {r["tag"]: r for r in done}
    late = by_tag["dup"]["start"] - by_tag["holder"]["end"]
    # its re-send comes after at most lock_retry_backoff_max (1 s); a reservation runs out after the
    # TTL (3 s). 1.5 s of tolerance for a loaded machine still tells the two apart.
    assert late < 2.5, f"the waiter ran {late:.2f} s after the holder: it waited for its reservation to run out"
