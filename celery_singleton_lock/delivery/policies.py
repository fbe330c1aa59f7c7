"""What a delivery that does not run now does: wait in line, be dropped, skipped or failed, or be
sent again later. ``LockedTask.before_start`` asks decide.py which, and calls one of these.

Each ends the delivery the Celery way (``Ignore``, ``Retry``, an exception the tracer stores),
except in eager mode, where back-off waits in place and returns so the caller tries again.
"""

from __future__ import annotations

import logging
import random
import secrets
import time
from dataclasses import replace
from typing import Any, NoReturn, cast

from celery import states
from celery.exceptions import Ignore, Retry

from ..engine import line as queue
from ..engine import sweeper as sweeping
from ..engine.backend import LockBackend
from ..engine.line import Park, Slot
from ..engine.lock import Done, Holder, Lock, Verdict
from ..engine.server import LockServer
from ..exceptions import (
    DuplicateTask,
    LockBackendUnavailable,
    LockContended,
    LockError,
    SelfDeadlock,
)
from ..results import WAITING, DuplicateSkipped
from ..signals import duplicate_coalesced, duplicate_skipped
from . import config, handoff, parked
from .compat import eager_result, get_actual_ignore_result
from .decide import Action
from .headers import MARKED, Turn, resend_of, turn_of

logger = logging.getLogger("celery_singleton_lock")


def has_line(server: LockBackend, request: Any) -> bool:
    """Whether this delivery can wait in ``server``'s line: wherever the server keeps one, except an
    eager call on a backend with lines of its own (etcd), which has no way to block in one: it
    backs off in place instead, as on a quorum."""
    return server.supports_line and (server.supports_slot_wait or not request.is_eager)


def park(task: Any, action: Action, request: Any, args: Any, kwargs: Any, settings: config.LockSettings,
         server: LockBackend, key: str, outcome: Any, entry: str | None) -> Lock | None:
    """Park this delivery in the key's line and end it (raises Ignore); returns None if the key was
    freed meanwhile, for the caller to try again, or the Lock if it was handed the key while it waited
    in its worker slot (``lock_wait_in_slot``), to run now."""
    same = action is Action.PARK_SAME
    first = action not in (Action.PARK, Action.COALESCE)
    holder_id = outcome.owner_id if isinstance(outcome, Holder) else request.id
    wait = parked.wait_left(request, settings, server, key, entry)
    message = handoff.pack(task, request, args, kwargs)
    given, entry = entry, entry or queue.entry_for(request.id, request.retries)
    # a fresh "retry" duplicate, or a copy sent ahead of its turn (or one that lost its reservation),
    # waits in its worker slot first (lock_wait_in_slot)
    ahead = action is Action.PARK_FIRST and turn_of(request.headers).entry == entry
    block = settings.wait_in_slot if (action is Action.PARK or ahead) and settings.on_duplicate == "retry" else 0.0
    if not server.supports_slot_wait:  # waiting in a worker slot is one Redis's (BLPOP): etcd parks at once
        block = 0.0
    try:
        parked_as = queue.park(
            server, key, entry, kind="s" if same else "t", wait=wait, ttl=settings.ttl,
            owner_id=request.id, message=message, first=first,
            again=turn_of(request.headers).entry == entry,
            redelivered=bool((request.delivery_info or {}).get("redelivered")),
            # a redelivery under "coalesce" parks, unless it was merged already: then it stays merged
            merge=action is Action.COALESCE or (action is Action.PARK and settings.on_duplicate == "coalesce"),
            block=block,
        )
    except LockBackendUnavailable as exc:
        # sent again as when an acquire cannot reach Redis: if this PARK did run, its entry (named by
        # the task id) is there, and the copy finds itself parked already, or its turn taken. No token
        # to take back: this delivery took nothing (a made-up one would send its copy the full ACQUIRE)
        unreachable(task, request, args, kwargs, settings, "", exc, given)
        return None  # (eager: never here, it never parks)
    if parked_as.found is Park.FREE:
        return None
    if parked_as.found is Park.CLAIM:  # its turn came while it looked: the key is reserved for this copy
        return _claim(task, request, args, kwargs, settings, server, key, entry)
    if parked_as.found is Park.MERGED:
        merged(task, request, key, parked_as.into_owner)
    if parked_as.found is Park.TOOK_ITS_TURN:  # a redelivery of a parked message whose turn already came
        refuse(task, Action.DROP, request, settings, key, Verdict.ENTRY_GONE)
    already = parked_as.found is Park.ALREADY  # a redelivery of a parked message whose ack was lost
    if not already:
        try:
            queue.announce(server, settings.index, key)
        except LockError as exc:  # the line still moves on releases; only a dead holder needs the sweeper
            logger.warning("lock %s: could not tell the sweepers about its line: %s", key, exc)
    sweeping.get_sweeper().remember(server, key, entry, request.id, settings.ttl, message)
    sweeping.get_sweeper().watch(server, settings.index)
    if block and not already:
        lock = _in_slot(task, request, args, kwargs, settings, cast(LockServer, server), key, entry)
        if lock is not None:
            return lock
    parked.ends_waiting(task, request, key, parked_as.place, holder_id, entry, same, already)


