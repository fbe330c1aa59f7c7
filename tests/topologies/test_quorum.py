"""Quorum mode: a Redlock majority over 5 independent redis-servers, with fencing tokens that only rise.

Every server is a private one on a free loopback port, with no persistence, stopped by PID.
Exclusion and fencing must hold with 2 servers stopped (SIGSTOP), with 2 servers restarted
empty mid-run, and in a randomised history of many holders (each grant's interval and token
recorded, then checked for overlap and order, Jepsen-style). With 3 servers down, an acquire
is "unreachable", never a lock.
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
from contextlib import ExitStack

import pytest
from _task_support import load_worker_app, start_worker_process
from _topology_support import each_body_once, every_call_ends, every_call_succeeded
from celery import Celery

from celery_singleton_lock import LockBackendUnavailable, LockedTask, LockLost, held
from celery_singleton_lock.engine.lock import Holder, Lock, Release
from celery_singleton_lock.testing.servers import RedisServer, wait_until
from celery_singleton_lock.topologies.quorum import QuorumLockServer
from celery_singleton_lock.topologies.servers import from_settings

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow, pytest.mark.usefixtures("collect_results")]


@pytest.fixture(scope="module")
def masters():
    with ExitStack() as stack:
        servers = [stack.enter_context(RedisServer()) for _ in range(5)]
        yield servers
        for s in servers:
            if s.paused:
                s.resume()


@pytest.fixture
def quorum(masters):
    for s in masters:
        if s.paused:
            s.resume()
        if s.proc is None:
            s.start()
        s.client(2).flushdb()  # our private servers only
    q = from_settings(";".join(s.url(2) for s in masters), redis_options={"socket_timeout": 0.5})
    assert isinstance(q, QuorumLockServer) and q.majority == 3
    yield q
    q.close()


def name() -> str:
    return f"q-{uuid.uuid4().hex[:10]}"


class History:
    """Grant intervals and tokens of one key's holders, checked for overlap and token order."""

    def __init__(self) -> None:
        self.grants: list[tuple[float, float, int]] = []
        self._lock = threading.Lock()

    def hold(self, lock: Lock, seconds: float) -> None:
        start = time.monotonic()
        time.sleep(seconds)
        lock.ensure()  # still ours by the clock when the hold ends: the interval really was held
        with self._lock:
            self.grants.append((start, time.monotonic(), lock.fencing_token))

    def check(self) -> None:
        ordered = sorted(self.grants)
        for (s1, e1, t1), (s2, e2, t2) in zip(ordered, ordered[1:], strict=False):
            assert e1 <= s2, f"two holders overlapped: [{s1}, {e1}] and [{s2}, {e2}]"
            assert t1 < t2, f"a later holder got a token not above the earlier one's: {t1} then {t2}"


def take(q: QuorumLockServer, key: str, ttl: float = 5.0, deadline: float = 10.0) -> Lock:
    def attempt() -> Lock | None:
        try:
            got = q.acquire(key, ttl)
        except LockBackendUnavailable:
            return None
        return got if isinstance(got, Lock) else None

    return wait_until(attempt, deadline, 0.01, f"{key} to be taken")


def test_a_majority_grants_and_a_minority_does_not(quorum, masters):
    key = name()
    lock = quorum.acquire(key, 5, owner_id="task-1")
    assert isinstance(lock, Lock) and lock.fencing_token > 0
    values = [m.client(2).get(lock.key) for m in masters]
    assert sum(1 for v in values if v and v.startswith(lock.token.encode())) >= 3
    other = quorum.acquire(key, 5, owner_id="task-2")
    assert isinstance(other, Holder) and other.owner_id == "task-1"
    assert quorum.release(lock)
    # the release returns once a majority answered; the other members follow within moments,
    # well before the 5 s TTL could delete the key for them
    wait_until(lambda: all(not m.client(2).exists(lock.key) for m in masters), 2.0, 0.01,
               "every member to drop the released key")
    again = quorum.acquire(key, 5)
    assert isinstance(again, Lock) and again.fencing_token > lock.fencing_token
    assert quorum.release(again)


