"""What the result backend knows of a delivery's task id, for the few deliveries that need it.

The lock Redis can forget (a restart without persistence, a failover to a lagging replica, a
Cluster shard restarted empty), and a process can die between the release and Celery's store of
the result. The result backend is what Celery itself trusts for "this task id already ran"
(``worker_deduplicate_successful_tasks``), so the questions the lock Redis cannot answer after
such a loss are asked there, and only on the paths that need them (never on a fresh delivery
that takes the lock):

* a copy sent again after a loss whose waiter entry is gone: did its task start since it first
  parked? (:func:`ran_since_park`; a waiting copy marks its start by storing STARTED with its entry);
* a redelivery that finds its task succeeded here: was its result stored? (:func:`result_missing`).

Without a result backend (``ignore_result``, or none configured) neither can be told: a copy whose
entry is gone is run (a waiter is never lost), and a recorded success is only dropped.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from celery.backends.base import DisabledBackend
from celery.states import READY_STATES, STARTED, SUCCESS

from ..engine.lock import Done, Holder, Lock, Verdict
from .compat import get_actual_ignore_result
from .decide import Delivery, Found
from .headers import resend_of, turn_of

logger = logging.getLogger("celery_singleton_lock")


def delivery(task: Any, request: Any, policy: str, line: bool, redelivered: bool, resent: bool,
             entry: str | None) -> Delivery:
    """Who is asking, for the decision table (looked up once, at the delivery's first refusal)."""
    turn = turn_of(request.headers)
    # a turn's claim sent again because the lock Redis did not answer it: its place may be gone (its
    # first try took the key, then gave it back), so, as a recovered copy, it asks whether the call ran
    copy = turn.recovered or (entry is not None and resend_of(request.headers).unreachable > 0)
    return Delivery(
        policy=policy,
        eager=bool(request.is_eager),
        redelivered=redelivered,
        never_ran=not resent and never_ran(task, request, redelivered and entry is None),
        handoff=entry is not None and not copy,
        recovered=copy,
        retry=bool(request.retries),
        line=line,
    )


def found(task: Any, request: Any, outcome: Lock | Holder | Verdict | Done, recovered: bool) -> Found:
    """What the acquire found, in the words of decide.py's table (asking the backend where needed)."""
    if isinstance(outcome, Lock):
        return Found.TAKEN
    if isinstance(outcome, Done):
        return Found.RESULT_MISSING if result_missing(task, request) else Found.ALREADY_SUCCEEDED
    if outcome is Verdict.ALREADY_SUCCEEDED:
        return Found.ALREADY_SUCCEEDED
    if outcome is Verdict.ENTRY_GONE:
        return Found.ENTRY_RAN if recovered and ran_since_park(task, request) else Found.ENTRY_GONE
    if outcome.queued:
        return Found.QUEUED
    if outcome.owner_id == request.id and not outcome.reserved and not outcome.cooldown:
        return Found.HELD_BY_SELF
    return Found.HELD


def _meta(task: Any, request: Any) -> dict[str, Any] | None:
    """The stored state of the request's task id; None when there is no backend to ask."""
    if request.is_eager or get_actual_ignore_result(task, request) or isinstance(task.backend, DisabledBackend):
        return None
    try:
        meta: dict[str, Any] = task.backend.get_task_meta(request.id, cache=False)
        return meta
    except Exception as exc:
        logger.warning("task %s[%s]: the result backend did not answer (%r)", task.name, request.id, exc)
        return None


def result_missing(task: Any, request: Any) -> bool:
    """A task that succeeded here (its done record says so): is its SUCCESS missing from the backend?"""
    meta = _meta(task, request)
    return meta is not None and meta.get("status") != SUCCESS


def succeeded(task: Any, request: Any) -> bool:
    """Did this task id succeed already (the backend stores SUCCESS)? Asked only by a re-send of a broker
    redelivery on a backend without a waiting line (a quorum, etcd) once it took the key: an early-acked
    task keeps no done record, so the backend is what tells a copy of a finished call from work to do."""
    meta = _meta(task, request)
    return meta is not None and meta.get("status") == SUCCESS


def ran_since_park(task: Any, request: Any) -> bool:
    """Did this waiting task start (take its turn) since it first parked?

    Its turn's copy stores STARTED naming its entry (:func:`mark_started`); any final state counts
    too. No clock is read: parking stored WAITING over whatever this task id held before, except a
    SUCCESS (which Celery's key-value backends never overwrite, and which is this very call's), so a
    final state read now was stored since it parked, or is this call's success. Without a backend:
    False (it runs: a waiter is never lost).
    """
    meta = _meta(task, request)
    if meta is None:
        return False
    status = meta.get("status")
    turn = turn_of(request.headers)
    entry = turn.entry
    info = meta.get("result")
    if status == STARTED:
        if not (isinstance(info, dict) and entry is not None and info.get("entry") == entry):
            return False
        # a broker redelivery of this very copy may have stored it, and died mid-body: not another's run
        redelivered = bool((request.delivery_info or {}).get("redelivered"))
        return not (redelivered and info.get("copy") == turn.copy)
    if status == "WAITING":  # parked again since (another message of it, e.g. its retry): this one ran
        return isinstance(info, dict) and info.get("entry") not in (None, entry)
    return status in READY_STATES  # PENDING, WAITING, RETRY: it never took its turn


def other_copy_ran(task: Any, request: Any) -> bool:
    """Asked by a copy that may meet another copy of its call after a loss of the lock Redis's data
    (the sweeper's recovered copy of a waiter), once it holds the key: did the other one take the call
    over meanwhile? Its look before the acquire could not rule out a whole run of the other one between
    the look and the acquire; under the lock it can: the other stores STARTED while it holds the key,
    before its body. False for every other delivery (no look)."""
    return turn_of(request.headers).recovered and ran_since_park(task, request)


def mark_started(task: Any, request: Any, track_started: bool) -> None:
    """STARTED, once the lock is taken: for ``track_started``, and always for a waiting task's copy,
    naming its entry (what :func:`ran_since_park` reads after a loss of the lock Redis)."""
    turn = turn_of(request.headers)
    entry = turn.entry
    if not (track_started or entry) or request.is_eager or get_actual_ignore_result(task, request):
        return
    meta: dict[str, Any] = {"pid": os.getpid(), "hostname": request.hostname}
    if entry:
        meta["entry"] = entry
    if turn.recovered:
        meta["copy"] = turn.copy
    task.backend.store_result(request.id, meta, STARTED, request=request)


def never_ran(task: Any, request: Any, redelivered: bool) -> bool:
    """A broker redelivery that provably never started (see ``Delivery.never_ran``).

    An early-acked message is acked as it starts: redelivered, it was requeued unstarted (prefetched
    at a worker restart). An ``acks_late`` one may have died mid-body; only ``track_started`` tells:
    every run stores STARTED once it holds the lock, so no stored state means it never ran. Without
    ``track_started`` it cannot be told, and it waits its turn (never skipped).
    """
    if not redelivered:
        return False
    if not (getattr(request, "acks_late", None) or task.acks_late or task.reject_on_worker_lost):
        return True
    if not getattr(task, "lock_track_started", False):
        return False
    meta = _meta(task, request)
    return meta is not None and meta.get("status") == "PENDING"
