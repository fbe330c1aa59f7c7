"""A lost reply at every script the task side sends, through real prefork workers and a real broker.

The fault proxy in front of the lock Redis lets Redis run the next call of one script, drops its
reply and resets the connection; the client then sends it again (a script kept under its request id
answers as the first send did) or treats it as failed (a renewal: the next round renews). Each test
runs one piece of traffic on one key with that fault armed, and checks what users rely on: every
call ends in a final state, each call that should run ran once, no two bodies overlapped, nothing
ran late twice, and an errback fired once where a call failed. Each also checks that the fault
happened (the reply was dropped), so none passes vacuously.
"""

from __future__ import annotations

import os
import signal
import socket
import time
import uuid

import pytest
from _clusters import new_key, runs, started, starts, state_of
from _fault_proxy import sha_of
from _slot_faults_support import in_slot
from _task_support import assert_no_overlap

from celery_singleton_lock.delivery.headers import Turn
from celery_singleton_lock.engine import dedupe, layout, line_scripts, scripts
from celery_singleton_lock.engine import line as queue
from celery_singleton_lock.exceptions import LockWaitTimeout
from celery_singleton_lock.testing.servers import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

TIMEOUT = 40
QUIET = 2.0  # after the last run: long enough for a late twin (a re-send, a recovered copy) to run


def parked(env, task, key, count=1):
    lock_key = task.lock_key_for((key,), {})
    wait_until(lambda: env.locks.client(2).llen(layout.line(lock_key)) >= count, TIMEOUT,
               what=f"{count} waiter(s) of {key} to park")


def waiter_parked(env, task, hold: float) -> tuple:
    """A holder of a new key for ``hold`` s, started, and a waiter parked behind it: (key, holder, waiter)."""
    k = new_key()
    holder = task.delay(k, hold, "holder")
    started(env, k)
    waiter = task.delay(k, 0.1, "waiter")
    parked(env, task, k)
    return k, holder, waiter


def merged_behind(env, task, hold: float, wait: float) -> tuple:
    """A holder of a new key for ``hold`` s, a coalescing waiter (a ``wait`` s body) parked behind it, and
    a call merged into that waiter: (key, holder, waiter, merged)."""
    k = new_key()
    holder = task.delay(k, hold, "holder")
    started(env, k)
    waiter = task.delay(k, wait, "waiter")
    parked(env, task, k)
    merged = task.delay(k, 0.1, "merged")
    wait_until(lambda: (task.backend.get_task_meta(merged.id, cache=False)["result"] or {}).get("merged_into")
               == waiter.id, TIMEOUT, what="the call to merge")
    return k, holder, waiter, merged


def checked(env, key, pattern, calls, ran, failed=()):
    """Every call final; the calls ``ran`` (by tag) each ran once and nothing else ran; the ``failed``
    ones failed with LockWaitTimeout and fired their errback once; no overlap; the fault happened."""
    for call in calls:
        if call in failed:
            with pytest.raises(LockWaitTimeout):
                call.get(timeout=TIMEOUT)
        else:
            call.get(timeout=TIMEOUT)
    assert env.proxy.left(pattern) == 0, "the reply was not dropped: the test did not run its fault"
    time.sleep(QUIET)
    done = runs(env, key)
    assert sorted(r["tag"] for r in done) == sorted(ran), [(r["tag"], r["headers"]) for r in done]
    assert len(env.journal.lrange(f"started:{key}", 0, -1)) == len(ran)  # and no run began twice
    assert_no_overlap([(r["start"], r["end"]) for r in done])
    for call in failed:
        assert env.journal.lrange(f"errbacks:{call.id}", 0, -1) == [b"LockWaitTimeout"]
    return done