def test_two_servers_stopped_exclusion_and_fencing_hold(quorum, masters):
    key = name()
    history = History()
    masters[0].pause()
    masters[3].pause()
    try:
        for _ in range(15):
            lock = take(quorum, key)
            history.hold(lock, 0.01)
            assert quorum.release(lock)
        # contenders at once: one at a time, tokens rising
        errors: list[BaseException] = []

        def contend() -> None:
            try:
                for _ in range(5):
                    lock = take(quorum, key)
                    history.hold(lock, 0.005)
                    quorum.release(lock)
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=contend) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
    finally:
        masters[0].resume()
        masters[3].resume()
    assert len(history.grants) == 30
    history.check()


def test_two_servers_restarted_empty_mid_run(quorum, masters):
    key = name()
    history = History()
    for round_ in range(10):
        lock = take(quorum, key)
        history.hold(lock, 0.01)
        assert quorum.release(lock)
        if round_ == 4:
            masters[1].restart()  # no persistence: its lock and fencing floor are gone
            masters[2].restart()
    assert len(history.grants) == 10
    history.check()


@pytest.mark.parametrize("run", range(3))
def test_a_released_lock_never_lingers_after_a_paused_minority_and_an_empty_restart(quorum, masters, run):
    """The paused-minority sequence: 2 members paused (SIGSTOP) and used through, then resumed; 3 calls
    of one key in turn; the OTHER 2 members restarted empty; 3 more calls in turn. Each call takes the
    key: a paused member runs an acquire sent to it before it froze, then that lock's release (never
    skipped, never first on another connection), so no finished call's lock lingers there to be
    counted, beside 2 young members, as held against the next calls."""
    key = name()
    tokens: list[int] = []

    def call(ttl: float = 30.0) -> None:
        def attempt() -> Lock | None:  # unreachable: tried again, as a task is re-sent
            try:
                got = quorum.acquire(key, ttl, owner_id=f"call-{len(tokens)}")
            except LockBackendUnavailable:
                return None
            assert isinstance(got, Lock), f"call {len(tokens)} was refused as a duplicate: {got!r}"
            return got

        got = wait_until(attempt, 15.0, 0.05, f"call {len(tokens)} to take the key")
        tokens.append(got.fencing_token)
        time.sleep(0.2)  # the body
        assert quorum.release(got).status is Release.DELETED

    masters[0].pause()
    masters[1].pause()
    try:
        for _ in range(3):
            call()
            time.sleep(0.05)
    finally:
        masters[0].resume()
        masters[1].resume()
    for _ in range(3):
        call()
        time.sleep(0.05)
    masters[3].restart()  # no persistence: empty
    masters[4].restart()
    for _ in range(3):
        call()
        time.sleep(0.05)
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens), f"fencing tokens rise: {tokens}"
    wait_until(lambda: all(not m.client(2).exists(key) for m in masters), 3.0, 0.02,
               "no member to keep a released lock")


def test_three_servers_down_is_unreachable_never_a_lock(quorum, masters):
    for m in masters[:3]:
        m.pause()
    try:
        with pytest.raises(LockBackendUnavailable, match="majority"):
            quorum.acquire(name(), 5)
    finally:
        for m in masters[:3]:
            m.resume()


def test_the_watchdog_keeps_a_quorum_lock_and_loses_it_without_a_majority(quorum, masters):
    key = name()
    with held(quorum, key, ttl=2.0) as lock:
        time.sleep(3.0)  # past the ttl: renewed on every member by the watchdog
        lock.ensure()
        assert all(0 < m.client(2).pttl(lock.key) <= 2000 for m in masters)
        for m in masters[:3]:  # the renewals can no longer reach a majority
            m.client(2).delete(lock.key)
        wait_until(lambda: lock.lost, 5, what="the quorum lock to be lost")
        with pytest.raises(LockLost):
            lock.ensure()


