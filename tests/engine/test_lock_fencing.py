"""The lock engine's fencing tokens and what a release leaves: tokens rise across holders, done
records, SCRIPT FLUSH and a restart; a done record drops only its owner's redeliveries; the lightest
paths (a fresh acquire, a release with nobody in line) keep the same promises.

Against private redis-servers (``any_redis``) and the contract tests' ``backend`` (engine/conftest.py).
"""

from __future__ import annotations

import pytest
from _lock_support import DB, new_name, server_for, warm

from celery_singleton_lock.engine import kept
from celery_singleton_lock.engine.lock import Holder, Lock, Release, slot_safe
from celery_singleton_lock.engine.server import LockServer
from celery_singleton_lock.testing.servers import Monitor, wait_until
from celery_singleton_lock.topologies.servers import from_settings

pytestmark = pytest.mark.timeout(60)


# -- fencing tokens -----------------------------------------------------------------


def test_fencing_tokens_increase_across_holders(backend):
    servers = [from_settings(backend.url), from_settings(backend.url)]
    name = new_name()
    fences = []
    for i in range(40):
        lock = servers[i % 2].acquire(name, 5)
        fences.append(lock.fencing_token)
        if i % 3 == 0 and backend.name == "etcd":  # some holders lose their session's lease instead
            servers[i % 2].session(5).revoke(servers[i % 2].transport)
            wait_until(lambda: servers[0].holder(name) is None, 10)
        elif i % 3 == 0:
            lock.ttl = 0.001  # some holders just expire instead of releasing
            assert lock.renew()
            wait_until(lambda lock=lock: servers[0].holder(name) is None, 10)
        else:
            assert lock.release()
    assert all(a < b for a, b in zip(fences, fences[1:], strict=False)), fences


def test_fencing_tokens_increase_across_done_records_and_script_flush(any_redis):
    """Tokens come from the server clock: they rise whether or not a done record sits beside the
    lock (acks_late tasks leave one, early-ack tasks nothing), and after SCRIPT FLUSH."""
    c = any_redis.client(DB)
    server = LockServer(c)
    name = new_name()
    fences = []

    def take_and_release(remember: float = 0.0):
        lock = server.acquire(name, 5, owner_id=f"task-{len(fences)}")
        assert isinstance(lock, Lock)
        fences.append(lock.fencing_token)
        assert server.release(lock, succeeded=True, remember=remember)

    take_and_release()
    take_and_release(remember=60)
    assert c.exists(slot_safe(name) + ":d")
    take_and_release()
    take_and_release(remember=0.05)
    wait_until(lambda: not c.exists(slot_safe(name) + ":d"), 10, what="the done record to expire")
    take_and_release()
    c.script_flush()
    take_and_release()
    take_and_release()
    assert len(fences) == 7
    assert all(a < b for a, b in zip(fences, fences[1:], strict=False)), fences


def test_fencing_tokens_increase_across_restart(fresh_redis):
    server = server_for(fresh_redis)
    name = new_name()
    first = server.acquire(name, 5)
    assert first.fencing_token  # read while held
    fresh_redis.restart()
    second = server.acquire(name, 5)  # data and scripts are gone; the fence still rises
    assert isinstance(second, Lock) and second.fencing_token > first.fencing_token


def test_a_release_leaves_nothing_behind_unless_asked_to_remember(any_redis):
    """Early-ack tasks: after the release the lock Redis holds nothing for the key. A success
    remembered for a redelivery window leaves one small record that expires with the window."""
    c = any_redis.client(DB)
    server = server_for(any_redis)
    name = new_name()
    before = c.dbsize()

    def left() -> int:
        """Keys beside the replies kept for a second send (each checked to expire within KEEP_MS)."""
        replies = list(c.scan_iter(f"{slot_safe(name)}:r:*"))
        assert all(0 < c.pttl(r) <= kept.KEEP_MS for r in replies), replies
        return c.dbsize() - len(replies)

    lock = server.acquire(name, 5, owner_id="task-1")
    assert server.release(lock, succeeded=True)
    # the uncontended path keeps no reply: nothing at all
    assert c.dbsize() == before
    lock = server.acquire(name, 5, owner_id="task-2")
    assert server.release(lock, succeeded=False, remember=60)  # only successes are remembered
    assert left() == before
    lock = server.acquire(name, 5, owner_id="task-3")
    assert server.release(lock, succeeded=True, remember=60)
    done = lock.key + ":d"
    assert c.zrange(done, 0, -1) == [b"task-3"] and 0 < c.pttl(done) <= 60_000
    assert left() == before + 1


