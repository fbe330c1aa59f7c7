"""Hot keys: a duplicate waits its turn in the key's FIFO line and is handed the lock on release.

Against real redis-servers and real ``celery worker`` subprocesses (prefork):

1. FIFO across two nodes: 30 duplicates park one by one; each body runs once, none overlap, they
   start in the order they parked, and each caused ONE park and ONE hand-off publish (no re-sends).
2. A chain and a chord through a waiting task carry on with the right values.
3. Every SIGKILL point loses no waiter and runs none twice: the holder mid-body, a waiter right
   after it parked, the releaser between the release script and the publish (hooks: the
   CSL_TEST_KILL_AT environment variable, see tests/apps/kill_points.py).
5. A line that does not move: LockWaitTimeout (FAILURE) and the errback fires.

4. (a restart of the lock Redis) is in test_handoff_restart.py, 6. (plain ``held(..., wait=...)``)
in test_handoff_plain.py. The hand-off latencies (release to the next body's start) are printed,
not asserted: they are benchmark material.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid

import pytest
from _handoff_support import FEW, LOCK_TTL, SWEEP_LATE, WORKER_ENV, intervals, note, report
from _line_support import events, open_gate, parks, publishes, starts, wait_starts, worker_nodes
from _task_support import TIMEOUT, assert_no_overlap
from celery import chain, chord
from celery.exceptions import WorkerLostError

from celery_singleton_lock import LockWaitTimeout
from celery_singleton_lock.engine.line import SWEEP_LEASE
from celery_singleton_lock.testing.servers import wait_until

pytestmark = [pytest.mark.timeout(150), pytest.mark.usefixtures("collect_results")]


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
