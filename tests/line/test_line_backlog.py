"""The line moves under any backlog: real ``celery worker`` subprocesses, a real broker.

1. A busy queue: the key's queue is kept deeper than the lock TTL with other short tasks; each
   waiter's turn still comes at once (the turns queue), ONE publish per turn, in park order. On
   the Redis broker and on RabbitMQ, with Celery's default prefetch.
2. A slow broker (a proxy delays every delivery by more than the TTL): a sent turn keeps its
   reservation until it arrives; no livelock.
3. ``lock_max_wait`` counts from the first park and holds for a waiter that is not the head.
4. Revoke of a waiting task, or of one whose turn was sent: it leaves the line, the key passes on.
5. `celery locks line` / `drop`.
6. A copy whose turn passed on while it travelled (the turn timeout) goes back to the head of the
   line, not ahead of it, and is never dropped as "already ran"; its record lives as long as its
   reservation, and ends at its deadline.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
import uuid

import pytest
from _apps import make_app
from _fault_proxy import FaultProxy
from _line_support import events, open_gate, publishes, starts, wait_starts, worker_nodes
from _task_support import (
    ROOT,
    TIMEOUT,
    assert_no_overlap,
    load_worker_app,
    locked,
    rabbit_up,
    start_worker_process,
)
from celery import Celery

from celery_singleton_lock import LockedTask, LockServer, LockWaitTimeout, held
from celery_singleton_lock.delivery.headers import turn_of
from celery_singleton_lock.delivery.turns import SUFFIX, TurnsConsumer
from celery_singleton_lock.engine import line as queue
from celery_singleton_lock.engine import scripts
from celery_singleton_lock.engine.line import SWEEP_INTERVAL, SWEEP_LEASE
from celery_singleton_lock.engine.lock import Handoff, Lock, slot_safe
from celery_singleton_lock.testing.servers import wait_until

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("collect_results")]

AMQP_URL = "amqp://guest:guest@127.0.0.1:5672//"
LOCK_TTL = 2.0
FILLER = 0.05  # seconds per backlog task
SWEEP_SLACK = SWEEP_INTERVAL * 1.25 + SWEEP_LEASE + 5.0  # a sweeper's look, plus a loaded machine's slack
WORKER_ENV = {"CSL_LOCK_TTL": str(LOCK_TTL), "CSL_JOURNAL_HANDOFF": "1", "CSL_PREFETCH": "4"}


class Nodes:
    """Two prefork workers x 2 children on ``queue``, and a client app that sends by task name."""

    def send(self, task: str, args, **options):
        return self.client.send_task(f"apps.worker_app.{task}", args, queue=options.pop("queue", self.queue),
                                     **options)

    def depth(self) -> int:
        if self.broker == "redis":
            return int(self.broker_redis.llen(self.queue))
        with self.client.connection_for_write() as conn:
            return int(conn.default_channel.queue_declare(self.queue, passive=True).message_count)


@contextlib.contextmanager
def start_nodes(redis_server, tmp_path_factory, broker: str, env: dict | None = None, count: int = 2,
                concurrency: int = 2):
    wa = load_worker_app(redis_server)
    n = Nodes()
    # locks of their own per broker: a sweeper sends a waiter through its OWN app's broker
    lock_db = 4 if broker == "amqp" else 2
    n.wa, n.locks, n.broker = wa, redis_server.client(lock_db), broker
    n.broker_redis = redis_server.client(0)
    n.queue = f"csl-ll-{broker}-{uuid.uuid4().hex[:8]}"
    url = AMQP_URL if broker == "amqp" else redis_server.url(0)
    n.client = Celery(f"client-{uuid.uuid4().hex[:6]}", broker=url, backend=redis_server.url(1),
                      set_as_current=False)
    n.client.conf.update(result_expires=None, broker_heartbeat=0)
    logdir = tmp_path_factory.mktemp(f"line-load-{broker}")
    extra_env = {**WORKER_ENV, **(env or {}), "CSL_LOCK_URL": redis_server.url(lock_db),
                 **({"CSL_BROKER_URL": AMQP_URL} if broker == "amqp" else {})}
    specs = {f"{broker}-node{i}": (n.queue, concurrency, extra_env) for i in range(count)}
    try:
        with worker_nodes(redis_server, logdir, specs) as started:
            n.workers = list(started.values())
            yield n
    finally:
        if broker == "amqp":
            with n.client.connection_for_write() as conn:
                for q in (n.queue, n.queue + SUFFIX):
                    with contextlib.suppress(Exception):
                        conn.default_channel.queue_delete(q)


@pytest.fixture(scope="module")
def redis_nodes(redis_server, tmp_path_factory):
    with start_nodes(redis_server, tmp_path_factory, "redis") as n:
        yield n


@pytest.fixture
def amqp_nodes(redis_server, tmp_path_factory):
    if not rabbit_up():
        pytest.skip("RabbitMQ: nothing accepts connections on 127.0.0.1:5672")
    with start_nodes(redis_server, tmp_path_factory, "amqp") as n:
        yield n


# -- the workers' journal (Redis db 3; the rest in tests/_line_support.py) ----------------------------


def line_of(locks, key: str) -> list[str]:
    """The task ids in ``key``'s line, next first."""
    entries = locks.lrange(key + ":q", 0, -1)
    if not entries:
        return []
    return [rec.split(b"\n", 4)[3].decode() for rec in locks.hmget(key + ":w", entries) if rec]


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