@pytest.mark.parametrize("script", ["fresh ACQUIRE", "PARK", "ACQUIRE", "RELEASE", "CONFIRM", "RENEW_MANY"])
def test_a_line_of_waiters_with_one_reply_lost(env, script):
    """A holder (renewed once: 1.5 s against a 3 s TTL), two waiters parked behind it, each claiming
    its turn and releasing to the next: the reply of the first fresh acquire (a waiter's, which finds
    the key held), PARK, claim, release, hand-off's confirm or renewal after the holder started is lost."""
    text = {"fresh ACQUIRE": scripts.ACQUIRE, "PARK": line_scripts.PARK, "ACQUIRE": scripts.ACQUIRE,
            "RELEASE": scripts.RELEASE, "CONFIRM": line_scripts.CONFIRM, "RENEW_MANY": scripts.RENEW_MANY}[script]
    env.locks.client(2).script_load(text)  # (a script Redis has not seen answers NOSCRIPT first: nothing ran)
    # ACQUIRE's and RELEASE's calls by their number of keys: the fresh path's 2, the whole script's 5
    keys = {"fresh ACQUIRE": 2, "ACQUIRE": 5, "RELEASE": 5}.get(script, 0)
    pattern = sha_of(text, keys)
    k = new_key()
    errback = env.errback_log.s()
    holder = env.inline.apply_async((k, 1.5, "holder"), link_error=errback)
    started(env, k)
    env.proxy.arm(pattern, 1)
    first = env.inline.apply_async((k, 0.1, "first"), link_error=errback)
    parked(env, env.inline, k)
    second = env.inline.apply_async((k, 0.1, "second"), link_error=errback)
    done = checked(env, k, pattern, [holder, first, second], ["holder", "first", "second"])
    assert [r["tag"] for r in sorted(done, key=lambda r: r["start"])][0] == "holder"


def test_a_short_holds_release_that_lost_its_replies_twice_still_sends_the_call_it_sent_ahead(env):
    """A short hold's release hands the key to the first in line and sends the second ahead of its
    turn (to wait for it in a worker slot); the release's reply is lost twice (the client's own second
    send too), and the task's release tries again. That retry used to be answered with the hand-off
    alone: the call sent ahead was never sent, the key waited for it a lock TTL, and it failed at its
    deadline without running. The retry carries the first try's request id and gets its whole reply:
    every call runs once, in order."""
    release = sha_of(scripts.RELEASE)
    env.locks.client(2).script_load(scripts.RELEASE)  # (else the first send meets NOSCRIPT: nothing runs)
    task = env.slot  # lock_wait_in_slot=1.0: a hold under 1 s sends the second in line ahead
    k = new_key()
    holder = task.delay(k, 3.0, "holder")
    started(env, k)
    calls = []
    for tag in ("a", "b", "c"):  # one at a time: the line is a, b, c
        calls.append(task.delay(k, 0.5 if tag == "a" else 0.1, tag))
        parked(env, task, k, len(calls))
    wait_until(lambda: not in_slot(env, task, k), TIMEOUT, what="the waiters' slot waits to end (all parked)")
    wait_until(lambda: any(s["id"] == calls[0].id for s in starts(env, k)), TIMEOUT, what="the first waiter's run")
    env.proxy.arm(release, 2)  # its release: the first send and the client's second
    done = checked(env, k, release, [holder, *calls], ["holder", "a", "b", "c"])
    assert [r["tag"] for r in sorted(done, key=lambda r: r["start"])] == ["holder", "a", "b", "c"]


@pytest.mark.parametrize("script", ["PARK", "TAKE_MERGED"])
def test_a_coalesced_call_with_one_reply_lost(env, script):
    """A holder, a waiter, and a call merged into the waiter: the reply of the merge (a PARK that
    finds the waiter) or of the waiter's read of its merged calls is lost. One run covers both."""
    pattern = sha_of(line_scripts.PARK if script == "PARK" else dedupe.TAKE_MERGED)
    k, holder, waiter = waiter_parked(env, env.merging, 1.0)
    env.proxy.arm(pattern, 1)
    merged = env.merging.delay(k, 0.1, "merged")
    checked(env, k, pattern, [holder, waiter, merged], ["holder", "merged"])
    assert merged.get(timeout=TIMEOUT) == waiter.get(timeout=TIMEOUT)


@pytest.mark.parametrize("script", ["PUBLISH", "UNMARK"])
def test_a_joined_publish_with_one_reply_lost(env, script):
    """``lock_publish="join"``: a call published with a countdown (so it is not started yet), and a
    second publish that joins it; then, once it ran, a third publish, which is a call of its own. The
    reply of the first PUBLISH, or of the UNMARK at its start, is lost: no phantom call is joined."""
    pattern = sha_of(dedupe.PUBLISH if script == "PUBLISH" else dedupe.UNMARK)
    k = new_key()
    env.proxy.arm(pattern, 1)
    first = env.joining.apply_async((k, 0.1, "first"), countdown=1.0)
    joined = env.joining.delay(k, 0.1, "joined")
    assert joined.id == first.id  # it joined the call published and not yet started
    first.get(timeout=TIMEOUT)
    later = env.joining.delay(k, 0.1, "later")
    assert later.id != first.id
    checked(env, k, pattern, [first, later], ["first", "later"])


