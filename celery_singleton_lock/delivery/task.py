"""The Celery integration: LockedTask's hooks, every exit path, the duplicate policies.

One execution, as data::

    before_start -> keys.derive -> LockServer.acquire (one round trip)
      -> decide.decide(what it found, who is asking) -> one action, carried out here:
         run (the body sees the handle as self.lock), park in the key's line,
         drop, skip, raise, back off, ...
    body -> any end (success, exception, retry, Ignore, Reject, time limit, eager)
      -> watchdog.forget -> LockServer.release (one round trip, once; the key
         passes to the next waiter in the same round trip, and it is sent at once)

The release happens in ``__call__`` as soon as the body returns or raises,
before Celery stores the result: whoever sees the result and sends a
duplicate finds the key free. ``task_postrun`` is the safety net for every
other way out (an error after the acquire but before the body).

Per-execution state (the handle) lives on ``self.request``, never on ``self``:
one task instance serves every thread of a process.
"""

from __future__ import annotations

import inspect
import logging
import os
import secrets
from dataclasses import replace
from functools import partial
from typing import Any, ClassVar

from celery import Task
from celery.exceptions import Ignore, Reject, Retry
from celery.signals import task_postrun
from celery.states import FAILURE, IGNORED, REJECTED, RETRY, SUCCESS

from ..engine import reentry
from ..engine.backend import LockBackend
from ..engine.lock import Done, Holder, Lock
from ..exceptions import LockBackendUnavailable, LockError
from ..signals import lock_acquired, lock_lost
from ..watchdog.process import get_watchdog
from . import arrival, coalescing, config, handoff, identity, keys, options, policies, publishing, releasing
from .decide import Action, Delivery, decide
from .headers import MARKED, resend_of, turn_of
from .headers import PREFIX as HEADER_PREFIX

logger = logging.getLogger("celery_singleton_lock")

HANDLE = "_singleton_lock"
"""Attribute of ``self.request`` that holds the execution's Lock."""
_REENTERED = "_singleton_lock_reentered"
"""Set on ``self.request`` when it runs under a lock held further up its call stack."""
_REPLAY = "_singleton_lock_replay"
"""Set on ``self.request`` to the recorded value of a body that already ran (see decide's REPLAY)."""
_BODY_STARTED = "_singleton_lock_body_started"
"""Set on ``self.request`` once the tracer called the body (a nested direct call is told apart)."""


