"""Quorum mode's members: one pipelined connection per member and no thread, a member killed or
reconnected keeps working, a forked child does not inherit a stuck member, operators see every
member with the majority's verdict, fencing tokens rise when members disagree, and nothing a
finished lock or a cooldown leaves outlives its time on any member.

Every member is a private redis-server on a free loopback port, with no persistence, stopped by PID.
"""

from __future__ import annotations

import json
import threading
import time
import uuid

import pytest
from _quorum_support import name, take
from celery import Celery

from celery_singleton_lock import LockedTask
from celery_singleton_lock.engine.lock import Holder, Lock, Release
from celery_singleton_lock.testing.servers import wait_until
from celery_singleton_lock.topologies.quorum import QuorumLockServer

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow, pytest.mark.usefixtures("collect_results")]


# -- the fan-out: one pipelined connection per member, no thread ---------------------------------------


def test_no_thread_per_member_and_a_stopped_member_gets_its_commands_in_order(quorum, masters):
    """Operations go to the members on one connection each, without threads; a member that is
    stopped gets an acquire and its release in the order they were written (the release is not
    skipped), so once it resumes, the finished lock is not there."""
    before = {t.ident for t in threading.enumerate()}
    key = name()
    lock = quorum.acquire(key, 5.0, owner_id="first")
    assert isinstance(lock, Lock)
    quorum.release(lock)
    masters[0].pause()
    try:
        started = time.monotonic()
        lock = quorum.acquire(key, 5.0, owner_id="second")  # member 0 stopped: 4 answer
        assert isinstance(lock, Lock), lock
        assert time.monotonic() - started < 1.0  # decided by the majority, not held up by the stopped one
        released = quorum.release(lock)
        assert released.status is Release.DELETED
        third = quorum.acquire(key, 5.0, owner_id="third")  # member 0 now skipped (stuck)
        assert isinstance(third, Lock)
        quorum.release(third)
    finally:
        masters[0].resume()
    # member 0 runs what was written to it, in order: no lock of "second" (or anyone) lingers there
    member = masters[0].client(2)
    wait_until(lambda: member.get(key) is None, timeout=5.0, what="the stopped member to catch up")
    assert {t.ident for t in threading.enumerate()} - before == set(), [t.name for t in threading.enumerate()]
    again = quorum.acquire(key, 5.0, owner_id="fourth")
    assert isinstance(again, Lock) and again.fencing_token > lock.fencing_token
    quorum.release(again)


def test_a_member_killed_and_restarted_empty_is_reconnected_with_its_scripts(quorum, masters):
    """A member's connection breaks when it dies: its waiting commands fail, the next command connects
    again and loads the scripts ahead of itself, so it votes again once its data is old enough."""
    key = name()
    lock = quorum.acquire(key, 2.0, owner_id="a")
    assert isinstance(lock, Lock)
    quorum.release(lock)
    masters[1].restart()  # empty: SINCE is gone there
    for attempt in range(3):
        lock = quorum.acquire(key, 2.0, owner_id=f"b{attempt}")
        assert isinstance(lock, Lock)
        quorum.release(lock)
    member = masters[1].client(2)
    assert member.exists("celery_singleton_lock:{quorum}:since") == 1  # it was asked (and answered) again


# -- operators see every member -------------------------------------------------------------------------


