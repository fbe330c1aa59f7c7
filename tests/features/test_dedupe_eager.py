"""The dedupe options (``lock_publish``, coalesce, ``lock_cooldown``) in eager mode (``apply()``) and at
the engine, against a real redis-server: what a test suite running tasks eagerly sees, and the
scripts' own edges."""

from __future__ import annotations

import threading
import uuid

import pytest
from _apps import celery_cli, make_app

from celery_singleton_lock import LockedTask
from celery_singleton_lock.engine import dedupe, layout, line_ops
from celery_singleton_lock.engine import line as queue
from celery_singleton_lock.engine.lock import Holder
from celery_singleton_lock.engine.server import LockServer
from celery_singleton_lock.testing.servers import wait_until

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def app(redis_server):
    return make_app(redis_server, task_always_eager=True, result_backend=None)


def test_cooldown_in_eager_mode_skips_a_second_call_and_ends(app, redis_server):
    ran = []

    @app.task(base=LockedTask, bind=True, shared=False, name=f"e.cool.{uuid.uuid4().hex[:6]}", lock_cooldown=1.0)
    def cool(self, k):
        ran.append(k)
        return k

    k = uuid.uuid4().hex
    assert cool.apply((k,)).get() == k
    key = cool.lock_key_for((k,))
    holder = Holder.parse(key, redis_server.client(2).get(key), redis_server.client(2).pttl(key))
    assert holder.cooldown and 0 < holder.ttl_ms <= 1000
    second = cool.apply((k,))
    assert second.state == "REVOKED" and ran == [k]  # an eager skip ends as in a worker
    wait_until(lambda: redis_server.client(2).get(key) is None, 5, what="the cooldown to end")
    assert cool.apply((k,)).get() == k and ran == [k, k]


def test_cooldown_on_failure_keeps_the_key_only_when_asked(app, redis_server):
    @app.task(base=LockedTask, bind=True, shared=False, name=f"e.fail.{uuid.uuid4().hex[:6]}", lock_cooldown=5.0,
              lock_cooldown_on_failure=True)
    def fails(self, k):
        raise ValueError(k)

    k = uuid.uuid4().hex
    assert fails.apply((k,)).state == "FAILURE"
    key = fails.lock_key_for((k,))
    assert Holder.parse(key, redis_server.client(2).get(key), 5000).cooldown


def test_publish_check_is_off_in_eager_mode(app):
    @app.task(base=LockedTask, bind=True, shared=False, name=f"e.pub.{uuid.uuid4().hex[:6]}", lock_publish="raise")
    def pub(self, k):
        return k

    assert pub.delay("a").get() == "a" and pub.delay("a").get() == "a"


def test_coalesce_in_eager_mode_waits_in_line_like_retry(app, redis_server):
    gate, ran = threading.Event(), []

    @app.task(base=LockedTask, bind=True, shared=False, name=f"e.co.{uuid.uuid4().hex[:6]}",
              on_duplicate="coalesce", lock_key=["k"])
    def co(self, k, tag):
        ran.append(tag)
        if tag == "holder":
            gate.wait(10)
        return tag

    k = uuid.uuid4().hex
    holder = threading.Thread(target=lambda: co.apply((k, "holder")))
    holder.start()
    wait_until(lambda: ran, 5, what="the holder to start")
    second = []
    t = threading.Thread(target=lambda: second.append(co.apply((k, "second")).get()))
    t.start()
    wait_until(lambda: queue.line(LockServer.from_url(redis_server.url(2)), co.lock_key_for((k, "x"))), 5,
               what="the eager duplicate to wait in line")
    gate.set()
    holder.join(10)
    t.join(10)
    assert second == ["second"] and ran == ["holder", "second"]


def test_publish_mark_script_finds_mark_then_line_then_holder(redis_server):
    server = LockServer.from_url(redis_server.url(2))
    key = f"t:{{{uuid.uuid4().hex}}}"
    assert dedupe.mark(server, key, "a", 5000) is None
    assert dedupe.mark(server, key, "b", 5000) == dedupe.Pending("a", "queued")
    assert dedupe.unmark(server, key, "b") is False and dedupe.unmark(server, key, "a") is True
    lock = server.acquire(key, 5, owner_id="runner")
    assert dedupe.mark(server, key, "c", 5000) == dedupe.Pending("runner", "running")
    assert queue.park(server, key, queue.entry_for("w"), kind="t", wait=10, ttl=5, owner_id="w",
                      message=b"m").place == 1
    assert dedupe.mark(server, key, "d", 5000) == dedupe.Pending("w", "waiting")
    lock.release()  # hands the key to w: reserved for it, still its call
    assert dedupe.mark(server, key, "e", 5000) == dedupe.Pending("w", "waiting")
    server.client.delete(key, layout.line(key), layout.waiters(key))
    cool = server.acquire(key, 5, owner_id="cooled")
    server.release(cool, succeeded=True, cooldown=5.0)
    assert dedupe.mark(server, key, "f", 5000) is None  # a cooldown runs nothing: publish


def test_merge_goes_into_a_parked_task_only(redis_server):
    server = LockServer.from_url(redis_server.url(2))
    key = f"t:{{{uuid.uuid4().hex}}}"
    server.acquire(key, 5, owner_id="holder")
    first = queue.park(server, key, queue.entry_for("w1"), kind="t", wait=10, ttl=5, owner_id="w1", message=b"1",
                       merge=True)
    assert first == queue.Parked(queue.Park.PARKED, 1)  # nobody to merge into: it parks
    merged = queue.park(server, key, queue.entry_for("w2"), kind="t", wait=10, ttl=5, owner_id="w2", message=b"2",
                        merge=True)
    assert merged == queue.Parked(queue.Park.MERGED, 0, "w1")
    assert dedupe.merged_calls(server, key, merged.into_owner) == [b"2"]
    assert queue.line(server, key) == ["w1"]
    dedupe.drop_merged(server, key, merged.into_owner)
    assert dedupe.merged_calls(server, key, merged.into_owner) == []


