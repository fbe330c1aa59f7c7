"""Whose lock is whose: eager nesting never deadlocks, bad watchdog settings fail before any lock,
servers are told apart by their credentials, ``duplicate_skipped`` names every policy, and a
recovered copy counts only another delivery's run as its call's run. One section each.

Everything runs against a real redis-server (private, on a free port) and, where a worker is
involved, a real Celery worker. Forks and interrupted or retried releases are in
test_identity_release.py; re-sends and their counters in test_identity_resends.py; the watchdog's
receivers and deadline in test_identity_watchdog.py.

Timing bounds here are deadlines for "does not hang", far below what a hang would take (minutes,
a lock TTL of 30 s, ~30 s of release retries), never benchmarks.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
import uuid

import pytest
from _apps import make_app
from _task_support import RESTORE_FAST, TIMEOUT, Gates, Runs, TaskEvents, locked, messages, redeliver, within

from celery_singleton_lock import LockError, SelfDeadlock
from celery_singleton_lock.delivery import config as csl_config
from celery_singleton_lock.engine.addresses import redact_url
from celery_singleton_lock.testing.servers import Monitor, wait_until
from celery_singleton_lock.watchdog.process import get_watchdog

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("collect_results")]


# -- eager mode never deadlocks on itself --------------------------------------------------------


@pytest.mark.timeout(20)
def test_eager_replace_with_same_task_and_key_runs_reentrantly(redis_server, caplog):
    """Celery's eager replace() reuses the task id: the replacement runs at once under the
    caller's lock and its value comes back; nothing is re-queued, and the key is free after."""
    caplog.set_level(logging.INFO, logger="celery_singleton_lock")
    app = make_app(redis_server)
    seen = []

    @locked(app, lock_key=["k"], on_duplicate="retry")
    def step(self, k, stage):
        seen.append((stage, self.request.id, self.lock.token, self.lock.fencing_token))
        if stage == "first":
            return self.replace(step.s(k, "second"))
        return f"replaced:{k}"

    k = f"k-{uuid.uuid4().hex[:8]}"
    result, _ = within(15, step.apply, (k, "first"))
    assert result.state == "SUCCESS", result.traceback
    assert result.result == f"replaced:{k}"
    assert [s[0] for s in seen] == ["first", "second"]  # the replacement did run, once
    (_, id1, token1, fence1), (_, id2, token2, fence2) = seen
    assert id1 == id2  # the same task id (what made it wait for itself)
    assert (token1, fence1) == (token2, fence2)  # under the caller's lock, not a new one
    assert not any("re-queued" in m for m in messages(caplog, logging.INFO))
    assert redis_server.client(2).get(step.lock_key_for((k, "x"))) is None  # released by the caller


@pytest.mark.timeout(20)
def test_eager_nested_duplicate_fails_at_once_with_self_deadlock(redis_server):
    """Under task_always_eager, deduct.delay(sku) from inside deduct with the same key and
    on_duplicate="retry" can never get the lock: it fails AT ONCE with SelfDeadlock (a LockError)
    naming the key and the holder, instead of backing off for ~17 minutes."""
    # the default back-off (1 s doubling to 30 s, 50 tries): ~17 minutes, were the duplicate backed off
    app = make_app(redis_server, task_always_eager=True)
    app.conf.update(singleton_lock_retry_backoff=1.0, singleton_lock_retry_backoff_max=30.0)
    inner = {}

    @locked(app, lock_key=["sku"], on_duplicate="retry")
    def deduct(self, sku, qty):
        if qty == 2:
            nested = deduct.delay(sku, 1)
            inner.update(state=nested.state, result=nested.result, holder=self.request.id)
        return qty

    sku = f"sku-{uuid.uuid4().hex[:8]}"
    outer, took = within(15, deduct.delay, sku, 2)
    assert outer.state == "SUCCESS" and outer.result == 2  # the caller itself is unharmed
    assert inner["state"] == "FAILURE"
    error = inner["result"]
    assert isinstance(error, SelfDeadlock) and isinstance(error, LockError)
    key = deduct.lock_key_for((sku, 1))
    assert error.key == key and error.holder_task_id == inner["holder"]
    assert key in str(error) and inner["holder"] in str(error)
    assert took < 5.0  # "at once": no back-off (the first back-off alone is 0.5-1 s, all of them ~17 min)


# -- bad watchdog settings fail before any lock --------------------------------------------------


@pytest.mark.timeout(20)
def test_bad_watchdog_setting_fails_the_first_execution_before_any_lock(fresh_redis, redis_server):
    """singleton_lock_watchdog_tick="0.1" (a str): the FIRST execution fails with a ValueError
    naming the setting and the value, and no lock is ever taken (nothing reaches the lock Redis)."""
    app = make_app(redis_server, singleton_lock_watchdog_tick="0.1")
    app.conf.singleton_lock_url = fresh_redis.url(2)  # a lock Redis of this test alone: all its traffic is ours
    ran = []

    @locked(app, lock_key=["k"])
    def job(self, k):
        ran.append(k)
        return k

    with Monitor(fresh_redis) as mon:
        result, _ = within(15, job.apply, ("a",))
        mon.sync()
        sent = mon.commands()
    assert result.state == "FAILURE"
    error = result.result
    assert isinstance(error, ValueError), repr(error)
    assert "singleton_lock_watchdog_tick" in str(error) and "'0.1'" in str(error)
    assert ran == []
    assert not any(w[0].upper() in ("EVALSHA", "EVAL", "SET") for w in sent), sent  # no acquire, no release
    assert not any("job" in word for w in sent for word in w), sent
    assert fresh_redis.client(2).dbsize() == 0