def _in_slot(task: Any, request: Any, args: Any, kwargs: Any, settings: config.LockSettings, server: LockServer,
             key: str, entry: str) -> Lock | None:
    """``lock_wait_in_slot``: wait for the hand-off in the worker slot, briefly (the hot-key fast path).
    The Lock when it was woken there and claimed the key; None when it stays parked as usual (its
    message goes in its turn); Ignore when its turn came as a message (that copy runs it), or its place
    was lost with the lock Redis's data (its process's sweeper sends it again)."""
    try:
        got = queue.wait_in_slot(server, key, entry, settings.wait_in_slot)
    except LockError as exc:
        # its mark in Redis runs out by itself: it is then an ordinary parked task, and a key reserved for
        # it meanwhile is sent to it as a message once that reservation runs out (SWEEP)
        logger.warning("lock %s: task %s stops waiting in its slot (%s); parked", key, request.id, exc)
        return None
    if got is Slot.WOKEN:
        # forgotten before the claim: a claim in the slot leaves no tombstone, and the sweeper must not
        # take the entry for one lost with the data (if the claim fails, its copy carries the entry)
        sweeping.get_sweeper().forget(server, key, entry)
        # the delivery that parked the entry first leaves no tombstone; a copy (sent ahead, or its turn)
        # does: the process that parked the entry first remembers it, and looks for one
        first = turn_of(request.headers).entry != entry
        return _claim(task, request, args, kwargs, settings, server, key, entry, slot_claim=first)
    if got is Slot.SENT:
        raise Ignore(f"its turn for lock {key} came as a message while it waited in its slot: that copy runs it")
    if got is Slot.UNKNOWN:
        logger.warning("task %s[%s]: its place in the line of lock %s was lost with the lock Redis's data "
                       "while it waited in its slot; sent again by the sweeper", task.name, request.id, key)
        raise Ignore(f"its place in the line of lock {key} was lost: the sweeper sends it again")
    return None


def _claim(task: Any, request: Any, args: Any, kwargs: Any, settings: config.LockSettings, server: LockBackend,
           key: str, entry: str, slot_claim: bool = False) -> Lock:
    """Take the key reserved for ``entry``, to run now.

    The claim takes the entry out of the line. If Redis cannot confirm it (unreachable, or fewer
    replicas than ``singleton_lock_min_replicas`` acknowledged it in time, and the lock was given
    back), the place is gone but the call has not run: it is sent again as when an acquire cannot
    reach Redis, with the claim's token (its copy takes the key back if the claim did land) and its
    entry (its copy claims the key still reserved for it if it did not), as a turn's claim is."""
    token = secrets.token_hex(16)
    try:
        lock = server.acquire(key, settings.ttl, owner_id=request.id, token=token, entry=entry, slot_claim=slot_claim)
    except LockBackendUnavailable as exc:
        unreachable(task, request, args, kwargs, settings, token, exc, entry)
        raise  # (eager: never here, it never parks)
    if isinstance(lock, Lock):
        return lock
    raise Ignore(f"its reservation of lock {key} ran out before it claimed it: its copy is sent")