# -- 3. lock_max_wait: from the first park, for every waiter ------------------------------------------


@pytest.mark.slow
def test_lock_max_wait_fails_a_waiter_that_is_not_the_head(redis_nodes):
    """A patient plain waiter (held(..., wait=60)) at the head, a task with lock_max_wait 6 s behind
    it: the task FAILS with LockWaitTimeout at its own deadline (before: the sweeper's scan stopped
    at the live head, and the task stayed WAITING as long as the head waited)."""
    n, wa = redis_nodes, redis_nodes.wa
    k = f"maxwait-{uuid.uuid4().hex[:8]}"
    key = wa.in_line_wait6.lock_key_for((k,), {})
    server = LockServer.from_url(redis_url(n.locks))
    holder = n.send("in_line_wait6", (k, "holder", True))
    out: list = []

    def patient() -> None:
        try:
            with held(server, key, ttl=30, wait=60):
                out.append("ran")
        except Exception as exc:
            out.append(exc)

    thread = threading.Thread(target=patient, daemon=True)
    try:
        wait_starts(wa, k, 1)
        thread.start()
        wait_until(lambda: n.locks.llen(key + ":q") == 1, TIMEOUT, 0.02, "the plain waiter at the head")
        late = n.send("in_line_wait6", (k, "late"))
        wait_until(lambda: late.state == "WAITING", TIMEOUT, 0.05, "the task to wait behind it")
        parked = time.time()
        # its deadline (6 s) plus a sweeper's look, on a machine loaded by the whole suite: well before
        # the head's own 60 s wait, which is what the task waited for before
        bound = 6 + SWEEP_SLACK + 10
        with pytest.raises(LockWaitTimeout):
            late.get(timeout=bound)
        assert time.time() - parked <= bound
        assert line_of(n.locks, key) != [late.id] and n.locks.llen(key + ":q") == 1, "only the plain waiter"
    finally:
        open_gate(wa, k)
        thread.join(TIMEOUT)
        server.close()
    assert out == ["ran"] and [e["id"] for e in starts(wa, k)] == [holder.id]


@pytest.mark.slow
def test_lock_max_wait_counts_from_the_first_park(redis_nodes):
    """A copy of a waiting task that first parked 10 s ago (lock_max_wait 6 s) and finds the key
    held again: it FAILS with LockWaitTimeout at once and leaves the line (before: it parked
    again with a new deadline, WAITING, and each re-park reset its wait)."""
    n, wa = redis_nodes, redis_nodes.wa
    k = f"firstpark-{uuid.uuid4().hex[:8]}"
    key = wa.in_line_wait6.lock_key_for((k,), {})
    holder = n.send("in_line_wait6", (k, "holder", True))
    try:
        wait_starts(wa, k, 1)
        waiter = n.send("in_line_wait6", (k, "w"))
        wait_until(lambda: waiter.state == "WAITING", TIMEOUT, 0.05, "the waiter to park")
        [entry] = n.locks.lrange(key + ":q", 0, -1)
        body = parked_body(n.locks.hget(key + ":w", entry))
        turn = turn_of(body["options"]["headers"])
        headers = {**body["options"]["headers"],
                   **dataclasses.replace(turn, entry=entry.decode(), why="run", parked_at=time.time() - 10).header()}
        # its copy, as a hand-off would send it, that lost its turn and finds the key held
        n.client.send_task(body["task"], body["args"], body["kwargs"], task_id=waiter.id, headers=headers,
                           queue=n.queue)
        with pytest.raises(LockWaitTimeout):  # at once: not a whole new lock_max_wait (6 s) later
            waiter.get(timeout=4)
        wait_until(lambda: n.locks.llen(key + ":q") == 0, TIMEOUT, 0.05, "its old place to go")
    finally:
        open_gate(wa, k)
    holder.get(timeout=TIMEOUT)
    assert [e["id"] for e in starts(wa, k)] == [holder.id]


