"""Slot waiters and turns whose replies are lost or faulted, through real prefork workers and a real
broker (sections 4-6 of the slot-waiter fault tests): a reply lost at UNBLOCK (and at the wake-up), a
turn's claim faulted (a waiter with no slot wait: its turn comes as a message), a park that fails
twice, a coalescing turn that cannot read its merged calls, and a slot waiter's claim faulted.

Two worker nodes (prefork, 2 children each) run tests/apps/slot_faults_app.py, the lock Redis behind
the fault proxy. Bodies journal each start and end: the tests count runs per call.
"""

from __future__ import annotations

import pytest
from _clusters import new_key, runs, started, state_of
from _fault_proxy import sha_of
from _slot_faults_support import TIMEOUT, _waiting_in_its_slot, in_slot, once_each, quiet_then_check
from _task_support import assert_no_overlap

from celery_singleton_lock.engine import dedupe, layout, line_scripts, scripts
from celery_singleton_lock.testing.servers import wait_until

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
