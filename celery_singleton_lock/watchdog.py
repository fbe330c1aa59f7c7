"""Liveness: one thread per process renews every lock the process holds.

Locks are kept with a short TTL so that a crashed worker frees them quickly;
the watchdog keeps a running execution's lock alive. It is one thread driving
a :class:`~celery_singleton_lock.wheel.TimerWheel`, whatever the number of
locks (python-redis-lock starts a thread per lock):

* a lock is due for renewal TTL/3 after the send time of its last confirmed
  acquire or renewal, which leaves two more tries before it would expire;
* on each tick, every due lock is renewed in ONE pipelined round trip per
  Redis server (``LockServer.renew_many``), on a connection pool of the
  watchdog's own with short socket timeouts;
* "not owner" means lost at once; a transport error means try again on the
  next tick, never give up on a live lock; and a lock whose local deadline
  (send time + TTL - margin) passes unconfirmed is lost even while Redis is
  unreachable, because by then Redis may have let it expire.

A lost lock is marked on its handle (``.lost``, ``.ensure()``), logged once at
ERROR, handed to the ``on_lost`` callback, and never renewed again.

Ticks keep a fixed schedule (tick n fires at start + n * tick), so a slow
batch does not stretch every later period.

The watchdog knows the lock engine and nothing of Celery.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from .exceptions import LockError
from .lock import Lock, LockServer
from .wheel import TimerWheel

logger = logging.getLogger(__name__)

OnLost = Callable[[Lock, str], None]

DEFAULT_TICK = 0.1
DEFAULT_CHUNK = 500
DEFAULT_SOCKET_TIMEOUT = 0.25


class Watchdog:
    """The renewal thread and its wheel. Use :func:`get_watchdog` for the process's one."""

    def __init__(
        self,
        *,
        tick: float = DEFAULT_TICK,
        chunk: int = DEFAULT_CHUNK,
        socket_timeout: float = DEFAULT_SOCKET_TIMEOUT,
    ) -> None:
        self.tick = tick
        self.chunk = chunk
        self.socket_timeout = socket_timeout
        self.pid = os.getpid()
        self._cond = threading.Condition()
        self._wheel: TimerWheel[Lock] = TimerWheel(tick, start=time.monotonic())
        self._on_lost: dict[Lock, OnLost | None] = {}
        self._in_flight: set[Lock] = set()
        self._twins: dict[LockServer, LockServer] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.batches = 0  # renewal round trips sent (for tests and benchmarks)

    # -- the API the task side uses -------------------------------------------

    def track(self, lock: Lock, on_lost: OnLost | None = None) -> None:
        """Renew ``lock`` from now on, until :meth:`forget`.

        Called right after the acquire: the first renewal is scheduled from
        the acquire's send time, so even a slow acquire is renewed on time.
        """
        with self._cond:
            if self._stopping:
                raise LockError("the watchdog is shut down; no lock can be renewed in this process")
            self._start_thread()
            self._on_lost[lock] = on_lost
            self._wheel.schedule(lock, lock.confirmed_at + lock.ttl / 3)
            self._cond.notify_all()

    def forget(self, lock: Lock) -> None:
        """Stop renewing ``lock``; when this returns, no renewal of it is in flight."""
        with self._cond:
            self._wheel.cancel(lock)
            self._on_lost.pop(lock, None)
            while lock in self._in_flight:
                self._cond.wait()

    def __len__(self) -> int:
        return len(self._on_lost)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the thread and join it. Called from ``worker_process_shutdown``."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    # -- the thread -------------------------------------------------------------

    def _start_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(
                target=self._loop, name="celery-singleton-lock-watchdog", daemon=True
            )
            self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._on_lost and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                # fixed schedule: sleep to the next tick boundary, not "tick after the work"
                wake = self._wheel.time_of(self._wheel.current)
                delay = wake - time.monotonic()
                if delay > 0:
                    self._cond.wait(delay)
                    if self._stopping:
                        return
                    if time.monotonic() < wake:
                        continue  # woken early (a track); recheck
                due = self._wheel.advance(time.monotonic())
                self._in_flight.update(due)
            try:
                lost = self._renew(due)
            except Exception:  # never let the thread die silently
                logger.exception("celery-singleton-lock watchdog: renewal round failed")
                lost = []
                with self._cond:
                    for lock in due:
                        if lock in self._on_lost:
                            self._wheel.schedule(lock, time.monotonic() + self.tick)
            finally:
                with self._cond:
                    self._in_flight.clear()
                    self._cond.notify_all()
            for lock, reason, callback in lost:
                self._report_lost(lock, reason, callback)

    def _renew(self, due: list[Lock]) -> list[tuple[Lock, str, OnLost | None]]:
        """One round of renewals. Returns the locks found lost, to report outside the mutex."""
        lost: list[tuple[Lock, str, OnLost | None]] = []
        now = time.monotonic()
        by_server: dict[LockServer, list[Lock]] = {}
        for lock in due:
            if now >= self._deadline(lock):
                lost.append((lock, f"not confirmed within its ttl of {lock.ttl:g}s (Redis unreachable?)", None))
            else:
                by_server.setdefault(lock.server, []).append(lock)
        outcomes: list[tuple[Lock, bool | LockError]] = []
        for server, locks in by_server.items():
            results = self._twin(server).renew_many(locks, chunk=self.chunk)
            self.batches += 1
            outcomes.extend(zip(locks, results, strict=False))
        failed: list[tuple[Lock, LockError]] = []
        with self._cond:
            now = time.monotonic()
            for lock, result in outcomes:
                if lock not in self._on_lost:
                    continue  # forgotten meanwhile: released, never renew again
                if result is True:
                    self._wheel.schedule(lock, lock.confirmed_at + lock.ttl / 3)
                elif result is False:
                    lost.append((lock, "no longer the owner (expired, deleted or taken)", None))
                else:  # transport error: try again next tick, up to the local deadline
                    failed.append((lock, result))
                    self._wheel.schedule(lock, min(now + self.tick, self._deadline(lock)))
            reported = []
            for lock, reason, _ in lost:
                if lock in self._on_lost:
                    reported.append((lock, reason, self._on_lost.pop(lock)))
        if failed:
            logger.warning(
                "renewal of %d lock(s) failed, retrying next tick (first: %s): %s",
                len(failed), failed[0][0].key, failed[0][1],
            )
        return reported

    def _deadline(self, lock: Lock) -> float:
        """Local time after which Redis may have let the lock expire."""
        margin = self.tick + lock.ttl * 0.02
        return lock.confirmed_at + lock.ttl - margin

    def _twin(self, server: LockServer) -> LockServer:
        twin = self._twins.get(server)
        if twin is None:
            twin = self._twins[server] = server.with_timeout(self.socket_timeout)
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
    """The watchdog of this process, created on first use (and anew after a fork)."""
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
    global _watchdog
    wd = _watchdog
    if wd is not None and wd.pid == os.getpid():
        wd.shutdown(timeout)


def _forget_parent_watchdog() -> None:
    # The parent's thread does not exist in a forked child: start afresh.
    global _watchdog, _lock
    _watchdog = None
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_parent_watchdog)