@pytest.mark.timeout(20)
def test_get_watchdog_with_other_options_warns_once_and_returns_the_running_one(caplog):
    """One watchdog per process: asking for other options returns the running one and logs
    one WARNING per distinct set of options (not per call, and none for the same options)."""
    caplog.set_level(logging.WARNING)
    wd = get_watchdog()
    odd_tick = round(wd.tick + 0.001 + secrets.randbelow(10_000) / 1e7, 7)  # options nobody asked for yet
    odd_chunk = wd.chunk + 1 + secrets.randbelow(10_000)
    assert get_watchdog(tick=odd_tick) is wd
    assert get_watchdog(tick=odd_tick) is wd
    assert get_watchdog(chunk=odd_chunk) is wd
    assert get_watchdog(**wd.options) is wd  # the running options: no warning
    warnings = [m for m in messages(caplog) if "watchdog already runs with" in m]
    assert len(warnings) == 2, warnings
    assert repr(odd_tick) in warnings[0] and str(odd_chunk) in warnings[1]
    assert wd.tick != odd_tick and wd.chunk != odd_chunk  # the running one is untouched


# -- servers told apart by their credentials, not by the redacted URL -----------------------------


@pytest.mark.timeout(30)
def test_credentials_tell_servers_and_watchdog_twins_apart(fresh_redis, redis_server):
    """Two lock URLs that differ only in their credentials (two ACL users, each allowed only
    its own keys) redact to the same text, yet get two LockServers from config.server_for, and
    the watchdog renews each lock through a twin of its OWN server: had one user's connection
    renewed the other's lock, Redis would refuse (NOPERM) and the lock would be lost."""
    admin = fresh_redis.client()
    secret = {user: secrets.token_hex(8) for user in ("alice", "bob")}
    for user, password in secret.items():
        admin.execute_command("ACL", "SETUSER", user, "on", f">{password}", f"~{user}:*", "+@all")
    admin.execute_command("ACL", "LOG", "RESET")
    lock_db = fresh_redis.client(2)
    urls = {user: f"redis://127.0.0.1:{fresh_redis.port}/2?username={user}&password={password}"
            for user, password in secret.items()}
    assert redact_url(urls["alice"]) == redact_url(urls["bob"])  # what a cache keyed by the redacted URL saw

    tasks, seen = {}, {}
    for user, url in urls.items():
        app = make_app(redis_server, singleton_lock_prefix=user)
        app.conf.singleton_lock_url = url

        @locked(app, lock_key=["k"], lock_ttl=2.0, name=f"identity.creds_{user}")
        def hold(self, k, seconds, _user=user):
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:  # several renewals (every ttl/3), each on the right account
                if self.lock.lost:
                    break
                time.sleep(0.05)
            seen[_user] = (self.lock.key, self.lock.lost, self.lock.lost_reason, lock_db.pttl(self.lock.key))
            self.lock.ensure()
            return _user

        tasks[user] = hold

    servers = {user: task.lock_server() for user, task in tasks.items()}
    assert servers["alice"] is not servers["bob"]
    assert csl_config.server_for(tasks["alice"].lock_settings()) is servers["alice"]  # and each is stable
    for user, server in servers.items():
        assert server.client.connection_pool.connection_kwargs.get("username") == user

    threads = {user: threading.Thread(target=lambda t=task: seen.setdefault(t.name, t.apply(("x", 3.5))))
               for user, task in tasks.items()}
    for thread in threads.values():
        thread.start()
    for thread in threads.values():
        thread.join(20)
    for user, task in tasks.items():
        result = seen[task.name]
        assert result.state == "SUCCESS", result.traceback
        key, lost, reason, pttl = seen[user]
        assert key.startswith(f"{user}:") and not lost, reason
        assert pttl > 0
    denied = admin.execute_command("ACL", "LOG")
    assert denied == [], denied  # no command ever ran under the other user's account


# -- duplicate_skipped names every policy ---------------------------------------------------------


