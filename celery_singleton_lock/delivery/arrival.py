"""What a delivery looks at before and right after its acquire, apart from the decision table: an
expired turn, and a copy that holds the key although its call already ran. ``LockedTask.before_start``
calls these around the acquire.
"""

from __future__ import annotations

from typing import Any

from ..engine import line as queue
from ..engine.backend import LockBackend
from ..engine.lock import Holder, Lock, Verdict
from ..exceptions import LockBackendUnavailable, LockWaitTimeout
from . import coalescing, config, identity, policies, publishing, releasing
from .decide import Action, Delivery
from .headers import turn_of


def first_look(task: Any, request: Any, args: Any, kwargs: Any, settings: config.LockSettings, server: LockBackend,
               key: str) -> None:
    """Before the acquire. A turn whose wait ran out fails with :class:`LockWaitTimeout` (and the
    calls merged into it the same way). If those cannot be read, it is sent again, still expired: it
    must not fail alone and leave them WAITING."""
    if turn_of(request.headers).expired:
        expired = LockWaitTimeout(key, settings.max_wait)
        if settings.on_duplicate == "coalesce":
            try:
                coalescing.fail_all(task, server, key, request.id, expired)
            except LockBackendUnavailable as exc:
                policies.unreachable(task, request, args, kwargs, settings, "", exc)
        raise expired


def drop_if_ran(task: Any, request: Any, settings: config.LockSettings, key: str, lock: Lock, resent: bool) -> None:
    """A copy that holds the key, but whose call already ran (a quorum's re-send of a redelivery that
    finds its success stored; a copy after a loss of the data whose other copy ran): the key is
    released and the copy dropped (raises)."""
    if resent and identity.succeeded(task, request):
        why = Verdict.ALREADY_SUCCEEDED
    elif identity.other_copy_ran(task, request):
        why = Verdict.ENTRY_GONE
    else:
        return
    # the task's own release, which never raises (at worst the key runs out): a copy dropped as its
    # call ran elsewhere must not fail that call, or fire its errbacks
    releasing.release(lock, settings, succeeded=False, remember=0.0)
    policies.refuse(task, Action.DROP, request, settings, key, why)


def wait_here(task: Any, request: Any, args: Any, kwargs: Any, settings: config.LockSettings, server: LockBackend,
              key: str) -> Lock:
    """Eager, behind a holder: wait in the line in place; the lock, or :class:`LockWaitTimeout` after
    ``lock_max_wait``. A lock Redis that cannot be reached meanwhile is waited out in its place, as an
    eager acquire waits it out (:func:`policies.unreachable`, within ``singleton_lock_eager_timeout``)."""

    def wait_out(exc: LockBackendUnavailable) -> None:
        policies.unreachable(task, request, args, kwargs, settings, "", exc)  # (sleeps; raises past its budget)

    # decide() waits here only where the server can block a waiter in place (supports_slot_wait)
    got = queue.wait_turn(server, key, settings.ttl, owner_id=request.id, wait=settings.max_wait,
                          on_unreachable=wait_out)
    if isinstance(got, Lock):
        return got
    raise LockWaitTimeout(key, settings.max_wait)


def back_off(task: Any, request: Any, args: Any, kwargs: Any, settings: config.LockSettings, server: LockBackend,
             key: str, outcome: Any, who: Delivery) -> None:
    """``on_duplicate="backoff"`` (or no line to wait in): sent again later (:func:`policies.backoff`), as a
    redelivery when it is a copy of the running call or one that may have run; returns only in eager mode."""
    publishing.queued_again(task, request, key, server)
    same = isinstance(outcome, Holder) and outcome.owner_id == request.id  # a copy of the running call
    policies.backoff(task, request, args, kwargs, settings, outcome,
                     redelivered=who.redelivered and (same or not who.never_ran))
