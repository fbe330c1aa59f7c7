"""The watchdog under real Celery workers: a 1 s lock kept for a 6 s task on every pool,
duplicates excluded meanwhile, prefork child recycling, warm shutdown, gevent and eventlet.

Subprocess workers (prefork, solo, gevent, eventlet) run tests/apps/worker_app.py (task
``watchdog_hold``); the in-process threads worker runs tasks defined here.
"""

from __future__ import annotations

import importlib.util
import re
import threading
import time
import uuid
from collections.abc import Callable

import pytest
from celery.result import AsyncResult

from celery_singleton_lock import LockedTask, LockLost, lock_lost
from celery_singleton_lock.engine.server import LockServer
from celery_singleton_lock.testing.servers import wait_until

LONG = 6.0  # seconds the long task runs
TTL = 2  # its lock's ttl: the watchdog must renew it about 9 times (1 s would be below
# timing.shortest_safe_ttl(), ~1.8 s, where one late wake-up of a busy machine already loses it)
EVERY = 0.3  # a duplicate every EVERY seconds while it runs

pytestmark = pytest.mark.slow


def check_exclusion(
    long: AsyncResult,
    started: Callable[[], bool],
    send_duplicate: Callable[[], AsyncResult],
    holder_owner: Callable[[], str | None],
    intervals: Callable[[], list[tuple[float, float]]],
) -> dict:
    """Send a duplicate every EVERY s while ``long`` runs; check it held its lock throughout
    and nothing ran beside it. Returns the long task's result."""
    wait_until(started, 30, 0.02, "the long task to start")
    duplicates: list[AsyncResult] = []
    owners: list[str | None] = []
    while not long.ready():
        owners.append(holder_owner())
        duplicates.append(send_duplicate())
        time.sleep(EVERY)  # the pace of the duplicates, not a synchronisation
    result = long.get(timeout=30)
    # the long body did run, for its whole length, and never lost its lock
    assert result["lost"] is False
    runs = sorted(intervals())
    assert runs and any(end - start >= LONG - 0.1 for start, end in runs), runs
    # the lock was held by the long task at every duplicate's send (bar the very last look,
    # which may come after the body ended and released it)
    assert len(owners) >= LONG / EVERY / 2, len(owners)
    assert all(owner == long.id for owner in owners[:-1]), owners
    # every duplicate ended: skipped (REVOKED) while the long one ran, or ran after it
    wait_until(lambda: all(d.state in ("REVOKED", "SUCCESS") for d in duplicates), 30, 0.05, "duplicates to end")
    skipped = [d for d in duplicates if d.state == "REVOKED"]
    assert len(skipped) >= len(duplicates) - 2, [d.state for d in duplicates]
    # no two bodies with the key ever overlapped
    for (_, end), (start, _) in zip(runs, runs[1:], strict=False):
        assert start >= end - 0.01, runs
    return result


# -- subprocess workers: prefork, gevent, eventlet --------------------------------------------


def journal_intervals(worker_app, key: str) -> list[tuple[float, float]]:
    raw = worker_app.journal.lrange(f"runs:watchdog_hold:{key}", 0, -1)
    return [(float(s), float(e)) for s, e, _pid in (item.decode().split(":") for item in raw)]


def holder_of(worker_app, redis_server, key: str) -> Callable[[], str | None]:
    name = worker_app.watchdog_hold.lock_key_for((key, LONG), {})
    server = LockServer(redis_server.client(2))

    def owner() -> str | None:
        holder = server.holder(name)
        return holder.owner_id if holder else None

    return owner


def run_subprocess_case(
    worker_app, worker_processes, redis_server, pool: str, concurrency: int, count: int = 1
) -> dict:
    workers = [
        worker_processes(pool=pool, concurrency=concurrency, env={"CSL_LOCK_TTL": str(TTL)}) for _ in range(count)
    ]
    for worker in workers:
        worker.wait_ready(60)
    key = f"{pool}-{uuid.uuid4().hex[:8]}"
    task = worker_app.watchdog_hold
    long = task.apply_async((key, LONG, "long"))
    result = check_exclusion(
        long,
        started=lambda: worker_app.journal.llen(f"started:watchdog_hold:{key}") >= 1,
        send_duplicate=lambda: task.apply_async((key, 0.1, "dup")),
        holder_owner=holder_of(worker_app, redis_server, key),
        intervals=lambda: journal_intervals(worker_app, key),
    )
    for worker in workers:
        assert "LOST" not in worker.log(), worker.log()[-3000:]
    return result