class LockedTask(Task):
    """A task whose executions are single-flight per lock key.

    Options (decorator keyword arguments; each beats its app setting):

    ``lock_key``
        None (every argument), a list of argument names, or a callable taking
        the task's arguments and returning a str.
    ``lock_ttl``
        seconds the lock lives without renewal (``singleton_lock_ttl``, 30).
    ``on_duplicate``
        "skip", "retry", "raise", "backoff" or "coalesce" (``singleton_lock_on_duplicate``, "skip").
    ``lock_max_wait``, ``lock_wait_in_slot``
        seconds a duplicate may wait in line ("retry") before it fails with :class:`LockWaitTimeout`
        (3600); seconds it first waits in its worker slot, woken by the hand-off (0: it parks at once).
    ``lock_max_retries``, ``lock_retry_backoff``, ``lock_retry_backoff_max``
        the budget and back-off of re-sends, for "backoff" and for an
        unreachable Redis, apart from the task's own ``max_retries`` (50, 1 s, 30 s).
    ``lock_prefix``
        the first part of every key (``singleton_lock_prefix``, "singleton_lock").
    ``lock_cooldown``, ``lock_cooldown_on_failure``
        seconds the key stays taken after a successful run (0), and whether a failed
        run keeps it too (False): at most one run per key per cooldown.
    ``lock_publish``, ``lock_publish_ttl``
        "join" or "raise": ``delay()`` of a call whose key has a call queued, waiting or running returns
        its AsyncResult, or raises AlreadyQueued (None: no check); a publish mark's longest life (600 s).

    Options are checked when the task class is made (app finalize, or first use), naming the bad one.
    ``track_started`` is honoured, but STARTED is stored by LockedTask once the lock
    is taken (never by a duplicate or a redelivery); ``task.track_started`` then
    reads False and ``task.lock_track_started`` True.
    """

    singleton_lock: ClassVar[bool] = True
    """The mark the worker's start-up looks for (turns.has_locked_tasks) without importing this class."""
    lock_key: ClassVar[keys.KeySpec] = None
    lock_ttl: ClassVar[float | None] = None
    on_duplicate: ClassVar[str | None] = None
    lock_prefix: ClassVar[str | None] = None
    lock_max_wait: ClassVar[float | None] = None
    lock_max_retries: ClassVar[int | None] = None
    lock_retry_backoff: ClassVar[float | None] = None
    lock_retry_backoff_max: ClassVar[float | None] = None
    lock_cooldown: ClassVar[float | None] = None
    lock_cooldown_on_failure: ClassVar[bool | None] = None
    lock_publish: ClassVar[str | None] = None
    lock_publish_ttl: ClassVar[float | None] = None
    lock_wait_in_slot: ClassVar[float | None] = None

    lock_track_started: ClassVar[bool] = False
    """The task's ``track_started``: LockedTask stores STARTED itself, once the lock is taken (:meth:`on_bound`)."""

    _lock_signature: Any = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Check the lock options when the task class is made, i.e. when it binds to its app.

        ``app.task`` makes the class (``type(...)``) when the app is finalized or the
        task proxy is first used; failing here, before Celery registers the task,
        means a bad option fails at every access, never only the first one.
        """
        super().__init_subclass__(**kwargs)
        spec = cls.__dict__.get("lock_key")
        if inspect.isfunction(spec):
            # a function as a class attribute would be bound to the task: self.lock_key(...)
            # would receive the task as its first argument
            cls.lock_key = staticmethod(spec)
        if cls.run is Task.run:
            return  # an abstract base, not a real task
        raw = next((k.__dict__["run"] for k in cls.__mro__ if "run" in k.__dict__), None)
        cls._lock_signature = config.signature_of(cls.run, bound=not isinstance(raw, staticmethod))
        config.check_task_options(cls.name or cls.__qualname__, cls, cls._lock_signature)
        options.check_unknown_options(cls.name or cls.__qualname__, cls, LockedTask)
        if isinstance(cls.__dict__.get("lock_ttl"), (int, float)):  # (the app's setting: when it is read)
            config.warn_long_ttl(cls.name or cls.__qualname__, float(cls.__dict__["lock_ttl"]))

    @classmethod
    def on_bound(cls, app: Any) -> None:
        """Take over ``track_started`` once Celery has filled it in from the app's conf.

        Celery's tracer stores STARTED *before* ``before_start``, so a duplicate or a
        redelivery of the running task id would overwrite the holder's state (STARTED
        with another pid, or a FAILURE turned back into STARTED). LockedTask turns the
        tracer's store off and stores STARTED itself, only after taking the lock.
        """
        super().on_bound(app)
        if cls.track_started:
            cls.lock_track_started = True
            cls.track_started = False

    @property
    def lock(self) -> Lock | None:
        """The running execution's lock handle (None outside a locked execution)."""
        return getattr(self.request, HANDLE, None)

    def lock_settings(self) -> config.LockSettings:
        """This task's resolved settings (read once per process)."""
        settings = self.__dict__.get("_singleton_lock_settings")
        if settings is None:
            if self._lock_signature is None:  # a class made before ``run`` was set
                self._lock_signature = config.signature_of(self.run, bound=False)  # a bound method
            # the options may have been changed on the class since it was made
            config.check_task_options(self.name, type(self), self._lock_signature)
            settings = config.resolve(self)
            config.warn_short_ttl(self.name, settings)
            if self.lock_ttl is None:  # (a task's own lock_ttl was warned about when the task was made)
                config.warn_long_ttl(self.name, settings.ttl)
            self.__dict__["_singleton_lock_keys"] = keys.KeyMaker(
                settings.prefix, self.name, self._lock_signature, self.lock_key)
            self.__dict__["_singleton_lock_settings"] = settings
        return settings

    def lock_key_for(self, args: Any = (), kwargs: Any = None, *, partial: bool = False) -> str:
        """The lock key these arguments map to (for operators and tests); ``partial``: with ``lock_key`` a
        list of names, the arguments may give those alone."""
        settings = self.lock_settings()
        return keys.derive(settings.prefix, self.name, self._lock_signature, args or (), kwargs or {}, self.lock_key,
                           partial=partial)

    def lock_server(self) -> LockBackend:
        """The process's LockServer for this task's settings; its waiting copies go through this app."""
        server = self.__dict__.get("_singleton_lock_server")
        if server is None:
            server = config.server_for(self.lock_settings())
            if self.lock_settings().cooldown and not server.supports_cooldown:
                raise ValueError(f"task {self.name!r}: lock_cooldown is not supported by {type(server).__name__}")
            if server.send_handoff is None:
                server.send_handoff = handoff.SEND
            server.turn_timeout = self.lock_settings().turn_timeout
            handoff.register(self)
            self.__dict__["_singleton_lock_server"] = server
        return server

    def signature_from_request(self, request: Any = None, args: Any = None, kwargs: Any = None,
                               queue: Any = None, **extra_options: Any) -> Any:
        """Celery's, without our headers: ``self.retry()`` and ``replace()`` copies start afresh."""
        sig = super().signature_from_request(request, args, kwargs, queue, **extra_options)
        headers = sig.options.get("headers")
        if headers:
            sig.options["headers"] = {k: v for k, v in headers.items() if not k.startswith(HEADER_PREFIX)}
        return sig

    # -- acquire -------------------------------------------------------------------

    def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
        super().before_start(task_id, args, kwargs)
        settings = self.__dict__.get("_singleton_lock_settings") or self.lock_settings()
        request, headers = self.request, self.request.headers or {}
        key = self.__dict__["_singleton_lock_keys"](args, kwargs)  # keys.derive, the per-task part done once
        server = self.__dict__.get("_singleton_lock_server") or self.lock_server()
        arrival.first_look(self, request, args, kwargs, settings, server, key)
        again = resend_of(headers)
        resent = again.redelivered  # a quorum's re-send of a redelivery: the same copy
        redelivered = resent or bool((request.delivery_info or {}).get("redelivered"))
        entry = turn_of(headers).entry
        retake = again.token  # a lost attempt's token: taken back under a new one
        token = secrets.token_hex(16)
        who: Delivery | None = None
        while True:
            try:
                outcome = server.acquire(key, settings.ttl, owner_id=task_id, token=token, retake=retake, entry=entry,
                                         check_done=redelivered)
            except LockBackendUnavailable as exc:
                policies.unreachable(self, request, args, kwargs, settings, token, exc, entry)
                retake, token = token, secrets.token_hex(16)  # eager: take back what the lost attempt took
                continue
            if MARKED in headers:  # published under lock_publish: the lock or the line shows it from now on
                publishing.started(self, request, key, server)
                headers = {}
            if isinstance(outcome, Lock):  # the common case, first: no table to consult
                arrival.drop_if_ran(self, request, settings, key, outcome, resent)
                return self._run_with(outcome, request, settings)
            if who is None:
                who = identity.delivery(self, request, settings.on_duplicate, policies.has_line(server, request),
                                        redelivered, resent, entry)
            if isinstance(outcome, Holder):
                who = replace(who, holder_on_stack=self._on_my_stack(outcome.owner_id))
            action = decide(identity.found(self, request, outcome, who.recovered), who)
            if action is Action.RUN:
                assert isinstance(outcome, Lock)
                return self._run_with(outcome, request, settings)
            if action is Action.REPLAY:  # it ran to its end, and died before Celery stored the result
                assert isinstance(outcome, Done)
                return self._replay(request, outcome)
            if action is Action.AGAIN:  # its entry is gone but its run never happened or ended: as a redelivery
                entry, redelivered = None, True
                who = Delivery(policy=settings.on_duplicate, redelivered=True, line=policies.has_line(server, request))
                continue
            if action is Action.REENTER:
                return self._reenter(request, key)
            if action is Action.WAIT_HERE:
                waited = arrival.wait_here(self, request, args, kwargs, settings, server, key)
                return self._run_with(waited, request, settings)
            if action is Action.BACKOFF:  # (returns only in eager mode, to try again)
                arrival.back_off(self, request, args, kwargs, settings, server, key, outcome, who)
                continue
            if action in (Action.PARK, Action.PARK_FIRST, Action.PARK_SAME, Action.COALESCE):
                assert server.supports_line  # decide() parks only where there is a line
                handed = policies.park(self, action, request, args, kwargs, settings, server, key, outcome, entry)
                if handed is not None:  # handed the key while it waited in its worker slot
                    return self._run_with(handed, request, settings)
                entry = None  # park() ends the delivery once parked; back here, the key was freed: try again
                continue
            policies.refuse(self, action, request, settings, key, outcome)

    def _replay(self, request: Any, outcome: Done) -> None:
        """It ran to its end and died before Celery stored the result: store its recorded value and
        send its callbacks (``__call__`` returns the value), without running the body again."""
        request.__dict__[_REPLAY] = releasing.unpack_value(outcome.value)
        logger.warning("task %s[%s] already succeeded but its result was never stored: storing its "
                       "recorded value and sending its callbacks, without running it again", self.name, request.id)

    def _reenter(self, request: Any, key: str) -> None:
        """A nested call of this task for the key its caller, up this stack, holds: one more hold of
        the one lock (reentry.again, entered here and left when this execution ends)."""
        nested = reentry.again(self._lock_on_stack(key))
        request.__dict__[HANDLE] = nested.__enter__()
        request.__dict__[_REENTERED] = nested

    def _run_with(self, lock: Lock, request: Any, settings: config.LockSettings) -> None:
        entry = turn_of(request.headers).entry
        if entry and settings.on_duplicate == "coalesce":  # the calls merged into this waiter: it covers them
            try:  # read first, before the lock is its own: unread, the call is sent again and takes it back
                coalescing.take(lock.server, request, lock.key)
            except LockBackendUnavailable as exc:
                policies.unreachable(self, request, request.args, request.kwargs, settings, lock.token, exc, entry)
                raise  # (eager: never here, it never parks)
        setattr(request, HANDLE, lock)  # from here on, __call__ (or task_postrun) releases it
        reentry.register(lock)  # held(..., owner_id=<task id>) in the body re-enters it
        get_watchdog(**settings.watchdog_options).track(lock, partial(_announce_lost, self, request.id))
        lock_acquired.send(sender=self, key=lock.key, task_id=request.id, lock=lock)
        if self.lock_track_started or entry:
            identity.mark_started(self, request, self.lock_track_started)

    def _on_my_stack(self, owner_id: str | None) -> bool:
        """Is the execution holding the key up this thread's call stack (eager nesting)?"""
        return owner_id is not None and any(
            getattr(r, "id", None) == owner_id and HANDLE in getattr(r, "__dict__", {})
            for r in self.request_stack.stack[:-1]
        )

    def _lock_on_stack(self, key: str) -> Lock:
        for r in reversed(self.request_stack.stack[:-1]):
            lock: Lock | None = getattr(r, "__dict__", {}).get(HANDLE)
            if lock is not None and lock.key == key:
                return lock
        raise LockError(f"lock {key}: no execution up this call stack holds it")  # decide() said one did

    # -- release -------------------------------------------------------------------

    def apply(self, *args: Any, **kwargs: Any) -> Any:
        """Run eagerly; a skipped duplicate ends REVOKED, as in a worker (:func:`policies.eager_skip`)."""
        return policies.eager_skip(super().apply(*args, **kwargs))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the body, and release the lock the moment it returns or raises.

        That is before Celery stores the result, so a caller who has seen the
        result and sends a duplicate finds the key free. ``task_postrun``
        releases on every other way out (it is a no-op once this has run).

        Celery's tracer calls this (instead of ``run``) because it is
        overridden. Our execution's request is already on the stack then, so
        the body runs under it; a direct call ``task(x)``, or a nested one from
        inside the body, goes through Celery's own ``__call__`` and takes no lock.
        """
        request = self.request_stack.top
        if request is None or HANDLE not in request.__dict__ or request.__dict__.get(_BODY_STARTED):
            if request is not None and _REPLAY in request.__dict__:
                return request.__dict__.pop(_REPLAY)  # its recorded value, the body not run again
            return super().__call__(*args, **kwargs)
        request.__dict__[_BODY_STARTED] = True
        state, error = FAILURE, None
        latest = coalescing.latest_arguments(request)
        if latest is not None:  # coalesce: "latest wins"
            args, kwargs = latest
        try:
            result = self.run(*args, **kwargs)
            state = SUCCESS
            return result
        except Retry:
            state = RETRY
            raise
        except Ignore:
            state = IGNORED
            raise
        except Reject:
            state = REJECTED
            raise
        except BaseException as exc:
            error = exc
            raise
        finally:
            self.release_lock(state, result if state == SUCCESS else None, error)

    def apply_async(self, args: Any = None, kwargs: Any = None, task_id: str | None = None, **options: Any) -> Any:
        """Celery's, checked at publish if the task asks (``lock_publish``, publishing.py): one round trip."""
        settings = self.__dict__.get("_singleton_lock_settings") or self.lock_settings()
        if settings.publish is None or not publishing.checked(self, task_id, options):
            return super().apply_async(args, kwargs, task_id=task_id, **options)
        return publishing.publish(self, args, kwargs, options, super().apply_async)

    def release_lock(self, state: str | None = None, value: Any = None, error: BaseException | None = None) -> None:
        """Let the running execution's lock go, once: when the body ends, else from ``task_postrun``.

        Never fails the task: whatever Redis answers, the task keeps its own
        outcome; a refusal is logged and signalled (``deleted=False``).
        """
        request = self.request
        lock: Lock | None = request.__dict__.get(HANDLE)
        if lock is None:
            return
        nested = request.__dict__.pop(_REENTERED, None)
        if nested is not None:
            nested.__exit__(None, None, None)  # one hold off: the outer execution releases it
            request.__dict__.pop(HANDLE, None)
            return
        if lock.pid != os.getpid():
            request.__dict__.pop(HANDLE, None)  # the parent process releases it
            return
        reentry.unregister(lock)
        get_watchdog().forget(lock)  # first: no renewal may follow the release, even if we are interrupted
        request.__dict__.pop(HANDLE, None)
        releasing.at_end(self, request, lock, state, value)
        coalescing.settle(self, request, state, value, error)


def _announce_lost(task: LockedTask, task_id: str, lock: Lock, reason: str) -> None:
    lock_lost.send(sender=task, key=lock.key, task_id=task_id, reason=reason)


@task_postrun.connect(weak=False)
def _release_after_run(sender: Any = None, state: str | None = None, **_: Any) -> None:
    if isinstance(sender, LockedTask):
        sender.release_lock(state)
