"""The hot-key fast path at the engine, against a real redis-server: a task waiting in its worker slot
is woken by the release that hands it the key (no message), and a short hold sends the task second in
line ahead of its turn, to wait in a slot for it (``lock_wait_in_slot``)."""

from __future__ import annotations

import uuid

import pytest

from celery_singleton_lock.engine import layout, line_scripts
from celery_singleton_lock.engine import line as queue
from celery_singleton_lock.engine.lock import Lock
from celery_singleton_lock.engine.server import LockServer

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def server(redis_server):
    s = LockServer.from_url(redis_server.url(2))
    yield s
    s.close()


def _key() -> str:
    return f"slot:{{{uuid.uuid4().hex}}}"


def _state(server: LockServer, key: str, entry: str) -> str:
    record = server.client.hget(layout.waiters(key), entry)
    return "" if record is None else layout.Waiter.parse(record).state


def _park(server, key, owner, block=0.0, first=False, again=False, token=""):
    entry = queue.entry_for(owner)
    assert queue.park(server, key, entry, kind="t", wait=30, ttl=5, owner_id=owner, message=b"m-" + owner.encode(),
                      block=block, first=first, again=again, token=token)
    return entry


def test_a_release_makes_the_key_the_slot_waiters_own_and_its_wake_up_carries_the_fence(server):
    """A slot waiter that parked with its token is not woken to claim: the release makes the key its
    own (its token, a newer fence, its metadata), takes it out of the line with a tombstone, and sends
    nothing. The waiter's lock is then an ordinary one."""
    key = _key()
    holder = server.acquire(key, 5, owner_id="holder")
    entry = _park(server, key, "w1", block=5.0, token="tok1")
    before = holder.fencing_token  # (drawn now, while held: a fresh lock draws it when first read)
    released = server.release(holder)
    assert released.status == 1 and released.handoffs == ()
    seen = server.holder(key)
    assert seen is not None and seen.owner_id == "w1" and seen.fencing_token > before
    assert server.client.get(key).startswith(b"tok1 ")
    assert _state(server, key, entry) == "" and queue.line(server, key) == []
    assert server.client.zscore(layout.gone(key), entry) is not None  # a redelivery of it finds TOOK_ITS_TURN
    got = queue.wait_in_slot(server, key, entry, 1.0, "tok1")
    assert got == queue.Handed(seen.fencing_token)
    lock = Lock(server, key, "tok1", got.fence, 5, "w1")
    assert lock.renew() and server.release(lock).status == 1 and server.holder(key) is None


def test_a_missed_wake_up_of_a_direct_hand_over_is_found_when_the_wait_ends(server):
    """The wake-up's reply was lost (its read cut short): when the waiter stops waiting, the lock's value
    (its token) says the key is its own, with the fence, however often that look is sent (its own reply
    lost too); it is not taken for a task whose turn went as a message."""
    key = _key()
    holder = server.acquire(key, 5, owner_id="holder")
    entry = _park(server, key, "w1", block=5.0, token="tok1")
    server.release(holder)
    assert server.client.delete(layout.wake(key, entry)) == 1  # as if its BLPOP popped it and the reply was lost
    fence = server.holder(key).fencing_token
    assert queue.wait_in_slot(server, key, entry, 0.01, "tok1") == queue.Handed(fence)
    assert queue.wait_in_slot(server, key, entry, 0.01, "tok1") == queue.Handed(fence)  # sent again: the same


def test_a_wake_up_not_read_before_the_wait_ended_is_found_there(server):
    """The hand-off landed after its BLPOP timed out and before it said so: the fence is still in its
    wake-up list, and the end of the wait takes it."""
    key = _key()
    holder = server.acquire(key, 5, owner_id="holder")
    entry = _park(server, key, "w1", block=5.0, token="tok1")
    server.release(holder)
    got = server.run(line_scripts.UNBLOCK, server.keys_for(key), (entry, "tok1"))
    assert got[0] == 3 and int(got[1]) == server.holder(key).fencing_token


