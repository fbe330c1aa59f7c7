"""``on_duplicate="coalesce"``: a burst of duplicates becomes ONE follow-up run, with the latest arguments.

For refresh work (rebuild a cache, reindex a document, sync an account), ten calls while one
runs should cause exactly one more run after it: not ten, and not zero. So:

* the first duplicate that finds the key held parks in its line, as ``"retry"`` does;
* a later duplicate, while a parked call is last in line, merges into it
  (``line.park(..., merge=True)``, one atomic script): it adds no run, it is stored
  WAITING (``{"merged_into": <waiter's task id>}``), and :data:`duplicate_coalesced` is sent;
* when the waiter's turn comes, its run reads the merged calls (:func:`take`) and runs with
  the arguments of the LATEST one ("latest wins"; where every argument is in the key,
  ``lock_key=None``, they are all the same);
* when that run ends, every merged call is settled (:func:`settle`) as if it had run: on
  success its result is the run's value and its own links and chain are sent; on failure it
  fails with the run's exception and its errbacks are called. A run that did not end either
  way (retried, ignored, rejected) sends the merged calls again as they were, so none is lost.

A waiter that times out in line (``lock_max_wait``) fails its merged calls with the same
:class:`LockWaitTimeout`, one whose run was lost with its process (a hard time limit, SIGKILL) fails
them with the same error, from the worker's main process; one revoked while waiting sends them
again. A merged call revoked while it waits leaves its waiter's merged calls (REVOKED), and a
redelivery of a merged call stays merged (``K:mo:<task id>``): its waiter's run covers it once.
A covering run that outlives the merged calls' records (they live the waiter's deadline plus ten
minutes) settles the calls it took at its start, less those stored as REVOKED since.
"""

from __future__ import annotations

import logging
from typing import Any

from billiard.exceptions import TimeLimitExceeded, WorkerLostError
from celery import signature
from celery.app.task import Context
from celery.signals import task_failure
from celery.states import FAILURE, REVOKED, SUCCESS

from ..engine import dedupe, kept
from ..exceptions import LockError
from .releasing import unpack_value

logger = logging.getLogger("celery_singleton_lock")

MERGED = "_singleton_lock_merged"
"""Attribute of ``self.request``: (key, entry, the merged calls' signatures) of a coalescing run."""


def take(server: Any, request: Any, key: str) -> list[dict[str, Any]]:
    """The calls merged into this waiter (a copy whose turn came), remembered on the request until
    it ends; the latest is last."""
    if not server.supports_merge:
        return []
    calls = [unpack_value(m) for m in dedupe.merged_calls(server, key, request.id)]
    if calls:
        request.__dict__[MERGED] = (server, key, request.id, calls)
    return calls


def latest_arguments(request: Any) -> tuple[Any, Any] | None:
    """The arguments of the latest merged call, to run with instead of the waiter's own."""
    merged = request.__dict__.get(MERGED)
    if not merged:
        return None
    last = merged[3][-1]
    return tuple(last.get("args") or ()), dict(last.get("kwargs") or {})


def settle(task: Any, request: Any, state: str | None, value: Any = None, exc: BaseException | None = None) -> None:
    """The run that covered the merged calls ended in ``state``: settle each of them (module doc)."""
    merged = request.__dict__.pop(MERGED, None)
    if not merged:
        return
    server, key, owner, taken = merged
    try:  # read again: a call revoked while this ran has left them
        calls = [unpack_value(m) for m in dedupe.merged_calls(server, key, owner)]
    except LockError as exc:  # the run covered the calls it took at its start: those are settled
        logger.warning("lock %s: the merged calls of %s could not be read again (%s); those taken at its start "
                       "are settled", key, owner, exc)
        calls = []
    if not calls:  # none left: all revoked, or their records ran out under a long run (or unread)
        calls = [call for call in taken if not _revoked(task, call)]
    resend: list[dict[str, Any]] = []
    for call in calls:
        try:
            if state == SUCCESS:
                _succeed(task, call, value)
            elif state == FAILURE and exc is not None:
                _fail(task, call, exc)
            else:
                resend.append(call)  # not covered: it goes again, as it was
        except Exception:
            logger.exception("lock %s: settling the merged call %s failed", key, _id(call))
    try:  # before they are sent again it is tried harder: a call sent again that found its old record
        # would count itself merged into this finished run, and wait for ever; a settled call's record
        # only has to expire (its redelivery stays merged, covered)
        kept.tried(lambda rid: dedupe.drop_merged(server, key, owner, sent_again=bool(resend), request_id=rid),
                   tries=5 if resend else 1)
    except LockError as exc:
        logger.warning("lock %s: the merged calls of %s stay until they expire: %s", key, owner, exc)
    for call in resend:
        task.app.signature(call).apply_async()


