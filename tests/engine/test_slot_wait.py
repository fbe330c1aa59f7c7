"""The hot-key fast path at the engine, against a real redis-server: a task waiting in its worker slot
is woken by the release that reserves the key for it, and claims it (no message), and a short hold
sends the task second in line ahead of its turn, to wait in a slot for it (``lock_wait_in_slot``)."""

from __future__ import annotations

import time
import uuid

import pytest

from celery_singleton_lock.engine import layout
from celery_singleton_lock.engine import line as queue
from celery_singleton_lock.engine.lock import Lock, Release
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


def _park(server, key, owner, block=0.0, first=False, again=False):
    entry = queue.entry_for(owner)
    assert queue.park(server, key, entry, kind="t", wait=30, ttl=5, owner_id=owner, message=b"m-" + owner.encode(),
                      block=block, first=first, again=again).found is queue.Park.PARKED
    return entry


def test_a_release_wakes_a_slot_waiter_and_sends_nothing(server):
    key = _key()
    holder = server.acquire(key, 5, owner_id="holder")
    entry = _park(server, key, "w1", block=5.0)
    assert _state(server, key, entry) == "p" and server.client.exists(layout.blocking(key, entry))  # in its slot
    released = server.release(holder)
    assert released.status is Release.DELETED and released.handoffs == ()  # no message to send
    assert _state(server, key, entry) == "p" and not server.client.exists(layout.blocking(key, entry))
    assert server.holder(key).reserved  # woken: the key is reserved for it
    assert queue.wait_in_slot(server, key, entry, 1.0) is queue.Slot.WOKEN
    got = server.acquire(key, 5, owner_id="w1", entry=entry)
    assert isinstance(got, Lock)
    got.release()

def test_a_slot_waiter_that_stops_waiting_is_parked_and_later_sent(server):
    key = _key()
    holder = server.acquire(key, 5, owner_id="holder")
    entry = _park(server, key, "w1", block=0.05)
    assert queue.wait_in_slot(server, key, entry, 0.05) is queue.Slot.PARKED
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
    assert queue.wait_in_slot(server, key, entry, 0.01) is queue.Slot.SENT  # a late look ends that delivery

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
    assert queue.wait_in_slot(server, key, second, 1.0) is queue.Slot.WOKEN

def test_a_long_hold_sends_nobody_ahead(server):
    key = _key()
    holder = server.acquire(key, 5, owner_id="holder")
    first = _park(server, key, "w1")
    _park(server, key, "w2")
    holder.acquired_at -= 10.0  # held 10 s longer than it was, as far as the release measures it
    released = server.release(holder, presend=5.0)  # (a "presend=0.001" passed or not with the VM's speed)
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
                      again=True) == queue.Parked(queue.Park.CLAIM)
    got = server.acquire(key, 5, owner_id="w1", entry=entry)
    assert isinstance(got, Lock)
    got.release()

def test_a_wake_up_whose_read_was_lost_is_found_when_the_wait_ends(server):
    """The wake-up was popped but its reply lost (or it landed as the wait timed out): when the waiter
    stops waiting, its record says it was woken: it claims the key, however often that look is sent."""
    key = _key()
    holder = server.acquire(key, 5, owner_id="holder")
    entry = _park(server, key, "w1", block=5.0)
    server.release(holder)
    assert server.client.delete(layout.wake(key, entry)) == 1  # as if its BLPOP popped it and the reply was lost
    assert queue.stop_waiting(server, key, entry) is queue.Slot.WOKEN
    assert queue.stop_waiting(server, key, entry) is queue.Slot.WOKEN  # looked at again: the same
    assert isinstance(server.acquire(key, 5, owner_id="w1", entry=entry), Lock)


def test_a_wake_up_left_from_an_earlier_hand_off_is_not_taken_by_a_later_wait_of_the_same_entry(server):
    key = _key()
    holder = server.acquire(key, 5, owner_id="holder")
    entry = _park(server, key, "w1", block=5.0)
    server.release(holder)  # the wake-up waits in its list; nobody reads it
    assert isinstance(server.acquire(key, 5, owner_id="w1", entry=entry), Lock)  # claimed all the same
    entry = _park(server, key, "w1", block=5.0, again=True)  # its call, sent again, parks behind itself
    assert queue.wait_in_slot(server, key, entry, 0.01) is queue.Slot.PARKED


def test_a_short_hold_after_a_slot_wake_up_sends_the_next_in_line_ahead(server):
    key = _key()
    holder = server.acquire(key, 5, owner_id="holder")
    _park(server, key, "w1", block=5.0)
    second = _park(server, key, "w2")
    released = server.release(holder, presend=5.0)
    assert [(h.what, h.entry) for h in released.handoffs] == [("next", second)]
    assert _state(server, key, second) == "n"