def test_a_direct_hand_over_whose_lock_ran_out_before_the_waiter_learnt_of_it_is_told_apart(server):
    """A waiter stopped for longer than the lock's TTL after it was handed the key: its wake-up and its
    lock are gone, and only the tombstone says it was handed the key (its call is then sent again);
    a waiter timed out of the line is not mistaken for it."""
    key = _key()
    holder = server.acquire(key, 5, owner_id="holder")
    entry = _park(server, key, "w1", block=5.0, token="tok1")
    server.release(holder)
    server.client.delete(layout.wake(key, entry), key)  # both ran out
    assert queue.wait_in_slot(server, key, entry, 0.01, "tok1") == queue.LAPSED
    other = _key()
    server.acquire(other, 5, owner_id="holder2")
    entry = _park(server, other, "w2", block=5.0, token="tok2")
    assert queue.leave(server, other, entry) is False  # left the line (revoked): an ordinary tombstone
    assert queue.wait_in_slot(server, other, entry, 0.01, "tok2") == queue.SENT


def test_a_park_sent_again_after_its_reply_was_lost_still_waits_in_its_slot(server):
    """The PARK ran and its reply was lost; the client sends it again: it is told it is parked (its own
    mark carries its token), not "parked already", which would end the delivery and leave the key to
    be made the owner of a token nobody holds."""
    key = _key()
    server.acquire(key, 5, owner_id="holder")
    entry = queue.entry_for("w1")
    args = dict(kind="t", wait=30, ttl=5, owner_id="w1", message=b"m", block=5.0, token="tok1")
    assert queue.park(server, key, entry, **args) == 1
    again = queue.park(server, key, entry, **args)
    assert again == 1 and not isinstance(again, queue.AlreadyParked)
    other = queue.park(server, key, entry, **{**args, "token": "tok2"})  # a redelivery (another token)
    assert isinstance(other, queue.AlreadyParked)


def test_a_fence_left_from_an_earlier_hand_off_is_not_taken_by_a_later_wait_of_the_same_entry(server):
    key = _key()
    holder = server.acquire(key, 5, owner_id="holder")
    entry = _park(server, key, "w1", block=5.0, token="tok1")
    server.release(holder)  # the fence waits in its wake-up list; nobody reads it
    server.client.delete(key)  # (an operator's release)
    server.acquire(key, 5, owner_id="another")
    entry = _park(server, key, "w1", block=5.0, token="tok2", again=True)  # its call, sent again, parks
    assert queue.wait_in_slot(server, key, entry, 0.01, "tok2") == queue.PARKED


def test_a_retried_release_after_a_direct_hand_over_counts_as_deleted(server):
    """The release's reply was lost after it made the key a slot waiter's own: its retry is told
    "deleted" (not "another holds it", which would report the lock lost)."""
    key = _key()
    holder = server.acquire(key, 5, owner_id="holder")
    _park(server, key, "w1", block=5.0, token="tok1")
    assert server.release(holder).status == 1
    assert server.release(holder, again=True).status == 1
    assert server.client.get(key).startswith(b"tok1 ")


def test_a_short_hold_after_a_direct_hand_over_sends_the_next_in_line_ahead(server):
    key = _key()
    holder = server.acquire(key, 5, owner_id="holder")
    _park(server, key, "w1", block=5.0, token="tok1")
    second = _park(server, key, "w2")
    released = server.release(holder, presend=5.0)
    assert [(h.what, h.entry) for h in released.handoffs] == [("next", second)]
    assert _state(server, key, second) == "n"


def test_a_release_wakes_a_slot_waiter_and_sends_nothing(server):
    key = _key()
    holder = server.acquire(key, 5, owner_id="holder")
    entry = _park(server, key, "w1", block=5.0)
    assert _state(server, key, entry) == "b"
    released = server.release(holder)
    assert released.status == 1 and released.handoffs == ()  # no message to send
    assert _state(server, key, entry) == "w"
    assert queue.wait_in_slot(server, key, entry, 1.0) == queue.WOKEN
    got = server.acquire(key, 5, owner_id="w1", entry=entry)
    assert isinstance(got, Lock)
    got.release()


def test_a_slot_waiter_that_stops_waiting_is_parked_and_later_sent(server):
    key = _key()
    holder = server.acquire(key, 5, owner_id="holder")
    entry = _park(server, key, "w1", block=0.05)
    assert queue.wait_in_slot(server, key, entry, 0.05) == queue.PARKED
    assert _state(server, key, entry) == "p"
    released = server.release(holder)
    assert [(h.what, h.entry) for h in released.handoffs] == [("run", entry)]


