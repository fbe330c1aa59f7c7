"""What our tasks did, recorded from our signals, with waits and assertions that have deadlines.

:class:`LockEvents` is what the pytest plugin's ``singleton_lock_events`` fixture gives
(``singleton_lock_events.assert_duplicate(dup, of=holder)``); it works without pytest too.
It sees the signals sent in this process only: eager runs and in-process workers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

_T = TypeVar("_T")

DEFAULT_TIMEOUT = 10.0
"""Seconds a wait or an assertion of :class:`LockEvents` waits, unless told otherwise."""


# -- what our tasks did --------------------------------------------------------------------------


def _task_id(value: Any, what: str) -> str:
    """A task id from an id, an ``AsyncResult``/``EagerResult`` or anything else with ``.id``."""
    if isinstance(value, str) and value:
        return value
    task_id = getattr(value, "id", None)
    if isinstance(task_id, str) and task_id:
        return task_id
    raise TypeError(f"{what}: expected a task id or a result with an .id, got {value!r}")


@dataclass(frozen=True)
class LockEvent:
    """One signal our tasks sent: which one, by which task, and everything it carried."""

    seq: int
    """Order of arrival in this recorder (0, 1, 2, ...)."""
    signal: str
    """The signal's name: ``lock_acquired``, ``lock_released``, ``duplicate_skipped``, ``lock_lost``."""
    sender: Any
    """The task that sent it."""
    kwargs: Mapping[str, Any]
    """The signal's arguments, e.g. ``key``, ``task_id``, ``holder_task_id``, ``policy``."""
    at: float = field(default_factory=time.monotonic)

    @property
    def task_id(self) -> str | None:
        return self.kwargs.get("task_id")

    @property
    def key(self) -> str | None:
        return self.kwargs.get("key")

    @property
    def task_name(self) -> str | None:
        return getattr(self.sender, "name", None)

    @property
    def holder_task_id(self) -> str | None:
        """``duplicate_skipped``: the task that held the lock."""
        return self.kwargs.get("holder_task_id")

    @property
    def policy(self) -> str | None:
        """``duplicate_skipped``: what the duplicate did ("skip", "retry", "raise", "redelivery", ...)."""
        return self.kwargs.get("policy")

    def __str__(self) -> str:
        shown = [f"task={self.task_name}"]
        for name, value in self.kwargs.items():
            text = value if isinstance(value, (str, int, float, bool, type(None))) else type(value).__name__
            shown.append(f"{name}={text}")
        return f"#{self.seq} {self.signal} " + " ".join(shown)