def parked_body(record: bytes) -> dict:
    """The task message a waiter parked (its record's last field), as a signature dict."""
    from kombu.serialization import loads

    message = record.split(b"\n", 4)[4]
    content_type, encoding, data = message.split(b"\n", 2)
    return loads(data, content_type.decode(), encoding.decode(), accept=[content_type.decode()])


def redis_url(client) -> str:
    kw = client.connection_pool.connection_kwargs
    return f"redis://{kw['host']}:{kw['port']}/{kw.get('db', 0)}"


# -- 4. revoke -----------------------------------------------------------------------------------------


def holder_and_two_parked(n: Nodes, k: str, key: str) -> tuple:
    """A gated holder of ``k``, started, and ``a`` then ``b`` parked behind it, in that order."""
    holder = n.send("in_line", (k, 0.0, "holder", True))
    wait_starts(n.wa, k, 1)
    a = n.send("in_line", (k, 0.0, "a"))
    wait_until(lambda: n.locks.llen(key + ":q") == 1, TIMEOUT, 0.02, "a to park")
    b = n.send("in_line", (k, 0.0, "b"))
    wait_until(lambda: n.locks.llen(key + ":q") == 2, TIMEOUT, 0.02, "b to park")
    return holder, a, b


def b_ran_in_place_of_a(n: Nodes, k: str, holder, b) -> None:
    """``b`` ran, and of ``k``'s calls only the holder and ``b`` did (``a`` left the line)."""
    assert b.get(timeout=TIMEOUT)["tag"] == "b"
    holder.get(timeout=TIMEOUT)
    assert [e["id"] for e in starts(n.wa, k)] == [holder.id, b.id]


@pytest.mark.slow
def test_revoke_takes_a_waiting_task_out_of_the_line(redis_nodes):
    """AsyncResult.revoke() of a parked task: it leaves the line, its state is REVOKED, it never
    runs, and the waiter behind it runs in its place (before: nothing took it out; it stayed WAITING
    and ran in its turn)."""
    n, wa = redis_nodes, redis_nodes.wa
    k = f"revoke-{uuid.uuid4().hex[:8]}"
    key = wa.in_line.lock_key_for((k,), {})
    try:
        holder, a, b = holder_and_two_parked(n, k, key)
        a.revoke()
        wait_until(lambda: a.state == "REVOKED", TIMEOUT, 0.05, "a to be REVOKED")
        assert line_of(n.locks, key) == [b.id]
    finally:
        open_gate(wa, k)
    b_ran_in_place_of_a(n, k, holder, b)
    assert a.state == "REVOKED"


@pytest.mark.slow
def test_revoke_of_a_task_whose_turn_was_sent_passes_the_key_on_at_once(redis_nodes):
    """The key is reserved for A, whose turn is on its way (a slow queue: 60 s of reservation left):
    revoking A passes the key to B at once, not when A's reservation runs out."""
    n, wa = redis_nodes, redis_nodes.wa
    k = f"revoke-sent-{uuid.uuid4().hex[:8]}"
    key = wa.in_line.lock_key_for((k,), {})
    server = LockServer.from_url(redis_url(n.locks))
    try:
        holder, a, b = holder_and_two_parked(n, k, key)
        # the holder's key handed to A, A's turn "sent" and slow: reserved for A for 60 s
        reply = server.run(scripts.FORCE_RELEASE, server.keys_for(key), ("",))
        [handed] = [Handoff.parse(key, item) for item in reply[2:]]
        assert handed.owner_id == a.id
        server.turn_timeout = 60.0
        assert server.confirm(key, handed.entry) and n.locks.pttl(key) > 30_000
        a.revoke()
        revoked = time.time()
        assert b.get(timeout=TIMEOUT)["tag"] == "b"
        assert starts(wa, k)[-1]["at"] - revoked < 30, "B ran long before A's reservation ran out"
        assert a.state == "REVOKED"
    finally:
        open_gate(wa, k)
        server.close()
    b_ran_in_place_of_a(n, k, holder, b)


