"""Leader election for celery beat (celery_singleton_lock.beat) against a private redis-server.

The takeover tests run real ``celery beat -S celery_singleton_lock.beat:LeaderScheduler``
subprocesses (tests/apps/beat_app.py: one entry due on every whole wall-clock second, every
send journalled by the beat that sent it) and a real worker, and stop them by PID. The
others drive LeaderScheduler / LeaderMixin instances in this process, against the same kind
of private server.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path

import pytest
from _apps import ROOT, make_app
from celery.beat import Scheduler
from celery.signals import before_task_publish

from celery_singleton_lock import Lock
from celery_singleton_lock.beat import LeaderMixin, LeaderScheduler, beat_settings
from celery_singleton_lock.testing.servers import RedisServer, WorkerProcess, wait_until
from celery_singleton_lock.topologies.servers import from_settings

pytestmark = pytest.mark.long  # (dev.py test --all and CI run it)

TTL = 2.0  # the subprocesses' singleton_lock_beat_ttl (tests/apps/beat_app.py reads CSL_BEAT_TTL)
POLL = 0.25  # their singleton_lock_beat_poll
KEY = "singleton_lock:beat-leader:{beat_app}"  # the default key for the app named "beat_app"


# -- subprocesses ----------------------------------------------------------------------------------


class Beat:
    """One real ``celery beat`` subprocess with its own schedule file, stopped by PID."""

    def __init__(self, server: RedisServer, tmp: Path, n: int, lock_url: str = "") -> None:
        self.log_path = tmp / f"beat{n}.log"
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "apps.beat_app", "beat",
             "-S", "celery_singleton_lock.beat:LeaderScheduler",
             "--schedule", str(tmp / f"schedule{n}"), "--pidfile", str(tmp / f"beat{n}.pid"),
             "--loglevel", "INFO"],
            stdout=log, stderr=subprocess.STDOUT, env=_env(server, lock_url), cwd=ROOT / "tests",
        )
        log.close()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


def _env(server: RedisServer, lock_url: str = "") -> dict[str, str]:
    return dict(
        os.environ,
        CSL_REDIS_URL_BASE=f"redis://127.0.0.1:{server.port}",
        CSL_LOCK_URL=lock_url,
        CSL_BEAT_TTL=str(TTL),
        CSL_BEAT_POLL=str(POLL),
        PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT)]),
    )


@pytest.fixture
def processes(fresh_redis, tmp_path, lock_backend):
    """Start beats (``processes.beat()``) and workers (``processes.worker()``), their locks on the
    backend under test (``processes.locks``: a server, ``processes.store``); all stopped by PID at the end."""

    class Started:
        def __init__(self) -> None:
            self.beats: list[Beat] = []
            self.workers: list[WorkerProcess] = []
            self.url = lock_backend.url if lock_backend.name == "etcd" else ""
            self.locks = from_settings(lock_backend.url if self.url else fresh_redis.url(2))
            self.store = lock_backend.store if self.url else fresh_redis.client(2)

        def beat(self) -> Beat:
            b = Beat(fresh_redis, tmp_path, len(self.beats), self.url)
            self.beats.append(b)
            return b

        def worker(self) -> WorkerProcess:
            w = WorkerProcess("apps.beat_app", pool="solo", concurrency=1, env=_env(fresh_redis, self.url),
                              cwd=ROOT / "tests", logfile=str(tmp_path / f"worker{len(self.workers)}.log"))
            self.workers.append(w.start())
            return w

    started = Started()
    yield started
    for b in started.beats:
        b.stop()
    for w in started.workers:
        w.stop()


def sends(server: RedisServer) -> list[tuple[int, int, float, str]]:
    """(tick, beat pid, time, task id) of every send so far, in order."""
    out = []
    for raw in server.client(3).lrange("sends", 0, -1):
        tick, pid, at, task_id = raw.decode().split()
        out.append((int(tick), int(pid), float(at), task_id))
    return out


def leader_pid(locks) -> int:
    """The pid in the leader lock's value (the lock carries its holder's host and pid)."""
    holder = wait_until(lambda: locks.holder(KEY), 30, 0.05, "a beat to take the leader lock")
    assert holder.pid is not None
    return int(holder.pid)


def logs(*procs: Beat) -> str:
    return "\n".join(f"--- beat pid {b.pid}:\n{b.log()[-2500:]}" for b in procs)


def assert_each_tick_once(record: list[tuple[int, int, float, str]]) -> None:
    per_tick = Counter(tick for tick, _, _, _ in record)
    twice = {tick: n for tick, n in per_tick.items() if n > 1}
    assert not twice, f"ticks sent more than once: {twice}; sends: {record}"


# -- the takeover, with real processes -------------------------------------------------------------


def _each_send_ran_once_on_the_worker(fresh_redis, record, killed_at: float, stopped_at: float) -> None:
    """Every send in ``record`` ran exactly once on the worker; but a send recorded just before the
    SIGKILL or the stop may never have been published (before_task_publish records it, then the
    process died)."""
    send_ids = [task_id for _, _, t, task_id in record
                if not (killed_at - 0.5 < t < killed_at or stopped_at - 0.5 < t)]
    journal = fresh_redis.client(3)

    def run_ids():
        return [raw.decode().split()[0] for raw in journal.lrange("runs", 0, -1)]

    wait_until(lambda: set(send_ids) <= set(run_ids()), 20, 0.1, "every send to run on the worker")
    assert all(n == 1 for n in Counter(run_ids()).values())


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_two_beats_one_sends_and_the_standby_takes_over_after_sigkill(fresh_redis, processes):
    """2 beats + 1 worker, one entry due every second, ~20 s; the leader is SIGKILLed mid-run.
    Every tick is sent exactly once, all by the leader until the kill and all by the standby after,
    except the ticks that fall in the takeover window (at most TTL + one poll + a second after the
    kill); no tick is ever sent twice; every send runs once on the worker."""
    worker = processes.worker()
    beats = [processes.beat(), processes.beat()]
    worker.wait_ready(30)
    first = leader_pid(processes.locks)
    by_pid = {b.pid: b for b in beats}
    assert first in by_pid, f"the lock names pid {first}, not one of our beats {list(by_pid)}"
    leader, standby = by_pid[first], next(b for b in beats if b.pid != first)

    # the leader sends every second; the standby nothing
    wait_until(lambda: len(sends(fresh_redis)) >= 8, 20, 0.1, "8 sends from the leader")
    killed_at = time.time()
    leader.kill()  # SIGKILL, by PID: it releases nothing

    def standby_sent():
        return [s for s in sends(fresh_redis) if s[1] == standby.pid]

    locks = processes.locks

    def standby_holds():
        holder = locks.holder(KEY)
        return holder is not None and holder.pid == standby.pid

    wait_until(standby_holds, TTL + POLL + 10, 0.02, "the standby to take the leader lock")
    locked_at = time.time()
    took_over = wait_until(standby_sent, 10, 0.05, "the standby's first send")[0]
    wait_until(lambda: len(standby_sent()) >= 8, 20, 0.1, "8 sends from the new leader")
    stopped_at = time.time()
    standby.stop()
    record = sends(fresh_redis)

    assert_each_tick_once(record)
    before = [s for s in record if s[2] < killed_at]
    after = [s for s in record if s[2] >= killed_at]
    assert before and all(pid == leader.pid for _, pid, _, _ in before), logs(*beats)
    assert after and all(pid == standby.pid for _, pid, _, _ in after), logs(*beats)
    takeover = took_over[2] - killed_at
    # the dead leader's lock expires at most TTL after its last renewal; the standby looks every POLL;
    # the next whole second is the first tick it may send. Plus slack for two busy cores.
    assert takeover <= TTL + POLL + 1.0 + 1.5, f"takeover took {takeover:.2f}s\n{logs(*beats)}"
    ticks = sorted(tick for tick, _, _, _ in record)
    missed = sorted(set(range(ticks[0], ticks[-1] + 1)) - set(ticks))
    assert all(killed_at - 1 < t < took_over[2] for t in missed), (missed, killed_at, took_over)
    print(f"\ntakeover after SIGKILL: the standby held the lock {locked_at - killed_at:.2f}s and sent its first "
          f"tick {takeover:.2f}s after the kill "
          f"(lock ttl {TTL:g}s, poll {POLL:g}s); {len(missed)} tick(s) missed: {missed}")

    _each_send_ran_once_on_the_worker(fresh_redis, record, killed_at, stopped_at)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_leader_whose_lock_is_deleted_stops_at_once_and_the_standby_takes_over(fresh_redis, processes):
    """The leader lock deleted from outside: the leader sends nothing more (it confirms the lock
    before every send), steps down, and the standby continues the schedule: no tick twice, at most
    the one tick that fell during the switch missed."""
    beats = [processes.beat(), processes.beat()]
    first = leader_pid(processes.locks)
    by_pid = {b.pid: b for b in beats}
    leader, standby = by_pid[first], next(b for b in beats if b.pid != first)
    wait_until(lambda: len(sends(fresh_redis)) >= 4, 20, 0.1, "4 sends from the leader")

    # just before a whole second: the next tick comes before the watchdog's next renewal (every TTL/3)
    # would find the lock gone, so only the check before each send can stop that tick
    wait_until(lambda: 0.85 <= time.time() % 1 < 0.9, 5, 0.002, "the end of a second")
    assert processes.store.delete(KEY) == 1
    deleted_at = time.time()
    wait_until(lambda: len([s for s in sends(fresh_redis) if s[1] == standby.pid]) >= 4, 15, 0.05,
               "4 sends from the standby")
    record = sends(fresh_redis)
    for b in beats:
        b.stop()

    assert_each_tick_once(record)
    late = [s for s in record if s[1] == leader.pid and s[2] > deleted_at + 0.1]
    assert not late, f"the old leader sent after its lock was deleted: {late}\n{logs(*beats)}"
    after = [s for s in record if s[2] > deleted_at + 0.1]
    assert after and all(pid == standby.pid for _, pid, _, _ in after)
    ticks = sorted(tick for tick, _, _, _ in record)
    missed = sorted(set(range(ticks[0], ticks[-1] + 1)) - set(ticks))
    assert len(missed) <= 1, (missed, deleted_at, record)
    assert "stepped down" in leader.log(), logs(leader)
    first_new = min(s[2] for s in record if s[1] == standby.pid)
    print(f"\nlock deleted: the standby's first send {first_new - deleted_at:.2f}s later; missed ticks {missed}")


# -- in this process --------------------------------------------------------------------------------


def _scheduler(cls, app, tmp_path, n: int):
    if issubclass(cls, LeaderScheduler):
        return cls(app=app, schedule_filename=str(tmp_path / f"schedule{n}"))
    return cls(app=app)


class _Recorder:
    """Sends by scheduler instance, recorded by before_task_publish (real publishes, to the private broker)."""

    def __init__(self) -> None:
        self.sends: list[tuple[str, float]] = []
        before_task_publish.connect(self._on, weak=False)

    def _on(self, sender=None, headers=None, **_):
        self.sends.append((str(sender), time.time()))

    def close(self) -> None:
        before_task_publish.disconnect(self._on)


@pytest.mark.timeout(30)
def test_settings_defaults_and_bad_values(redis_server):
    app = make_app(redis_server)
    settings = beat_settings(app)
    assert settings.key == f"singleton_lock:beat-leader:{{{app.main}}}"
    assert settings.ttl == 10.0 and settings.poll == 1.0
    assert settings.lock.url == redis_server.url(2)  # the tasks' own resolution
    app.conf.update(singleton_lock_prefix="acme", singleton_lock_beat_ttl=2)
    settings = beat_settings(app)
    assert settings.key.startswith("acme:beat-leader:{") and settings.poll == 0.5 and settings.ttl == 2.0
    for setting, value, words in (
        ("singleton_lock_beat_ttl", "10", "singleton_lock_beat_ttl"),
        ("singleton_lock_beat_ttl", 0, "singleton_lock_beat_ttl"),
        ("singleton_lock_beat_poll", 5, "singleton_lock_beat_poll"),
        ("singleton_lock_beat_key", "", "singleton_lock_beat_key"),
        ("singleton_lock_beat_key", 12, "singleton_lock_beat_key"),
    ):
        bad = make_app(redis_server, singleton_lock_beat_ttl=2)
        bad.conf[setting] = value
        with pytest.raises(ValueError, match=words) as info:
            beat_settings(bad)
        assert repr(value) in str(info.value)


@pytest.mark.timeout(30)
def test_watchdog_keeps_an_idle_leader_and_close_hands_over_at_once(fresh_redis, tmp_path, lock_backend):
    """The leader's lock outlives its TTL many times over with no send at all (the watchdog renews
    it); a standby takes nothing meanwhile; the leader's close() releases it, and the standby's very
    next tick takes the lead (no TTL to wait)."""
    url = lock_backend.url if lock_backend.name == "etcd" else fresh_redis.url(2)
    app = make_app(fresh_redis, singleton_lock_beat_ttl=2, singleton_lock_url=url, beat_schedule={
        "rare": {"task": "nothing.rare", "schedule": timedelta(hours=1)},
    })
    a = _scheduler(LeaderScheduler, app, tmp_path, 0)
    b = _scheduler(LeaderScheduler, app, tmp_path, 1)
    try:
        a.tick()
        b.tick()
        assert a.is_leader and not b.is_leader
        lock = a.leader_lock
        assert isinstance(lock, Lock)
        locks = from_settings(url)
        deadline = time.monotonic() + 3 * 2.0  # three TTLs
        while time.monotonic() < deadline:
            b.tick()
            assert not b.is_leader
            time.sleep(0.2)
        holder = locks.holder(lock.key)
        assert holder is not None and holder.raw.startswith(lock.token + " ") and not lock.lost
        a.close()
        assert locks.holder(lock.key) is None
        b.tick()
        assert b.is_leader
    finally:
        b.close()
        a.close()


class MemoryLeader(LeaderMixin, Scheduler):
    """LeaderMixin over another scheduler class: Celery's in-memory base Scheduler."""