@pytest.mark.timeout(180)
@pytest.mark.long
def test_randomised_history_with_faults(quorum, masters):
    """Jepsen-style: 4 threads take the key at random; servers are stopped, resumed and
    restarted at random meanwhile. Every grant's interval and token go in the history."""
    rng = random.Random(20261123)
    key = name()
    history = History()
    stop = time.monotonic() + 12
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        r = random.Random(seed)
        try:
            while time.monotonic() < stop:
                try:
                    lock = quorum.acquire(key, 2.0)
                except LockBackendUnavailable:
                    time.sleep(0.02)
                    continue
                if not isinstance(lock, Lock):
                    time.sleep(r.uniform(0.001, 0.02))
                    continue
                try:
                    history.hold(lock, r.uniform(0.0, 0.03))
                except LockLost:
                    pass  # not recorded: the holder found out before it claimed the interval
                finally:
                    try:
                        quorum.release(lock)
                    except LockBackendUnavailable:
                        pass
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    down: list[RedisServer] = []
    while time.monotonic() < stop:
        time.sleep(rng.uniform(0.3, 0.8))
        if down and rng.random() < 0.6:
            down.pop().resume()
        elif len(down) < 2:  # a minority at a time
            victim = rng.choice([m for m in masters if m not in down])
            if rng.random() < 0.3:
                victim.restart()
            else:
                victim.pause()
                down.append(victim)
    for m in down:
        m.resume()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert len(history.grants) >= 20, len(history.grants)
    history.check()


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


def test_renewals_reach_a_member_restarted_empty(quorum, masters):
    """A member restarted without data has lost its scripts too: the renewal pipeline reloads
    RENEW_MANY there (NOSCRIPT) instead of counting that member as failed for good."""
    warm = take(quorum, name())
    assert quorum.renew_many([warm]) == [True]  # every member has loaded the scripts, RENEW_MANY too
    assert quorum.release(warm)
    masters[1].restart()
    masters[2].restart()
    lock = take(quorum, name(), ttl=30.0)
    holders = [m for m in masters if m.client(2).get(lock.key)]
    time.sleep(1.0)  # let the TTL run down (below 29 s), so a renewal shows in PTTL
    # a renewal answered by a majority (on a loaded host a member may answer late once: the next one
    # counts; what this test holds is the line below, every holder renewed, the restarted ones too)
    wait_until(lambda: quorum.renew_many([lock]) == [True], 10.0, 0.05, "a majority to confirm a renewal")
    # the renewal returns at a majority; the other members follow within moments
    wait_until(lambda: all(m.client(2).pttl(lock.key) > 29_500 for m in holders), 0.4, 0.01,
               "the renewal on every member that holds the key")
    assert any(m in holders for m in masters[1:3]), "a restarted member holds the key too"
    assert quorum.release(lock)


def test_two_messages_with_one_lost_attempts_token_never_both_hold_the_lock(quorum):
    """(quorum mode) An attempt whose replies were lost left its lock on the
    masters under token T. The re-send carrying T takes it back, under a new token; a broker
    redelivery of that same message (also carrying T) then finds the key held, not granted twice."""
    name = f"q-{uuid.uuid4().hex[:10]}"
    orphan = quorum.acquire(name, 30, owner_id="job", token="t" * 32)
    assert isinstance(orphan, Lock)
    first = quorum.acquire(name, 30, owner_id="job", token="a" * 32, retake="t" * 32)
    assert isinstance(first, Lock) and first.token == "a" * 32
    second = quorum.acquire(name, 30, owner_id="job", token="b" * 32, retake="t" * 32)
    assert not isinstance(second, Lock), "two messages carrying one token both hold the lock"
    assert quorum.release(first).status is Release.DELETED


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
    for m in masters:
        if m.paused:
            m.resume()
        if m.proc is None:
            m.start()
        m.client(2).flushdb()
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

        # the paused-minority sequence first
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
    refusals = [json.loads(x) for x in wa.journal.lrange("handoff:parks", 0, -1)]
    ended_at: dict[str, float] = {}
    for k in keys:
        _, ends = each_body_once(wa, k)
        ended_at.update({i: e["at"] for i, e in ends.items()})
    stale = [r for r in refusals if r["holder"] in ended_at and r["at"] > ended_at[r["holder"]] + 3.0]
    assert not stale, f"{len(stale)} refused because of a finished task's lock: {stale[:3]}; faults {faults.log}"
    ran = sum(1 for c in calls if c.state == "SUCCESS")
    print(f"\n[jepsen] {ran} calls on {len(keys)} keys, {len(refusals)} refusals, faults: {len(faults.log)}")


