"""Hot keys: a duplicate waits its turn in the key's FIFO line and is handed the lock on release.

Against real redis-servers and real ``celery worker`` subprocesses (prefork):

1. FIFO across two nodes: 30 duplicates park one by one; each body runs once, none overlap, they
   start in the order they parked, and each caused ONE park and ONE hand-off publish (no re-sends).
2. A chain and a chord through a waiting task carry on with the right values.
3. Every SIGKILL point loses no waiter and runs none twice: the holder mid-body, a waiter right
   after it parked, the releaser between the release script and the publish (hooks: the
   CSL_TEST_KILL_AT environment variable, see tests/apps/kill_points.py).
4. A restart of the lock Redis (its data gone) with waiters parked: each runs once, soon.
5. A line that does not move: LockWaitTimeout (FAILURE) and the errback fires.
6. Plain ``held(..., wait=...)``: FIFO, woken by the release, a timed-out waiter leaves the line,
   a SIGKILLed holder lets the waiters in within its TTL.

The hand-off latencies (release to the next body's start) are printed, not asserted: they are
benchmark material.
"""

from __future__ import annotations

import gc
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid

import pytest
from _line_support import events, open_gate, parks, publishes, starts, wait_starts, worker_nodes
from _task_support import ROOT, TIMEOUT, assert_no_overlap, load_worker_app, start_worker_process
from celery import chain, chord
from celery.exceptions import WorkerLostError

from celery_singleton_lock import LockContended, LockServer, LockWaitTimeout, held
from celery_singleton_lock.engine.line import LONGEST_BLOCK, SWEEP_INTERVAL, SWEEP_LEASE
from celery_singleton_lock.engine.lock import slot_safe
from celery_singleton_lock.testing.servers import wait_until

pytestmark = [pytest.mark.timeout(150), pytest.mark.usefixtures("collect_results")]

LOCK_TTL = 3.0  # the workers' singleton_lock_ttl here (CSL_LOCK_TTL)
SWEEP_LATE = SWEEP_INTERVAL * 1.25  # the sweeper's longest pause between two looks (jittered +-25%)
FEW = 5.0  # "a few seconds": slack for a loaded two-core machine on top of every bound below
WORKER_ENV = {"CSL_LOCK_TTL": str(LOCK_TTL), "CSL_JOURNAL_HANDOFF": "1"}


@pytest.fixture(scope="module")
def nodes(lock_nodes, redis_server, tmp_path_factory):
    """Two prefork workers x 2 children on ``queue``, and two single-child workers with a fault hook,
    their locks on the backend under test (the session's private Redis, or etcd)."""
    n = lock_nodes
    env = {**WORKER_ENV, "CSL_LOCK_URL": n.url}
    tag = uuid.uuid4().hex[:8]
    n.queue, n.q_parked, n.q_handoff = f"csl-ho-{tag}", f"csl-ho-parked-{tag}", f"csl-ho-handoff-{tag}"
    specs = {"node0": (n.queue, 2, env), "node1": (n.queue, 2, env),
             "kill-parked": (n.q_parked, 1, {**env, "CSL_TEST_KILL_AT": "parked"}),
             "kill-handoff": (n.q_handoff, 1, {**env, "CSL_TEST_KILL_AT": "handoff"})}
    with worker_nodes(redis_server, tmp_path_factory.mktemp("handoff"), specs) as started:
        n.workers = [started["node0"], started["node1"]]
        n.kill_parked, n.kill_handoff = started["kill-parked"], started["kill-handoff"]
        yield n


# -- the journal the workers write (Redis db 3; the rest in tests/_line_support.py) -----------------


def wait_ends(wa, k: str, count: int, timeout: float = TIMEOUT) -> list[dict]:
    def ends():
        found = [e for e in events(wa, k) if e["event"] == "end"]
        return len(found) >= count and found
    return wait_until(ends, timeout, 0.02, f"{count} end(s) of {k}")


def intervals(wa, k: str, without: str | None = None) -> dict[str, tuple[float, float]]:
    """task id -> (start, end) of its body's last run, for every id but ``without`` (a holder that was
    killed mid-body). A body with no journaled start or end fails here: it cannot be checked for overlap."""
    out: dict[str, list[float | None]] = {}
    for e in events(wa, k):
        if e["id"] != without:
            out.setdefault(e["id"], [None, None])[0 if e["event"] == "start" else 1] = e["at"]
    missing = [i for i, (s, e) in out.items() if s is None or e is None]
    assert not missing, f"bodies of {k} without a journaled start or end: {missing}"
    return {i: (s, e) for i, (s, e) in out.items()}  # type: ignore[misc]


