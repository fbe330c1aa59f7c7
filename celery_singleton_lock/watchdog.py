"""Liveness: one thread per process renews every lock the process holds.

Locks are kept with a short TTL so that a crashed worker frees them quickly;
the watchdog keeps a running execution's lock alive. It is one thread driving
a :class:`~celery_singleton_lock.wheel.TimerWheel`, whatever the number of
locks (python-redis-lock starts a thread per lock):

* a lock is due for renewal TTL/3 after the send time of its acquire, and
  after that TTL/3 after the tick its last renewal was sent on. Ticks keep a
  fixed schedule (tick n fires at start + n * tick, whatever the previous
  round cost), so neither the batch's latency nor a late wake-up stretches the
  period: a lock is due no later than TTL/3 (rounded up to the tick) after its
  last confirmed renewal was sent. That leaves two more tries before expiry;
* on each tick, every due lock is renewed in ONE pipelined round trip per
  Redis server (``LockServer.renew_many``, chunked), on a connection pool of
  the watchdog's own with socket timeouts shorter than TTL/3, so a task's
  heavy Redis use cannot starve it and a dead server cannot block it. A server
  that failed last round goes last, so it cannot delay the healthy ones;
* "not owner" means lost at once. A transport error or a failed chunk means
  try again on the next tick: never give up on a live lock. (The locks of a
  chunk that Redis refused, e.g. because one key was overwritten with another
  type, are retried alone, in a second round trip, so one bad key cannot take
  its chunk-mates down with it.) A lock whose local deadline (send time + TTL
  minus a margin for the tick and clock drift) passes unconfirmed is lost,
  even while Redis is unreachable, because by then Redis may have let it expire.

A lost lock is marked on its handle (``.lost``, ``.ensure()`` raises
:class:`LockLost`), logged once at ERROR, handed to the ``on_lost`` callback
(the task side fires the ``lock_lost`` signal from it), and never renewed
again. :meth:`Watchdog.forget` is synchronous: when it returns no renewal of the
lock is in flight and none will ever be sent, so the caller may release.

Under gevent or eventlet ``threading.Thread`` is a greenlet: I/O-bound tasks
(that sleep or do network I/O) let it run, but a CPU-bound task starves it and
the lock expires. The loss is then reported honestly, as soon as the watchdog
runs again or the task forgets the lock, with a reason that says the watchdog
ran late.

The watchdog knows the lock engine and nothing of Celery.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable

from .exceptions import LockBackendUnavailable, LockError
from .lock import Lock, LockServer
from .wheel import TimerWheel

logger = logging.getLogger(__name__)

OnLost = Callable[[Lock, str], None]

DEFAULT_TICK = 0.1
"""Seconds between two ticks of the wheel (renewal rounds)."""
DEFAULT_CHUNK = 500
"""Locks per EVALSHA in a round's pipeline."""
DEFAULT_SOCKET_TIMEOUT = 0.25
"""Socket (and connect) timeout of the watchdog's own connections, in seconds."""

STARVED_AFTER = 1.0
"""A lock found past its deadline this many seconds (plus a tick) late means
the watchdog itself did not run in time, and the loss reason says so."""

_REWARN_EVERY = 10.0  # seconds between two warnings about one server that keeps failing


def _positive(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"watchdog {name} must be a number of seconds > 0, got {value!r}")
    return float(value)