def test_the_quorum_drift_allowance_survives_the_watchdog(quorum):
    """Redlock's drift allowance (DRIFT x ttl) is part of a quorum lock's deadline also once the
    watchdog tracks it and sets its own margin (before: the watchdog's margin replaced it)."""
    from celery_singleton_lock.topologies.quorum import DRIFT
    from celery_singleton_lock.watchdog.renewer import Watchdog

    dog = Watchdog()
    lock = take(quorum, name(), ttl=10.0)
    try:
        dog.track(lock)
        watchdog_margin = dog.margin(lock.ttl)
        assert lock.margin == watchdog_margin
        assert lock.deadline == pytest.approx(lock.confirmed_at + 10.0 - watchdog_margin - DRIFT * 10.0)
    finally:
        dog.forget(lock)
        dog.shutdown()
        quorum.release(lock)


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


# -- the fan-out: one pipelined connection per member, no thread ---------------------------------------


def test_no_thread_per_member_and_a_stopped_member_gets_its_commands_in_order(quorum, masters):
    """Operations go to the members on one connection each, without threads; a member that is
    stopped gets an acquire and its release in the order they were written (the release is not
    skipped), so once it resumes, the finished lock is not there."""
    before = {t.ident for t in threading.enumerate()}
    key = name()
    lock = quorum.acquire(key, 5.0, owner_id="first")
    assert isinstance(lock, Lock)
    quorum.release(lock)
    masters[0].pause()
    try:
        started = time.monotonic()
        lock = quorum.acquire(key, 5.0, owner_id="second")  # member 0 stopped: 4 answer
        assert isinstance(lock, Lock), lock
        assert time.monotonic() - started < 1.0  # decided by the majority, not held up by the stopped one
        released = quorum.release(lock)
        assert released.status is Release.DELETED
        third = quorum.acquire(key, 5.0, owner_id="third")  # member 0 now skipped (stuck)
        assert isinstance(third, Lock)
        quorum.release(third)
    finally:
        masters[0].resume()
    # member 0 runs what was written to it, in order: no lock of "second" (or anyone) lingers there
    member = masters[0].client(2)
    wait_until(lambda: member.get(key) is None, timeout=5.0, what="the stopped member to catch up")
    assert {t.ident for t in threading.enumerate()} - before == set(), [t.name for t in threading.enumerate()]
    again = quorum.acquire(key, 5.0, owner_id="fourth")
    assert isinstance(again, Lock) and again.fencing_token > lock.fencing_token
    quorum.release(again)


def test_a_member_killed_and_restarted_empty_is_reconnected_with_its_scripts(quorum, masters):
    """A member's connection breaks when it dies: its waiting commands fail, the next command connects
    again and loads the scripts ahead of itself, so it votes again once its data is old enough."""
    key = name()
    lock = quorum.acquire(key, 2.0, owner_id="a")
    assert isinstance(lock, Lock)
    quorum.release(lock)
    masters[1].restart()  # empty: SINCE is gone there
    for attempt in range(3):
        lock = quorum.acquire(key, 2.0, owner_id=f"b{attempt}")
        assert isinstance(lock, Lock)
        quorum.release(lock)
    member = masters[1].client(2)
    assert member.exists("celery_singleton_lock:{quorum}:since") == 1  # it was asked (and answered) again


# -- operators see every member -------------------------------------------------------------------------


