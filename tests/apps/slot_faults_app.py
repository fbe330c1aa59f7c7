"""The app that tests/line/test_slot_faults.py's real ``celery worker`` subprocesses run: slot waiters
(``lock_wait_in_slot``) under faults.

Broker (db 0), results (db 1) and the journal (db 3) on CSL_REDIS_URL_BASE; the LOCKS on a Redis of
their own (CSL_LOCK_URL), so that the lock Redis can be restarted empty without losing the broker.
Bodies journal each start and end (apps/_slot_journal.py), so the tests count runs and check that
no two bodies of one key overlapped.

Fault hooks (from outside the package, as tests/apps/kill_points.py; installed in the worker processes
only, where tests/_clusters.py sets CSL_WORKER_HOOKS, never in a test process that imports this app): a
slot waiter whose key is named by the journal's ``kill-handed`` set SIGKILLs its own process right after it
was handed the key
in its worker slot (``policies._in_slot`` returned its Lock: it claimed the key) and before its body
starts; once per key. A call named by the ``run-elsewhere`` set has run elsewhere right after a copy's
first look at its stored state (``identity.ran_since_park``); once per call.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import time
from typing import Any

from celery.exceptions import Ignore

from apps._slot_journal import run_body, slot_app
from celery_singleton_lock import LockedTask
from celery_singleton_lock.delivery import identity, policies

app, journal = slot_app("slot_faults_app", singleton_lock_ttl=3.0, singleton_lock_retry_backoff=0.2)


@app.task(base=LockedTask, bind=True, lock_key=["key"], on_duplicate="retry", lock_wait_in_slot=1.0)
def slot(self, key: str, seconds: float = 0.0, tag: str = "") -> dict:
    return run_body(journal, self, key, seconds, tag)


@app.task(base=LockedTask, bind=True, lock_key=["key"], on_duplicate="retry", lock_wait_in_slot=5.0)
def slot_long(self, key: str, seconds: float = 0.0, tag: str = "") -> dict:
    """Waits up to 5 s (the most allowed) in its slot: long enough to be in it while the lock Redis restarts."""
    return run_body(journal, self, key, seconds, tag)


@app.task(base=LockedTask, bind=True, lock_key=["key"], on_duplicate="retry", lock_wait_in_slot=5.0, lock_ttl=30.0)
def slot_ttl30(self, key: str, seconds: float = 0.0, tag: str = "") -> dict:
    """As slot_long, with the package's default lock TTL (30 s): a hand-off within a third of it
    (10 s, longer than the longest slot wait) is trusted without a confirming renewal."""
    return run_body(journal, self, key, seconds, tag)


@app.task(base=LockedTask, bind=True, lock_key=["key"], on_duplicate="retry", lock_wait_in_slot=5.0,
          lock_retry_backoff=4.0, lock_retry_backoff_max=4.0)
def slot_slow_resend(self, key: str, seconds: float = 0.0, tag: str = "") -> dict:
    """As slot_long, with a slower re-send when the lock Redis is unreachable (2 to 4 s: the default
    back-off is 1 s, i.e. 0.5 to 1 s for a first re-send)."""
    return run_body(journal, self, key, seconds, tag)


@app.task(base=LockedTask, bind=True, lock_key=["key"], on_duplicate="retry", lock_wait_in_slot=2.0, lock_ttl=4.0,
          acks_late=True, reject_on_worker_lost=True)
def slot_late(self, key: str, seconds: float = 0.0, tag: str = "") -> dict:
    """acks_late + reject_on_worker_lost: a killed child's message is delivered again."""
    return run_body(journal, self, key, seconds, tag)


@app.task(bind=True)
def filler(self, seconds: float = 0.05) -> None:
    """Other work in the same queue (the backlog)."""
    time.sleep(seconds)
    journal.incr("fillers")


_in_slot = getattr(policies._in_slot, "__wrapped__", policies._in_slot)  # (a reload wraps the original)


