"""Real prefork workers: time limits, a SIGKILLed child, a whole worker killed.

* soft time limit: SoftTimeLimitExceeded ends the body; the lock is released (not expired).
* hard time limit / kill -9 of the pool child: nothing runs in the child any more, so the
  watchdog stops with it and the key expires within lock_ttl; the main process's
  on_failure (empty request) crashes nothing; the worker goes on.
* the whole worker killed while holding: a redelivery of the holder's task id waits in line
  for the dead holder's lock to expire, then the sweeper hands it the key and it runs once.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import time
import uuid

import pytest
from _task_support import TIMEOUT, load_worker_app, redeliver, start_worker_process
from celery.exceptions import SoftTimeLimitExceeded, TimeLimitExceeded, WorkerLostError

from celery_singleton_lock.engine.line import SWEEP_INTERVAL, SWEEP_LEASE
from celery_singleton_lock.testing.servers import wait_until

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("collect_results")]

LOCK_TTL = 3.0  # seconds, the workers' singleton_lock_ttl here (CSL_LOCK_TTL)


@pytest.fixture(scope="module")
def crash_env(redis_server, tmp_path_factory):
    wa = load_worker_app(redis_server)
    for db in (1, 2, 3):
        redis_server.client(db).flushdb()  # our private server; the broker db keeps its bindings
    queue = f"csl-crash-{uuid.uuid4().hex[:8]}"
    logdir = tmp_path_factory.mktemp("crash")
    w = start_worker_process(
        redis_server, logdir, pool="prefork", concurrency=2,
        env={"CSL_LOCK_TTL": str(LOCK_TTL)}, extra=("-Q", queue), name="crash",
    )
    try:
        w.wait_ready(60)
        yield wa, w, queue, logdir
    finally:
        w.stop()
        gc.collect()


def journal(wa, key):
    return [json.loads(raw) for raw in wa.journal.lrange(f"journaled:{key}", 0, -1)]


def started(wa, key, count=1):
    return wait_until(
        lambda: [e for e in journal(wa, key) if e["event"] == "start"][count - 1:] and journal(wa, key),
        TIMEOUT, 0.05, f"{count} start(s) of {key}",
    )


def test_soft_time_limit_releases(crash_env, redis_server):
    wa, w, queue, _ = crash_env
    k = f"soft-{uuid.uuid4().hex[:8]}"
    key = wa.soft_limited.lock_key_for((k,), {})
    locks = redis_server.client(2)
    result = wa.soft_limited.apply_async((k,), queue=queue)
    started(wa, k)
    assert 0 < locks.pttl(key) <= 60_000
    with pytest.raises(SoftTimeLimitExceeded):
        result.get(timeout=TIMEOUT)
    # lock_ttl is 60 s: only the release (task_postrun) can free the key this soon
    wait_until(lambda: not locks.exists(key), 15, what="the soft-limited run's release")
    # a fresh duplicate runs at once
    again = wa.journaled.apply_async((k, 0.0, "after-soft"), queue=queue)
    assert again.get(timeout=TIMEOUT)["tag"] == "after-soft"


def test_sigkill_of_the_child_frees_the_key_within_ttl(crash_env, redis_server):
    wa, w, queue, _ = crash_env
    k = f"kill-{uuid.uuid4().hex[:8]}"
    key = wa.journaled.lock_key_for((k,), {})
    locks = redis_server.client(2)
    result = wa.journaled.apply_async((k, 60.0, "victim"), queue=queue)
    [start] = started(wa, k)
    assert start["pid"] in w.children()
    os.kill(start["pid"], signal.SIGKILL)  # only the pool child, by PID
    assert 0 < locks.pttl(key) <= LOCK_TTL * 1000  # no one renews it now: gone within lock_ttl
    wait_until(lambda: not locks.exists(key), LOCK_TTL + 20, what="the killed holder's key to expire")
    with pytest.raises(WorkerLostError):
        result.get(timeout=TIMEOUT)
    # the worker replaced its child and runs the next one with the same key
    again = wa.journaled.apply_async((k, 0.0, "after-kill"), queue=queue)
    assert again.get(timeout=TIMEOUT)["tag"] == "after-kill"
    wait_until(lambda: not locks.exists(key), 15, what="the release")


def test_hard_time_limit_frees_the_key_and_main_process_on_failure_is_harmless(crash_env, redis_server):
    wa, w, queue, _ = crash_env
    k = f"hard-{uuid.uuid4().hex[:8]}"
    key = wa.hard_limited.lock_key_for((k,), {})
    locks = redis_server.client(2)
    result = wa.hard_limited.apply_async((k,), queue=queue)
    [start] = started(wa, k)
    with pytest.raises(TimeLimitExceeded):
        result.get(timeout=TIMEOUT)
    assert result.state == "FAILURE"
    wait_until(lambda: not locks.exists(key), LOCK_TTL + 20, what="the hard-limited holder's key to expire")
    # on_failure ran in the worker's main process, with an empty request: no lock handle there
    record = json.loads(wait_until(lambda: wa.journal.lindex("on_failure", -1), TIMEOUT, what="on_failure"))
    assert record["task_id"] == result.id and record["exc"] == "TimeLimitExceeded"
    assert record["pid"] == w.pid and record["pid"] != start["pid"]
    assert record["lock"] == "None" and record["request_id"] is None
    # nothing crashed: the worker goes on with the same key
    again = wa.journaled.apply_async((k, 0.0, "after-hard"), queue=queue)
    assert again.get(timeout=TIMEOUT)["tag"] == "after-hard"
    assert not errors_raised_in_our_code(w.log())


def errors_raised_in_our_code(log: str) -> list[str]:
    """Tracebacks in a worker log whose innermost frame is in our package.

    Task errors pass through LockedTask.__call__ (it releases the lock on the
    way out), so our frames may appear in them; none may be where it was raised.
    """
    found = []
    last_frame = None
    for line in log.splitlines():
        stripped = line.strip()
        if stripped.startswith('File "'):
            last_frame = stripped
        elif last_frame and stripped and not line.startswith(" ") and not stripped.startswith("Traceback"):
            if "celery_singleton_lock/" in last_frame:
                found.append(f"{last_frame} -> {stripped}")
            last_frame = None
    return found


@pytest.mark.long
def test_redelivery_after_the_whole_worker_died_runs_once_the_lock_expired(crash_env, redis_server):
    """kill -9 of the holder's whole worker; the broker redelivers its message to another worker at
    once: the copy waits first in line while the dead holder's lock lives, then the sweeper hands it
    the key and it runs, once."""
    wa, w, queue, logdir = crash_env
    k = f"dead-{uuid.uuid4().hex[:8]}"
    key = wa.journaled.lock_key_for((k,), {})
    locks = redis_server.client(2)
    dead_queue = f"csl-dead-{uuid.uuid4().hex[:8]}"
    doomed = start_worker_process(
        redis_server, logdir, pool="prefork", concurrency=1,
        env={"CSL_LOCK_TTL": str(LOCK_TTL)}, extra=("-Q", dead_queue), name="doomed",
    )
    args = (k, 3.0, "holder")  # still running when the worker is killed, even on a slow machine
    try:
        doomed.wait_ready(60)
        holder = wa.journaled.apply_async(args, queue=dead_queue)
        [start] = started(wa, k)
        assert start["id"] == holder.id
        doomed.kill()  # SIGKILL, main process and its child, by PID
    finally:
        doomed.stop()
    asked_at = time.time()  # before the PTTL: a stall after the reply must not move the expiry later
    pttl = locks.pttl(key)
    assert 0 < pttl <= LOCK_TTL * 1000
    expires_at = asked_at + pttl / 1000
    redeliver(redis_server.client(0), wa.journaled, args, holder.id, queue)
    wait_until(lambda: "redelivered copy of the running task" in w.log(), TIMEOUT, what="the copy to wait")
    starts = [e for e in started(wa, k, count=2) if e["event"] == "start"]
    assert [e["id"] for e in starts] == [holder.id, holder.id]  # ran once more, not twice
    assert starts[1]["at"] >= expires_at - 0.25  # only after the dead holder's lock expired
    # handed the key by a sweeper soon after: its next look (interval, jittered), or, if another
    # process's sweeper had just leased the key, once that lease ends; plus slack for a loaded
    # machine (the suite runs in three pytest processes on two cores: 16 s was seen once)
    assert starts[1]["at"] <= expires_at + SWEEP_INTERVAL * 1.25 + SWEEP_LEASE + 20
    assert starts[1]["fence"] > starts[0]["fence"]
    wait_until(lambda: not locks.exists(key, key + ":q", key + ":w"), 15, what="the copy's release")
    assert len([e for e in journal(wa, k) if e["event"] == "start"]) == 2