@pytest.mark.parametrize("script", ["RELEASE", "SWEEP", "INDEX_DUE", "INDEX_DONE"])
def test_a_cooldown_with_one_reply_lost(env, script):
    """``lock_cooldown``: the holder's release keeps the key 1 s, then the sweeper hands it to the
    waiter. The reply of that release, of the sweeper's next SWEEP, or of a sweeper's next lease of
    the keys due (INDEX_DUE) or report of its looks (INDEX_DONE) is lost."""
    pattern = sha_of({"RELEASE": scripts.RELEASE, "SWEEP": line_scripts.SWEEP, "INDEX_DUE": line_scripts.INDEX_DUE,
                      "INDEX_DONE": line_scripts.INDEX_DONE}[script])
    k, holder, waiter = waiter_parked(env, env.cooling, 0.5)
    env.proxy.arm(pattern, 1)
    done = checked(env, k, pattern, [holder, waiter], ["holder", "waiter"])
    by_tag = {r["tag"]: r for r in done}
    assert by_tag["waiter"]["start"] >= by_tag["holder"]["end"] + 1.0 - 0.1  # (0.1 s: the hosts' clocks)


def test_a_waiter_past_its_max_wait_with_the_sweeps_reply_lost(env):
    """``lock_max_wait`` 1.5 s behind a 4 s holder: the sweeper fails the waiter. The reply of the
    SWEEP that finds it expired is lost; sent again, it still names it: it ends LockWaitTimeout, its
    errback fires once, and it never runs."""
    pattern = sha_of(line_scripts.SWEEP)
    k = new_key()
    holder = env.impatient.delay(k, 4.0, "holder")
    started(env, k)
    waiter = env.impatient.apply_async((k, 0.1, "waiter"), link_error=env.errback_log.s())
    parked(env, env.impatient, k)
    # armed just before the waiter's deadline, so that the SWEEP whose reply is lost is the one that
    # finds it expired (an earlier one may pass the key over and find nothing to do)
    time.sleep(1.0)
    env.proxy.arm(pattern, 1)
    checked(env, k, pattern, [holder, waiter], ["holder"], failed=[waiter])


def test_the_fresh_release_with_its_reply_lost_is_not_a_lost_lock(env):
    """A holder with nobody behind it releases with the fresh release; its reply is lost and the
    release sent again: the run is not reported lost, and the next call takes the key at once."""
    pattern = sha_of(scripts.RELEASE, keys=2)  # its fresh path: the lock and its line
    k = new_key()
    env.proxy.arm(pattern, 1)
    holder = env.inline.delay(k, 0.1, "holder")
    holder.get(timeout=TIMEOUT)
    after = env.inline.delay(k, 0.1, "after")
    checked(env, k, pattern, [holder, after], ["holder", "after"])
    logs = "".join(w.log() for w in env.workers)
    assert f"was no longer held by task {holder.id}" not in logs  # its release was not taken for a lost lock


# -- a call that fails twice: the client's own second send fails too ------------------------------


def test_an_expired_coalescing_turn_that_cannot_read_its_merged_calls_fails_them_once(env):
    """A coalescing waiter times out in line (``lock_max_wait`` 1.5 s behind a 4 s holder) with a call
    merged into it; the turn that fails them cannot read the merged calls (the read meets a dead
    connection twice). It used to end with LockBackendUnavailable, its merged call WAITING for ever.
    It is sent again, still expired: both end LockWaitTimeout, each errback fires once, neither runs."""
    take = sha_of(dedupe.TAKE_MERGED)
    k = new_key()
    errback = env.errback_log.s()
    holder = env.merging_impatient.apply_async((k, 4.0, "holder"), link_error=errback)
    started(env, k)
    waiter = env.merging_impatient.apply_async((k, 0.1, "waiter"), link_error=errback)
    parked(env, env.merging_impatient, k)
    merged = env.merging_impatient.apply_async((k, 0.1, "merged"), link_error=errback)
    wait_until(lambda: (merged.backend.get_task_meta(merged.id, cache=False)["result"] or {}).get("merged_into")
               == waiter.id, TIMEOUT, what="the call to merge")
    env.proxy.refuse(take, 2)
    checked(env, k, take, [holder, waiter, merged], ["holder"], failed=[waiter, merged])