# -- 5. celery locks line / drop ---------------------------------------------------------------------


def celery_cli(*args: str):
    """``python -m celery -A apps.worker_app <args>``, as the workers run (cwd tests/)."""
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "apps.worker_app", *args],
        cwd=ROOT / "tests", capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)]), **WORKER_ENV},
    )


@pytest.mark.slow
def test_cli_lists_a_line_in_order_and_drops_one_waiter(redis_nodes):
    """`celery locks line KEY` lists the waiters in order (place, task id, state, waited, gives up
    in); `celery locks drop KEY TASK_ID --yes` takes one out (REVOKED; it never runs), with the
    exit statuses of `release`: 0 done, 1 nothing there, 2 a bad key."""
    n, wa = redis_nodes, redis_nodes.wa
    k = f"cli-{uuid.uuid4().hex[:8]}"
    key = wa.in_line.lock_key_for((k,), {})
    try:
        holder, a, b = holder_and_two_parked(n, k, key)
        out = celery_cli("locks", "line", key, "--json")
        assert out.returncode == 0, out.stderr
        rows = json.loads(out.stdout)
        assert [(r["place"], r["task_id"], r["state"]) for r in rows] == [(1, a.id, "parked"), (2, b.id, "parked")]
        assert all(r["waited_ms"] >= 0 and 0 < r["gives_up_in_ms"] <= 3600_000 for r in rows)
        assert rows[0]["waited_ms"] >= rows[1]["waited_ms"] and rows[0]["args"][0] == k
        text = celery_cli("locks", "line", key)
        assert text.returncode == 0 and a.id in text.stdout.splitlines()[1] and b.id in text.stdout.splitlines()[2]
        out = celery_cli("locks", "drop", key, a.id, "--yes")
        assert out.returncode == 0, (out.stdout, out.stderr)
        assert f"task {a.id} dropped from the line of lock {key} by user" in out.stdout
        assert a.state == "REVOKED" and line_of(n.locks, key) == [b.id]
        assert celery_cli("locks", "drop", key, a.id, "--yes").returncode == 1, "no such waiter any more"
        assert celery_cli("locks", "drop", key + "x", a.id, "--yes").returncode == 2, "not a lock key"
        assert celery_cli("locks", "line", wa.in_line.lock_key_for(("nobody",), {})).returncode == 1
    finally:
        open_gate(wa, k)
    b_ran_in_place_of_a(n, k, holder, b)


# -- 6. a sent turn's record, in the engine (a real Redis, no worker) -----------------------------------


def test_a_sent_turn_keeps_its_record_and_reservation_then_ends_at_its_deadline(plain_server):
    """A turn sent and confirmed: the key stays reserved for it up to the turn timeout, and its record
    lives at least as long (before: one lock TTL, and the record could expire with the waiters hash
    while the copy travelled: "already ran", WAITING forever). Once the turn timeout passed the key on,
    the record stays out of the line until its lock_max_wait deadline, when the sweep fails it
    ("expired"; before: nothing ever timed it out)."""
    server = plain_server
    name = f"record-{uuid.uuid4().hex[:8]}"
    key = slot_safe(name)
    client = server.client
    holder = server.acquire(name, 5, owner_id="holder")
    assert queue.park(server, name, "e1", kind="t", wait=60, ttl=5, owner_id="w1", message=b"m").place == 1
    [turn] = server.release(holder).handoffs  # no sender here: reserved, not yet sent
    assert turn.entry == "e1"
    server.turn_timeout = 120.0
    assert server.confirm(name, "e1")
    assert client.pttl(key) > 100_000, "reserved for the sent turn up to the turn timeout"
    assert client.pttl(key + ":w") > 120_000, "its record outlives the reservation"

    name = f"record-late-{uuid.uuid4().hex[:8]}"
    key = slot_safe(name)
    holder = server.acquire(name, 5, owner_id="holder")
    queue.park(server, name, "e2", kind="t", wait=1.5, ttl=0.2, owner_id="w2", message=b"m")
    server.turn_timeout = 0.4
    server.release(holder)
    assert server.confirm(name, "e2")
    wait_until(lambda: not client.exists(key), 5, 0.05, "the turn timeout to pass the key on")
    next_ms, handoffs = queue.sweep(server, name)
    assert handoffs == () and next_ms > 0 and client.hexists(key + ":w", "e2"), "kept until its deadline"
    expired = wait_until(lambda: queue.sweep(server, name)[1], 5, 0.1, "the deadline")
    assert [(h.what, h.owner_id) for h in expired] == [("expired", "w2")]
    assert not client.exists(key + ":w", key + ":q")