def test_a_done_record_drops_only_redeliveries_of_that_owner_until_its_window_ends(backend):
    server = from_settings(backend.url)
    name = new_name()
    for owner in ("task-a", "task-b"):  # a then b succeed: the record is per owner, not "the last one"
        lock = server.acquire(name, 5, owner_id=owner)
        assert server.release(lock, succeeded=True, remember=0.5)
    from celery_singleton_lock.engine.lock import Verdict

    assert server.acquire(name, 5, owner_id="task-a", check_done=True) is Verdict.ALREADY_SUCCEEDED
    assert server.acquire(name, 5, owner_id="task-b", check_done=True) is Verdict.ALREADY_SUCCEEDED
    # while another holds the key, a redelivery of a finished owner is still told so
    other = server.acquire(name, 5, owner_id="task-c")
    assert isinstance(other, Lock)
    assert server.acquire(name, 5, owner_id="task-a", check_done=True) is Verdict.ALREADY_SUCCEEDED
    assert isinstance(server.acquire(name, 5, owner_id="task-a"), Holder)  # a fresh delivery is not checked
    assert server.release(other)
    fresh = server.acquire(name, 5, owner_id="task-a")  # a fresh delivery of that id runs
    assert isinstance(fresh, Lock) and server.release(fresh)
    def runs_again():  # once the window ended (on etcd: its lease, up to a second or two later)
        got = server.acquire(name, 5, owner_id="task-a", check_done=True)
        return got if isinstance(got, Lock) else None

    again = wait_until(runs_again, 10, 0.1, what="the window to end")
    assert server.release(again)


# -- the lightest paths (a fresh acquire, a release with nobody in line) -------------------------


def test_a_fresh_locks_fencing_token_is_known_at_the_acquire_and_keeps_rising(any_redis):
    """A fresh acquire draws the fence from the server clock in its own script: reading it costs no
    round trip, operators read the same value in Redis, and it rises across holders, also after an
    expiry."""
    server = server_for(any_redis)
    warm(server)
    name = new_name()
    first = server.acquire(name, 5)
    assert isinstance(first, Lock) and first.known_fence() == first.fencing_token > 0
    with Monitor(any_redis) as mon:
        fence = first.fencing_token
        mon.sync()
        # (no round trip to read it; a sweeper an earlier test started may look at the waiting index)
        assert [c for c in mon.commands() if not any("{waiting}" in w for w in c)] == []
    assert server.holder(name).fencing_token == fence and server.release(first)
    second = server.acquire(name, 5)
    assert second.fencing_token > fence and server.release(second)
    server.acquire(name, 0.3)
    wait_until(lambda: server.holder(name) is None, 10, 0.02, "the lock to expire")
    third = server.acquire(name, 5)
    assert third.fencing_token > second.fencing_token and server.release(third)


def test_a_fresh_acquire_on_a_client_that_decodes_replies(redis_server):
    """``decode_responses=True`` (a client the user built): replies come as text then."""
    server = LockServer(redis_server.client(DB, decode_responses=True), url=redis_server.url(DB))
    name = new_name()
    mine = server.acquire(name, 5, owner_id="first")
    assert isinstance(mine, Lock)
    seen = server.acquire(name, 5, owner_id="second")
    assert isinstance(seen, Holder) and seen.owner_id == "first"
    assert server.release(mine)
    server.close()


def test_a_fresh_acquire_never_jumps_a_line_whose_holder_died(any_redis):
    """The holder died (its key expired) with a waiter in line: a fresh task finds the key free, but
    must not run ahead of the waiter. It is told the key is queued, and takes nothing."""
    from celery_singleton_lock.engine import line as queue

    server = server_for(any_redis)
    name = new_name()
    holder = server.acquire(name, 0.3, owner_id="holder")
    assert isinstance(holder, Lock)
    assert queue.park(server, name, "e-waiter", kind="t", wait=30, ttl=5, owner_id="waiter", message=b"m").place == 1
    wait_until(lambda: server.holder(name) is None, 10, 0.02, "the holder's key to expire")
    newcomer = server.acquire(name, 5, owner_id="newcomer")
    assert isinstance(newcomer, Holder) and newcomer.queued, newcomer
    assert server.holder(name) is None  # nothing taken: the sweeper hands the key to the waiter


def test_release_of_a_fresh_holder_hands_the_key_to_a_waiter_that_parked_behind_it(any_redis):
    """The fresh acquire and the plain release skip the line only while it is empty: a holder someone
    parked behind (its value unchanged) still hands the key on at release (a release that skipped the
    line would strand the waiter)."""
    from celery_singleton_lock.engine import line as queue

    server = server_for(any_redis)
    name = new_name()
    holder = server.acquire(name, 5, owner_id="holder")
    assert isinstance(holder, Lock) and holder.fencing_token  # (drawn now, on first read)
    taken_as = server.holder(name).raw
    assert queue.park(server, name, "p-waiter", kind="t", wait=30, ttl=5, owner_id="waiter",
                      message=b"its message").place == 1
    found = server.holder(name)
    assert found.owner_id == "holder" and found.raw == taken_as  # parking behind it left it as taken
    assert found.fencing_token == holder.fencing_token
    released = server.release(holder)
    assert released.status is Release.DELETED and [h.entry for h in released.handoffs] == ["p-waiter"]
    reserved = server.holder(name)
    assert reserved.reserved and reserved.owner_id == "waiter"
    taken = server.acquire(name, 5, owner_id="waiter", entry="p-waiter")
    assert isinstance(taken, Lock) and taken.fencing_token > holder.fencing_token
    assert server.release(taken).status is Release.DELETED
    assert server.holder(name) is None
