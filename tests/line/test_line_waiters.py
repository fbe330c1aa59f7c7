"""A waiter leaves the line when it should: real ``celery worker`` subprocesses, a real broker.
One section each, numbered on from test_line_backlog.py:

3. ``lock_max_wait`` counts from the first park and holds for a waiter that is not the head.
4. Revoke of a waiting task, or of one whose turn was sent: it leaves the line, the key passes on.
5. `celery locks line` / `drop`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
import uuid

import pytest
from _backlog_support import SWEEP_SLACK, WORKER_ENV, Nodes, line_of
from _line_support import open_gate, starts, wait_starts
from _task_support import ROOT, TIMEOUT

from celery_singleton_lock import LockServer, LockWaitTimeout, held
from celery_singleton_lock.delivery.headers import turn_of
from celery_singleton_lock.engine import scripts
from celery_singleton_lock.engine.lock import Handoff
from celery_singleton_lock.testing.servers import wait_until

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("collect_results")]


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
        # the holder's release, in its name, its hand-off kept here rather than sent
        holder_token = n.locks.get(key).split(b" ", 1)[0].decode()
        reply = server.run(scripts.RELEASE, server.keys_for(key),
                           (holder_token + " ", "", "0", "0", "", "0", "0", "0", "0"))
        [handed] = [Handoff.parse(key, item) for item in reply[1:]]
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