def test_celery_locks_list_show_and_release_read_every_member_with_the_majority_verdict(masters, quorum):
    from celery.bin.base import CLIContext
    from click.testing import CliRunner

    from celery_singleton_lock.ops.cli import locks

    app = Celery(f"t{uuid.uuid4().hex[:8]}", broker=masters[0].url(0), set_as_current=False)
    app.conf.singleton_lock_url = ";".join(s.url(2) for s in masters)
    app.conf.singleton_lock_prefix = f"ops{uuid.uuid4().hex[:6]}"

    @app.task(base=LockedTask, shared=False, name="t.deduct")
    def deduct(sku):
        return sku

    held_key = deduct.lock_key_for(["held"])
    minority_key = deduct.lock_key_for(["minority"])
    lock = quorum.acquire(held_key, 30.0, owner_id="holder-1")
    assert isinstance(lock, Lock)
    # a lock only 2 of 5 members still have (a release that has not reached them): no majority
    for s in masters[:2]:
        s.client(2).set(minority_key, b"tok " + b"1 " + b'{"owner":"gone-1","host":"h","pid":1}', px=30_000)
    runner = CliRunner()
    obj = CLIContext(app=app, no_color=True, workdir=None)

    out = runner.invoke(locks, ["list", "--json"], obj=obj)
    assert out.exit_code == 0, out.output
    rows = {row["key"]: row for row in json.loads(out.output)}
    assert set(rows) == {held_key, minority_key}
    assert rows[held_key]["held"] is True and rows[held_key]["held_on"] == 5
    assert rows[held_key]["task_id"] == "holder-1"
    assert rows[minority_key]["held"] is False and rows[minority_key]["held_on"] == 2
    assert sorted(t is None for t in rows[minority_key]["members"].values()) == [False, False, True, True, True]
    out = runner.invoke(locks, ["list"], obj=obj)
    assert "MEMBERS" in out.output and "5/5" in out.output and "2/5, no majority: not held" in out.output

    out = runner.invoke(locks, ["show", held_key], obj=obj)
    assert out.exit_code == 0 and "on 5/5" in out.output and out.output.count("member ") == 5, out.output
    out = runner.invoke(locks, ["show", minority_key], obj=obj)
    assert out.exit_code == 1 and "no majority: not held" in out.output, out.output

    masters[4].pause()  # one member down: still read, shown as unreachable, the verdict still holds
    try:
        out = runner.invoke(locks, ["show", held_key, "--json"], obj=obj)
        assert out.exit_code == 0, out.output
        shown = json.loads(out.output)
        assert shown["held_on"] == 4 and shown["held"] is True
        assert sum(1 for t in shown["members"].values() if t and t.startswith("unreachable")) == 1
    finally:
        masters[4].resume()

    out = runner.invoke(locks, ["release", held_key, "--yes"], obj=obj)
    assert out.exit_code == 0 and "force-released on 5 of 5 members" in out.output, out.output
    assert all(s.client(2).get(held_key) is None for s in masters)
    assert lock.renew() is False  # the holder finds out at its next renewal
    out = runner.invoke(locks, ["release", minority_key], obj=obj, input="y\n")
    assert out.exit_code == 0 and "on 2 of 5 members" in out.output, out.output
    out = runner.invoke(locks, ["release", minority_key, "--yes"], obj=obj)
    assert out.exit_code == 1 and "nothing released" in out.output
    out = runner.invoke(locks, ["list"], obj=obj)
    assert out.exit_code == 0 and "no locks held" in out.output