def park_one_by_one(n, task, k: str, key: str, args_of, count: int, queue: str | None = None) -> list:
    """Send ``count`` duplicates, each after the previous one is visibly in line: the order in which
    they found the key held is then the order they were sent."""
    sent = []
    base = n.line_len(key)
    for i in range(count):
        sent.append(task.apply_async(args_of(i), queue=queue or n.queue))
        have = base + len(sent)
        wait_until(lambda have=have: n.line_len(key) >= have, TIMEOUT, 0.005, f"waiter {i} of {k} to park")
    return sent


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def report(capsys, what: str, samples: list[float]) -> None:
    with capsys.disabled():
        print(
            f"\n[hand-off latency] {what}: n={len(samples)} p50={percentile(samples, 50) * 1000:.1f} ms "
            f"p99={percentile(samples, 99) * 1000:.1f} ms max={max(samples) * 1000:.1f} ms "
            f"mean={statistics.mean(samples) * 1000:.1f} ms"
        )


def note(capsys, text: str) -> None:
    """A measurement for the record (printed even under -q; never asserted beyond its bound)."""
    with capsys.disabled():
        print(f"\n[handoff] {text}")


# -- 1. FIFO across two nodes ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_fifo_across_two_nodes_one_park_and_one_send_each(nodes, capsys):
    """30 duplicates of one key from two worker nodes: every body runs exactly once, none overlap,
    they start in the order they parked, and each caused ONE park and ONE hand-off publish."""
    n, wa = nodes, nodes.wa
    children = {w.pid: set(w.children()) for w in n.workers}
    k, key, holder = n.gated_holder("fifo")
    try:
        [first] = wait_starts(wa, k, 1)
        assert first["id"] == holder.id
        dups = park_one_by_one(n, wa.in_line, k, key, lambda i: (k, 0.02, f"d{i}"), 30)
        # parked, not polling: WAITING with its place, no worker slot held
        wait_until(lambda: all(d.state == "WAITING" for d in dups), TIMEOUT, 0.05, "every duplicate WAITING")
        assert [d.info["place"] for d in dups] == list(range(1, 31))
        assert all(d.info["holder"] == holder.id and d.info["key"] == key for d in dups)
        assert len(starts(wa, k)) == 1
    finally:
        open_gate(wa, k)
    assert holder.get(timeout=TIMEOUT)["tag"] == "holder"
    assert [d.get(timeout=60)["tag"] for d in dups] == [f"d{i}" for i in range(30)]

    ran = starts(wa, k)
    ids = [holder.id, *(d.id for d in dups)]
    assert sorted(e["id"] for e in ran) == sorted(ids), "every body ran exactly once"
    by_fence = [e["id"] for e in sorted(ran, key=lambda e: e["fence"])]
    by_start = [e["id"] for e in sorted(ran, key=lambda e: e["at"])]
    assert by_fence == ids and by_start == ids, "they ran in the order they parked (first come, first served)"
    spans = intervals(wa, k)
    assert_no_overlap(list(spans.values()), "bodies of one key")

    pids = [parks(wa, d.id) for d in dups]
    assert all(len(p) == 1 and p[0]["policy"] == "retry" for p in pids), "ONE park per duplicate"
    node_of = {pid: node for node, kids in children.items() for pid in kids}
    assert {node_of.get(p[0]["pid"]) for p in pids} == set(children), "both nodes parked duplicates"
    for d in dups:
        sent = publishes(wa, d.id)
        assert len(sent) == 1, f"ONE hand-off publish for {d.id}, got {sent}"
        assert sent[0].get("singleton_lock_entry") and set(sent[0]) & {
            "singleton_lock_recovered", "singleton_lock_expired", "singleton_lock_backoff"} == set()
    assert publishes(wa, holder.id) == []
    n.nothing_left(key)

    # release (the previous body's end) -> the next body's start, one host
    order = [spans[i] for i in ids]
    gaps = [nxt[0] - prev[1] for prev, nxt in zip(order, order[1:], strict=False)]
    report(capsys, "task to task, 2 prefork nodes", gaps)


