"""The core contract, run by a real in-process worker against a lock topology (not a test module).

tests/topologies/test_sentinel.py and test_cluster.py call :func:`check_contract` with an app whose
broker and results live on a plain private redis-server and whose ``singleton_lock_url`` is the
Sentinel or Cluster deployment: exclusion, skip / retry / raise, the exit paths, renewal past the
TTL and lost-lock detection, on one worker (its start-up is paid once).

The fault runs through real workers (test_quorum.py, test_etcd_cluster.py) check their traffic with
:func:`every_call_ends`, :func:`every_call_succeeded` and :func:`each_body_once`.
"""

from __future__ import annotations

import threading
import time
import uuid
from types import SimpleNamespace

import pytest
from _line_support import events
from _task_support import TIMEOUT, Gates, Runs, assert_no_overlap, locked
from celery.contrib.testing.worker import start_worker
from celery.exceptions import TaskRevokedError

from celery_singleton_lock import DuplicateTask
from celery_singleton_lock.signals import lock_lost
from celery_singleton_lock.testing.servers import wait_until


def every_call_ends(calls: list, faults: object, timeout: float = 120) -> None:
    """Wait until every call has ended (SUCCESS, FAILURE or REVOKED); fail naming the first that did not,
    and ``faults`` (what the test did to the servers)."""
    try:
        wait_until(lambda: all(c.state in ("SUCCESS", "FAILURE", "REVOKED") for c in calls), timeout, 0.2,
                   "every call to end")
    except TimeoutError:
        raise AssertionError(f"not ended: {[(c.id, c.state) for c in calls if not c.ready()][:10]}; "
                             f"faults: {faults}") from None


def every_call_succeeded(calls: list) -> None:
    assert [c.state for c in calls].count("SUCCESS") == len(calls), \
        [(c.id, c.state, c.result) for c in calls if c.state != "SUCCESS"][:10]


def each_body_once(wa, k: str) -> tuple[list[dict], dict[str, dict]]:
    """Of the bodies of ``k`` that apps/worker_app.py's workers journaled: none ran twice, each that
    started ended, no two overlapped, and their fencing tokens rise in the order they started.
    (Their starts; their ends, by task id.)"""
    journaled = events(wa, k)
    starts = [e for e in journaled if e["event"] == "start"]
    ends = {e["id"]: e for e in journaled if e["event"] == "end"}
    assert len({e["id"] for e in starts}) == len(starts), f"{k}: a body ran twice"
    assert set(ends) == {e["id"] for e in starts}, f"{k}: every body that started ended"
    assert_no_overlap([(e["at"], ends[e["id"]]["at"]) for e in starts], f"bodies of {k}")
    fences = [e["fence"] for e in sorted(starts, key=lambda e: e["at"])]
    assert all(a < b for a, b in zip(fences, fences[1:], strict=False)), f"{k}: fencing tokens rise: {fences}"
    return starts, ends


def _contract_tasks(app, runs: Runs, gates: Gates) -> SimpleNamespace:
    """The contract's tasks on ``app``: skip, raise_ and retry (gated bodies), long (sleeps past its
    TTL) and lose (waits until its loss is noticed)."""

    def make(name, policy, **opts):
        @locked(app, lock_key=["k"], on_duplicate=policy, name=f"topo.{name}", **opts)
        def body(self, k, tag):
            return runs.gated(k, self.request.id, tag, gates, fail="boom")

        return body

    skip, raise_, retry = make("skip", "skip"), make("raise", "raise"), make("retry", "retry")

    @locked(app, lock_key=["k"], lock_ttl=2.0, name="topo.long")
    def long(self, k, seconds):
        time.sleep(seconds)  # several TTLs: only the watchdog keeps the lock
        return self.lock.lost

    @locked(app, lock_key=["k"], lock_ttl=1.5, name="topo.lose")
    def lose(self, k):
        gates.open(f"{k}:holding")
        wait_until(lambda: self.lock.lost, TIMEOUT, 0.02, "the loss to be noticed")
        return self.lock.lost_reason

    return SimpleNamespace(skip=skip, raise_=raise_, retry=retry, long=long, lose=lose)


