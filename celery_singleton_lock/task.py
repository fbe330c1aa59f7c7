"""The Celery integration: LockedTask's hooks, every exit path, the duplicate policies.

One execution, as data::

    before_start -> keys.derive -> LockServer.acquire (one round trip)
      taken:        watchdog.track; the body sees the handle as self.lock
      held:         the duplicate policy (skip / retry / raise) decides; the body never runs
      same task id: a redelivery of the running task: re-queued until the holder is gone
    body -> any end (success, exception, retry, Ignore, Reject, time limit, eager)
      -> watchdog.forget -> LockServer.release (one round trip, once)

The release happens in ``__call__`` as soon as the body returns or raises,
before Celery stores the result: whoever sees the result and sends a
duplicate finds the key free. ``task_postrun`` is the safety net for every
other way out (an error after the acquire but before the body): Celery's
tracer sends it for every state once it has entered the task, eager runs that
propagate included, while ``after_return`` is skipped for RETRY, IGNORED and
REJECTED.

Per-execution state (the handle) lives on ``self.request``, never on ``self``:
one task instance serves every thread of a process.
"""

from __future__ import annotations

import inspect
import logging
import os
import random
import time
from functools import partial
from typing import Any, ClassVar, NoReturn

from celery import Task
from celery.app.task import get_actual_ignore_result
from celery.exceptions import Ignore, Reject, Retry
from celery.signals import task_postrun, worker_process_shutdown, worker_shutdown
from celery.states import FAILURE, IGNORED, REJECTED, RETRY, STARTED, SUCCESS

from . import config, keys
from .exceptions import DuplicateTask, LockBackendUnavailable, LockContended
from .lock import Holder, Lock
from .signals import duplicate_skipped, lock_acquired, lock_lost, lock_released
from .watchdog import get_watchdog, shutdown_watchdog

logger = logging.getLogger("celery_singleton_lock")

HANDLE = "_singleton_lock"
"""Attribute of ``self.request`` that holds the execution's Lock."""

_BODY_STARTED = "_singleton_lock_body_started"
"""Set on ``self.request`` once the tracer called the body, so a nested direct call is told apart."""

ATTEMPT_HEADER = "singleton_lock_attempt"
"""Message header counting lock-contention re-queues (kept apart from ``retries``)."""