def test_a_hand_off_after_the_slot_mark_ran_out_sends_the_message(server):
    """The waiter's process died while it waited in its slot: its mark runs out, and the release sends
    its message as for any parked task (nothing is lost)."""
    key = _key()
    holder = server.acquire(key, 5, owner_id="holder")
    entry = _park(server, key, "w1", block=0.01)
    server.client.delete(layout.blocking(key, entry))  # as if it ran out
    released = server.release(holder)
    assert [(h.what, h.entry) for h in released.handoffs] == [("run", entry)]
    assert queue.wait_in_slot(server, key, entry, 0.01) == queue.SENT  # a late look ends that delivery


def test_a_short_hold_sends_the_second_in_line_ahead_and_the_next_release_wakes_it(server):
    key = _key()
    holder = server.acquire(key, 5, owner_id="holder")
    first, second, third = (_park(server, key, o) for o in ("w1", "w2", "w3"))
    released = server.release(holder, presend=5.0)  # held for far less than 5 s
    assert [(h.what, h.entry) for h in released.handoffs] == [("run", first), ("next", second)]
    assert _state(server, key, second) == "n"
    running = server.acquire(key, 5, owner_id="w1", entry=first)  # w1's turn arrives
    assert isinstance(running, Lock)
    # w2's copy, sent ahead, finds the key held: it parks again at the head and waits in its slot
    assert _park(server, key, "w2", block=5.0, first=True, again=True)
    assert queue.line(server, key)[:2] == ["w2", "w3"]
    released = server.release(running, presend=5.0)
    assert [(h.what, h.entry) for h in released.handoffs] == [("next", third)]  # w2 is woken, not sent
    assert queue.wait_in_slot(server, key, second, 1.0) == queue.WOKEN


def test_a_long_hold_sends_nobody_ahead(server):
    key = _key()
    holder = server.acquire(key, 5, owner_id="holder")
    first = _park(server, key, "w1")
    _park(server, key, "w2")
    released = server.release(holder, presend=0.001)
    assert [(h.what, h.entry) for h in released.handoffs] == [("run", first)]


def test_a_copy_sent_ahead_whose_turn_comes_before_it_arrives_gets_the_key_kept_for_it(server):
    key = _key()
    holder = server.acquire(key, 5, owner_id="holder")
    first, second = _park(server, key, "w1"), _park(server, key, "w2")
    server.release(holder, presend=5.0)
    running = server.acquire(key, 5, owner_id="w1", entry=first)
    released = server.release(running)  # w2's copy is still on its way
    assert released.handoffs == ()  # nothing sent twice: the key is reserved for the copy
    assert _state(server, key, second) == "c"
    got = server.acquire(key, 5, owner_id="w2", entry=second)
    assert isinstance(got, Lock)
    got.release()


def test_a_copy_whose_turn_came_while_it_looked_claims_instead_of_parking_again(server):
    """A hand-off copy finds the key held, then the holder releases and hands the key to its entry before
    the copy parks again: the park says "claim it". (Before, the copy parked again and the key stayed
    reserved for an entry nobody was coming for, until the lock's TTL ran out: a 30 s stall.)"""
    key = _key()
    holder = server.acquire(key, 5, owner_id="holder")
    entry = _park(server, key, "w1")
    seen = server.acquire(key, 5, owner_id="w1", entry=entry)  # its copy looks: held
    assert not isinstance(seen, Lock)
    server.release(holder)  # the key is handed to w1's entry meanwhile
    assert queue.park(server, key, entry, kind="t", wait=30, ttl=5, owner_id="w1", message=b"m", first=True,
                      again=True) == queue.CLAIM
    got = server.acquire(key, 5, owner_id="w1", entry=entry)
    assert isinstance(got, Lock)
    got.release()


def test_a_park_sent_again_after_the_key_was_made_its_own_reads_its_wake_up(server):
    """PARK ran, its reply was lost, a release made the key the waiter's own, then the PARK was sent
    again: it is told to wait (the fence is in its wake-up list), and the entry is not parked a second
    time (its own release would otherwise hand it the key again: a second run)."""
    key = _key()
    holder = server.acquire(key, 5, owner_id="holder")
    entry = _park(server, key, "w1", block=5.0, token="tok1")
    server.release(holder)
    assert _park(server, key, "w1", block=5.0, token="tok1") == entry  # (asserts a truthy place)
    assert queue.line(server, key) == [] and _state(server, key, entry) == ""
    got = queue.wait_in_slot(server, key, entry, 1.0, "tok1")
    assert isinstance(got, queue.Handed) and server.client.get(key).startswith(b"tok1 ")