def test_celery_locks_list_show_and_release_read_every_member_with_the_majority_verdict(masters, quorum):
    from celery.bin.base import CLIContext
    from click.testing import CliRunner

    from celery_singleton_lock.ops.cli import locks

    app = Celery(f"t{uuid.uuid4().hex[:8]}", broker=masters[0].url(0), set_as_current=False)
    app.conf.singleton_lock_url = ";".join(s.url(2) for s in masters)
    app.conf.singleton_lock_prefix = f"ops{uuid.uuid4().hex[:6]}"

    @app.task(base=LockedTask, shared=False, name="t.deduct")
    def deduct(sku):
        return sku

    held_key = deduct.lock_key_for(["held"])
    minority_key = deduct.lock_key_for(["minority"])
    lock = quorum.acquire(held_key, 30.0, owner_id="holder-1")
    assert isinstance(lock, Lock)
    # a lock only 2 of 5 members still have (a release that has not reached them): no majority
    for s in masters[:2]:
        s.client(2).set(minority_key, b"tok " + b"1 " + b'{"owner":"gone-1","host":"h","pid":1}', px=30_000)
    runner = CliRunner()
    obj = CLIContext(app=app, no_color=True, workdir=None)

    out = runner.invoke(locks, ["list", "--json"], obj=obj)
    assert out.exit_code == 0, out.output
    rows = {row["key"]: row for row in json.loads(out.output)}
    assert set(rows) == {held_key, minority_key}
    assert rows[held_key]["held"] is True and rows[held_key]["held_on"] == 5
    assert rows[held_key]["task_id"] == "holder-1"
    assert rows[minority_key]["held"] is False and rows[minority_key]["held_on"] == 2
    assert sorted(t is None for t in rows[minority_key]["members"].values()) == [False, False, True, True, True]
    out = runner.invoke(locks, ["list"], obj=obj)
    assert "MEMBERS" in out.output and "5/5" in out.output and "2/5, no majority: not held" in out.output

    out = runner.invoke(locks, ["show", held_key], obj=obj)
    assert out.exit_code == 0 and "on 5/5" in out.output and out.output.count("member ") == 5, out.output
    out = runner.invoke(locks, ["show", minority_key], obj=obj)
    assert out.exit_code == 1 and "no majority: not held" in out.output, out.output

    masters[4].pause()  # one member down: still read, shown as unreachable, the verdict still holds
    try:
        out = runner.invoke(locks, ["show", held_key, "--json"], obj=obj)
        assert out.exit_code == 0, out.output
        shown = json.loads(out.output)
        assert shown["held_on"] == 4 and shown["held"] is True
        assert sum(1 for t in shown["members"].values() if t and t.startswith("unreachable")) == 1
    finally:
        masters[4].resume()

    out = runner.invoke(locks, ["release", held_key, "--yes"], obj=obj)
    assert out.exit_code == 0 and "force-released on 5 of 5 members" in out.output, out.output
    assert all(s.client(2).get(held_key) is None for s in masters)
    assert lock.renew() is False  # the holder finds out at its next renewal
    out = runner.invoke(locks, ["release", minority_key], obj=obj, input="y\n")
    assert out.exit_code == 0 and "on 2 of 5 members" in out.output, out.output
    out = runner.invoke(locks, ["release", minority_key, "--yes"], obj=obj)
    assert out.exit_code == 1 and "nothing released" in out.output
    out = runner.invoke(locks, ["list"], obj=obj)
    assert out.exit_code == 0 and "no locks held" in out.output