class LockedTask(Task):
    """A task whose executions are single-flight per lock key.

    Options (decorator keyword arguments; each beats its app setting):

    ``lock_key``
        None (every argument), a list of argument names, or a callable taking
        the task's arguments and returning a str.
    ``lock_ttl``
        seconds the lock lives without renewal (``singleton_lock_ttl``, 30).
    ``on_duplicate``
        "skip", "retry" or "raise" (``singleton_lock_on_duplicate``, "skip").
    ``lock_max_retries``, ``lock_retry_backoff``, ``lock_retry_backoff_max``
        the budget and back-off of lock-contention re-queues, apart from the
        task's own ``max_retries`` (50, 1 s, 30 s).
    ``lock_prefix``
        the first part of every key (``singleton_lock_prefix``, "singleton_lock").

    Options are checked when the task class is made (app finalize, or first use of
    the task), so a bad one fails there, naming the task and the option.
    ``track_started`` is honoured, but STARTED is stored by LockedTask once the lock
    is taken (never by a duplicate or a redelivery); ``task.track_started`` then
    reads False and ``task.lock_track_started`` True.
    """

    abstract = True

    lock_key: ClassVar[keys.KeySpec] = None
    lock_ttl: ClassVar[float | None] = None
    on_duplicate: ClassVar[str | None] = None
    lock_prefix: ClassVar[str | None] = None
    lock_max_retries: ClassVar[int | None] = None
    lock_retry_backoff: ClassVar[float | None] = None
    lock_retry_backoff_max: ClassVar[float | None] = None

    lock_track_started: ClassVar[bool] = False
    """The task's ``track_started`` (option or ``task_track_started``): LockedTask stores
    STARTED itself, once the lock is taken (see :meth:`on_bound`)."""

    _lock_signature: ClassVar[Any] = None

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
            settings = self.__dict__["_singleton_lock_settings"] = config.resolve(self)
        return settings

    def lock_key_for(self, args: Any = (), kwargs: Any = None) -> str:
        """The lock key these arguments map to (for operators and tests)."""
        settings = self.lock_settings()
        return keys.derive(settings.prefix, self.name, self._lock_signature, args or (), kwargs or {}, self.lock_key)

    # -- acquire -------------------------------------------------------------------

    def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
        super().before_start(task_id, args, kwargs)
        settings = self.lock_settings()
        key = keys.derive(settings.prefix, self.name, self._lock_signature, args, kwargs, self.lock_key)
        server = config.server_for(settings)
        request = self.request
        attempt = _attempt(request)
        while True:
            try:
                outcome = server.acquire(key, settings.ttl, owner_id=task_id)
            except LockBackendUnavailable as exc:
                if attempt >= settings.max_retries:
                    raise
                logger.warning("lock %s: %s; task %s will try again", key, exc, task_id)
                attempt = self._requeue(request, args, kwargs, settings, attempt, exc)
                continue
            if isinstance(outcome, Lock):
                setattr(request, HANDLE, outcome)  # from here on, __call__ (or task_postrun) releases it
                get_watchdog(**settings.watchdog_options).track(outcome, partial(_announce_lost, self, task_id))
                lock_acquired.send(sender=self, key=key, task_id=task_id, lock=outcome)
                if self.lock_track_started and not request.is_eager and not get_actual_ignore_result(self, request):
                    # what the tracer would have stored, had we let it (see on_bound)
                    self.backend.store_result(
                        task_id, {"pid": os.getpid(), "hostname": request.hostname}, STARTED, request=request
                    )
                return
            if outcome is None:
                self._drop_redelivery(key, task_id)
            if outcome.owner_id == task_id:
                attempt = self._wait_for_own_run(request, args, kwargs, settings, attempt, outcome)
                continue
            attempt = self._on_duplicate(request, args, kwargs, settings, attempt, outcome)

    def _on_duplicate(
        self, request: Any, args: Any, kwargs: Any, settings: config.LockSettings, attempt: int, holder: Holder
    ) -> int:
        """Apply the task's duplicate policy; returns only to try again (eager retry)."""
        policy = settings.on_duplicate
        task_id = request.id
        logger.info(
            "task %s[%s] is a duplicate: lock %s is held by task %s on %s (policy %s)",
            self.name, task_id, holder.key, holder.owner_id, holder.host, policy,
        )
        duplicate_skipped.send(
            sender=self, key=holder.key, task_id=task_id, holder_task_id=holder.owner_id, policy=policy
        )
        if policy == "raise":
            raise DuplicateTask(holder.key, holder.owner_id)
        if policy == "retry":
            if attempt >= settings.max_retries:
                raise LockContended(holder.key, holder.owner_id, attempt + 1)
            return self._requeue(request, args, kwargs, settings, attempt, DuplicateTask(holder.key, holder.owner_id))
        # skip: a terminal state at once, so result.get() does not hang in PENDING
        reason = f"duplicate: lock {holder.key} is held by task {holder.owner_id}"
        if not request.is_eager and not (self.ignore_result or request.ignore_result):
            self.backend.mark_as_revoked(task_id, reason, request=request)
        raise Ignore(reason)

    def _wait_for_own_run(
        self, request: Any, args: Any, kwargs: Any, settings: config.LockSettings, attempt: int, holder: Holder
    ) -> int:
        """A delivery of the task id that holds the lock: a redelivery of the running task.

        It must not run beside the holder, must not touch the holder's result,
        and must not be lost: re-queue a copy for later (no budget: the holder
        may run for long) and end this delivery without storing any state.
        """
        logger.info(
            "task %s[%s] is being redelivered while its first run still holds lock %s; re-queued",
            self.name, request.id, holder.key,
        )
        duplicate_skipped.send(
            sender=self, key=holder.key, task_id=request.id, holder_task_id=holder.owner_id, policy="redelivery"
        )
        delay = _backoff(settings, attempt)
        if request.is_eager:
            time.sleep(delay)
            return attempt + 1
        self._publish_again(request, args, kwargs, delay, attempt + 1)
        raise Ignore("redelivery of a running task; re-queued")

    def _drop_redelivery(self, key: str, task_id: str) -> NoReturn:
        logger.info("task %s[%s] already succeeded under lock %s; this redelivery is dropped", self.name, task_id, key)
        duplicate_skipped.send(sender=self, key=key, task_id=task_id, holder_task_id=task_id, policy="redelivery")
        raise Ignore("redelivery of a finished task")

    def _requeue(
        self, request: Any, args: Any, kwargs: Any, settings: config.LockSettings, attempt: int, exc: Exception
    ) -> int:
        """Try again after a jittered back-off, without touching ``max_retries``.

        Eager runs wait in place; worker runs re-publish and end as RETRY.
        """
        delay = _backoff(settings, attempt)
        if request.is_eager:
            time.sleep(delay)
            return attempt + 1
        sig = self._publish_again(request, args, kwargs, delay, attempt + 1)
        raise Retry(f"lock busy, attempt {attempt + 1} of {settings.max_retries}", exc=exc, when=delay, sig=sig)

    def _publish_again(self, request: Any, args: Any, kwargs: Any, delay: float, attempt: int) -> Any:
        headers = dict(request.headers or {})
        headers[ATTEMPT_HEADER] = attempt
        sig = self.signature_from_request(
            request, args, kwargs, countdown=delay, retries=request.retries, headers=headers
        )
        sig.apply_async()
        return sig

    # -- release -------------------------------------------------------------------

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
            return super().__call__(*args, **kwargs)
        request.__dict__[_BODY_STARTED] = True
        state = FAILURE
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
        finally:
            self.release_lock(state)

    def release_lock(self, state: str | None = None) -> None:
        """Let the running execution's lock go, once: when the body ends, else from ``task_postrun``."""
        request = self.request
        lock: Lock | None = request.__dict__.pop(HANDLE, None)
        if lock is None:
            return
        get_watchdog().forget(lock)  # no renewal may follow the release
        deleted = False
        for tries in range(3):
            try:
                deleted = lock.server.release(lock, finished=state == SUCCESS)
                break
            except LockBackendUnavailable as exc:
                logger.warning("releasing lock %s failed (try %d of 3): %s", lock.key, tries + 1, exc)
                time.sleep(0.05 * (tries + 1))
        else:
            logger.error("lock %s could not be released; it expires within %gs", lock.key, lock.ttl)
        if not deleted and not lock.lost:
            logger.warning("lock %s was no longer held by task %s at release", lock.key, request.id)
        lock_released.send(sender=self, key=lock.key, task_id=request.id, state=state, deleted=deleted)


def _attempt(request: Any) -> int:
    value = (request.headers or {}).get(ATTEMPT_HEADER, getattr(request, ATTEMPT_HEADER, 0))
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0


def _backoff(settings: config.LockSettings, attempt: int) -> float:
    """Exponential back-off with jitter (50-100% of the step), capped."""
    step = min(settings.retry_backoff_max, settings.retry_backoff * (2 ** min(attempt, 30)))
    return step * random.uniform(0.5, 1.0)


def _announce_lost(task: LockedTask, task_id: str, lock: Lock, reason: str) -> None:
    lock_lost.send(sender=task, key=lock.key, task_id=task_id, reason=reason)


@task_postrun.connect(weak=False)
def _release_after_run(sender: Any = None, state: str | None = None, **_: Any) -> None:
    if isinstance(sender, LockedTask):
        sender.release_lock(state)


@worker_process_shutdown.connect(weak=False)
@worker_shutdown.connect(weak=False)
def _stop_watchdog(**_: Any) -> None:
    shutdown_watchdog()