def test_a_revoked_waiter_whose_removal_replies_are_lost_ends_revoked(env):
    """A waiter is revoked; every worker takes it out of its line (LEAVE by task id), and each one's reply is
    lost twice (the client's own second send too): the first one removed it. A later look finds
    nothing, so the waiter used to stay WAITING for ever. The look is sent again with its request id,
    and answers as it did the first time: the waiter ends REVOKED, never runs, and the line moves on.

    Its line now empty, a sweeper drops the key from its index before the looks are tried again (done
    here at once, as a sweeper does within a second or so): the looks tried again used to list the
    index only, never asked that key again, and the waiter stayed WAITING (seen under load in CI)."""
    remove = sha_of(line_scripts.LEAVE)
    k = new_key()
    holder = env.inline.delay(k, 3.0, "holder")
    started(env, k)
    waiter = env.inline.delay(k, 0.1, "waiter")
    parked(env, env.inline, k)
    env.proxy.arm(remove, 4)  # two worker nodes, two sends each
    waiter.revoke()
    wait_until(lambda: env.proxy.left(remove) == 0, TIMEOUT, what="both nodes' first looks to lose their replies")
    index, lock_key = env.inline.lock_settings().index, env.inline.lock_key_for((k,), {})
    env.locks.client(2).zrem(index, lock_key)  # (the looks are tried again 2 s after they failed)
    wait_until(lambda: state_of(waiter) == "REVOKED", TIMEOUT, what="the revoked waiter to end REVOKED")
    after = env.inline.delay(k, 0.1, "after")
    checked(env, k, remove, [holder, after], ["holder", "after"])


def test_a_revoked_waiter_ends_revoked_when_the_worker_whose_removal_ran_stops_before_it_asks_again(env):
    """One worker's look takes the revoked waiter out of its line, and loses the reply twice; that worker
    stops before it asks again (stopped here, as a worker killed would be). Another worker's look comes
    after: it used to find nothing (the waiter had left the line), and the waiter stayed WAITING for ever.
    Every worker's look now carries the same request id, so the later one is answered as the first was:
    the waiter ends REVOKED, and never runs."""
    remove = sha_of(line_scripts.LEAVE)
    env.locks.client(2).script_load(line_scripts.LEAVE)  # (else the first send meets NOSCRIPT: nothing runs)
    first, second = (f"{w.nodename.split('@')[0]}@{socket.gethostname()}" for w in env.workers)
    k = new_key()
    holder = env.inline.delay(k, 2.0, "holder")
    started(env, k)
    waiter = env.inline.delay(k, 0.1, "waiter")
    parked(env, env.inline, k)
    env.proxy.arm(remove, 2)  # the first worker's send and its client's second send
    env.inline.app.control.revoke(waiter.id, destination=[first])
    wait_until(lambda: env.proxy.left(remove) == 0, TIMEOUT, what="the first worker's look to lose its replies")
    os.kill(env.workers[0].pid, signal.SIGSTOP)  # before it asks again (2 s later)
    try:
        env.inline.app.control.revoke(waiter.id, destination=[second])
        wait_until(lambda: state_of(waiter) == "REVOKED", TIMEOUT, what="the revoked waiter to end REVOKED")
    finally:
        os.kill(env.workers[0].pid, signal.SIGCONT)
    after = env.inline.delay(k, 0.1, "after")
    checked(env, k, remove, [holder, after], ["holder", "after"])


def test_a_revoked_coalescing_waiters_merged_call_whose_take_loses_its_replies_runs_once(env):
    """A coalescing waiter with a call merged into it is revoked: the merged call did not run, and goes
    again as it was. The worker that takes it (reads and forgets the waiter's merged calls, in one call)
    loses the take's reply twice (its client's own second send too); the other worker's take finds
    nothing. The look is tried again with the worker's own request id and is answered as its take was:
    the merged call is sent once and runs once, the waiter ends REVOKED and never runs."""
    take = sha_of(dedupe.TAKE_MERGED)
    env.locks.client(2).script_load(dedupe.TAKE_MERGED)  # (else the first send meets NOSCRIPT: nothing runs)
    k, holder, waiter, merged = merged_behind(env, env.merging, 2.0, 0.1)
    env.proxy.arm(take, 2)
    waiter.revoke()
    wait_until(lambda: state_of(waiter) == "REVOKED", TIMEOUT, what="the revoked waiter to end REVOKED")
    checked(env, k, take, [holder, merged], ["holder", "merged"])