def test_fencing_tokens_rise_when_members_disagree_and_stay_near_the_members_clocks(quorum, masters, monkeypatch):
    """Members that agree answer the client's proposed token and keep it as their floor in
    the same script: no second round trip. A member whose floor is ahead answers higher; the token is
    then written back to the others before the acquire returns, so the next token is higher still.
    A client clock far off is pulled into a second of the members' clocks."""
    from celery_singleton_lock.topologies import quorum as quorum_module

    key = name()
    first = take(quorum, key)
    quorum.release(first)
    floor_key = first.key + ":f"
    assert sum(1 for m in masters if int(m.client(2).get(floor_key) or 0) == first.fencing_token) >= 3
    # floors ahead on a majority (3 of 5): any granting majority includes one of them, which answers
    # higher than the others; the token is then written back to the others that granted
    ahead = first.fencing_token + 10_000_000
    for m in masters[:3]:
        m.client(2).set(floor_key, ahead, px=60_000)
    second = take(quorum, key)
    assert second.fencing_token == ahead + 1
    floors = [int(m.client(2).get(floor_key) or 0) for m in masters]
    assert sum(1 for f in floors if f >= second.fencing_token) >= 3, floors
    quorum.release(second)
    third = take(quorum, key)
    assert third.fencing_token > second.fencing_token
    quorum.release(third)

    hour = 3600 * 1_000_000
    fresh = name()
    monkeypatch.setattr(quorum_module, "_proposal", lambda: time.time_ns() // 1000 + hour)
    fast = take(quorum, fresh)
    assert fast.fencing_token < time.time_ns() // 1000 + 2_000_000  # not an hour ahead: a second at most
    quorum.release(fast)
    monkeypatch.setattr(quorum_module, "_proposal", lambda: time.time_ns() // 1000 - hour)
    slow = take(quorum, fresh)
    assert slow.fencing_token > fast.fencing_token  # the floors, not the slow clock
    quorum.release(slow)


def test_finished_locks_leave_nothing_that_outlives_two_minutes_on_any_member(quorum, masters):
    """(footprint) After many locks on distinct keys, each member keeps only keys that expire
    within FENCE_KEEP (the fencing floors), besides its one SINCE key: nothing is left after 2 minutes."""
    from celery_singleton_lock.topologies.quorum import FENCE_KEEP, SINCE

    for i in range(200):
        lock = quorum.acquire(f"fp-{i}-{uuid.uuid4().hex[:6]}", 5.0, owner_id=f"task-{i}")
        assert isinstance(lock, Lock)
        assert quorum.release(lock).status is Release.DELETED
    for m in masters:
        client = m.client(2)
        left = [k for k in client.scan_iter(count=1000) if k != SINCE.encode()]
        assert len(left) <= 200, len(left)  # the floors: one per key, no more
        ttls = [client.pttl(k) for k in left]
        assert all(0 < t <= FENCE_KEEP * 1000 for t in ttls), sorted(ttls)[-3:]
        assert FENCE_KEEP + 5.0 < 120.0  # so 2 minutes after the run, nothing of these is left


def test_a_member_reconnected_many_times_keeps_working(quorum, masters):
    """A reconnect to a member gives back its slot of the client's connection pool: after more than
    100 reconnects (restarts, killed connections) the member still answers, never lost to this
    process for its whole life ("Too many connections")."""
    key = name()
    admin = masters[0].client(2)
    for i in range(110):
        lock = quorum.acquire(key, 5.0, owner_id=f"t{i}")
        assert isinstance(lock, Lock)
        quorum.release(lock)
        admin.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")  # every client but this one
    lock = None
    for _ in range(3):  # the first use after a kill finds the connection broken; the next reconnects
        got = quorum.acquire(key, 5.0, owner_id="last")
        if isinstance(got, Lock) and admin.get(got.key) is not None:
            lock = got
            break
        if isinstance(got, Lock):
            quorum.release(got)
    assert lock is not None, "member 0 no longer takes part"
    quorum.members[0].client.ping()  # and its own client still has connections to give
    quorum.release(lock)


def test_a_forked_child_does_not_inherit_a_member_stuck_in_its_parent(quorum, masters):
    """A parent with a command still unanswered on a member (stopped when it
    was sent) forks: the child starts with its own connections, and asks that member like any other."""
    import multiprocessing

    key = name()
    masters[2].pause()
    try:
        lock = quorum.acquire(key, 5.0, owner_id="parent")
        assert isinstance(lock, Lock)
        quorum.release(lock)
    finally:
        masters[2].resume()
    time.sleep(0.3)  # the parent's call on member 2 is now "stuck" by its age, though answered meanwhile

    def child(q: QuorumLockServer, key: str, out: multiprocessing.Queue) -> None:
        got = q.acquire(key, 5.0, owner_id="child")
        out.put(isinstance(got, Lock) and masters[2].client(2).get(got.key) is not None)
        if isinstance(got, Lock):
            q.release(got)

    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    proc = ctx.Process(target=child, args=(quorum, key, out))
    proc.start()
    proc.join(20)
    assert proc.exitcode == 0
    assert out.get(timeout=5) is True, "the child skipped member 2, stuck only in its parent"


def test_a_cooldown_keeps_the_key_on_a_majority_then_frees_it(quorum, masters):
    """lock_cooldown on a quorum: the release keeps the key, by nobody, on every member it was on."""
    key = name()
    lock = take(quorum, key)
    assert quorum.release(lock, succeeded=True, cooldown=1.0).status is Release.DELETED
    found = quorum.acquire(key, 5.0)
    assert isinstance(found, Holder) and found.cooldown and 0 < found.ttl_ms <= 1000
    assert sum(1 for s in masters if (s.client(2).get(found.key) or b"").startswith(b"= ")) >= quorum.majority
    after = take(quorum, key, deadline=5.0)  # the cooldown ran out: free again, with a higher fence
    assert after.fencing_token > lock.fencing_token
    quorum.release(after)