class Watchdog:
    """The renewal thread and its wheel. Use :func:`get_watchdog` for the process's one."""

    def __init__(
        self,
        *,
        tick: float = DEFAULT_TICK,
        chunk: int = DEFAULT_CHUNK,
        socket_timeout: float = DEFAULT_SOCKET_TIMEOUT,
    ) -> None:
        self.tick = _positive("tick", tick)
        self.socket_timeout = _positive("socket_timeout", socket_timeout)
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"watchdog chunk must be an int >= 1, got {chunk!r}")
        self.chunk = chunk
        self.pid = os.getpid()
        self._cond = threading.Condition()
        self._wheel: TimerWheel[Lock] = TimerWheel(self.tick, start=time.monotonic())
        self._on_lost: dict[Lock, OnLost | None] = {}  # the tracked locks
        self._in_flight: set[Lock] = set()
        self._twins: dict[str, LockServer] = {}  # server url -> twin with short timeouts
        self._failing: dict[str, list[float]] = {}  # server url -> [failing since, last warned]
        self._suspects: set[Lock] = set()  # in a chunk that Redis refused: renewed alone until it works
        self._errors: dict[Lock, str] = {}  # the last renewal error of a lock not confirmed since
        self._short_ttls_warned: set[float] = set()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.batches = 0
        """Renewal round trips sent: one per server per round (for tests and benchmarks)."""
        self.rounds = 0
        """Ticks on which at least one lock was due."""

    def __repr__(self) -> str:
        return f"<Watchdog pid={self.pid} locks={len(self._on_lost)} tick={self.tick:g}s alive={self.alive}>"

    # -- the API the task side uses -------------------------------------------

    def track(self, lock: Lock, on_lost: OnLost | None = None) -> None:
        """Renew ``lock`` from now on, until :meth:`forget`.

        Called right after the acquire: the first renewal is scheduled from
        the acquire's send time (``lock.confirmed_at``), so even a slow acquire
        is renewed on time. Starts the thread on first use. ``on_lost(lock,
        reason)`` is called once, from the watchdog's thread, if the lock is lost.
        """
        if lock.released:
            raise ValueError(f"lock {lock.key} is already released; there is nothing to renew")
        self._check_process()
        with self._cond:
            if self._stopping:
                raise LockError("the watchdog is shut down; no lock can be renewed by it any more")
            if lock.lost:
                return
            self._start_thread()
            idle = not self._on_lost  # the thread waits for work only while it tracks nothing
            self._on_lost[lock] = on_lost
            self._wheel.schedule(lock, lock.confirmed_at + lock.ttl / 3)
            if idle:  # otherwise it wakes on every tick anyway: no need to pay for a wake-up
                self._cond.notify_all()
        if lock.ttl / 3 <= max(self.tick, self.socket_timeout) and lock.ttl not in self._short_ttls_warned:
            self._short_ttls_warned.add(lock.ttl)
            logger.warning(
                "lock %s: ttl %gs is too short for the watchdog (tick %gs, socket timeout %gs); "
                "use a ttl above %gs or it may expire between renewals",
                lock.key, lock.ttl, self.tick, self.socket_timeout, 3 * max(self.tick, self.socket_timeout),
            )

    def forget(self, lock: Lock) -> None:
        """Stop renewing ``lock``; when this returns, no renewal of it is in flight or will be sent.

        If the lock was still tracked but its local deadline has passed (the
        watchdog could not renew it in time, e.g. its thread was starved), it
        is reported lost here, so the loss is never silent.
        """
        if os.getpid() != self.pid:
            return  # a parent's watchdog: it renews nothing in this process
        with self._cond:
            self._wheel.cancel(lock)
            tracked = lock in self._on_lost
            callback = self._on_lost.pop(lock, None)
            while lock in self._in_flight and self.alive:
                self._cond.wait(0.5)  # the round is bounded by the socket timeouts
            overdue = time.monotonic() - self._deadline(lock)
            reason = self._overdue_reason(lock, overdue) if tracked and overdue >= 0 else ""
            self._forget_state(lock)
        if reason and not lock.lost:
            self._report_lost(lock, reason, callback)

    def __len__(self) -> int:
        return len(self._on_lost)

    def __contains__(self, lock: object) -> bool:
        return lock in self._on_lost

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the thread and join it. Called from ``worker_process_shutdown`` and ``worker_shutdown``."""
        if os.getpid() != self.pid:
            return
        with self._cond:
            self._stopping = True
            held = len(self._on_lost)
            self._cond.notify_all()
            thread = self._thread
        if held:
            logger.warning(
                "celery-singleton-lock watchdog stopping with %d lock(s) still held: "
                "they are no longer renewed and expire within their ttl", held,
            )
        if thread is None or thread is threading.current_thread():
            return
        thread.join(timeout)
        if thread.is_alive():
            logger.warning("celery-singleton-lock watchdog of process %d did not stop within %gs", self.pid, timeout)
        else:
            logger.info("celery-singleton-lock watchdog of process %d stopped", self.pid)

    # -- the thread -------------------------------------------------------------

    def _check_process(self) -> None:
        if os.getpid() != self.pid:
            raise LockError(
                f"this watchdog belongs to process {self.pid}, not {os.getpid()}; "
                "use get_watchdog() for the current process's one"
            )

    def _start_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(
                target=self._loop, name=f"celery-singleton-lock-watchdog-{self.pid}", daemon=True
            )
            self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._on_lost and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                # fixed schedule: wake on the next tick's instant, not "one tick after the work"
                wake = self._wheel.time_of(self._wheel.current)
                now = time.monotonic()
                if now < wake:
                    self._cond.wait(wake - now)
                    continue  # recheck: stopping, woken early by a track, or on time
                due = self._wheel.advance(now)
                if not due:
                    continue
                round_time = self._wheel.time_of(self._wheel.current - 1)  # this tick's instant, <= now
                self._in_flight.update(due)
                self.rounds += 1
            lost: list[tuple[Lock, str, OnLost | None]] = []
            try:
                self._round(due, round_time, lost)
            except Exception:  # never let the thread die: retry these locks next tick
                logger.exception("celery-singleton-lock watchdog: renewal round failed; retrying next tick")
                with self._cond:
                    for lock in due:
                        if lock in self._on_lost and lock not in self._wheel:
                            self._wheel.schedule(lock, time.monotonic())
            finally:
                with self._cond:
                    self._in_flight.difference_update(due)
                    self._cond.notify_all()
            for lock, reason, callback in lost:
                self._report_lost(lock, reason, callback)

    def _round(self, due: list[Lock], round_time: float, lost: list[tuple[Lock, str, OnLost | None]]) -> None:
        """Renew what came due on one tick: one round trip per server. Appends what was lost."""
        by_server: dict[str, tuple[LockServer, list[Lock]]] = {}
        with self._cond:
            now = time.monotonic()
            for lock in due:
                if lock not in self._on_lost:
                    continue  # forgotten since
                overdue = now - self._deadline(lock)
                if overdue >= 0:
                    lost.append((lock, self._overdue_reason(lock, overdue), self._on_lost.pop(lock)))
                    self._forget_state(lock)
                else:
                    by_server.setdefault(lock.server.url, (lock.server, []))[1].append(lock)
        # servers that failed last time go last, so they cannot delay the healthy ones
        for url, (server, locks) in sorted(by_server.items(), key=lambda kv: kv[0] in self._failing):
            # Locks whose chunk Redis refused last time (e.g. one key overwritten with
            # another type fails its whole script) go alone, in chunks of one, so a bad
            # key cannot take its chunk-mates down with it.
            normal = [lock for lock in locks if lock not in self._suspects]
            alone = [lock for lock in locks if lock in self._suspects]
            results: list[bool | LockError] = []
            for part, chunk in ((normal, self.chunk), (alone, 1)):
                if part:
                    results.extend(self._renew_on(url, server, part, chunk))
            locks = normal + alone
            failed, first_error = 0, None
            with self._cond:
                for lock, result in zip(locks, results, strict=True):
                    self._in_flight.discard(lock)
                    if lock not in self._on_lost:
                        continue  # forgotten meanwhile: released, never renew again
                    if result is True:
                        self._suspects.discard(lock)
                        self._errors.pop(lock, None)
                        # TTL/3 after this tick's instant (<= the send time): a fixed period
                        self._wheel.schedule(lock, round_time + lock.ttl / 3)
                    elif result is False:
                        self._forget_state(lock)
                        lost.append((lock, "no longer the owner (expired, deleted or taken)", self._on_lost.pop(lock)))
                    else:  # transport error or failed chunk: try again next tick, up to the local deadline
                        failed += 1
                        first_error = first_error or result
                        self._errors[lock] = str(result)
                        if not isinstance(result, LockBackendUnavailable):
                            self._suspects.add(lock)
                        self._wheel.schedule(lock, time.monotonic())
                self._cond.notify_all()  # a forget() may be waiting for these
            self._note_server(url, failed, len(locks), first_error)

    def _renew_on(self, url: str, server: LockServer, locks: list[Lock], chunk: int) -> list[bool | LockError]:
        """One pipelined round trip: renew_many on the server's twin."""
        self.batches += 1
        try:
            return self._twin(server).renew_many(locks, chunk=chunk)
        except Exception as exc:  # renew_many reports errors per lock; this is a bug, not a reason to stop
            logger.exception("celery-singleton-lock watchdog: renewing on %s raised", url)
            return [LockError(f"renewal on {url} raised {exc!r}")] * len(locks)

    def _forget_state(self, lock: Lock) -> None:
        self._suspects.discard(lock)
        self._errors.pop(lock, None)

    def _note_server(self, url: str, failed: int, total: int, error: object) -> None:
        """Log a server's failures once when they start, then every few seconds, and its recovery."""
        now = time.monotonic()
        streak = self._failing.get(url)
        if not failed:
            if streak is not None:
                del self._failing[url]
                logger.warning("lock renewals on %s work again after %.1fs of failures", url, now - streak[0])
            return
        if streak is None:
            self._failing[url] = [now, now]
            logger.warning(
                "renewing %d of %d lock(s) on %s failed; retrying every tick until each lock's deadline: %s",
                failed, total, url, error,
            )
        elif now - streak[1] >= _REWARN_EVERY:
            streak[1] = now
            logger.warning("lock renewals on %s still failing after %.1fs: %s", url, now - streak[0], error)

    def _deadline(self, lock: Lock) -> float:
        """Local time after which Redis may have let the lock expire.

        The TTL runs from when Redis got the command, which is after it was
        sent; the margin covers the tick and 2% of clock-rate drift.
        """
        margin = min(self.tick + lock.ttl * 0.02, lock.ttl / 3)
        return lock.confirmed_at + lock.ttl - margin

    def _overdue_reason(self, lock: Lock, overdue: float) -> str:
        reason = (
            f"not confirmed within its ttl of {lock.ttl:g}s "
            f"(last confirmed {time.monotonic() - lock.confirmed_at:.2f}s ago; Redis unreachable or too slow?)"
        )
        error = self._errors.get(lock)
        if error:
            reason += f"; last error: {error}"
        if overdue > STARVED_AFTER + self.tick:
            reason += (
                f"; the watchdog ran {overdue:.1f}s after the lock's deadline: its thread did not get to run "
                "(a CPU-bound task under gevent/eventlet starves it) or the process was stopped"
            )
        return reason

    def _twin(self, server: LockServer) -> LockServer:
        twin = self._twins.get(server.url)
        if twin is None:
            twin = self._twins[server.url] = server.with_timeout(self.socket_timeout)
        return twin

    def _report_lost(self, lock: Lock, reason: str, callback: OnLost | None) -> None:
        if not lock.mark_lost(reason):
            return
        logger.error("lock %s held by %s was LOST: %s", lock.key, lock.owner_id, reason)
        if callback is not None:
            try:
                callback(lock, reason)
            except Exception:
                logger.exception("lock-lost callback for %s failed", lock.key)


# -- the process's one watchdog ------------------------------------------------

_lock = threading.Lock()
_watchdog: Watchdog | None = None


def get_watchdog(**options: float | int) -> Watchdog:
    """The watchdog of this process, created on first use (and anew after a fork or a shutdown).

    ``options`` (``tick``, ``chunk``, ``socket_timeout``) apply only when it is created.
    """
    global _watchdog
    wd = _watchdog
    if wd is not None and wd.pid == os.getpid() and not wd._stopping:
        return wd
    with _lock:
        if _watchdog is None or _watchdog.pid != os.getpid() or _watchdog._stopping:
            _watchdog = Watchdog(**options)  # type: ignore[arg-type]
        return _watchdog


def shutdown_watchdog(timeout: float = 5.0) -> None:
    """Stop and join this process's watchdog, if it has one."""
    wd = _watchdog
    if wd is not None and wd.pid == os.getpid():
        wd.shutdown(timeout)


def _forget_parent_watchdog() -> None:
    # The parent's thread does not exist in a forked child, and its locks are
    # not the child's to renew: the child starts afresh on its first acquire.
    global _watchdog, _lock
    _watchdog = None
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_parent_watchdog)