def merged(task: Any, request: Any, key: str, into: str) -> NoReturn:
    """End a delivery merged into waiting task ``into``, last in line (coalesce): its run covers it."""
    if not get_actual_ignore_result(task, request):
        task.backend.store_result(request.id, {"key": key, "merged_into": into}, WAITING, request=request)
    logger.info("task %s[%s] merged into waiting task %s (lock %s): its run covers this call",
                task.name, request.id, into, key)
    duplicate_skipped.send(sender=task, key=key, task_id=request.id, holder_task_id=into, policy="coalesce")
    duplicate_coalesced.send(sender=task, key=key, task_id=request.id, into_task_id=into)
    raise Ignore(f"merged into waiting task {into} (lock {key})")


def refuse(task: Any, action: Action, request: Any, settings: config.LockSettings, key: str, outcome: Any) -> NoReturn:
    """End a delivery that will not run: drop, skip, raise, or fail on a would-be deadlock."""
    holder_id = outcome.owner_id if isinstance(outcome, Holder) else request.id
    if action is Action.DROP:
        why = "it already succeeded" if isinstance(outcome, Done) else {
            Verdict.ALREADY_SUCCEEDED: "it already succeeded",
            Verdict.ENTRY_GONE: "its waiting copy already ran",
        }.get(outcome, f"task {holder_id} (the same call) runs it already")
        logger.info("task %s[%s] is dropped: %s (lock %s)", task.name, request.id, why, key)
        duplicate_skipped.send(sender=task, key=key, task_id=request.id, holder_task_id=holder_id,
                               policy="redelivery")
        raise Ignore(f"dropped: {why}")
    if action is Action.DEADLOCK:
        raise SelfDeadlock(key, holder_id)
    policy = settings.on_duplicate
    logger.info(
        "task %s[%s] is a duplicate: lock %s is held by task %s (policy %s)",
        task.name, request.id, key, holder_id, policy,
    )
    duplicate_skipped.send(sender=task, key=key, task_id=request.id, holder_task_id=holder_id, policy=policy)
    if action is Action.RAISE:
        raise DuplicateTask(key, holder_id)
    # skip: a terminal state at once, so result.get() does not hang in PENDING; REVOKED in a worker
    # and in eager mode alike (eager_skip), stored wherever eager results are stored
    skipped = DuplicateSkipped(key, holder_id)
    stored = not request.is_eager or task.app.conf.task_store_eager_result
    if stored and not get_actual_ignore_result(task, request):
        # as the backend's mark_as_revoked, with the error that names the holder
        task.backend.store_result(request.id, skipped, states.REVOKED, traceback=None, request=request)
        if request.chord:
            task.backend.on_chord_part_return(request, states.REVOKED, skipped)
    raise Skipped(skipped)


class Skipped(Ignore):
    """A duplicate skipped: Celery's Ignore (the worker stores nothing more, the revoked state stands),
    told apart from other Ignores so that an eager run can end REVOKED too (:func:`eager_skip`)."""

    def __init__(self, skipped: DuplicateSkipped) -> None:
        super().__init__(str(skipped))
        self.skipped = skipped


class _QuietSkips(logging.Filter):
    """Drops Celery's "Task ...[id] ignored" line for a skipped duplicate: the worker already logged
    why it was skipped (and by which holder), and its result says REVOKED, not ignored."""

    def filter(self, record: logging.LogRecord) -> bool:
        data = getattr(record, "data", None)
        return not (isinstance(data, dict) and data.get("description") == "ignored"
                    and str(data.get("exc", "")).startswith(Skipped.__name__ + "("))


if not any(isinstance(f, _QuietSkips) for f in logging.getLogger("celery.app.trace").filters):
    logging.getLogger("celery.app.trace").addFilter(_QuietSkips())  # (Celery's tracer logs there)


def eager_skip(result: Any) -> Any:
    """An eager run's result, with a skipped duplicate REVOKED as a worker leaves it (Celery's eager
    tracer would say IGNORED, whose ``get()`` returns the Ignore as if it were the task's value, so a
    test in eager mode would check a state production never shows, and an eager chain would run on)."""
    if result.state == states.IGNORED and isinstance(result.result, Skipped):
        return eager_result(result.id, result.result.skipped, states.REVOKED, result.name)
    return result