# -- 2. chains and chords through a waiting task -------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_chain_through_a_waiting_task(nodes):
    """chain(a, waiting, c): the middle link waits in line behind a holder, then the chain carries on
    with the right value, after the holder."""
    n, wa = nodes, nodes.wa
    k = f"chain-{uuid.uuid4().hex[:8]}"
    key = wa.in_line_append.lock_key_for(([], k, "x"), {})
    holder = wa.in_line_append.apply_async(([], k, "holder", True), queue=n.queue)
    try:
        wait_starts(wa, k, 1)
        result = chain(
            wa.plain_append.s([], "a").set(queue=n.queue),
            wa.in_line_append.s(key=k, tag="w").set(queue=n.queue),
            wa.plain_append.s(tag="c").set(queue=n.queue),
        ).apply_async()
        waiting = result.parent
        wait_until(lambda: waiting.state == "WAITING", TIMEOUT, 0.02, "the middle link to wait in line")
        assert n.line_len(key) == 1
        assert not result.ready() and result.parent.parent.get(timeout=TIMEOUT) == ["a"]
    finally:
        open_gate(wa, k)
    assert holder.get(timeout=TIMEOUT) == ["holder"]
    assert result.get(timeout=TIMEOUT) == ["a", "w", "c"]
    assert waiting.get(timeout=TIMEOUT) == ["a", "w"]
    spans = intervals(wa, k)
    assert [e["id"] for e in starts(wa, k)] == [holder.id, waiting.id]
    assert spans[waiting.id][0] >= spans[holder.id][1]
    # published twice by the workers: by the chain's first link, then ONCE when its turn came
    sent = publishes(wa, waiting.id)
    assert len(sent) == 2 and [bool(p.get("singleton_lock_entry")) for p in sent] == [False, True], sent
    assert len(parks(wa, waiting.id)) == 1
    n.nothing_left(key)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_chord_whose_header_waits_on_itself(nodes):
    """A chord whose header has two calls of one key: one waits for the other; the body gets both."""
    n, wa = nodes, nodes.wa
    k = f"chord-{uuid.uuid4().hex[:8]}"
    key = wa.in_line_append.lock_key_for(([], k, "x"), {})
    header = [wa.in_line_append.s([], k, tag, True).set(queue=n.queue) for tag in ("h1", "h2")]
    try:
        result = chord(header)(wa.collect.s().set(queue=n.queue))
        wait_until(lambda: n.line_len(key) == 1, TIMEOUT, 0.02, "one header call to wait in line")
        wait_starts(wa, k, 1)  # the holder may park its rival before it journals its own start
        assert len(starts(wa, k)) == 1 and not result.ready()
    finally:
        open_gate(wa, k)
    assert result.get(timeout=TIMEOUT) == [["h1"], ["h2"]]
    ran = starts(wa, k)
    assert len(ran) == 2 and len({e["id"] for e in ran}) == 2
    assert_no_overlap(list(intervals(wa, k).values()), "the chord's header calls")
    waited = [e["id"] for e in ran][1]
    assert len(parks(wa, waited)) == 1 and len(publishes(wa, waited)) == 1
    n.nothing_left(key)