@pytest.mark.timeout(120)
def test_prefork_keeps_a_2s_lock_for_6s_and_excludes_duplicates(worker_app, worker_processes, redis_server):
    result = run_subprocess_case(worker_app, worker_processes, redis_server, "prefork", 2)
    assert result["fence"] > 0


@pytest.mark.timeout(120)
def test_solo_pool_keeps_a_2s_lock_for_6s_and_excludes_duplicates(worker_app, worker_processes, redis_server):
    # Two solo workers: one is busy with the long body in its only thread, while the watchdog
    # thread beside it renews the lock; the other takes the duplicates.
    run_subprocess_case(worker_app, worker_processes, redis_server, "solo", 1, count=2)


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "pool",
    [
        pytest.param(
            "gevent",
            marks=pytest.mark.skipif(not _installed("gevent"), reason="gevent is not installed (pip install gevent)"),
        ),
        pytest.param(
            "eventlet",
            marks=pytest.mark.skipif(
                not _installed("eventlet"), reason="eventlet is not installed (pip install eventlet)"
            ),
        ),
    ],
)
def test_green_pool_keeps_the_lock_of_an_io_bound_task(worker_app, worker_processes, redis_server, pool):
    """Under gevent/eventlet the watchdog thread is a greenlet: an I/O-bound task (one that
    sleeps or waits on the network) lets it run. A CPU-bound one would starve it; see the
    README's watchdog section."""
    run_subprocess_case(worker_app, worker_processes, redis_server, pool, 4)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "pool",
    [
        pytest.param("gevent", marks=pytest.mark.skipif(not _installed("gevent"), reason="gevent is not installed")),
        pytest.param(
            "eventlet", marks=pytest.mark.skipif(not _installed("eventlet"), reason="eventlet is not installed")
        ),
    ],
)
def test_green_pool_cpu_bound_task_starves_the_watchdog_and_the_loss_is_reported(
    worker_app, worker_processes, redis_server, pool
):
    """The documented limit: a CPU-bound task never yields, so the watchdog greenlet cannot
    renew and the lock expires. It is not hidden: `.lost` says so the moment it is read, and
    the loss is reported once (ERROR line) with a reason that names a starved process."""
    worker = worker_processes(pool=pool, concurrency=2, env={"CSL_LOCK_TTL": str(TTL)})
    worker.wait_ready(60)
    key = f"busy-{pool}-{uuid.uuid4().hex[:8]}"
    res = worker_app.watchdog_busy.apply_async((key, 2.5 * TTL))
    res.get(timeout=30)
    wait_until(lambda: "was LOST" in worker.log(), 10, 0.1, "the loss to be logged")
    lost_lines = [line for line in worker.log().splitlines() if "was LOST" in line]
    assert len(lost_lines) == 1 and "starved" in lost_lines[0], lost_lines
    assert res.result["lost"] is True  # the body read .lost after its deadline: the truth


@pytest.mark.timeout(120)
def test_recycled_prefork_child_renews_its_own_locks(worker_app, worker_processes, redis_server):
    worker = worker_processes(
        pool="prefork", concurrency=1, env={"CSL_LOCK_TTL": str(TTL), "CSL_MAX_TASKS_PER_CHILD": "1"}
    )
    worker.wait_ready(60)
    task = worker_app.watchdog_hold
    seconds = 3.0  # past the TTL: it needs renewals
    pids = []
    for i in range(2):
        key = f"recycle-{i}-{uuid.uuid4().hex[:8]}"
        owner = holder_of(worker_app, redis_server, key)
        res = task.apply_async((key, seconds, "recycle"))
        wait_until(lambda k=key: worker_app.journal.llen(f"started:watchdog_hold:{k}") >= 1, 30)
        owners = []
        while not res.ready():
            owners.append(owner())
            time.sleep(0.2)  # sampling pace
        result = res.get(timeout=30)
        assert result["lost"] is False
        assert len(owners) >= 5 and all(o == res.id for o in owners[:-1]), owners
        pids.append(result["pid"])
    assert pids[0] != pids[1]  # the second ran in a new child, whose own watchdog renewed it
    # the first child stopped and joined its watchdog on the way out (worker_process_shutdown)
    wait_until(lambda: f"watchdog of process {pids[0]} stopped" in worker.log(), 20, 0.1, "the child's watchdog log")