@functools.wraps(_in_slot)
def _handed_then_maybe_die(task: Any, request: Any, args: Any, kwargs: Any, *rest: Any) -> Any:
    lock = _in_slot(task, request, args, kwargs, *rest)
    key = (kwargs or {}).get("key") or (args[0] if args else None)
    if lock is not None and key and journal.srem("kill-handed", key):
        journal.rpush(f"killed:{key}", json.dumps({"id": request.id, "pid": os.getpid(), "at": time.time(),
                                                   "fence": lock.fencing_token}))
        os.kill(os.getpid(), signal.SIGKILL)
    return lock


if os.environ.get("CSL_WORKER_HOOKS") == "1":  # in the workers only, never in the test process
    policies._in_slot = _handed_then_maybe_die  # type: ignore[assignment]

_ran_since_park = getattr(identity.ran_since_park, "__wrapped__", identity.ran_since_park)  # (the same)


@functools.wraps(_ran_since_park)
def _ran_elsewhere_after_the_look(task: Any, request: Any) -> bool:
    """A call named by the journal's ``run-elsewhere`` set runs to its end elsewhere (its SUCCESS stored)
    right after this copy's first look found it had not: the window between a recovered copy's look
    and its acquire, entered at will."""
    ran = _ran_since_park(task, request)
    if not ran and journal.srem("run-elsewhere", request.id):
        task.backend.store_result(request.id, {"tag": "elsewhere"}, "SUCCESS", request=request)
    return ran


if os.environ.get("CSL_WORKER_HOOKS") == "1":
    identity.ran_since_park = _ran_elsewhere_after_the_look  # type: ignore[assignment]


def journaled(name: str, **opts: Any) -> Any:
    """A LockedTask on ``key`` named ``name`` in this module, whose body journals its run (``run_body``)."""

    def body(self: Any, key: str, seconds: float = 0.0, tag: str = "") -> dict:
        return run_body(journal, self, key, seconds, tag)

    return app.task(base=LockedTask, bind=True, lock_key=["key"], name=f"{__name__}.{name}", **opts)(body)


# Waits in line with no slot wait: its turn comes as a message, whose claim the tests fault.
inline = journaled("inline", on_duplicate="retry", lock_max_wait=20.0)
# Coalesces: a call that finds a waiter parked behind the holder merges into it (no slot wait).
merging = journaled("merging", on_duplicate="coalesce", lock_max_wait=20.0)
# A publish of it while a call of its key is published and not yet started joins that call.
joining = journaled("joining", on_duplicate="retry", lock_publish="join")
# The key stays taken 1 s after each run; the next waiter gets it from the sweeper then.
cooling = journaled("cooling", on_duplicate="retry", lock_cooldown=1.0)
# Waits in line 1.5 s at most, then fails with LockWaitTimeout.
impatient = journaled("impatient", on_duplicate="retry", lock_max_wait=1.5)
# Coalesces, and waits in line 1.5 s at most: the calls merged into a waiter that times out fail with it.
merging_impatient = journaled("merging_impatient", on_duplicate="coalesce", lock_max_wait=1.5)


@app.task(base=LockedTask, bind=True, lock_key=["key"], name=f"{__name__}.merging_ignored", on_duplicate="coalesce",
          lock_max_wait=20.0)
def merging_ignored(self: Any, key: str, seconds: float = 0.0, tag: str = "") -> dict:
    """Coalesces; a run whose task id the journal's ``ignore-run`` set names ends with Ignore after its
    body (neither success nor failure): the calls merged into it are sent again, as they were."""
    done = run_body(journal, self, key, seconds, tag)
    if journal.srem("ignore-run", self.request.id):
        raise Ignore("told to")
    return done


@app.task
def errback_log(request: Any, exc: Any, traceback: Any) -> None:
    """Journals each errback call, by the failed task's id (the tests count them)."""
    journal.rpush(f"errbacks:{request.id}", type(exc).__name__)
