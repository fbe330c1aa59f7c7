"""The line moves under any backlog: real ``celery worker`` subprocesses, a real broker.

1. A busy queue: the key's queue is kept deeper than the lock TTL with other short tasks; each
   waiter's turn still comes at once (the turns queue), ONE publish per turn, in park order. On
   the Redis broker and on RabbitMQ, with Celery's default prefetch.
2. A slow broker (a proxy delays every delivery by more than the TTL): a sent turn keeps its
   reservation until it arrives; no livelock.

``lock_max_wait``, revoke and ``celery locks line`` / ``drop`` are in test_line_waiters.py; a sent
turn's record and the sweepers' part in test_line_turns.py.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from _backlog_support import LOCK_TTL, Nodes, line_of, start_nodes
from _fault_proxy import FaultProxy
from _line_support import events, open_gate, publishes, starts, wait_starts
from _task_support import TIMEOUT, assert_no_overlap

from celery_singleton_lock.delivery.turns import SUFFIX
from celery_singleton_lock.testing.servers import wait_until

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("collect_results")]


FILLER = 0.05  # seconds per backlog task


class Backlog:
    """Keeps the nodes' queue at least ``depth`` tasks deep with FILLER-second tasks until stopped."""

    def __init__(self, n: Nodes, depth: int) -> None:
        self.n, self.depth = n, depth
        self.stop = threading.Event()
        self.sent = 0
        self.thread = threading.Thread(target=self._feed, daemon=True, name="backlog")

    def __enter__(self) -> Backlog:
        self.thread.start()
        wait_until(lambda: self.n.depth() >= self.depth, TIMEOUT, 0.05, f"a backlog of {self.depth}")
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)

    def _feed(self) -> None:
        while not self.stop.is_set():
            missing = self.depth + 20 - self.n.depth()
            for _ in range(max(0, missing)):
                self.n.send("busy", (FILLER,), ignore_result=True)
                self.sent += 1
            self.stop.wait(0.05)


# -- 1. a busy queue ---------------------------------------------------------------------------------


def drain_under_backlog(n: Nodes, count: int = 6) -> None:
    wa = n.wa
    k = f"busy-{uuid.uuid4().hex[:8]}"
    key = wa.in_line.lock_key_for((k,), {})
    # the slots' throughput is at most 4 / FILLER tasks a second: this depth is > 2 x the lock TTL
    depth = int(2 * LOCK_TTL * 4 / FILLER)
    holder = n.send("in_line", (k, 0.0, "holder", True))
    try:
        wait_starts(wa, k, 1)
        with Backlog(n, depth):
            dups = [n.send("in_line", (k, FILLER, f"d{i}")) for i in range(count)]
            # each went through the backlog once, and parked
            wait_until(lambda: n.locks.llen(key + ":q") >= count, 60, 0.05, "every duplicate to park")
            parked_order = line_of(n.locks, key)
            open_gate(wa, k)
            opened = time.time()
            assert [d.get(timeout=TIMEOUT)["tag"] for d in dups] == [f"d{i}" for i in range(count)]
            drained = time.time() - opened
            assert n.depth() >= depth / 2, "the backlog was kept up during the drain"
    finally:
        open_gate(wa, k)
    holder.get(timeout=TIMEOUT)
    ran = starts(wa, k)
    assert sorted(e["id"] for e in ran) == sorted([holder.id, *(d.id for d in dups)]), "each ran once"
    assert_no_overlap([(s["at"], e["at"]) for s, e in zip(
        ran, [e for e in events(wa, k) if e["event"] == "end"], strict=False)])
    for d in dups:
        turns = [p for p in publishes(wa, d.id) if p.get("singleton_lock_entry")]
        assert len(turns) == 1, f"ONE turn for {d.id} (no re-park, no re-send), got {publishes(wa, d.id)}"
    assert [e["id"] for e in ran[1:]] == parked_order, "in park order"
    for w in n.workers:  # each said at start which turns queue it consumes
        assert f"also consumes the turns queues {n.queue}{SUFFIX}" in w.log()
    print(f"\n[line-load] {n.broker}: {count} turns under a {depth}-task backlog drained in {drained:.2f} s")


@pytest.mark.slow
def test_busy_redis_queue_does_not_stall_the_line(redis_nodes):
    drain_under_backlog(redis_nodes)


@pytest.mark.slow
def test_busy_rabbitmq_queue_does_not_stall_the_line(amqp_nodes):
    drain_under_backlog(amqp_nodes)