def _check_skip_and_raise(tasks: SimpleNamespace, server, runs: Runs, gates: Gates) -> None:
    skip, raise_ = tasks.skip, tasks.raise_
    # skip: the duplicate is REVOKED at once, its body never runs
    k = f"skip-{uuid.uuid4().hex[:6]}"
    holder = skip.delay(k, "holder")
    runs.wait_started(k)
    dup = skip.delay(k, "dup")
    with pytest.raises(TaskRevokedError):
        dup.get(timeout=TIMEOUT)
    assert server.holder(skip.lock_key_for((k, "x"))) is not None, "the holder holds the key"
    gates.open(k)
    assert holder.get(timeout=TIMEOUT) == "holder"
    assert [r.info["tag"] for r in runs.of(k)] == ["holder"], "the duplicate never ran"

    # raise: FAILURE with DuplicateTask
    k = f"raise-{uuid.uuid4().hex[:6]}"
    holder = raise_.delay(k, "holder")
    runs.wait_started(k)
    with pytest.raises(DuplicateTask):
        raise_.delay(k, "dup").get(timeout=TIMEOUT)
    gates.open(k)
    assert holder.get(timeout=TIMEOUT) == "holder"


def _check_retry(retry, server, runs: Runs, gates: Gates) -> None:
    # retry: the duplicate waits in the key's line and runs after the holder, never beside it
    k = f"retry-{uuid.uuid4().hex[:6]}"
    holder = retry.delay(k, "holder")
    runs.wait_started(k)
    dups = [retry.delay(k, f"dup{i}") for i in range(2)]
    wait_until(lambda: all(d.state == "WAITING" for d in dups), TIMEOUT, 0.05, "the duplicates to park")
    assert len(runs.of(k)) == 1
    gates.open(k)
    assert holder.get(timeout=TIMEOUT) == "holder"
    assert sorted(d.get(timeout=TIMEOUT) for d in dups) == ["dup0", "dup1"]
    assert len(runs.of(k)) == 3
    assert_no_overlap([(r.start, r.end) for r in runs.of(k)], f"runs of {k}")
    key = retry.lock_key_for((k, "x"))
    wait_until(lambda: server.holder(key) is None, TIMEOUT, 0.05, "the last waiter to release")


def _check_exit_paths_and_renewal(tasks: SimpleNamespace, server, lost: list) -> None:
    skip, long = tasks.skip, tasks.long
    # exit paths: an exception releases, a success releases
    k = f"boom-{uuid.uuid4().hex[:6]}"
    with pytest.raises(RuntimeError):
        skip.delay(k, "boom").get(timeout=TIMEOUT)
    assert server.holder(skip.lock_key_for((k, "x"))) is None, "released on the exception"
    assert skip.delay(k, "again").get(timeout=TIMEOUT) == "again", "and free for the next call"
    assert server.holder(skip.lock_key_for((k, "x"))) is None, "released on success"

    # renewal past the TTL: 5 s under a 2 s TTL, never lost, and the key is exclusive meanwhile
    k = f"long-{uuid.uuid4().hex[:6]}"
    first = long.delay(k, 5.0)  # ends well after the duplicate below, even on a slow machine
    key = long.lock_key_for((k, 0))
    wait_until(lambda: server.holder(key) is not None, TIMEOUT, 0.02, "the long task to hold its key")
    time.sleep(2.5)  # past the TTL: only renewals keep it
    with pytest.raises(TaskRevokedError):
        long.delay(k, 0).get(timeout=TIMEOUT)
    assert first.get(timeout=TIMEOUT) is False, "renewed past its TTL, never lost"
    assert not lost


def _check_loss(lose, server, gates: Gates, lost: list, lost_seen: threading.Event) -> None:
    # lost-lock detection: the key is deleted under the holder; the watchdog finds out
    k = f"lose-{uuid.uuid4().hex[:6]}"
    res = lose.delay(k)
    gates.wait(f"{k}:holding")
    key = lose.lock_key_for((k,))
    assert server.client.delete(key) == 1
    reason = res.get(timeout=TIMEOUT)
    assert "no longer the owner" in reason
    assert lost_seen.wait(TIMEOUT) and lost[0][0] == key


def check_contract(app) -> None:
    runs, gates = Runs(), Gates()
    lost: list[tuple[str, str]] = []
    lost_seen = threading.Event()

    def on_lost(sender=None, key=None, task_id=None, reason=None, **_):
        if getattr(sender, "app", None) is app:
            lost.append((key, reason))
            lost_seen.set()

    tasks = _contract_tasks(app, runs, gates)
    lock_lost.connect(on_lost, weak=False)
    try:
        with start_worker(app, pool="threads", concurrency=4, perform_ping_check=False, loglevel="WARNING",
                          shutdown_timeout=30):
            server = tasks.skip.lock_server()
            _check_skip_and_raise(tasks, server, runs, gates)
            _check_retry(tasks.retry, server, runs, gates)
            _check_exit_paths_and_renewal(tasks, server, lost)
            _check_loss(tasks.lose, server, gates, lost, lost_seen)
    finally:
        lock_lost.disconnect(on_lost)
        gates.open_all()