# -- 3. every SIGKILL point -------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_holder_killed_mid_body_waiters_run_once_after_its_lock_expired(nodes, capsys):
    """SIGKILL of the holder's pool child: nobody releases; its lock expires within the TTL, then a
    sweeper in another process passes the key on, and each waiter runs once, in order."""
    n, wa = nodes, nodes.wa
    k, key, holder = n.gated_holder("kill-holder")
    try:
        [first] = wait_starts(wa, k, 1)
        waiters = park_one_by_one(n, wa.in_line, k, key, lambda i: (k, 0.05, f"w{i}"), 3)
        assert any(first["pid"] in w.children() for w in n.workers)
        os.kill(first["pid"], signal.SIGKILL)  # the pool child only, by PID
        killed_at = time.time()  # also before the PTTL: a stall after its reply must not move the expiry later
        pttl = n.pttl(key)
        assert 0 < pttl <= LOCK_TTL * 1000  # nobody renews it now
        expires_at = killed_at + pttl / 1000
        with pytest.raises(WorkerLostError):
            holder.get(timeout=TIMEOUT)
        assert [w.get(timeout=TIMEOUT)["tag"] for w in waiters] == ["w0", "w1", "w2"]
    finally:
        open_gate(wa, k)
    ran = starts(wa, k)
    assert [e["id"] for e in ran] == [holder.id, *(w.id for w in waiters)]  # each once, in order
    assert ran[1]["at"] >= expires_at - 0.25, "a waiter ran while the dead holder's lock lived"
    # the sweeper looks at the key when the lock would expire, then every SWEEP_INTERVAL
    assert ran[1]["at"] <= expires_at + SWEEP_LATE + SWEEP_LEASE + FEW
    assert ran[-1]["at"] - killed_at <= LOCK_TTL + SWEEP_LATE + SWEEP_LEASE + FEW
    assert_no_overlap(list(intervals(wa, k, without=holder.id).values()), "the waiters")
    for w in waiters:
        assert len(parks(wa, w.id)) == 1 and len(publishes(wa, w.id)) == 1
    n.nothing_left(key)
    note(capsys, f"holder SIGKILLed: its lock expired -> first waiter's start {ran[1]['at'] - expires_at:.2f} s "
                 f"(kill -> last waiter's start {ran[-1]['at'] - killed_at:.2f} s, ttl {LOCK_TTL:g} s)")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_waiter_killed_right_after_it_parked_still_runs_once(nodes):
    """SIGKILL of a waiter's pool child right after its park (CSL_TEST_KILL_AT=parked), before its
    delivery ended: its message lives on in the key's line, and it runs once, in its turn."""
    n, wa = nodes, nodes.wa
    doomed = n.kill_parked.children()
    k, key, holder = n.gated_holder("kill-parked")
    try:
        wait_starts(wa, k, 1)
        [victim] = park_one_by_one(n, wa.in_line, k, key, lambda i: (k, 0.0, "victim"), 1, queue=n.q_parked)
        # it died there: the pool lost the job (WorkerLostError), and nothing after the park ran
        wait_until(lambda: victim.state == "FAILURE", TIMEOUT, 0.05, "the waiter's child to die")
        assert isinstance(victim.result, WorkerLostError)
        assert parks(wa, victim.id) == []  # the delivery never got as far as its "waits in line"
        wait_until(lambda: set(n.kill_parked.children()) - set(doomed), TIMEOUT, 0.1, "a new pool child")
        [behind] = park_one_by_one(n, wa.in_line, k, key, lambda i: (k, 0.0, "behind"), 1)
        assert n.line_len(key) == 2
    finally:
        open_gate(wa, k)
    assert holder.get(timeout=TIMEOUT)["tag"] == "holder"
    assert behind.get(timeout=TIMEOUT)["tag"] == "behind"
    ran = wait_starts(wa, k, 3)
    assert [e["id"] for e in ran] == [holder.id, victim.id, behind.id]  # in its turn, once
    # its own run's result replaces the WorkerLostError (an AsyncResult caches a ready state: read afresh)
    meta = wait_until(lambda: (m := wa.app.backend.get_task_meta(victim.id, cache=False))["status"] == "SUCCESS"
                      and m, TIMEOUT, 0.05, "the killed waiter's own run to succeed")
    assert meta["result"]["tag"] == "victim"
    assert_no_overlap(list(intervals(wa, k).values()))
    assert len(publishes(wa, victim.id)) == 1
    n.nothing_left(key)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_releaser_killed_between_hand_off_and_publish_the_sweeper_sends_it(nodes, capsys):
    """SIGKILL of the releasing child after the release script reserved the key for the next waiter
    and before it published the waiter (CSL_TEST_KILL_AT=handoff): once the reservation runs out, a
    sweeper sends the waiter; it runs once, and the line goes on."""
    n, wa = nodes, nodes.wa
    k, key, holder = n.gated_holder("kill-releaser", queue=n.q_handoff)
    try:
        [first] = wait_starts(wa, k, 1)
        assert first["pid"] in n.kill_handoff.children()
        waiters = park_one_by_one(n, wa.in_line, k, key, lambda i: (k, 0.0, f"w{i}"), 2)
    finally:
        open_gate(wa, k)
    [end] = wait_ends(wa, k, 1)
    released_by = end["at"]  # the release came right after this
    with pytest.raises(WorkerLostError):  # it died in the release, before its result was stored
        holder.get(timeout=TIMEOUT)
    assert [w.get(timeout=TIMEOUT)["tag"] for w in waiters] == ["w0", "w1"]
    ran = starts(wa, k)
    assert [e["id"] for e in ran] == [holder.id, *(w.id for w in waiters)]  # each once, in order
    # the key stayed reserved for w0 (no one else could take it) until the reservation ran out
    assert ran[1]["at"] >= released_by + LOCK_TTL - 0.25
    assert ran[1]["at"] <= released_by + LOCK_TTL + SWEEP_LATE + SWEEP_LEASE + FEW
    [sent] = publishes(wa, waiters[0].id)  # by a sweeper: the releaser never published it
    assert sent["singleton_lock_entry"] and sent["pid"] != first["pid"]
    assert len(publishes(wa, waiters[1].id)) == 1
    assert_no_overlap(list(intervals(wa, k, without=holder.id).values()), "the waiters")
    n.nothing_left(key)
    note(capsys, f"releaser SIGKILLed before the publish: release -> the waiter's start "
                 f"{ran[1]['at'] - released_by:.2f} s (reservation {LOCK_TTL:g} s)")


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