@pytest.mark.timeout(120)
def test_warm_shutdown_lets_the_task_finish_releases_and_joins(worker_app, worker_processes, redis_server):
    worker = worker_processes(pool="prefork", concurrency=1, env={"CSL_LOCK_TTL": str(TTL)})
    worker.wait_ready(60)
    task = worker_app.watchdog_hold
    key = f"warm-{uuid.uuid4().hex[:8]}"
    owner = holder_of(worker_app, redis_server, key)
    seconds = 4.0
    res = task.apply_async((key, seconds, "warm"))
    wait_until(lambda: worker_app.journal.llen(f"started:watchdog_hold:{key}") >= 1, 30)
    assert owner() == res.id
    child_pid = int(worker_app.journal.lindex(f"started:watchdog_hold:{key}", 0).decode().split(":")[1])
    code = worker.stop(timeout=40)  # SIGTERM: warm shutdown, the task is let finish
    log = worker.log()
    assert code == 0, log[-3000:]
    # the task finished, having kept its lock to the end...
    assert res.get(timeout=10)["lost"] is False
    runs = journal_intervals(worker_app, key)
    assert len(runs) == 1 and runs[0][1] - runs[0][0] >= seconds - 0.1
    # ...released it...
    assert owner() is None
    assert redis_server.client(2).exists(task.lock_key_for((key, seconds), {})) == 0
    # ...and its process stopped and joined the watchdog thread, with no lock left behind
    assert f"watchdog of process {child_pid} stopped" in log, log[-3000:]
    assert "still held" not in log and "did not stop" not in log


# -- in-process workers: threads, solo ------------------------------------------------------


def define_long_task(app, name: str):
    runs: list[tuple[str, float, float]] = []
    started = threading.Event()

    @app.task(base=LockedTask, bind=True, name=name, lock_ttl=TTL, lock_key=["key"], on_duplicate="skip")
    def long_task(self, key: str, seconds: float, tag: str = "") -> dict:
        start = time.time()
        if tag == "long":
            started.set()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(0.05)
        self.lock.ensure()
        runs.append((self.request.id, start, time.time()))
        return {"lost": self.lock.lost, "fence": self.lock.fencing_token}

    return long_task, runs, started


def run_in_process_case(app, redis_server, defined) -> None:
    task, runs, started = defined
    key = uuid.uuid4().hex[:8]
    server = LockServer(redis_server.client(2))
    name = task.lock_key_for((key, LONG), {})

    def owner() -> str | None:
        holder = server.holder(name)
        return holder.owner_id if holder else None

    long = task.apply_async((key, LONG, "long"))
    check_exclusion(
        long,
        started=started.is_set,
        send_duplicate=lambda: task.apply_async((key, 0.1, "dup")),
        holder_owner=owner,
        intervals=lambda: [(s, e) for _, s, e in runs],
    )
    assert owner() is None or owner() != long.id


@pytest.mark.timeout(120)
def test_threads_pool_keeps_a_2s_lock_for_6s_and_excludes_duplicates(app, run_worker, redis_server):
    defined = define_long_task(app, f"wd_long_{uuid.uuid4().hex[:6]}")  # before the worker starts
    with run_worker(app, pool="threads", concurrency=4):
        run_in_process_case(app, redis_server, defined)


@pytest.mark.timeout(60)
def test_lost_lock_fires_the_signal_and_ensure_raises_in_the_task(app, run_worker, redis_server):
    ttl = 1.5
    started = threading.Event()
    got: list[dict] = []

    @app.task(base=LockedTask, bind=True, name=f"wd_lost_{uuid.uuid4().hex[:6]}", lock_ttl=ttl)
    def careful(self, key: str) -> str:
        started.set()
        deadline = time.monotonic() + 30
        while not self.lock.lost and time.monotonic() < deadline:
            time.sleep(0.02)
        self.lock.ensure()  # the pattern: check before a critical write
        return "wrote anyway"

    def on_lost(sender=None, key=None, task_id=None, reason=None, **_):
        got.append({"sender": sender, "key": key, "task_id": task_id, "reason": reason, "at": time.monotonic()})

    lock_lost.connect(on_lost, weak=False)
    try:
        with run_worker(app, pool="threads", concurrency=2):
            key = uuid.uuid4().hex[:8]
            res = careful.apply_async((key,))
            assert started.wait(30)
            name = careful.lock_key_for((key,), {})
            assert redis_server.client(2).delete(name) == 1
            deleted_at = time.monotonic()
            with pytest.raises(LockLost) as info:
                res.get(timeout=30)
            assert info.value.key == name
            wait_until(lambda: got, 5, what="the lock_lost signal")
    finally:
        lock_lost.disconnect(on_lost)
    assert len(got) == 1
    assert got[0]["key"] == name and got[0]["task_id"] == res.id and got[0]["sender"].name == careful.name
    assert re.search("owner", got[0]["reason"])
    assert got[0]["at"] - deleted_at <= ttl / 3 + 0.1 + 1.0  # TTL/3 + a tick, with room for a busy machine
