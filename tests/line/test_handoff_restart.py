"""Hot keys when the lock Redis restarts, its data gone, with waiters parked (section 4 of the hand-off
tests): each runs once, soon. Against real redis-servers and real ``celery worker`` subprocesses."""

from __future__ import annotations

import gc
import time
import uuid

import pytest
from _handoff_support import FEW, LOCK_TTL, SWEEP_LATE, WORKER_ENV, intervals, note
from _line_support import open_gate, publishes, starts, wait_starts
from _task_support import TIMEOUT, assert_no_overlap, load_worker_app, start_worker_process

from celery_singleton_lock.testing.servers import wait_until

pytestmark = [pytest.mark.timeout(150), pytest.mark.usefixtures("collect_results")]


# -- 4. the lock Redis restarts, its data gone ------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_lock_redis_restart_with_waiters_parked_each_runs_once(redis_server, fresh_redis, tmp_path, capsys):
    """The locks on a Redis of their own; waiters parked behind a long holder; that Redis restarts
    empty: the sweepers of the processes that parked send their waiters again, and each runs once."""
    wa = load_worker_app(redis_server)
    queue = f"csl-ho-restart-{uuid.uuid4().hex[:8]}"
    locks = fresh_redis.client(0)
    w = start_worker_process(
        redis_server, tmp_path, concurrency=2, env={**WORKER_ENV, "CSL_LOCK_URL": fresh_redis.url(0)},
        extra=("-Q", queue), name="restart",
    )
    k = f"restart-{uuid.uuid4().hex[:8]}"
    key = wa.in_line.lock_key_for((k,), {})
    try:
        w.wait_ready(90)
        holder = wa.in_line.apply_async((k, 0.0, "holder", True), queue=queue)
        wait_starts(wa, k, 1)
        assert locks.exists(key)
        waiters = []
        for i in range(3):
            waiters.append(wa.in_line.apply_async((k, 0.05, f"w{i}"), queue=queue))
            wait_until(lambda: locks.llen(key + ":q") == len(waiters), TIMEOUT, 0.01, f"waiter {i} to park")
        fresh_redis.restart()  # same port, no data: the lock, the line and the parked messages are gone
        restarted_at = time.time()
        assert not locks.exists(key, key + ":q", key + ":w")
        assert sorted(x.get(timeout=TIMEOUT)["tag"] for x in waiters) == ["w0", "w1", "w2"]
        ran = starts(wa, k)
        ids = [x.id for x in waiters]
        assert sorted(e["id"] for e in ran[1:]) == sorted(ids) and ran[0]["id"] == holder.id, "each ran once"
        # the sweeper notices the new epoch on its next look, and sends what its process parked
        assert ran[1]["at"] - restarted_at <= SWEEP_LATE + FEW
        spans = intervals(wa, k, without=holder.id)  # the holder is still in its body (gated)
        assert_no_overlap([spans[i] for i in ids], "the waiters after the restart")
        for x in waiters:
            recovered = [p for p in publishes(wa, x.id) if p.get("singleton_lock_recovered")]
            assert len(recovered) == 1, f"{x.id} sent again once after the restart, got {publishes(wa, x.id)}"
        assert "lost its data" in w.log()
        note(capsys, f"lock Redis restart -> first waiter's start {ran[1]['at'] - restarted_at:.2f} s, "
                     f"-> last {max(s for s, _ in (spans[i] for i in ids)) - restarted_at:.2f} s")
        # the holder learns of its loss on its watchdog's next renewal (every TTL/3), which may come
        # after the waiters already ran: wait for the lock_lost signal before letting its body end
        wait_until(lambda: wa.journal.llen(f"lost_signal:{holder.id}") >= 1, LOCK_TTL + FEW, 0.05,
                   "the holder's lock_lost signal")
    finally:
        open_gate(wa, k)
    try:
        result = holder.get(timeout=TIMEOUT)
        assert result["lost"] is True  # the holder's lock went with the data, and it was told
        assert len(starts(wa, k)) == 4  # nobody ran twice, even after the holder's release
    finally:
        w.stop()
        gc.collect()