# -- 5. a line that does not move --------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_line_that_does_not_move_fails_with_lock_wait_timeout_and_errback(nodes, capsys):
    """A holder that runs longer than the waiter's lock_max_wait (2 s): the waiter FAILS with
    LockWaitTimeout (never a PENDING or WAITING forever) and its link_error fires."""
    n, wa = nodes, nodes.wa
    k = f"stuck-{uuid.uuid4().hex[:8]}"
    key = wa.in_line_short_wait.lock_key_for((k,), {})
    holder = wa.in_line_short_wait.apply_async((k, "holder", True), queue=n.queue)
    try:
        wait_starts(wa, k, 1)
        dup = wa.in_line_short_wait.apply_async((k, "dup"), queue=n.queue, link_error=wa.errback_journal.s())
        wait_until(lambda: dup.state == "WAITING", TIMEOUT, 0.02, "the duplicate to wait")
        parked_at = time.time()
        with pytest.raises(LockWaitTimeout) as info:
            dup.get(timeout=TIMEOUT)
        failed_at = time.time()
        assert dup.state == "FAILURE" and info.value.key == key and info.value.max_wait == 2.0
        assert failed_at - parked_at <= 2.0 + SWEEP_LATE + SWEEP_LEASE + FEW
        errbacks = wait_until(
            lambda: [e for e in map(json.loads, wa.journal.lrange("handoff:errbacks", 0, -1)) if e["id"] == dup.id],
            TIMEOUT, 0.05, "the errback",
        )
        assert [e["exc"] for e in errbacks] == ["LockWaitTimeout"]
        assert not holder.ready() and [e["id"] for e in starts(wa, k)] == [holder.id]
        assert not n.line_len(key)  # it left the line
    finally:
        open_gate(wa, k)
    assert holder.get(timeout=TIMEOUT)["tag"] == "holder"
    assert [e["id"] for e in starts(wa, k)] == [holder.id]  # the timed-out waiter never ran
    expired = [p for p in publishes(wa, dup.id) if p.get("singleton_lock_expired")]
    assert len(expired) == 1 and len(publishes(wa, dup.id)) == 1
    n.nothing_left(key)
    note(capsys, f"lock_max_wait 2 s: WAITING seen -> FAILURE seen {failed_at - parked_at:.2f} s")


# -- 6. plain code: held(server, name, ttl, wait=...) -------------------------------------------------


def start_waiters(server: LockServer, name: str, count: int, *, wait: float, hold: float, out: list):
    """``count`` threads waiting on ``name``, started one at a time (each once the previous one is in
    line); each appends (tag, entered, leaving, fencing token) to ``out`` or (tag, the exception)."""
    key = slot_safe(name)
    client = server.client
    threads = []
    for i in range(count):
        tag = f"w{i}"

        def body(tag=tag):
            try:
                with held(server, name, ttl=30, wait=wait) as lock:
                    entered = time.monotonic()
                    time.sleep(hold)
                    out.append((tag, entered, time.monotonic(), lock.fencing_token))
            except Exception as exc:
                out.append((tag, exc))

        t = threading.Thread(target=body, daemon=True, name=f"waiter-{tag}")
        t.start()
        threads.append(t)
        wait_until(lambda: client.llen(key + ":q") >= len(threads), TIMEOUT, 0.002, f"{tag} to be in line")
    return threads


