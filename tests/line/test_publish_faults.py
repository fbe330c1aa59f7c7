"""``lock_publish="join"`` when a call's own calls to the lock Redis could not reach it, through real
prefork workers and a real broker (the line's worker cluster, the lock Redis behind the fault proxy
that refuses the chosen calls): a mark its delivery could not delete, a lock its run could not release.
A later publish must never join the finished call, whose work would then never run."""

from __future__ import annotations

import time

import pytest
from _clusters import new_key, runs
from _fault_proxy import sha_of
from _task_support import assert_no_overlap

from celery_singleton_lock.engine import dedupe, scripts
from celery_singleton_lock.testing.servers import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

TIMEOUT = 40
QUIET = 2.0  # after the last run: long enough for a late twin to run


def ran_once_each(env, key, calls, tags):
    """Every call ended; the bodies that ran are ``tags``, once each, and none overlapped."""
    for call in calls:
        call.get(timeout=TIMEOUT)
    time.sleep(QUIET)
    done = runs(env, key)
    assert sorted(r["tag"] for r in done) == sorted(tags), done
    assert_no_overlap([(r["start"], r["end"]) for r in done])


def test_a_publish_mark_its_call_could_not_delete_is_not_joined_once_the_call_ended(env):
    """``lock_publish="join"``: a call's delivery could not delete its key's publish mark (the delete
    met a dead connection twice), and the call ran and ended. A later publish used to find the mark
    and join that finished call (for ``lock_publish_ttl``, 600 s): its own work never ran. The result
    backend says the marked call ended: the later publish passes over the mark and is a call of its own."""
    unmark = sha_of(dedupe.UNMARK)
    k = new_key()
    env.proxy.refuse(unmark, 2)
    first = env.joining.delay(k, 0.1, "first")
    first.get(timeout=TIMEOUT)
    assert env.proxy.left(unmark) == 0, "the mark's delete was not refused: the test did not run its fault"
    later = env.joining.delay(k, 0.1, "later")
    assert later.id != first.id, "a publish joined a call that had ended"
    ran_once_each(env, k, [first, later], ["first", "later"])


@pytest.mark.parametrize("lost", [False, True], ids=["", "second-publish-reply-lost"])
def test_a_lock_its_call_could_not_release_is_not_joined_once_the_call_ended(env, lost):
    """``lock_publish="join"``: a call ran and ended, and its release met a dead connection on both
    tries (the lock Redis restarting, say), so its lock stays until its TTL. A later publish used to find
    that lock, naming the call, and join it as "running": the later call's own work never ran. The
    result backend says the call ended: the later publish is a call of its own. With ``lost``, the
    reply of its second PUBLISH (the one passing over the ended call: only it carries that id) is lost;
    sent again, it answers as the first send did (marked), not "queued" with the later call's own id."""
    fresh_release, release = sha_of(scripts.RELEASE, keys=2), sha_of(scripts.RELEASE, keys=5)
    k = new_key()
    env.proxy.refuse(fresh_release, 1)
    env.proxy.refuse(release, 2)  # (a kept script is sent once more on a new connection)
    first = env.joining.delay(k, 0.1, "first")
    first.get(timeout=TIMEOUT)
    wait_until(lambda: env.proxy.left(fresh_release) + env.proxy.left(release) == 0, TIMEOUT,
               what="both tries of the release to be refused")
    assert env.locks.client(2).exists(env.joining.lock_key_for((k,), {})), "the lock was released: no fault"
    if lost:
        env.proxy.arm(first.id.encode(), 1)
    later = env.joining.delay(k, 0.1, "later")
    assert later.id != first.id, "a publish joined a call that had ended"
    assert env.proxy.left(first.id.encode()) == 0, "the second PUBLISH's reply was not lost: no fault"
    ran_once_each(env, k, [first, later], ["first", "later"])