def backoff(task: Any, request: Any, args: Any, kwargs: Any, settings: config.LockSettings, outcome: Any,
            redelivered: bool = False) -> None:
    """The "backoff" policy: send this call again later; returns only to try again (eager).
    ``redelivered``: the call is a broker redelivery, and its re-send says so (``Resend.redelivered``)."""
    holder_id = outcome.owner_id if isinstance(outcome, Holder) else None
    attempt = _count(request, "backoff")
    key = outcome.key if isinstance(outcome, Holder) else ""
    duplicate_skipped.send(sender=task, key=key, task_id=request.id, holder_task_id=holder_id, policy="backoff")
    if attempt >= settings.max_retries:
        raise LockContended(key, holder_id, attempt + 1)
    reason = f"lock {key} busy (held by task {holder_id}), re-sent with back-off, attempt {attempt + 1} of " \
             f"{settings.max_retries}"
    _send_again(task, request, args, kwargs, settings, "backoff", attempt, reason, DuplicateTask(key, holder_id),
                redelivered=redelivered)


def unreachable(task: Any, request: Any, args: Any, kwargs: Any, settings: config.LockSettings, token: str,
                exc: LockBackendUnavailable, entry: str | None = None) -> None:
    """Redis unreachable: send this call again later, carrying the attempt's token, and, for a turn's
    claim, its ``entry`` (the key stays reserved for it: the copy claims it); returns only to try again
    (eager). The body never runs unlocked."""
    attempt = _count(request, "unreachable")
    if attempt >= settings.max_retries:
        raise exc
    reason = f"lock Redis unreachable ({exc.reason}), attempt {attempt + 1} of {settings.max_retries}"
    logger.warning("task %s[%s]: %s", task.name, request.id, reason)
    _send_again(task, request, args, kwargs, settings, "unreachable", attempt, reason, exc, token, entry=entry or "")


def _send_again(task: Any, request: Any, args: Any, kwargs: Any, settings: config.LockSettings, counter: str,
                attempt: int, reason: str, exc: Exception, token: str | None = None,
                redelivered: bool = False, entry: str = "") -> None:
    delay = _delay(settings, attempt)
    if request.is_eager:
        setattr(request, _EAGER + counter, attempt + 1)
        if counter == "unreachable":
            _eager_budget(settings, request, delay, exc)
        time.sleep(delay)
        return
    old, turn = resend_of(request.headers), turn_of(request.headers)
    headers = replace(old, token=token or old.token, redelivered=old.redelivered or redelivered,
                      **{counter: attempt + 1}).header()
    if MARKED in (request.headers or {}):
        headers[MARKED] = request.headers[MARKED]
    if turn.expired:  # an expired turn stays expired
        headers.update(turn.header())
    elif entry:  # a turn's claim: its entry, and when it first parked (a run stored before that is not its)
        headers.update(Turn(parked_at=turn.parked_at or time.time(), entry=entry, why="run").header())
    sig = task.signature_from_request(request, args, kwargs, countdown=delay, retries=request.retries)
    sig.options["headers"] = {**(sig.options.get("headers") or {}), **headers}
    sig.apply_async()
    raise Retry(reason, exc=exc, when=delay, sig=sig)


def _eager_budget(settings: config.LockSettings, request: Any, delay: float, exc: Exception) -> None:
    """An eager run waits in place for an unreachable lock Redis, but only ``singleton_lock_eager_timeout``
    seconds in all (a test or a script must not seem to hang): then it fails, naming the URL."""
    budget = settings.eager_timeout
    since = request.__dict__.setdefault("_singleton_lock_unreachable_since", time.monotonic())
    if time.monotonic() + delay - since <= budget:
        return
    if not isinstance(exc, LockBackendUnavailable):  # (every caller's is: it waits for an unreachable Redis)
        raise exc
    raise LockBackendUnavailable(exc.url, f"{exc.reason}; an eager run gives up after "
                                          f"singleton_lock_eager_timeout={budget:g}s") from exc


_EAGER = "_singleton_lock_resent_"
"""An eager run's re-send counters live on its request (it sends nothing)."""


def _count(request: Any, counter: str) -> int:
    """How many times this call was sent again under ``counter`` ("unreachable" or "backoff")."""
    return int(getattr(request, _EAGER + counter, 0) or getattr(resend_of(request.headers), counter))


def _delay(settings: config.LockSettings, attempt: int) -> float:
    """Exponential back-off with jitter (50-100% of the step), capped."""
    step = min(settings.retry_backoff_max, settings.retry_backoff * (2.0 ** min(attempt, 30)))
    return step * random.uniform(0.5, 1.0)
