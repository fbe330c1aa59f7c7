"""Quorum mode through real workers: a LockedTask on a quorum runs once and its duplicates back off,
a redelivery of a task that succeeded never runs it again, and the Jepsen-style run (two worker
nodes on 5 members while a random minority is paused, killed and restarted empty, or slowed).

Every member is a private redis-server on a free loopback port, with no persistence, stopped by PID.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import threading
import time
import uuid

import pytest
from _task_support import load_worker_app, start_worker_process
from _topology_support import each_body_once, every_call_ends, every_call_succeeded
from celery import Celery

from celery_singleton_lock import LockedTask
from celery_singleton_lock.testing.servers import RedisServer, wait_until

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow, pytest.mark.usefixtures("collect_results")]


def test_a_locked_task_on_a_quorum_runs_once_and_duplicates_back_off(masters, run_worker):
    for s in masters:
        if s.paused:
            s.resume()
    broker = masters[0]
    app = Celery(f"q{uuid.uuid4().hex[:6]}", broker=broker.url(0), backend=broker.url(1), set_as_current=False)
    app.conf.update(
        singleton_lock_url=[s.url(3) for s in masters], singleton_lock_retry_backoff=0.05,
        singleton_lock_retry_backoff_max=0.2, worker_hijack_root_logger=False, broker_connection_retry_on_startup=True,
    )
    runs: list[tuple[float, float]] = []
    gate = threading.Event()

    @app.task(base=LockedTask, bind=True, shared=False, lock_key=["k"], on_duplicate="retry")
    def job(self, k, tag):
        start = time.monotonic()
        if tag == "holder":
            assert gate.wait(30)
        runs.append((start, time.monotonic()))
        return self.lock.fencing_token

    with run_worker(app, pool="threads", concurrency=4):
        holder = job.delay("x", "holder")
        wait_until(lambda: any(m.client(3).keys("*job*") for m in masters), 20, what="the holder's lock")
        dup = job.delay("x", "dup")
        wait_until(lambda: dup.state == "RETRY", 20, what="the duplicate to back off")  # no line in quorum mode
        gate.set()
        first, second = holder.get(timeout=30), dup.get(timeout=30)
    assert second > first
    (s1, e1), (s2, e2) = sorted(runs)
    assert e1 <= s2


# -- Jepsen-style, through real workers -------------------------------------------------------------

JEPSEN_SECONDS = float(os.environ.get("CSL_JEPSEN_SECONDS", "60"))


class Faults:
    """A minority (at most 2 of 5) of faulty members at any time: paused (SIGSTOP), killed (SIGKILL)
    and started again empty, or slow (DEBUG SLEEP). Every fault is undone by ``heal``."""

    def __init__(self, masters: list[RedisServer], rng: random.Random) -> None:
        self.masters, self.rng = masters, rng
        self.paused: list[RedisServer] = []
        self.log: list[str] = []

    def kill_and_restart(self, m: RedisServer) -> None:
        assert m.proc is not None
        os.kill(m.proc.pid, signal.SIGKILL)
        m.proc.wait(10)
        m.proc = None
        m.start()  # same port, no persistence: empty

    def slow(self, m: RedisServer, seconds: float) -> None:
        def sleep() -> None:
            with contextlib.suppress(Exception), m.client(0, socket_timeout=seconds + 5) as c:
                c.execute_command("DEBUG", "SLEEP", seconds)
        threading.Thread(target=sleep, daemon=True).start()

    def step(self) -> None:
        healthy = [m for m in self.masters if m not in self.paused]
        roll = self.rng.random()
        if self.paused and (roll < 0.4 or len(self.paused) == 2):
            m = self.paused.pop(self.rng.randrange(len(self.paused)))
            m.resume()
            self.log.append(f"resume {m.port}")
        elif roll < 0.7:
            m = self.rng.choice(healthy)
            m.pause()
            self.paused.append(m)
            self.log.append(f"pause {m.port}")
        elif roll < 0.85 and len(self.paused) < 2:
            m = self.rng.choice(healthy)
            self.kill_and_restart(m)
            self.log.append(f"kill+restart {m.port}")
        elif len(self.paused) < 2:
            m = self.rng.choice(healthy)
            self.slow(m, self.rng.uniform(0.2, 1.5))
            self.log.append(f"slow {m.port}")

    def heal(self) -> None:
        while self.paused:
            self.paused.pop().resume()


def _members_up_and_empty(masters: list[RedisServer]) -> None:
    """Every member running and resumed (an earlier test may have left one stopped), its locks' db empty."""
    for m in masters:
        if m.paused:
            m.resume()
        if m.proc is None:
            m.start()
        m.client(2).flushdb()


def _paused_minority_sequence(masters: list[RedisServer], faults: Faults, send) -> None:
    """2 members paused and used through, resumed, then the other 2 restarted empty; ``send(n)`` sends
    n calls while the first 2 are paused and again once they are back."""
    masters[0].pause()
    masters[1].pause()
    faults.paused += [masters[0], masters[1]]
    send(6)
    time.sleep(1.5)
    faults.heal()
    send(6)
    time.sleep(1.5)
    faults.kill_and_restart(masters[3])
    faults.kill_and_restart(masters[4])
    faults.log.append("the paused-minority sequence")