class LockEvents:
    """Records our signals (in this process) so a test can wait for them and assert on them.

    It sees what runs in the test's own process: eager calls and in-process workers
    (``celery.contrib.testing.worker.start_worker``, celery's ``celery_worker`` fixture),
    not ``celery worker`` subprocesses. Every wait has a deadline (``timeout`` seconds,
    :data:`DEFAULT_TIMEOUT` unless told), and a failed one raises ``AssertionError``
    listing what was recorded. Given ``app`` (a Celery app), it records only the signals
    sent by that app's tasks, so tasks of other apps running in the same process
    (another test's worker still stopping, say) do not show up.

        with LockEvents() as events:   # or the singleton_lock_events fixture
            holder = rebuild.delay(7)
            events.assert_acquired(holder)
            dup = rebuild.delay(7)
            events.assert_duplicate(dup, of=holder, policy="skip")
    """

    def __init__(self, timeout: float = DEFAULT_TIMEOUT, *, app: Any = None) -> None:
        self.timeout = timeout
        self.app = app
        """The Celery app whose tasks' signals are recorded; None: every task's."""
        self._events: list[LockEvent] = []
        self._cond = threading.Condition()
        self._receivers: list[tuple[Any, Callable[..., None]]] = []

    # recording

    def __enter__(self) -> LockEvents:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Connect to every signal in ``celery_singleton_lock.signals`` (so new ones are recorded too)."""
        if self._receivers:
            return
        from .. import signals

        for name in signals.__all__:
            signal = getattr(signals, name)
            receiver = self._receiver(name)
            signal.connect(receiver, weak=False)
            self._receivers.append((signal, receiver))

    def stop(self) -> None:
        receivers, self._receivers = self._receivers, []
        for signal, receiver in receivers:
            signal.disconnect(receiver)

    def _receiver(self, name: str) -> Callable[..., None]:
        def receive(sender: Any = None, **kwargs: Any) -> None:
            if self.app is not None and getattr(sender, "app", None) is not self.app:
                return
            kwargs.pop("signal", None)
            with self._cond:
                self._events.append(LockEvent(len(self._events), name, sender, dict(kwargs)))
                self._cond.notify_all()

        return receive

    @property
    def signal_names(self) -> list[str]:
        from .. import signals

        return list(signals.__all__)

    # reading

    @property
    def events(self) -> list[LockEvent]:
        """Everything recorded so far, in order of arrival (a copy)."""
        with self._cond:
            return list(self._events)

    def __iter__(self) -> Iterator[LockEvent]:
        return iter(self.events)

    def __len__(self) -> int:
        with self._cond:
            return len(self._events)

    def clear(self) -> None:
        with self._cond:
            self._events.clear()

    def of(
        self,
        signal: str | None = None,
        *,
        task_id: Any = None,
        key: str | None = None,
        task: Any = None,
        **kwargs: Any,
    ) -> list[LockEvent]:
        """The events matching every criterion given.

        ``signal`` is a signal's name; ``task_id`` an id or a result; ``task`` a task or
        its name; any other keyword must equal the signal's argument of that name, e.g.
        ``of("duplicate_skipped", policy="retry", holder_task_id=holder)``.
        """
        match = self._matcher(signal, task_id, key, task, kwargs)
        with self._cond:
            return [e for e in self._events if match(e)]

    def _matcher(
        self, signal: str | None, task_id: Any, key: str | None, task: Any, kwargs: dict[str, Any]
    ) -> Callable[[LockEvent], bool]:
        if signal is not None and signal not in self.signal_names:
            raise ValueError(f"unknown signal {signal!r}; ours are {', '.join(self.signal_names)}")
        want_id = None if task_id is None else _task_id(task_id, "task_id")
        want_name = None if task is None else (task if isinstance(task, str) else getattr(task, "name", task))
        want = {
            name: _task_id(value, name) if name.endswith("task_id") and not isinstance(value, str) else value
            for name, value in kwargs.items()
        }

        def match(e: LockEvent) -> bool:
            return (
                (signal is None or e.signal == signal)
                and (want_id is None or e.task_id == want_id)
                and (key is None or e.key == key)
                and (want_name is None or e.task_name == want_name)
                and all(name in e.kwargs and e.kwargs[name] == value for name, value in want.items())
            )

        return match

    def _describe(self, task_ids: tuple[str, ...] = ()) -> str:
        events = self.events
        if task_ids:
            events = [e for e in events if e.task_id in task_ids or e.holder_task_id in task_ids]
        if not events:
            return "  (none)"
        lines = [f"  {e}" for e in events[-30:]]
        if len(events) > 30:
            lines.insert(0, f"  ... {len(events) - 30} earlier")
        return "\n".join(lines)

    def _wait(self, found: Callable[[], _T], timeout: float | None) -> _T | None:
        """Wait until ``found()`` returns something truthy (called under the lock); None at the deadline."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        with self._cond:
            while True:
                value = found()
                if value:
                    return value
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)

    def wait_for(
        self,
        signal: str | None = None,
        *,
        count: int = 1,
        timeout: float | None = None,
        task_id: Any = None,
        key: str | None = None,
        task: Any = None,
        **kwargs: Any,
    ) -> list[LockEvent]:
        """Wait until ``count`` events match (see :meth:`of`); return them all.

        Raises ``AssertionError`` at the deadline, listing what was recorded.
        """
        __tracebackhide__ = True
        match = self._matcher(signal, task_id, key, task, kwargs)

        def enough() -> list[LockEvent] | None:
            matching = [e for e in self._events if match(e)]
            return matching if len(matching) >= count else None

        found = self._wait(enough, timeout)
        if found is None:
            criteria = {"signal": signal, "task_id": task_id, "key": key, "task": task, **kwargs}
            shown = ", ".join(f"{k}={v!r}" for k, v in criteria.items() if v is not None)
            limit = self.timeout if timeout is None else timeout
            raise AssertionError(
                f"timed out after {limit}s waiting for {count} event(s) with {shown or 'any signal'}; "
                f"recorded:\n{self._describe()}"
            )
        return found

    def assert_acquired(self, result: Any, *, timeout: float | None = None) -> LockEvent:
        """Wait until the task (an id or a result) took its lock; return that ``lock_acquired`` event."""
        __tracebackhide__ = True
        tid = _task_id(result, "assert_acquired")
        event = self._wait(lambda: next((e for e in self._events if e.signal == "lock_acquired"
                                         and e.task_id == tid), None), timeout)
        if event is None:
            limit = self.timeout if timeout is None else timeout
            raise AssertionError(
                f"task {tid} did not take its lock within {limit}s; its events:\n{self._describe((tid,))}"
            )
        return event

    def assert_duplicate(
        self, result: Any, *, of: Any, policy: str | None = None, timeout: float | None = None
    ) -> LockEvent:
        """Assert that ``result`` was a duplicate of ``of``: it found the lock that ``of`` had taken.

        Waits (with a deadline) for the duplicate's ``duplicate_skipped`` event, then checks
        that its holder is ``of``, that ``of`` was seen taking the same key (so the holder
        really ran), and the policy if one is given (any value: skip, retry, raise,
        redelivery, ...). Fails at once if the duplicate took the lock itself before any
        ``duplicate_skipped``. Returns the (first) ``duplicate_skipped`` event.
        """
        __tracebackhide__ = True
        dup = _task_id(result, "assert_duplicate")
        holder = _task_id(of, "assert_duplicate(of=...)")
        limit = self.timeout if timeout is None else timeout

        def first_of_dup() -> LockEvent | None:
            return next((e for e in self._events if e.task_id == dup
                         and e.signal in ("duplicate_skipped", "lock_acquired")), None)

        first = self._wait(first_of_dup, timeout)
        if first is None:
            raise AssertionError(
                f"task {dup} was not skipped as a duplicate of {holder} within {limit}s "
                f"(no duplicate_skipped event); events of both:\n{self._describe((dup, holder))}"
            )
        if first.signal == "lock_acquired":
            raise AssertionError(
                f"task {dup} was not a duplicate of {holder}: it took lock {first.key} itself; "
                f"events of both:\n{self._describe((dup, holder))}"
            )
        if first.holder_task_id != holder:
            raise AssertionError(
                f"task {dup} was skipped as a duplicate of {first.holder_task_id}, not of {holder} "
                f"(lock {first.key}); events of both:\n{self._describe((dup, holder))}"
            )
        if policy is not None and first.policy != policy:
            raise AssertionError(
                f"task {dup} was skipped as a duplicate of {holder} with policy {first.policy!r}, "
                f"not {policy!r}"
            )
        took = self._wait(lambda: next((e for e in self._events if e.signal == "lock_acquired"
                                        and e.task_id == holder and e.key == first.key), None), timeout)
        if took is None:
            raise AssertionError(
                f"task {dup} names {holder} as the holder of lock {first.key}, but {holder} was not seen "
                f"taking that lock within {limit}s (did it run before the recording started, or in "
                f"another process?); events of both:\n{self._describe((dup, holder))}"
            )
        return first

    def __repr__(self) -> str:
        return f"<LockEvents: {len(self)} event(s)>"


