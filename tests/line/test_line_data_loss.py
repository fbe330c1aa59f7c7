"""The line when the lock Redis loses its data: flushed under a line of 40, or just before a burst of
parks, no waiter is lost and none runs twice; and the lock Redis's persistence, checked at worker start.

Real ``celery worker`` subprocesses (prefork) whose locks live on a Redis of their own, FLUSHDB by the
test; broker and results on the session's Redis.
"""

from __future__ import annotations

import time
import uuid

import pytest
from _line_support import Nodes, events, open_gate, starts, wait_starts, worker_nodes
from _recovery_support import LOCK_TTL
from _task_support import TIMEOUT, assert_no_overlap, load_worker_app

from celery_singleton_lock import LockServer
from celery_singleton_lock.testing.servers import wait_until

pytestmark = [pytest.mark.timeout(150), pytest.mark.usefixtures("collect_results")]


# -- the lock Redis loses its data -----------------------------------------------------------------


@pytest.fixture(scope="module")
def flushable(redis_server, tmp_path_factory):
    """Two prefork workers x 2 children whose locks live on a Redis of their own (which the tests
    FLUSHDB); broker and results stay on the session's Redis."""
    from celery_singleton_lock.testing.servers import RedisServer

    n = Nodes()
    n.wa = load_worker_app(redis_server)
    n.queue = f"csl-li-flush-{uuid.uuid4().hex[:8]}"
    with RedisServer() as lock_redis:
        n.lock_redis, n.locks = lock_redis, lock_redis.client(0)
        env = {"CSL_LOCK_TTL": str(LOCK_TTL), "CSL_JOURNAL_HANDOFF": "1", "CSL_LOCK_URL": lock_redis.url(0)}
        specs = {f"flush{i}": (n.queue, 2, env) for i in range(2)}
        with worker_nodes(redis_server, tmp_path_factory.mktemp("flush"), specs) as started:
            n.workers = list(started.values())
            yield n


def _each_ran_once(wa, k: str, ids: list[str]) -> None:
    ran = [e["id"] for e in starts(wa, k)]
    twice = sorted({i for i in ran if ran.count(i) > 1})
    assert not twice, f"{len(twice)} task(s) ran more than once: {twice}"
    assert sorted(ran) == sorted(ids), f"{len(set(ids) - set(ran))} task(s) never ran"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_flush_during_a_line_of_40_loses_no_waiter_and_runs_none_twice(flushable):
    """40 waiters parked on one key behind a holder, from two nodes; the lock Redis is
    flushed (a restart without persistence). Every waiter runs exactly once and succeeds."""
    n, wa = flushable, flushable.wa
    k, key, holder = n.gated_holder("flush-line")
    try:
        wait_starts(wa, k, 1)
        waiters = [wa.in_line.apply_async((k, 0.05, f"w{i}"), queue=n.queue) for i in range(40)]
        wait_until(lambda: n.locks.llen(key + ":q") == 40, 60, 0.05, "40 waiters in line")
        n.locks.flushdb()  # the test's own lock Redis: the lock, the line and the parked messages go
    finally:
        open_gate(wa, k)
    holder.get(timeout=TIMEOUT)
    tags = sorted(w.get(timeout=90)["tag"] for w in waiters)
    assert tags == sorted(f"w{i}" for i in range(40))
    wait_until(lambda: len(starts(wa, k)) >= 41, TIMEOUT, 0.05, "every body")
    _each_ran_once(wa, k, [holder.id, *(w.id for w in waiters)])


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_flush_before_a_burst_of_parks_runs_none_twice(flushable):
    """The lock Redis is flushed in a lull; a burst of 30 calls of one key follows at
    once, before the sweepers noticed the loss: each runs exactly once (the parks made after the
    loss are not sent again, and a copy whose entry already ran is not run again)."""
    n, wa = flushable, flushable.wa
    warm = f"flush-warm-{uuid.uuid4().hex[:8]}"
    assert wa.in_line.apply_async((warm, 0.0, "warm"), queue=n.queue).get(timeout=TIMEOUT)["tag"] == "warm"
    for w in n.workers:  # every process's sweeper has looked at the index (it learnt the epoch)
        wait_until(lambda w=w: n.locks.exists("singleton_lock:{waiting}:epoch"), TIMEOUT, 0.05, "an epoch")
    k = f"flush-burst-{uuid.uuid4().hex[:8]}"
    n.locks.flushdb()
    calls = [wa.in_line.apply_async((k, 0.1, f"c{i}"), queue=n.queue) for i in range(30)]
    tags = sorted(c.get(timeout=90)["tag"] for c in calls)
    assert tags == sorted(f"c{i}" for i in range(30))
    wait_until(lambda: len(starts(wa, k)) >= 30, TIMEOUT, 0.05, "every body")
    time.sleep(3 * 1.25)  # a wrong re-send would show within a few sweeper rounds: give it the chance
    _each_ran_once(wa, k, [c.id for c in calls])
    assert_no_overlap(list(_spans(wa, k).values()), "bodies of one key")


def _spans(wa, k: str) -> dict[str, tuple[float, float]]:
    out: dict[str, list[float]] = {}
    for e in events(wa, k):
        out.setdefault(e["id"], [0.0, 0.0])[0 if e["event"] == "start" else 1] = e["at"]
    return {i: (s, e) for i, (s, e) in out.items()}


# -- the lock Redis's persistence, checked at worker start -------------------------------------------


@pytest.mark.timeout(30)
def test_persistence_check_warns_on_a_redis_that_forgets_and_tolerates_config_disabled(caplog):
    """At worker start each lock server is checked once: a Redis with no AOF and no RDB save points
    gets a WARNING; one with appendonly on does not; one whose CONFIG is disabled (managed Redis)
    is left alone, without an error."""
    import logging

    from celery_singleton_lock.engine import persistence
    from celery_singleton_lock.testing.servers import RedisServer

    caplog.set_level(logging.WARNING, logger="celery_singleton_lock")
    with RedisServer() as forgets, RedisServer(extra_args=["--rename-command", "CONFIG", ""]) as managed:
        server = LockServer.from_url(forgets.url(0))
        assert persistence.check_once(server) is False
        assert any("keeps no data across a restart" in r.getMessage() for r in caplog.records)
        assert persistence.check_once(server) is None  # once per server and process
        forgets.client(0).config_set("appendonly", "yes")
        assert persistence.persistent(forgets.client(0)) is True
        caplog.clear()
        assert persistence.check_once(LockServer.from_url(managed.url(0))) is None
        assert not caplog.records