def test_another_delivery_of_a_slot_waiter_makes_it_an_ordinary_parked_task(server):
    """A copy of a slot waiter (sent again: another token) finds its entry still marked with the first
    delivery's token: that mark goes, so the release sends the entry's message instead of making a
    token nobody waits with any more the key's owner."""
    key = _key()
    holder = server.acquire(key, 5, owner_id="holder")
    entry = _park(server, key, "w1", block=5.0, token="tokA")
    again = queue.park(server, key, entry, kind="t", wait=30, ttl=5, owner_id="w1", message=b"m", block=5.0,
                       token="tokB")
    assert isinstance(again, queue.AlreadyParked)
    assert not server.client.exists(layout.blocking(key, entry))
    released = server.release(holder)
    assert [(h.what, h.entry) for h in released.handoffs] == [("run", entry)]


def test_a_redelivery_of_a_task_made_the_owner_in_its_slot_waits_rather_than_being_dropped(server):
    """A slot waiter made the key's owner ran in its own delivery; its worker died (acks_late): the
    broker's redelivery must not take the tombstone for "its turn's copy ran it". A turn taken by a
    message's claim still is."""
    key = _key()
    holder = server.acquire(key, 5, owner_id="holder")
    entry = _park(server, key, "w1", block=5.0, token="tok1")
    server.release(holder)  # the key is w1's (its holder then died, the lock still held)
    again = queue.park(server, key, entry, kind="s", wait=30, ttl=5, owner_id="w1", message=b"m", first=True,
                       redelivered=True)
    assert again == 1
    other = _key()
    holder = server.acquire(other, 5, owner_id="holder")
    entry = _park(server, other, "w2")
    server.release(holder)
    claimed = server.acquire(other, 5, owner_id="w2", entry=entry)  # its turn's message claimed it
    assert isinstance(claimed, Lock)
    assert queue.park(server, other, entry, kind="t", wait=30, ttl=5, owner_id="w2", message=b"m",
                      redelivered=True) == queue.TOOK_ITS_TURN


def test_a_slot_waiters_copy_sent_again_ends_if_its_entry_waits_or_its_turn_ran(app):
    """A slot waiter unsure of its fate sends its call again with its entry (SLOT): before trying the
    key, the copy ends if that entry still waits in line (its turn runs the call) or its turn's message
    copy took the key (a whole-millisecond tombstone), and goes on if it was made the key's owner in
    its slot (half a millisecond: nobody ran it) or the entry is unknown."""
    from celery.exceptions import Ignore

    from celery_singleton_lock import LockedTask
    from celery_singleton_lock.policies import slot_copy

    @app.task(base=LockedTask, bind=True, on_duplicate="retry", lock_wait_in_slot=1.0)
    def job(self, n):
        return n

    server = job.lock_server()
    key = _key()
    holder = server.acquire(key, 5, owner_id="holder")
    waiting = _park(server, key, "w1")
    with pytest.raises(Ignore):
        slot_copy(job, job.request, server, key, waiting, "")
    ran = _park(server, key, "w2")
    assert server.release(holder).handoffs  # w1's turn
    got = server.acquire(key, 5, owner_id="w1", entry=waiting)
    server.release(got)  # w2's turn
    assert isinstance(server.acquire(key, 5, owner_id="w2", entry=ran), Lock)  # its message copy took it
    with pytest.raises(Ignore):
        slot_copy(job, job.request, server, key, ran, "")
    other = _key()
    holder = server.acquire(other, 5, owner_id="holder")
    direct = _park(server, other, "w3", block=5.0, token="tok3")
    server.release(holder)  # made w3's own in its slot
    slot_copy(job, job.request, server, other, direct, "tok3")  # goes on (nothing raised)
    slot_copy(job, job.request, server, other, queue.entry_for("nobody"), "")  # never parked: goes on
    assert queue.stop_waiting(server, other, queue.entry_for("nobody")) == queue.UNKNOWN
    # its first delivery still marked as waiting in its slot (it parked, its reply was lost, and it sent
    # its call again at once): the copy ends that wait, so the release sends the entry's message rather
    # than make its token, which nobody waits with, the key's owner; a key without a hash tag too
    plain = f"slot-plain-{uuid.uuid4().hex}"
    holder = server.acquire(plain, 5, owner_id="holder")
    marked = _park(server, plain, "w4", block=5.0, token="tok4")
    with pytest.raises(Ignore):
        slot_copy(job, job.request, server, plain, marked, "tok4")
    assert [(h.what, h.entry) for h in server.release(holder).handoffs] == [("run", marked)]