@pytest.mark.timeout(60)
def test_duplicate_skipped_is_sent_with_each_policy_name(redis_server, run_worker):
    """The README's promise: duplicate_skipped fires for every way a delivery does not run now,
    with policy = skip, retry, raise, backoff, and redelivery (a real broker redelivery of the
    running task). Each case then ends as its policy says."""
    from celery_singleton_lock import DuplicateTask

    queue = f"q-{uuid.uuid4().hex[:8]}"
    app = make_app(redis_server, task_default_queue=queue, broker_transport_options=RESTORE_FAST)
    gates, runs = Gates(), Runs()

    def body(self, k, gate):
        run = runs.begin(k, self.request.id)
        try:
            if gate:
                gates.wait(k)
            return k
        finally:
            runs.end(run)

    policies = ("skip", "retry", "raise", "backoff")
    tag = uuid.uuid4().hex[:6]
    tasks = {p: locked(app, lock_key=["k"], on_duplicate=p, name=f"identity_dup_{tag}.{p}")(body) for p in policies}
    keys = {p: f"{p}-{tag}" for p in policies}
    with TaskEvents(app) as rec, run_worker(app, pool="threads", concurrency=6):
        holders = {p: tasks[p].delay(keys[p], True) for p in policies}
        for p in policies:
            runs.wait_started(keys[p])
        dups = {p: tasks[p].delay(keys[p], False) for p in policies}
        redeliver(redis_server.client(0), tasks["skip"], (keys["skip"], True), holders["skip"].id, queue)
        got = {p: rec.wait_for("duplicate_skipped", task_id=dups[p].id)[0].policy for p in policies}
        redelivered = rec.wait_for("duplicate_skipped", task_id=holders["skip"].id)[0]
        assert got == {p: p for p in policies}
        assert redelivered.policy == "redelivery"
        assert redelivered.holder_task_id == holders["skip"].id
        gates.open_all()
        for p in policies:
            assert holders[p].get(timeout=TIMEOUT) == keys[p]
        assert dups["retry"].get(timeout=TIMEOUT) == keys["retry"]
        assert dups["backoff"].get(timeout=TIMEOUT) == keys["backoff"]
        with pytest.raises(DuplicateTask):
            dups["raise"].get(timeout=TIMEOUT)
        wait_until(lambda: dups["skip"].state == "REVOKED", TIMEOUT, what="the skipped duplicate to be REVOKED")
    assert [r.task_id for r in runs.of(keys["skip"])] == [holders["skip"].id]  # the redelivered copy never ran


def test_after_a_data_loss_a_recovered_copy_counts_only_another_deliverys_start_as_a_run(app):
    """After the lock Redis lost its data, the sweeper's recovered copy of a waiting call looks in the
    result backend for another delivery's start. A STARTED that the copy stored itself, read by a broker
    redelivery of it (its worker died mid-body), is not another's run: counting it would lose the call."""
    from celery.app.task import Context

    from celery_singleton_lock import LockedTask
    from celery_singleton_lock.delivery import identity
    from celery_singleton_lock.delivery.headers import Turn

    @app.task(base=LockedTask, bind=True)
    def waiting(self):
        return None

    task_id, entry = uuid.uuid4().hex, "e1"

    def request(headers, redelivered=False):
        return Context(id=task_id, headers=headers, delivery_info={"redelivered": redelivered}, is_eager=False)

    recovered = Turn(entry=entry, why="recovered", copy="c1", parked_at=time.time() - 5).header()
    assert not identity.ran_since_park(waiting, request(recovered))  # nothing stored yet
    identity.mark_started(waiting, request(recovered), False)  # the recovered copy starts, then dies
    assert not identity.ran_since_park(waiting, request(recovered, redelivered=True))  # its own start
    another = Turn(entry=entry, why="recovered", copy="c2", parked_at=time.time() - 5).header()
    assert identity.ran_since_park(waiting, request(another, redelivered=True))  # another's

    identity.mark_started(waiting, request(Turn(entry=entry, why="run").header()), False)  # its turn starts (long)
    assert identity.ran_since_park(waiting, request(recovered, redelivered=True))  # a run, whoever asks
    # once a copy holds the key it asks again (the other's whole run may fit between its look and its acquire)
    assert identity.other_copy_ran(waiting, request(recovered))
    assert not identity.other_copy_ran(waiting, request({}))  # (any other delivery: no look at all)


def test_a_final_state_counts_as_the_parked_calls_run_whatever_the_hosts_clocks_say(app):
    """A recovered copy whose entry is gone asks the result backend whether its call ran. A final state
    stored there is its run: parking stored WAITING over anything earlier (a success excepted, which is
    this call's own). No host clock is compared: a parking host whose clock ran an hour ahead of the
    one that stored the result took that run for an older one, and the call ran twice."""
    from celery.app.task import Context

    from celery_singleton_lock import LockedTask
    from celery_singleton_lock.delivery import identity
    from celery_singleton_lock.delivery.headers import Turn

    @app.task(base=LockedTask, bind=True)
    def waiting(self):
        return None

    task_id = uuid.uuid4().hex
    ahead = Turn(entry="e1", why="recovered", copy="c1", parked_at=time.time() + 3600)  # (a host clock an hour ahead)
    copy = Context(id=task_id, headers=ahead.header(),
                   delivery_info={"redelivered": False}, is_eager=False)
    assert not identity.ran_since_park(waiting, copy)  # nothing stored yet
    waiting.backend.store_result(task_id, {"key": "k", "entry": "e1"}, "WAITING", request=copy)
    assert not identity.ran_since_park(waiting, copy)  # still waiting
    waiting.backend.store_result(task_id, 42, "SUCCESS", request=copy)  # its turn ran and ended
    assert identity.ran_since_park(waiting, copy)