@pytest.mark.timeout(30)
def test_mixin_over_another_scheduler_sends_only_from_the_leader_and_continues_its_schedule(fresh_redis,
                                                                                           lock_backend):
    """Two MemoryLeader instances tick side by side: only the leader's sends happen. When the leader
    resigns right after a send, the new leader takes over the send time from Redis and sends its
    first one a whole period later, not at once (which its own, never-sent schedule would say)."""
    url = lock_backend.url if lock_backend.name == "etcd" else fresh_redis.url(2)
    app = make_app(fresh_redis, singleton_lock_beat_ttl=2, singleton_lock_url=url, beat_schedule={
        "every": {"task": "nothing.every", "schedule": timedelta(seconds=1)},
    })
    recorder = _Recorder()
    a, b = MemoryLeader(app=app), MemoryLeader(app=app)
    try:
        a.tick()
        b.tick()  # a took the lead on its first tick
        assert a.is_leader and not b.is_leader
        a.schedule["every"].last_run_at = a.schedule["every"].default_now() - timedelta(seconds=5)
        a._heap = None
        while not recorder.sends:
            b.tick()
            a.tick()
            time.sleep(0.02)
        sent_at = recorder.sends[0][1]
        a.close()  # resigns right after its send
        b.schedule["every"].last_run_at = b.schedule["every"].default_now() - timedelta(seconds=5)  # "overdue"
        deadline = time.time() + 3
        while len(recorder.sends) < 2 and time.time() < deadline:
            b.tick()
            time.sleep(0.02)
        assert b.is_leader
        assert len(recorder.sends) == 2, recorder.sends
        gap = recorder.sends[1][1] - sent_at
        assert 0.9 <= gap <= 1.6, f"the new leader sent {gap:.2f}s after the old one's last send"
        # a scheduler that is not the leader refuses a direct apply_async too
        with pytest.raises(Exception, match="not the beat leader"):
            a.apply_async(a.schedule["every"])
    finally:
        recorder.close()
        a.close()
        b.close()