def test_fencing_tokens_rise_when_members_disagree_and_stay_near_the_members_clocks(quorum, masters, monkeypatch):
    """Members that agree answer the client's proposed token and keep it as their floor in
    the same script: no second round trip. A member whose floor is ahead answers higher; the token is
    then written back to the others before the acquire returns, so the next token is higher still.
    A client clock far off is pulled into a second of the members' clocks."""
    from celery_singleton_lock.topologies import quorum as quorum_module

    key = name()
    first = take(quorum, key)
    quorum.release(first)
    floor_key = first.key + ":f"
    assert sum(1 for m in masters if int(m.client(2).get(floor_key) or 0) == first.fencing_token) >= 3
    # floors ahead on a majority (3 of 5): any granting majority includes one of them, which answers
    # higher than the others; the token is then written back to the others that granted
    ahead = first.fencing_token + 10_000_000
    for m in masters[:3]:
        m.client(2).set(floor_key, ahead, px=60_000)
    second = take(quorum, key)
    assert second.fencing_token == ahead + 1
    floors = [int(m.client(2).get(floor_key) or 0) for m in masters]
    assert sum(1 for f in floors if f >= second.fencing_token) >= 3, floors
    quorum.release(second)
    third = take(quorum, key)
    assert third.fencing_token > second.fencing_token
    quorum.release(third)

    hour = 3600 * 1_000_000
    fresh = name()
    monkeypatch.setattr(quorum_module, "_proposal", lambda: time.time_ns() // 1000 + hour)
    fast = take(quorum, fresh)
    assert fast.fencing_token < time.time_ns() // 1000 + 2_000_000  # not an hour ahead: a second at most
    quorum.release(fast)
    monkeypatch.setattr(quorum_module, "_proposal", lambda: time.time_ns() // 1000 - hour)
    slow = take(quorum, fresh)
    assert slow.fencing_token > fast.fencing_token  # the floors, not the slow clock
    quorum.release(slow)


def test_finished_locks_leave_nothing_that_outlives_two_minutes_on_any_member(quorum, masters):
    """(footprint) After many locks on distinct keys, each member keeps only keys that expire
    within FENCE_KEEP (the fencing floors), besides its one SINCE key: nothing is left after 2 minutes."""
    from celery_singleton_lock.topologies.quorum import FENCE_KEEP, SINCE

    for i in range(200):
        lock = quorum.acquire(f"fp-{i}-{uuid.uuid4().hex[:6]}", 5.0, owner_id=f"task-{i}")
        assert isinstance(lock, Lock)
        assert quorum.release(lock).status is Release.DELETED
    for m in masters:
        client = m.client(2)
        left = [k for k in client.scan_iter(count=1000) if k != SINCE.encode()]
        assert len(left) <= 200, len(left)  # the floors: one per key, no more
        ttls = [client.pttl(k) for k in left]
        assert all(0 < t <= FENCE_KEEP * 1000 for t in ttls), sorted(ttls)[-3:]
        assert FENCE_KEEP + 5.0 < 120.0  # so 2 minutes after the run, nothing of these is left


def test_a_member_reconnected_many_times_keeps_working(quorum, masters):
    """A reconnect to a member gives back its slot of the client's connection pool: after more than
    100 reconnects (restarts, killed connections) the member still answers, never lost to this
    process for its whole life ("Too many connections")."""
    key = name()
    admin = masters[0].client(2)
    for i in range(110):
        lock = quorum.acquire(key, 5.0, owner_id=f"t{i}")
        assert isinstance(lock, Lock)
        quorum.release(lock)
        admin.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")  # every client but this one
    lock = None
    for _ in range(3):  # the first use after a kill finds the connection broken; the next reconnects
        got = quorum.acquire(key, 5.0, owner_id="last")
        if isinstance(got, Lock) and admin.get(got.key) is not None:
            lock = got
            break
        if isinstance(got, Lock):
            quorum.release(got)
    assert lock is not None, "member 0 no longer takes part"
    quorum.members[0].client.ping()  # and its own client still has connections to give
    quorum.release(lock)


def test_a_forked_child_does_not_inherit_a_member_stuck_in_its_parent(quorum, masters):
    """A parent with a command still unanswered on a member (stopped when it
    was sent) forks: the child starts with its own connections, and asks that member like any other."""
    import multiprocessing

    key = name()
    masters[2].pause()
    try:
        lock = quorum.acquire(key, 5.0, owner_id="parent")
        assert isinstance(lock, Lock)
        quorum.release(lock)
    finally:
        masters[2].resume()
    time.sleep(0.3)  # the parent's call on member 2 is now "stuck" by its age, though answered meanwhile

    def child(q: QuorumLockServer, key: str, out: multiprocessing.Queue) -> None:
        got = q.acquire(key, 5.0, owner_id="child")
        out.put(isinstance(got, Lock) and masters[2].client(2).get(got.key) is not None)
        if isinstance(got, Lock):
            q.release(got)

    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    proc = ctx.Process(target=child, args=(quorum, key, out))
    proc.start()
    proc.join(20)
    assert proc.exitcode == 0
    assert out.get(timeout=5) is True, "the child skipped member 2, stuck only in its parent"


def test_a_cooldown_keeps_the_key_on_a_majority_then_frees_it(quorum, masters):
    """lock_cooldown on a quorum: the release keeps the key, by nobody, on every member it was on."""
    key = name()
    lock = take(quorum, key)
    assert quorum.release(lock, succeeded=True, cooldown=1.0).status is Release.DELETED
    found = quorum.acquire(key, 5.0)
    assert isinstance(found, Holder) and found.cooldown and 0 < found.ttl_ms <= 1000
    assert sum(1 for s in masters if (s.client(2).get(found.key) or b"").startswith(b"= ")) >= quorum.majority
    after = take(quorum, key, deadline=5.0)  # the cooldown ran out: free again, with a higher fence
    assert after.fencing_token > lock.fencing_token
    quorum.release(after)