def test_a_claim_in_the_slot_leaves_no_tombstone_so_a_redelivery_waits_as_a_copy_of_the_run(server):
    """A slot waiter that claimed the key runs in its own delivery; if its worker dies (acks_late), the
    broker's redelivery must not be told "its turn's copy ran it": it waits as a copy of the running
    task (kind "s"), dropped when that run succeeds. A turn claimed by its message's copy is different:
    a redelivery of the parked message is told its turn was taken."""
    key = _key()
    holder = server.acquire(key, 5, owner_id="holder")
    entry = _park(server, key, "w1", block=5.0)
    server.release(holder)
    assert queue.wait_in_slot(server, key, entry, 1.0) is queue.Slot.WOKEN
    running = server.acquire(key, 5, owner_id="w1", entry=entry, slot_claim=True)  # its first delivery
    assert isinstance(running, Lock)
    assert server.client.zscore(layout.gone(key), entry) is None
    assert not server.client.exists(layout.blocking(key, entry))
    assert queue.park(server, key, entry, kind="s", wait=30, ttl=5, owner_id="w1", message=b"m", first=True,
                      redelivered=True).place == 1
    assert layout.Waiter.parse(server.client.hget(layout.waiters(key), entry)).kind == "s"
    released = server.release(running, succeeded=True, remember=60)
    assert released.status is Release.DELETED and released.handoffs == ()  # the copy was dropped, nothing handed
    assert queue.line(server, key) == []
    other = _key()
    holder = server.acquire(other, 5, owner_id="holder")
    entry = _park(server, other, "w2")
    server.release(holder)
    claimed = server.acquire(other, 5, owner_id="w2", entry=entry)  # its turn's message claimed it
    assert isinstance(claimed, Lock)
    assert queue.park(server, other, entry, kind="t", wait=30, ttl=5, owner_id="w2", message=b"m",
                      redelivered=True) == queue.Parked(queue.Park.TOOK_ITS_TURN)


def test_a_woken_waiter_that_never_claims_is_sent_its_turn_when_the_reservation_runs_out(server):
    """Woken in its slot, the waiter died (or lost Redis) before it claimed: its mark runs out, the
    reservation runs out, and the sweep sends its message: nothing is lost."""
    key = _key()
    holder = server.acquire(key, 0.2, owner_id="holder")
    entry = _park(server, key, "w1", block=0.05)
    server.client.set(key, server.client.get(key), px=50)  # the holder's lock runs out soon
    assert server.release(holder).status in (Release.GONE, Release.DELETED)
    if server.client.exists(layout.blocking(key, entry)):  # (the holder's lock ran out first: a sweep hands it on)
        queue.sweep(server, key)
    assert _state(server, key, entry) in ("p", "h")  # woken (p, reserved for it), or sent (h)
    server.client.pexpire(key, 1)  # the reservation runs out
    deadline = time.monotonic() + 5
    while server.client.exists(key) and time.monotonic() < deadline:
        time.sleep(0.005)
    _, handoffs = queue.sweep(server, key)
    assert [(h.what, h.entry) for h in handoffs] == [("run", entry)]
    assert _state(server, key, entry) == "h"


def test_two_deliveries_waiting_under_one_entry_the_woken_one_claims_and_the_other_ends(server):
    """After a loss of the lock Redis's data, the sweeper's copy of a lost park may wait in its slot
    under the same entry as the original: one wake-up, one claim; the other delivery's wait ends (its
    turn was taken: not run twice)."""
    key = _key()
    holder = server.acquire(key, 5, owner_id="holder")
    entry = _park(server, key, "w1", block=5.0)
    _park(server, key, "w1", block=5.0, again=True)  # the same entry, parked anew
    server.release(holder)
    assert queue.wait_in_slot(server, key, entry, 1.0) is queue.Slot.WOKEN
    assert isinstance(server.acquire(key, 5, owner_id="w1", entry=entry), Lock)  # (a copy's claim)
    assert queue.wait_in_slot(server, key, entry, 0.01) is queue.Slot.SENT  # its turn was taken: it ends


def test_a_copy_that_claims_in_its_slot_leaves_the_tombstone_its_first_parker_looks_for(server):
    """A copy of a parked entry (sent ahead of its turn) waits in a slot and claims there. The process that
    parked the entry first still remembers it, and takes an entry with neither record nor tombstone for
    one lost with the lock Redis's data (it sends it again): so a copy's claim leaves the tombstone. (It
    left none: the hot key's benchmark showed each such claim re-sent as "lost", and a second or so lost.)"""
    key = _key()
    holder = server.acquire(key, 5, owner_id="holder")
    entry = _park(server, key, "w1")  # the first delivery parks, and ends (its process remembers the entry)
    _park(server, key, "w1", block=5.0, first=True, again=True)  # its copy parks again, in its slot
    server.release(holder)
    assert queue.wait_in_slot(server, key, entry, 1.0) is queue.Slot.WOKEN
    assert isinstance(server.acquire(key, 5, owner_id="w1", entry=entry), Lock)  # the copy's claim
    assert server.client.zscore(layout.gone(key), entry) is not None


def test_a_call_never_merges_into_a_waiter_in_its_slot_or_woken_there(server):
    """A run claimed in the worker slot (the first delivery) takes no merged calls: a waiter still in its
    slot, or woken there, is no merge target (a coalescing call parks behind it instead)."""
    key = _key()
    holder = server.acquire(key, 5, owner_id="holder")
    _park(server, key, "w1", block=5.0)
    in_slot = queue.park(server, key, queue.entry_for("m1"), kind="t", wait=30, ttl=5, owner_id="m1",
                         message=b"m1", merge=True)
    assert in_slot.found is queue.Park.PARKED, in_slot
    other = _key()
    holder2 = server.acquire(other, 5, owner_id="holder")
    _park(server, other, "w2", block=5.0)
    server.release(holder2)  # w2 woken in its slot: the key is reserved for it
    woken = queue.park(server, other, queue.entry_for("m2"), kind="t", wait=30, ttl=5, owner_id="m2",
                       message=b"m2", merge=True)
    assert woken.found is queue.Park.PARKED, woken
    server.release(holder)