@pytest.mark.parametrize("ending", ["ignored", "succeeded"])
def test_a_coalescing_run_whose_merged_calls_cannot_be_read_again_settles_or_sends_each_once(env, ending):
    """A coalescing waiter's run covers a call merged into it; when the run ends, reading the merged
    calls again meets a dead connection twice, and forgetting them twice too. The run ends:

    * ``succeeded``: the merged call is settled with the run's value. It used to be sent again as if
      not covered: it then found its old record ("merged into" the finished run) and waited for
      ever, or ran a second time;
    * ``ignored`` (neither success nor failure): the merged call is sent again, as it was. It used to
      find its old record and wait for ever; forgetting the records is now tried again first.
    """
    task = env.merging_ignored
    k, holder, waiter, merged = merged_behind(env, task, 1.0, 1.0)
    if ending == "ignored":
        env.journal.sadd("ignore-run", waiter.id)
    wait_until(lambda: any(s["id"] == waiter.id for s in starts(env, k)), TIMEOUT, what="the waiter's run")
    # the waiter's merged-call records name it: settling reads them (twice), then forgets them (twice)
    take = layout.merged(task.lock_key_for((k,), {}), waiter.id).encode()
    env.proxy.refuse(take, 4)
    later = task.delay(k, 1.0, "later")  # parks: the key is held when a call comes again
    assert holder.get(timeout=TIMEOUT)["tag"] == "holder"
    if ending == "succeeded":
        assert merged.get(timeout=TIMEOUT) == waiter.get(timeout=TIMEOUT)  # covered by the one run
    else:
        assert merged.get(timeout=TIMEOUT)["tag"] in ("merged", "later")  # its own run, or later's covering one
    later.get(timeout=TIMEOUT)
    assert env.proxy.left(take) == 0, "the reads were not refused: the test did not run its fault"
    time.sleep(QUIET)
    done = runs(env, k)
    assert sum(r["id"] == waiter.id for r in done) == 1, done
    if ending == "succeeded":
        assert not [r for r in done if r["id"] == merged.id], done  # covered: never run itself
    assert_no_overlap([(r["start"], r["end"]) for r in done])


def test_a_recovered_copy_whose_call_ran_elsewhere_is_dropped_even_if_its_release_fails(env):
    """A recovered copy of a waiting call (sent again by a sweeper after the lock Redis lost its data)
    looks: its call has not run; it takes the key; meanwhile its call ran elsewhere (a hook stores its
    SUCCESS right after the look). Under the lock it looks again, gives the key back and is dropped.
    That release met a dead connection twice: it used to raise, so the call's errback fired and a
    failure was reported for a call that succeeded. It is dropped quietly; the next call runs."""
    release = sha_of(scripts.RELEASE)
    k, task_id = new_key(), uuid.uuid4().hex
    env.journal.sadd("run-elsewhere", task_id)
    env.proxy.refuse(release, 2)
    turn = Turn(entry="e-copy", why="recovered", copy="c1", parked_at=time.time() - 5)
    copy = env.inline.apply_async((k, 0.1, "copy"), task_id=task_id, link_error=env.errback_log.s(),
                                  headers=turn.header())
    wait_until(lambda: env.proxy.left(release) == 0, TIMEOUT, what="the copy's release")
    after = env.inline.delay(k, 0.1, "after")
    checked(env, k, release, [after], ["after"])
    assert copy.get(timeout=TIMEOUT) == {"tag": "elsewhere"}  # the call's own success, kept
    assert env.journal.lrange(f"errbacks:{task_id}", 0, -1) == []


@pytest.mark.parametrize("fault", ["refused", "reply_lost"])
def test_a_turn_past_its_max_wait_that_cannot_leave_its_place_fails_once(env, fault):
    """A waiting call's copy (sent ahead of its turn) comes back past ``lock_max_wait`` and finds the key
    held: it gives up its place (LEAVE) and fails with LockWaitTimeout. Giving it up failed twice (the
    client's own second send too): it never reached Redis (``refused``), or Redis ran it and both
    replies were lost (``reply_lost``). It used to fail with LockBackendUnavailable, its place maybe
    left in line. It tries again in place with the same request id (a LEAVE that ran answers as it
    did), and fails once with LockWaitTimeout (its errback once); it never runs."""
    leave = sha_of(line_scripts.LEAVE)
    k = new_key()
    errback = env.errback_log.s()
    holder = env.inline.delay(k, 2.0, "holder")
    started(env, k)
    waiter = env.inline.apply_async((k, 0.1, "waiter"), link_error=errback)
    parked(env, env.inline, k)
    (env.proxy.refuse if fault == "refused" else env.proxy.arm)(leave, 2)
    late = Turn(entry=queue.entry_for(waiter.id), why="run", parked_at=time.time() - 60)  # (max wait 20 s)
    env.inline.apply_async((k, 0.1, "waiter"), task_id=waiter.id, link_error=errback, headers=late.header())
    checked(env, k, leave, [holder, waiter], ["holder"], failed=[waiter])