def test_start_worker_consumes_the_turns_queue_of_each_of_its_queues(redis_server, run_worker):
    """celery.contrib.testing.worker.start_worker (as `celery worker -Q`) with a LockedTask: the
    worker also consumes <queue>.singleton_turns for each queue it consumes, and no more."""
    app = make_app(redis_server)
    queues = [f"csl-tq-{uuid.uuid4().hex[:8]}", f"csl-tq-{uuid.uuid4().hex[:8]}"]

    @locked(app, lock_key=["k"], on_duplicate="retry")
    def job(self, k):
        return k

    with run_worker(app, pool="threads", concurrency=1, queues=queues) as worker:
        assert sorted(app.amqp.queues.consume_from) == sorted(queues)  # the task channel: as asked
        step = next(s for s in worker.consumer.steps if isinstance(s, TurnsConsumer))
        (consumer,) = step.consumers  # the turns queues: a consumer and channel of their own
        assert sorted(q.name for q in consumer.queues) == sorted(q + SUFFIX for q in queues)
        assert consumer.channel is not worker.consumer.task_consumer.channel
        assert job.apply_async(("x",), queue=queues[1]).get(timeout=TIMEOUT) == "x"


def test_a_late_copy_never_takes_a_free_key_ahead_of_live_waiters(plain_server):
    """A's turn was sent, its reservation passed on to B, and B's (never sent) ran out too: the key is
    free, B waits at the head. A's late copy does not take the key ahead of B (before: it did, as its
    entry was out of the line); it goes back to the head (it is the oldest), and the sweep hands it
    the key in its turn."""
    server = plain_server
    name = f"late-fifo-{uuid.uuid4().hex[:8]}"
    key = slot_safe(name)
    client = server.client
    holder = server.acquire(name, 5, owner_id="holder")
    queue.park(server, name, "ea", kind="t", wait=60, ttl=0.2, owner_id="a", message=b"m")
    queue.park(server, name, "eb", kind="t", wait=60, ttl=0.2, owner_id="b", message=b"m")
    [turn] = server.release(holder).handoffs
    assert turn.owner_id == "a" and server.confirm(name, "ea")  # sent: reserved up to the turn timeout
    client.pexpire(key, 1)  # ... which ran out: the key passes on (a purged or very slow queue)
    wait_until(lambda: not client.exists(key), 5, 0.01, "A's reservation to run out")
    _, handed = queue.sweep(server, name)
    assert [h.owner_id for h in handed] == ["b"]  # B's turn, never sent (no sender here)
    wait_until(lambda: not client.exists(key), 5, 0.01, "B's reservation to run out")
    late = server.acquire(name, 5, owner_id="a", entry="ea")
    assert not isinstance(late, Lock), "A's late copy took the key ahead of B"
    assert late.queued  # free, but waiters are in line
    assert queue.park(server, name, "ea", kind="t", wait=50, ttl=0.2, owner_id="a", message=b"m", first=True,
                      again=True).found is queue.Park.PARKED  # its own copy (it carries the entry) parks anew
    _, handed = queue.sweep(server, name)
    assert [h.owner_id for h in handed] == ["a"], "the oldest waiter first"