@pytest.mark.timeout(60)
def test_plain_waiters_go_in_fifo_order_woken_by_the_release(plain_server, capsys):
    """Threads waiting on one key get it in the order they started waiting, each woken by the release
    that hands it the key: much sooner than the holder's 30 s TTL, and than LONGEST_BLOCK (the
    longest a waiter sleeps between two looks of its own)."""
    name = f"plain-fifo-{uuid.uuid4().hex[:8]}"
    key = slot_safe(name)
    out: list = []
    with held(plain_server, name, ttl=30) as first:
        first_fence = first.fencing_token  # (read while held: a fresh lock's token is drawn on first read)
        threads = start_waiters(plain_server, name, 20, wait=30, hold=0.01, out=out)
        released_at = time.monotonic()
    for t in threads:
        t.join(TIMEOUT)
    assert all(len(x) == 4 for x in out), out
    assert [x[0] for x in out] == [f"w{i}" for i in range(20)]  # first come, first served
    fences = [first_fence, *(x[3] for x in out)]
    assert fences == sorted(fences) and len(set(fences)) == len(fences)
    gaps = [out[0][1] - released_at] + [nxt[1] - prev[2] for prev, nxt in zip(out, out[1:], strict=False)]
    assert max(gaps) < LONGEST_BLOCK / 2, f"a waiter was not woken by the release: gaps {gaps}"
    assert not plain_server.client.exists(key, key + ":q", key + ":w")
    assert not list(plain_server.client.scan_iter(match=key + ":wake:*"))
    report(capsys, "plain held() threads, one process", gaps)


@pytest.mark.timeout(60)
def test_plain_waiter_whose_wait_runs_out_raises_and_leaves_the_line(plain_server):
    name = f"plain-timeout-{uuid.uuid4().hex[:8]}"
    key = slot_safe(name)
    client = plain_server.client
    out: list = []
    with held(plain_server, name, ttl=30):
        [patient] = start_waiters(plain_server, name, 1, wait=30, hold=0.0, out=out)
        started = time.monotonic()
        with pytest.raises(LockContended) as info:
            with held(plain_server, name, ttl=30, wait=0.5):
                pytest.fail("the body ran while the key was held")
        assert time.monotonic() - started >= 0.5
        assert info.value.key == key
        # it left the line: only the patient waiter is still in it, and no wake-up list is left
        assert client.llen(key + ":q") == 1 and client.hlen(key + ":w") == 1
        assert not list(client.scan_iter(match=key + ":wake:*"))
    patient.join(TIMEOUT)
    assert [x[0] for x in out] == ["w0"] and len(out[0]) == 4  # the patient one got it after the release
    assert not client.exists(key, key + ":q", key + ":w")


PLAIN_HOLDER = """
import sys, time
from celery_singleton_lock import LockServer, held
with held(LockServer.from_url(sys.argv[1]), sys.argv[2], ttl=float(sys.argv[3])):
    print("held", flush=True)
    time.sleep(120)
"""


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_plain_holder_killed_lets_the_waiters_in_within_its_ttl(plain_server, redis_server, capsys):
    """A process SIGKILLed while it holds the key through held(): nobody releases, so the waiters
    look again when its lock would expire, and go in, in order, within its TTL (plus a little)."""
    name = f"plain-dead-{uuid.uuid4().hex[:8]}"
    key = slot_safe(name)
    client = plain_server.client
    ttl = 3.0
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", PLAIN_HOLDER, redis_server.url(2), name, str(ttl)],
                            stdout=subprocess.PIPE, env=env, text=True)
    out: list = []
    try:
        assert proc.stdout.readline().strip() == "held"
        threads = start_waiters(plain_server, name, 3, wait=30, hold=0.05, out=out)
        time.sleep(ttl / 2)  # let the holder's watchdog renew at least once: it must not matter
        os.kill(proc.pid, signal.SIGKILL)  # our own subprocess, by PID
        proc.wait(10)
        killed_at = time.monotonic()  # also before the PTTL: a stall after its reply must not move the expiry later
        pttl = client.pttl(key)
        assert 0 < pttl <= ttl * 1000
        expires_at = killed_at + pttl / 1000
        for t in threads:
            t.join(TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert [x[0] for x in out] == ["w0", "w1", "w2"] and all(len(x) == 4 for x in out), out
    assert out[0][1] >= expires_at - 0.25  # not while the dead holder's lock lived
    assert out[-1][1] - killed_at <= ttl + 2.0  # within its TTL, plus a little
    assert not client.exists(key, key + ":q", key + ":w")
    note(capsys, f"plain holder SIGKILLed: its lock expired -> first waiter in {out[0][1] - expires_at:.3f} s")