@pytest.mark.slow
def test_a_turn_goes_ahead_of_the_workers_own_prefetched_backlog(redis_server, tmp_path_factory):
    """Two prefork children, prefetch 4: while the holder runs in one child, the worker has already
    taken 8 fillers from the queue into its own buffer (the other child runs a ninth). The waiter's
    turn arrives behind them, and must not queue a second time there: its body starts as soon as a
    child is free, after at most the fillers that took the children first, not after the whole
    buffer. Before: after about 8."""
    with start_nodes(redis_server, tmp_path_factory, "redis", count=1) as n:
        wa = n.wa
        k = f"front-{uuid.uuid4().hex[:8]}"
        key = wa.in_line.lock_key_for((k,), {})
        holder = n.send("in_line", (k, 0.0, "holder", True))
        try:
            wait_starts(wa, k, 1)
            waiter = n.send("in_line", (k, 0.0, "waiter"))
            wait_until(lambda: n.locks.llen(key + ":q") >= 1, 60, 0.05, "the waiter to park")
            fillers = [n.send("journaled_filler", (k, 0.3)) for _ in range(10)]
            # one runs; the worker holds 8 in its own buffer (prefetch 4 x 2 children): 1 left queued
            wait_until(lambda: n.depth() <= 1, 60, 0.05, "the worker to prefetch 8 fillers")
        finally:
            open_gate(wa, k)
        assert waiter.get(timeout=TIMEOUT)["tag"] == "waiter"
        holder.get(timeout=TIMEOUT)
        for f in fillers:
            f.get(timeout=TIMEOUT)
        log = events(wa, k)
        kinds = [(e["event"], e["id"]) for e in log]
        holder_end = kinds.index(("end", holder.id))
        waiter_start = kinds.index(("start", waiter.id))
        ahead = [e for e in log[holder_end:waiter_start] if e["event"] == "filler"]
        assert len([e for e in log if e["event"] == "filler"]) == 10, "every filler ran"
        # the turn comes on a channel of its own (not when the prefetch window has room): it is at the
        # head of the buffer by the time a child is free, but for the filler the holder's own child may
        # have taken in the moment before it arrived (the benchmark's hot key under a backlog measures
        # what the channel of its own gains under a saturated queue)
        assert len(ahead) <= 1, f"{len(ahead)} prefetched filler(s) started between the release and the turn"


# -- 2. a slow broker --------------------------------------------------------------------------------

BROKER_DELAY = 2.5  # every delivery comes this late: longer than the lock TTL and a sweep together
SLOW_TTL = 1.0


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.long
def test_slow_broker_turns_keep_their_reservation_no_livelock(redis_server, tmp_path_factory):
    """Deliveries come BROKER_DELAY late (a proxy on the workers' consuming connection), longer than
    the lock TTL: a sent turn keeps the key reserved until it arrives, so every waiter runs, once,
    in park order, with ONE turn each. Before: the reservation passed on at the TTL, the late copy
    re-parked at the head with a new deadline and was handed again: waiters ran out of park order,
    with several turns each (with more waiters and a longer delay, no body ran at all)."""
    proxy = FaultProxy(redis_server.port)
    proxy.lag(b"BRPOP", BROKER_DELAY)
    env = {"CSL_LOCK_TTL": str(SLOW_TTL), "CSL_BROKER_READ_URL": proxy.url(0), "CSL_PREFETCH": "1"}
    try:
        with start_nodes(redis_server, tmp_path_factory, "redis", env=env, count=1) as n:
            wa = n.wa
            k = f"slow-{uuid.uuid4().hex[:8]}"
            key = wa.in_line.lock_key_for((k,), {})
            holder = n.send("in_line", (k, 0.0, "holder", True))
            try:
                wait_starts(wa, k, 1, timeout=60)
                dups = [n.send("in_line", (k, 0.0, f"d{i}")) for i in range(3)]
                wait_until(lambda: n.locks.llen(key + ":q") >= 3, 60, 0.05, "every duplicate to park")
                parked_order = line_of(n.locks, key)
            finally:
                open_gate(wa, k)
            deadline = time.monotonic() + 60
            assert [d.get(timeout=max(1.0, deadline - time.monotonic()))["tag"] for d in dups] == \
                ["d0", "d1", "d2"]
            holder.get(timeout=TIMEOUT)
            ran = starts(wa, k)
            assert [e["id"] for e in ran] == [holder.id, *parked_order], "each once, in park order"
            for d in dups:
                turns = [p for p in publishes(wa, d.id) if p.get("singleton_lock_entry")]
                assert len(turns) == 1, f"ONE turn for {d.id}, got {publishes(wa, d.id)}"
            assert proxy.lagged >= 1, "no consuming connection was slowed: the test did not run its fault"
    finally:
        proxy.close()
