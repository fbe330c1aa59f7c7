"""The basic promise, end to end on an in-process worker."""

import pytest

from celery_singleton_lock import LockedTask


@pytest.mark.timeout(60)
def test_locked_task_runs_and_releases(app, run_worker, redis_server):
    ran = []

    @app.task(base=LockedTask, bind=True, lock_ttl=5, shared=False)
    def add(self, x, y=2):
        ran.append(self.lock.fencing_token)
        return x + y

    with run_worker(app):
        assert add.delay(1).get(timeout=10) == 3
    assert ran and ran[0] > 0
    assert redis_server.client(2).exists(add.lock_key_for((1,), {})) == 0
    assert add.lock_key_for((1,), {}) == add.lock_key_for((), {"x": 1, "y": 2})


@pytest.mark.timeout(60)
def test_the_key_is_free_as_soon_as_the_result_is_visible(app, run_worker, redis_server):
    """The lock is released when the body ends, before Celery stores the result:
    whoever has seen the result and sends a duplicate finds the key free (no polling here)."""
    locks = redis_server.client(2)
    seen_held = []

    @app.task(base=LockedTask, bind=True, lock_ttl=5, shared=False)
    def work(self, n):
        seen_held.append(locks.exists(self.lock.key))
        return n

    with run_worker(app):
        for n in range(20):
            assert work.delay(n).get(timeout=10) == n
            assert locks.exists(work.lock_key_for((n,), {})) == 0
    assert seen_held == [1] * 20  # the body really ran under the lock, every time


@pytest.mark.timeout(60)
def test_footprint_early_ack_leaves_nothing_and_acks_late_only_its_window(redis_server, run_worker):
    """Nothing is left in the lock Redis once an early-acked task released its key; an acks_late
    task leaves one done record per task id (and its return value), only for
    singleton_lock_redelivery_window."""
    import uuid

    from _apps import make_app

    from celery_singleton_lock.testing.servers import wait_until

    app = make_app(redis_server, singleton_lock_redelivery_window=1.0,
                   singleton_lock_prefix=f"fp{uuid.uuid4().hex[:6]}")
    locks = redis_server.client(2)
    prefix = app.conf.singleton_lock_prefix

    @app.task(base=LockedTask, bind=True, shared=False)
    def early(self, n):
        return n

    @app.task(base=LockedTask, bind=True, shared=False, acks_late=True)
    def late(self, n):
        return n

    def ours() -> list[bytes]:  # (beside the replies kept a short while for a second send: engine/kept.py)
        return sorted(k for k in locks.scan_iter(f"{prefix}:*") if b":r:" not in k)

    with run_worker(app):
        assert [early.delay(n).get(timeout=10) for n in range(20)] == list(range(20))
        assert ours() == []  # early ack: the lock is gone at release, and nothing beside it
        assert [late.delay(n).get(timeout=10) for n in range(5)] == list(range(5))
        left = ours()
        # one done record per key, and beside it what the body returned (for a redelivery that finds
        # its result never stored): both expire with the window
        assert len(left) == 10 and sum(k.endswith(b":d") for k in left) == 5, left
        assert sum(b":d:" in k for k in left) == 5, left
        assert all(0 < locks.pttl(k) <= 1000 for k in left)
        wait_until(lambda: ours() == [], 10, what="the done records to expire with their window")