def test_calls_taken_to_be_sent_again_are_taken_once(redis_server):
    """A revoked coalescing waiter's merged calls are sent again by the worker that takes them: every
    worker's revoke look may ask, so reading and forgetting them is one call, and a second take gets
    none (a read, then a delete, let two workers both read them and send each twice). A take whose
    answer was lost, asked again with its request id, is answered as it was (else they are lost)."""
    server = LockServer.from_url(redis_server.url(2))
    key = f"t:{{{uuid.uuid4().hex}}}"
    server.acquire(key, 5, owner_id="holder")
    queue.park(server, key, queue.entry_for("w1"), kind="t", wait=10, ttl=5, owner_id="w1", message=b"1", merge=True)
    for owner in ("w2", "w3"):
        queue.park(server, key, queue.entry_for(owner), kind="t", wait=10, ttl=5, owner_id=owner,
                   message=owner.encode(), merge=True)
    assert server.client.get(layout.merged_into(key, "w2")) == b"w1"
    assert dedupe.take_merged(server, key, "w1", "take-1") == [b"w2", b"w3"]
    assert dedupe.take_merged(server, key, "w1") == []  # another worker's take
    assert dedupe.take_merged(server, key, "w1", "take-1") == [b"w2", b"w3"]  # the first, asked again
    assert server.client.get(layout.merged_into(key, "w2")) is None  # sent again: no longer merged
    server.close()


def test_celery_locks_shows_a_cooldown_with_the_time_left(worker_app):
    """`celery locks list` and `show` print a cooldown as such (no holder), with the time left."""
    server = LockServer.from_url(worker_app.app.conf.singleton_lock_url)
    key = worker_app.hold.lock_key_for([f"cool-{uuid.uuid4().hex[:6]}", 1])
    lock = server.acquire(key, 5, owner_id="the-last-run")
    server.release(lock, succeeded=True, cooldown=30.0)
    listed = celery_cli("locks", "list")
    assert listed.returncode == 0, listed.stderr
    row = next(line for line in listed.stdout.splitlines() if key in line)
    assert "cooldown after the-last-run" in row
    shown = celery_cli("locks", "show", key)
    assert shown.returncode == 0, shown.stderr
    assert "cooling down after task the-last-run" in shown.stdout and "in 2" in shown.stdout  # 29 s / 30 s left


def test_publish_goes_unchecked_with_a_warning_when_the_lock_server_is_down(redis_server, caplog):
    from celery_singleton_lock.testing.servers import free_port

    app = make_app(redis_server, task_default_queue=f"nobody-{uuid.uuid4().hex[:6]}",
                   singleton_lock_redis_options={"socket_connect_timeout": 0.5})
    app.conf.singleton_lock_url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there

    @app.task(base=LockedTask, shared=False, name=f"e.down.{uuid.uuid4().hex[:6]}", lock_publish="raise")
    def down(k):
        return k

    first, second = down.delay("a"), down.delay("a")
    assert first.id != second.id  # both published: the execution lock decides between them
    assert any("published unchecked" in r.getMessage() for r in caplog.records)


def test_calls_merged_by_an_earlier_release_are_read_settled_and_revoked(redis_server):
    """0.2 kept a merged call's id in ``K:m:<owner>`` and its message in ``K:mm:<owner>``; this release
    keeps ``"<id>\\n<message>"`` in ``K:m:<owner>`` alone. Calls merged before an upgrade are still read
    (in order, beside those merged after it), a revoke of one takes it out, and the take forgets both keys."""
    server = LockServer.from_url(redis_server.url(2))
    key = f"t:{{{uuid.uuid4().hex}}}"
    server.acquire(key, 5, owner_id="holder")
    queue.park(server, key, queue.entry_for("w1"), kind="t", wait=10, ttl=5, owner_id="w1", message=b"1", merge=True)
    calls, before = layout.merged(key, "w1"), f"{key}:mm:w1"
    for old in ("w2", "w3"):  # as 0.2 merged them
        server.client.rpush(calls, old)
        server.client.hset(before, old, old.encode())
        server.client.set(layout.merged_into(key, old), "w1", px=60_000)
    server.client.pexpire(before, 60_000)  # (as 0.2 left it: its own expiry, shorter than the list's will be)
    queue.park(server, key, queue.entry_for("w4"), kind="t", wait=10, ttl=5, owner_id="w4", message=b"w4", merge=True)
    # a merge after the upgrade keeps both records as long: 0.2's messages must not run out first
    assert server.client.pttl(before) > 60_000 and abs(server.client.pttl(before) - server.client.pttl(calls)) < 1000
    assert dedupe.merged_calls(server, key, "w1") == [b"w2", b"w3", b"w4"]
    assert line_ops.remove(server, key, "w3")[0] == 1  # a revoke of a call merged before the upgrade
    assert dedupe.take_merged(server, key, "w1") == [b"w2", b"w4"]
    assert server.client.exists(calls, before) == 0
    assert server.client.get(layout.merged_into(key, "w2")) is None  # taken to be sent again
    server.close()