def _no_refusal_names_a_finished_task(wa, keys: list[str], faults: Faults) -> list[dict]:
    """Each key's bodies ran once each, and no call was refused because of a lock whose task had ended
    (more than 3 s before the refusal); the refusals journalled, for the summary."""
    refusals = [json.loads(x) for x in wa.journal.lrange("handoff:parks", 0, -1)]
    ended_at: dict[str, float] = {}
    for k in keys:
        _, ends = each_body_once(wa, k)
        ended_at.update({i: e["at"] for i, e in ends.items()})
    stale = [r for r in refusals if r["holder"] in ended_at and r["at"] > ended_at[r["holder"]] + 3.0]
    assert not stale, f"{len(stale)} refused because of a finished task's lock: {stale[:3]}; faults {faults.log}"
    return refusals


@pytest.mark.timeout(300)
@pytest.mark.long
def test_jepsen_real_workers_on_five_members_with_random_faults(masters, redis_server, tmp_path):
    """Two worker nodes x 2 prefork children run tasks on 3 keys (on_duplicate="retry", which backs
    off in quorum mode) for JEPSEN_SECONDS while a random minority of the 5 members is paused, killed
    and restarted empty, or slowed; it opens with the paused-minority sequence (2 paused and used
    through, resumed, the other 2 restarted empty). The history (body start and end, fencing tokens,
    refusals and the holder they named, results) must show: every call SUCCESS, each body once, no
    two bodies of a key at once, fencing tokens strictly rising per key, and no call refused because
    of a lock whose task had ended (a refusal naming a finished task: its lock lingering on members
    that ran a late acquire and skipped its release)."""
    _members_up_and_empty(masters)
    wa = load_worker_app(redis_server)
    wa.journal.delete("handoff:parks")
    url = ";".join(m.url(2) for m in masters)
    conf = {"singleton_lock_retry_backoff": 0.05, "singleton_lock_retry_backoff_max": 0.3,
            "singleton_lock_max_retries": 100000, "singleton_lock_redis_options": {"socket_timeout": 0.5}}
    env = {"CSL_LOCK_URL": url, "CSL_EXTRA_CONF": json.dumps(conf), "CSL_JOURNAL_HANDOFF": "1"}
    nodes = [start_worker_process(redis_server, tmp_path, concurrency=2, env=env, name=f"jepsen{i}")
             for i in range(2)]
    rng = random.Random(int(os.environ.get("CSL_JEPSEN_SEED", "20261124")))
    faults = Faults(masters, rng)
    keys = [f"jepsen-{uuid.uuid4().hex[:6]}-{i}" for i in range(3)]
    calls: list = []
    try:
        for w in nodes:
            w.wait_ready(90)

        def send(n: int) -> None:
            for _ in range(n):
                calls.append(wa.in_line.delay(rng.choice(keys), 0.05, f"c{len(calls)}"))

        _paused_minority_sequence(masters, faults, send)
        end = time.monotonic() + JEPSEN_SECONDS
        while time.monotonic() < end:
            send(2)
            faults.step()
            time.sleep(rng.uniform(0.2, 0.6))
        faults.heal()
        every_call_ends(calls, faults.log)
    finally:
        faults.heal()
        for w in nodes:
            w.stop()
    every_call_succeeded(calls)
    refusals = _no_refusal_names_a_finished_task(wa, keys, faults)
    ran = sum(1 for c in calls if c.state == "SUCCESS")
    print(f"\n[jepsen] {ran} calls on {len(keys)} keys, {len(refusals)} refusals, faults: {len(faults.log)}")


def test_a_redelivery_of_a_running_task_never_runs_again_after_it_succeeded(masters, redis_server):
    """Quorum mode has no line, so a broker redelivery of the running task (acks_late) is re-sent
    with a back-off rather than parked first. The re-send keeps its identity (a header): once the
    running task succeeded, the copy is dropped, never run again as new work (as a fresh message
    would be, finding the key free after the holder's release)."""
    from _apps import make_app
    from _task_support import RESTORE_FAST, Gates, Runs, TaskEvents, locked, redeliver
    from celery.contrib.testing.worker import start_worker

    for m in masters:
        if m.paused:
            m.resume()
        if m.proc is None:
            m.start()
    queue = f"qr-{uuid.uuid4().hex[:8]}"
    app = make_app(redis_server, task_default_queue=queue, broker_transport_options=RESTORE_FAST)
    app.conf.singleton_lock_url = ";".join(m.url(4) for m in masters)
    runs, gates = Runs(), Gates()

    def body(self, k):
        run = runs.begin(k, self.request.id)
        try:
            gates.wait(k)
            return "done"
        finally:
            runs.end(run)

    late = locked(app, lock_key=["k"], acks_late=True, on_duplicate="retry", name="qredeliv.late")(body)
    k = f"qr-{uuid.uuid4().hex[:8]}"
    with start_worker(app, pool="threads", concurrency=4, perform_ping_check=False, loglevel="WARNING",
                      shutdown_timeout=30):
        try:
            with TaskEvents(app) as rec:
                holder = late.delay(k)
                runs.wait_started(k)
                redeliver(redis_server.client(0), late, (k,), holder.id, queue)
                # the copy meets the running holder and is re-sent with a back-off, twice at least
                wait_until(lambda: len(rec.of("duplicate_skipped", task_id=holder.id, policy="backoff")) >= 2, 30, 0.02,
                           "the redelivered copy to back off while the holder runs")
                gates.open(k)
                assert holder.get(timeout=30) == "done"
                # its next try finds the holder's success: dropped ("redelivery"), never run
                wait_until(lambda: rec.of("duplicate_skipped", task_id=holder.id, policy="redelivery"),
                           30, 0.02, "the copy to be dropped")
            assert len(runs.of(k)) == 1, f"the body ran {len(runs.of(k))} times"
        finally:
            gates.open_all()