@pytest.mark.slow
@pytest.mark.long
def test_a_sweeper_leaves_alone_the_waiters_of_a_task_its_process_cannot_send(redis_server, tmp_path_factory):
    """Two apps share one lock Redis and prefix. Only app A's process sweeps while app B's waiter runs
    out of lock_max_wait: A's sweeper must leave B's line alone (before: it timed the waiter out,
    could not send B's task, and the waiter stayed WAITING for ever). Once a worker of B runs again,
    its own sweeper fails the waiter with LockWaitTimeout."""
    from celery_singleton_lock.engine import sweeper as sweeping

    logdir = tmp_path_factory.mktemp("foreign-sweeper")
    wa = load_worker_app(redis_server)
    queue_b = f"csl-fs-{uuid.uuid4().hex[:8]}"
    k = f"foreign-{uuid.uuid4().hex[:8]}"
    key = wa.in_line_wait6.lock_key_for((k,), {})
    client = Celery(f"client-{uuid.uuid4().hex[:6]}", broker=redis_server.url(0), backend=redis_server.url(1),
                    set_as_current=False)
    client.conf.update(result_expires=None)
    # app A, in this process, on the same lock Redis and prefix (a database of their own, so that no
    # other test's workers sweep it): its sweeper watches the index
    lock_url = redis_server.url(5)
    app_a = make_app(redis_server)
    app_a.conf.singleton_lock_url = lock_url

    @app_a.task(base=LockedTask, shared=False, name=f"a.job_{uuid.uuid4().hex[:6]}")
    def a_job(n):
        return n

    server_a = a_job.lock_server()
    sweeping.get_sweeper().watch(server_a, a_job.lock_settings().index)
    # this process stands for app A alone: forget B's task if an earlier test here ever locked with it
    from celery_singleton_lock.delivery import handoff

    handoff._apps.pop(wa.in_line_wait6.name, None)
    handoff._heads.discard(f"{wa.in_line_wait6.lock_settings().prefix}:{wa.in_line_wait6.name}")
    plain = LockServer.from_url(lock_url)
    env = {**WORKER_ENV, "CSL_LOCK_TTL": "5", "CSL_LOCK_URL": lock_url}
    worker = start_worker_process(redis_server, logdir, concurrency=1, env=env, extra=("-Q", queue_b), name="b1")
    try:
        worker.wait_ready(90)
        with held(plain, key, ttl=30):  # the key is held (by plain code here) for the whole test
            late = client.send_task("apps.worker_app.in_line_wait6", (k, "late"), queue=queue_b)
            wait_until(lambda: late.state == "WAITING", TIMEOUT, 0.05, "B's task to wait in the line")
            worker.stop()  # no process of B left: only A's sweeper looks at the line
            time.sleep(6 + SWEEP_INTERVAL * 3)  # past the waiter's deadline, with several looks of A's sweeper
            assert line_of(plain.client, key) == [late.id], "A's sweeper took B's waiter out of the line"
            worker = start_worker_process(redis_server, logdir, concurrency=1, env=env, extra=("-Q", queue_b),
                                          name="b2")
            worker.wait_ready(90)
            with pytest.raises(LockWaitTimeout):
                late.get(timeout=SWEEP_SLACK + 10)
    finally:
        worker.stop()
        plain.close()


def test_a_park_lost_with_the_data_whose_send_fails_is_sent_again_at_the_next_look(plain_server):
    """The lock Redis lost its data while the broker is unreachable: the sweeper's send of the lost park
    raises. It keeps the park and sends it at its next look (it used to forget it: the call was lost)."""
    from celery_singleton_lock.engine.sweeper import Sweeper

    server = plain_server
    name = f"lost-{uuid.uuid4().hex[:8]}"
    assert isinstance(server.acquire(name, 30, owner_id="holder"), Lock)
    entry = queue.new_entry()
    assert queue.park(server, name, entry, kind="t", wait=60, ttl=5, owner_id="waiter", message=b"msg").place == 1
    sent: list[Handoff] = []

    def send(srv, handoff):
        sent.append(handoff)
        if len(sent) == 1:
            raise ConnectionError("the broker is unreachable")
        return True

    server.send_handoff = send
    sweeper = Sweeper(interval=0.2)
    try:
        sweeper.remember(server, name, entry, "waiter", 5, b"msg")
        server.client.flushdb()  # the lock db's data is lost
        wait_until(lambda: len(sent) >= 2, 10, 0.02, "the lost park to be sent again after the failed send")
        assert [(h.what, h.entry, h.owner_id) for h in sent[:2]] == [("recovered", entry, "waiter")] * 2
        wait_until(lambda: sweeper.parked_count() == 0, 5, 0.02, "the sent park to be forgotten")
        assert len(sent) == 2
    finally:
        sweeper.stop()