def fail_all(task: Any, server: Any, key: str, owner: str, exc: BaseException) -> None:
    """A waiter whose run never ended well (it waited too long, or its process was lost) fails the
    calls merged into it the same way. Raises the server's LockError if they cannot be read; once
    failed, they are not failed again (errbacks once) if forgetting them fails: they expire."""
    if not server.supports_merge:
        return
    calls = [unpack_value(m) for m in dedupe.merged_calls(server, key, owner)]
    for call in calls:
        _fail(task, call, exc)
    if calls:
        try:
            dedupe.drop_merged(server, key, owner)
        except LockError as exc2:
            logger.warning("lock %s: the merged calls of %s stay until they expire: %s", key, owner, exc2)


def send_again(app: Any, server: Any, key: str, owner: str, request_id: str = "") -> int:
    """A waiter left its line without running (revoked): the calls merged into it go again, as they were.
    They are taken (read and forgotten) in one call, since every worker's revoke look may ask; a take
    sent again with its ``request_id`` (the same worker's look, tried again) is answered as it was."""
    if not server.supports_merge:
        return 0
    calls = [unpack_value(m) for m in dedupe.take_merged(server, key, owner, request_id)]
    for call in calls:
        app.signature(call).apply_async()
    return len(calls)


@task_failure.connect(weak=False)
def _lost_run(sender: Any = None, task_id: str = "", exception: Any = None, args: Any = (), kwargs: Any = None,
              **_: Any) -> None:
    """A coalescing run whose process was lost (a hard time limit, SIGKILL, OOM): the worker's main
    process reports it, and fails the calls merged into it, which that run would have settled."""
    if not isinstance(exception, (WorkerLostError, TimeLimitExceeded)) or not getattr(sender, "singleton_lock", False):
        return
    try:
        if sender.lock_settings().on_duplicate != "coalesce":
            return
        fail_all(sender, sender.lock_server(), sender.lock_key_for(args, kwargs), task_id, exception)
    except Exception:
        logger.exception("task %s[%s]: failing the calls merged into a lost run failed", sender.name, task_id)


def _revoked(task: Any, call: dict[str, Any]) -> bool:
    """Whether ``call`` was revoked, by its stored state (False where no result is stored)."""
    if task.ignore_result:
        return False
    try:
        return bool(task.backend.get_task_meta(_id(call)).get("status") == REVOKED)
    except Exception:  # (no result backend)
        return False


def _succeed(task: Any, call: dict[str, Any], value: Any) -> None:
    """What Celery's tracer does after a success, for a call that did not run itself: store the
    result (a chord part counts), then send its links and the rest of its chain."""
    ctx = _context(task, call)
    if not task.ignore_result:
        task.backend.mark_as_done(ctx.id, value, request=ctx)
    for link in ctx.callbacks or ():
        signature(link, app=task.app).apply_async((value,), parent_id=ctx.id, root_id=ctx.root_id)
    chain = list(ctx.chain or ())
    if chain:
        first = signature(chain.pop(), app=task.app)
        first.apply_async((value,), chain=chain, parent_id=ctx.id, root_id=ctx.root_id)


def _fail(task: Any, call: dict[str, Any], exc: BaseException) -> None:
    """Store the failure (a chord part counts) and call the call's errbacks, as Celery does."""
    ctx = _context(task, call)
    task.backend.mark_as_failure(ctx.id, exc, request=ctx, store_result=not task.ignore_result)


def _context(task: Any, call: dict[str, Any]) -> Context:
    options = call.get("options") or {}
    return Context(
        id=options.get("task_id"), task=task.name, args=call.get("args"), kwargs=call.get("kwargs"),
        callbacks=options.get("link"), errbacks=options.get("link_error"), chain=options.get("chain"),
        chord=options.get("chord"), group=options.get("group_id"), group_index=options.get("group_index"),
        root_id=options.get("root_id"), parent_id=options.get("parent_id"), reply_to=options.get("reply_to"),
        headers=options.get("headers"), delivery_info={}, ignore_result=task.ignore_result,
    )


def _id(call: dict[str, Any]) -> str:
    return str((call.get("options") or {}).get("task_id"))