def test_a_redelivery_of_a_task_running_after_a_direct_hand_over_waits_as_its_copy(server):
    """An acks_late redelivery of a slot waiter that was made the owner and still runs: it parks as a
    copy of the running task (kind "s"), dropped when that run succeeds, so it never runs twice; once
    the run succeeded (its done record), a redelivery is told its turn was taken."""
    key = _key()
    holder = server.acquire(key, 5, owner_id="holder")
    entry = _park(server, key, "w1", block=5.0, token="tok1")
    server.release(holder)
    got = queue.wait_in_slot(server, key, entry, 1.0, "tok1")
    running = Lock(server, key, "tok1", got.fence, 5, "w1")
    assert queue.park(server, key, entry, kind="t", wait=30, ttl=5, owner_id="w1", message=b"m",
                      redelivered=True) == 1
    assert layout.Waiter.parse(server.client.hget(layout.waiters(key), entry)).kind == "s"
    released = server.release(running, succeeded=True, remember=60)
    assert released.status == 1 and released.handoffs == ()  # the copy was dropped, nothing handed
    assert queue.line(server, key) == []
    assert queue.park(server, key, entry, kind="t", wait=30, ttl=5, owner_id="w1", message=b"m",
                      redelivered=True) == queue.TOOK_ITS_TURN


def test_a_hand_off_made_for_another_delivery_of_the_same_entry_is_left_to_it(server):
    """Two deliveries of one call wait in their slots under the same entry (the lock Redis lost its
    data, and the sweeper's copy of the lost park parked again in the original's place, with a token of
    its own). The release makes the key the later one's; the wake-up says whose it is, so the delivery
    that reads it first but holds another token ends (SENT: the other one runs the call) rather than
    running beside it, and the rightful one still finds its hand-off when its wait ends, also if the
    other one's end of the wait (UNBLOCK) popped the wake-up first."""
    key = _key()
    holder = server.acquire(key, 5, owner_id="holder")
    entry = _park(server, key, "w1", block=5.0, token="original")
    _park(server, key, "w1", block=5.0, token="recovered", again=True)  # the same entry, parked anew
    server.release(holder)
    fence = server.holder(key).fencing_token
    assert server.client.get(key).startswith(b"recovered ")
    assert queue.wait_in_slot(server, key, entry, 0.5, "original") == queue.SENT
    assert server.client.lrange(layout.wake(key, entry), 0, -1) == [f"{fence} recovered".encode()]  # put back
    assert 0 < server.client.pttl(layout.wake(key, entry)) <= server.client.pttl(key)
    assert queue.wait_in_slot(server, key, entry, 0.01, "recovered") == queue.Handed(fence)

    key = _key()  # the same, where the wrong delivery's wait ended (UNBLOCK) while the wake-up was there
    holder = server.acquire(key, 5, owner_id="holder")
    entry = _park(server, key, "w1", block=5.0, token="original")
    _park(server, key, "w1", block=5.0, token="recovered", again=True)
    server.release(holder)
    fence = server.holder(key).fencing_token
    assert queue.stop_waiting(server, key, entry, "original") == queue.SENT
    assert server.client.lrange(layout.wake(key, entry), 0, -1) == [f"{fence} recovered".encode()]  # put back
    assert queue.wait_in_slot(server, key, entry, 1.0, "recovered") == queue.Handed(fence)


def test_the_end_of_a_wait_leaves_alone_another_delivery_that_waits_in_its_place(server):
    """The first delivery's wait ends (UNBLOCK) while the delivery that parked in its place since waits in
    its slot: the first one ends (SENT), and the other one's wait goes on: the release still hands the
    key to it in its slot, with no message."""
    key = _key()
    holder = server.acquire(key, 5, owner_id="holder")
    entry = _park(server, key, "w1", block=5.0, token="original")
    _park(server, key, "w1", block=5.0, token="recovered", again=True)
    assert queue.stop_waiting(server, key, entry, "original") == queue.SENT
    assert _state(server, key, entry) == "b"
    assert server.client.get(layout.blocking(key, entry)).startswith(b"recovered ")
    released = server.release(holder)
    assert released.handoffs == ()  # nothing sent: handed in its slot
    assert queue.wait_in_slot(server, key, entry, 1.0, "recovered") == queue.Handed(server.holder(key).fencing_token)
