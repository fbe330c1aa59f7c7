"""Liveness: one thread per process renews every lock the process holds.

Locks are kept with a short TTL so that a crashed worker frees them quickly;
the watchdog keeps a running execution's lock alive. It is one thread driving
a :class:`~celery_singleton_lock.watchdog.wheel.TimerWheel`, whatever the number of
locks (python-redis-lock starts a thread per lock):

* a lock is due TTL/3 after the send time of its acquire or last renewal, on a
  fixed schedule of ticks (a slow batch or a late wake-up does not stretch the
  period), which leaves two more tries before its deadline;
* on each tick, every due lock is renewed in ONE pipelined round trip per
  Redis server (``LockServer.renew_many``, chunked; each lock's part of the
  command packed once), on a connection pool of the watchdog's own with short
  socket timeouts; a server that failed last round goes last, so it cannot
  delay the healthy ones. The renewed are rescheduled together, per TTL;
* "not owner" means lost at once; a transport error or a failed chunk means
  try again on the next tick (the locks of a chunk Redis refused are retried
  alone, so one bad key cannot take its chunk-mates down). A lock is never due
  after its deadline (:mod:`~celery_singleton_lock.engine.timing`), so one that
  passes it unconfirmed is found lost on time, even while Redis is unreachable.

A lost lock is marked on its handle (``.lost``, ``.ensure()`` raises
:class:`LockLost`) and never renewed again; its ERROR line and its ``on_lost``
callback run on the reporter thread (:mod:`~celery_singleton_lock.engine.notify`), so
a slow receiver cannot make other locks miss their renewals.
:meth:`Watchdog.forget` is synchronous: when it returns no renewal of the lock
is in flight and none will ever be sent, so the caller may release.

Under gevent or eventlet the thread is a greenlet: a CPU-bound task starves it,
and ``.lost`` then turns True by the clock the moment the deadline passes.

The watchdog knows the lock engine and nothing of Celery.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable

from ..engine import timing
from ..engine.lock import Backend, Lock
from ..engine.timing import DEFAULT_SOCKET_TIMEOUT, DEFAULT_TICK
from ..exceptions import LockBackendUnavailable, LockError
from .wheel import TimerWheel

logger = logging.getLogger("celery_singleton_lock.watchdog")  # pinned: the name users filter on

OnLost = Callable[[Lock, str], None]

DEFAULT_CHUNK = 500
"""Locks per EVALSHA in a round's pipeline."""

STARVED_AFTER = 1.0
"""A lock found past its deadline this many seconds (plus a tick) late means
the watchdog itself did not run in time, and the loss reason says so."""

_REWARN_EVERY = 10.0  # seconds between two warnings about one server that keeps failing
ROUND_HOOKS: list[Callable[[Backend, float, int, int], None]] = []
"""Called after each server's renewal round trip, on the watchdog's thread, with (server,
seconds, renewed, failed): for metrics. Keep them fast."""

IDLE_WAIT = 1.0
"""Seconds an idle watchdog sleeps before it looks again (track() wakes it sooner if a lock needs it)."""


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
        self._tracked: set[Lock] = set()
        self._in_flight: set[Lock] = set()
        self._failing: dict[Backend, list[float]] = {}  # server -> [failing since, last warned]
        self._suspects: set[Lock] = set()  # in a chunk that Redis refused: renewed alone until it works
        self._short_ttls_warned: set[float] = set()
        self._shortest_safe_ttl = timing.shortest_safe_ttl(self.tick, self.socket_timeout)
        self._idle_until = 0.0  # while it tracks nothing, the thread sleeps until then
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.batches = 0
        """Renewal round trips sent: one per server per round (for tests and benchmarks)."""
        self.rounds = 0
        """Ticks on which at least one lock was due."""
        self.last_round_seconds = 0.0
        """How long the last round took (its renewal round trips), for :func:`.control.watchdog_snapshot`."""
        self.failed_rounds = 0
        """Rounds in which a server's renewals failed (counted per server), for :func:`.control.watchdog_snapshot`."""
        self.losses = 0
        """Locks this watchdog declared lost, for :func:`.control.watchdog_snapshot`."""

    @property
    def options(self) -> dict[str, float | int]:
        return {"tick": self.tick, "chunk": self.chunk, "socket_timeout": self.socket_timeout}

    def __repr__(self) -> str:
        return f"<Watchdog pid={self.pid} locks={len(self._tracked)} tick={self.tick:g}s alive={self.alive}>"

    def margin(self, ttl: float) -> float:
        """How long before ``confirmed + ttl`` a lock it renews stops being trusted."""
        return timing.margin(ttl, self.tick, self.socket_timeout)

    # -- the API the task side uses -------------------------------------------

    def tracked_now(self) -> tuple[list[Lock], list[str]]:
        """The locks it renews and the URLs of the servers failing now, read at one instant (for
        ``celery inspect locks``: readers never touch the condition or the sets themselves)."""
        with self._cond:
            return list(self._tracked), sorted(server.url for server in self._failing)

    def track(self, lock: Lock, on_lost: OnLost | None = None) -> None:
        """Renew ``lock`` from now on, until :meth:`forget`.

        Called right after the acquire: the first renewal is scheduled from
        the acquire's send time (``lock.confirmed_at``), so even a slow acquire
        is renewed on time. Starts the thread on first use. ``on_lost(lock,
        reason)`` is called once if the lock is lost (from the reporter thread
        when the watchdog finds it, see :meth:`Lock.mark_lost`).
        """
        if lock.released:
            raise ValueError(f"lock {lock.key} is already released; there is nothing to renew")
        self._check_process()
        if on_lost is not None:
            lock.on_lost = on_lost
        lock.margin = self.margin(lock.ttl)
        with self._cond:
            if self._stopping:
                raise LockError("the watchdog is shut down; no lock can be renewed by it any more")
            if lock.lost_reason is not None:
                return
            self._start_thread()
            self._tracked.add(lock)
            # due TTL/3 after the acquire was sent, and never after its deadline: the wheel is also
            # what finds a lock lost by the clock (a lock is always in it unless its round is in flight)
            due = min(lock.confirmed_at + lock.ttl / 3, lock.deadline)
            self._wheel.schedule(lock, due)
            if due < self._idle_until:
                # an idle thread sleeps up to IDLE_WAIT: wake it only if this lock cannot wait
                # that long (a wake-up per task would cost more than the rest of track)
                self._idle_until = 0.0
                self._cond.notify_all()
        shortest = self._shortest_safe_ttl
        if lock.ttl < shortest and lock.ttl not in self._short_ttls_warned:
            self._short_ttls_warned.add(lock.ttl)
            logger.warning(
                "lock %s: ttl %gs is too short for the watchdog (tick %gs, socket timeout %gs): its first renewal "
                "has no time for a second try before the lock's deadline; use a ttl of at least %.1fs",
                lock.key, lock.ttl, self.tick, self.socket_timeout, shortest,
            )

    def forget(self, lock: Lock) -> None:
        """Stop renewing ``lock``; when this returns, no renewal of it is in flight or will be sent.

        If the lock was still tracked but its deadline has passed (the watchdog
        could not renew it in time, e.g. its thread was starved), it is reported
        lost here, on the caller's thread, so the loss is never silent.
        """
        if os.getpid() != self.pid:
            return  # a parent's watchdog: it renews nothing in this process
        with self._cond:
            self._wheel.cancel(lock)
            tracked = lock in self._tracked
            self._tracked.discard(lock)
            while lock in self._in_flight and self.alive:
                self._cond.wait(0.5)  # the round is bounded by the socket timeouts
            self._suspects.discard(lock)
        if tracked:
            lock.lost  # noqa: B018 - reading it reports a loss that the clock already shows

    def __len__(self) -> int:
        return len(self._tracked)

    def __contains__(self, lock: object) -> bool:
        return lock in self._tracked

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
            held = len(self._tracked)
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
                if not self._tracked and not self._stopping:
                    self._idle_until = time.monotonic() + IDLE_WAIT
                    self._cond.wait(IDLE_WAIT)
                    self._idle_until = 0.0
                    continue
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
            started = time.monotonic()
            try:
                self._round(due, round_time)
            except Exception:  # never let the thread die: retry these locks next tick
                logger.exception("celery-singleton-lock watchdog: renewal round failed; retrying next tick")
                with self._cond:
                    for lock in due:
                        if lock in self._tracked and lock not in self._wheel:
                            self._wheel.schedule(lock, time.monotonic())
            finally:
                with self._cond:
                    self.last_round_seconds = time.monotonic() - started
                    self._in_flight.difference_update(due)
                    self._cond.notify_all()

    def _lose(self, lock: Lock, reason: str) -> None:
        """Stop tracking ``lock`` and report it lost from the reporter thread (under the condition)."""
        self._tracked.discard(lock)
        self._wheel.cancel(lock)
        self._suspects.discard(lock)
        self.losses += 1
        lock.mark_lost(reason, defer=True)

    def _round(self, due: list[Lock], round_time: float) -> None:
        """Renew what came due on one tick: one round trip per server."""
        by_server: dict[Backend, list[Lock]] = {}
        with self._cond:
            now, tracked, server, part = time.monotonic(), self._tracked, None, []
            for lock in due:
                if lock not in tracked:
                    continue  # forgotten since
                overdue = now - (lock.confirmed_at + lock.ttl - lock.margin - lock.extra_margin)  # (its deadline)
                if overdue >= 0:
                    self._lose(lock, self._overdue_reason(lock, overdue))
                    continue
                if lock.server is not server:  # (a round's locks mostly share one server)
                    server = lock.server
                    part = by_server.setdefault(server, [])
                part.append(lock)
        # servers that failed last time go last, so they cannot delay the healthy ones
        for server, locks in sorted(by_server.items(), key=lambda kv: kv[0] in self._failing):
            # Locks whose chunk Redis refused last time (e.g. one key overwritten with another type fails
            # its whole script) go alone, in chunks of one: a bad key cannot take its chunk-mates down.
            suspects = self._suspects
            normal = [lock for lock in locks if lock not in suspects] if suspects else locks
            alone = [lock for lock in locks if lock in suspects] if suspects else []
            started = time.monotonic()
            results: list[bool | LockError] = []
            for part, chunk in ((normal, self.chunk), (alone, 1)):
                if part:
                    results.extend(self._renew_on(server, part, chunk))
            locks = normal + alone if alone else normal
            with self._cond:
                self._in_flight.difference_update(locks)
                failed, renewed, first_error = self._settle(locks, results, round_time)
                self._cond.notify_all()  # a forget() may be waiting for these
            self._note_server(server, failed, renewed, len(locks), first_error)
            for hook in ROUND_HOOKS:  # e.g. the metrics module: never let one stop the renewals
                try:
                    hook(server, time.monotonic() - started, renewed, failed)
                except Exception:
                    logger.exception("celery-singleton-lock watchdog: a round hook failed")

    def _settle(self, locks: list[Lock], results: list[bool | LockError],
                round_time: float) -> tuple[int, int, LockError | None]:
        """Act on one server's answers (under the condition); returns (failed, renewed, first error).
        The renewed are rescheduled together, per TTL; "not the owner" is lost; an error tries again."""
        tracked, failed, first_error = self._tracked, 0, None
        renewed: dict[float, list[Lock]] = {}  # ttl -> its renewed locks
        ttl, group = -1.0, []
        for lock, result in zip(locks, results, strict=True):
            if lock not in tracked:
                continue  # forgotten meanwhile: released, never renew again
            if result is True:
                if lock.ttl != ttl:  # (a round's locks mostly share one TTL)
                    ttl = lock.ttl
                    group = renewed.setdefault(ttl, [])
                group.append(lock)
            elif result is False:
                self._lose(lock, "no longer the owner (expired, deleted or taken)")
            else:
                failed += 1
                first_error = first_error or result
                lock.last_error = str(result)
                if not isinstance(result, LockBackendUnavailable):
                    self._suspects.add(lock)
                self._wheel.schedule(lock, time.monotonic())
        for ttl, group in renewed.items():
            if self._suspects:
                self._suspects.difference_update(group)
            # TTL/3 after this tick's instant (<= the send time), or after the lease's keep-alive the group
            # took as its own (etcd: one per period); never after a deadline that an extra margin brought nearer
            self._wheel.schedule_all(group, min(round_time, group[0].confirmed_at) + ttl / 3)
            for lock in group if group[0].extra_margin else ():  # (a server's locks share their margin)
                self._wheel.schedule(lock, min(round_time + ttl / 3, lock.deadline))
        return failed, sum(len(group) for group in renewed.values()), first_error

    def _renew_on(self, server: Backend, locks: list[Lock], chunk: int) -> list[bool | LockError]:
        """One pipelined round trip: renew_many on the server's twin."""
        self.batches += 1
        try:
            return server.with_timeout(self.socket_timeout).renew_many(locks, chunk=chunk)
        except Exception as exc:  # renew_many reports errors per lock; this is a bug, not a reason to stop
            logger.exception("celery-singleton-lock watchdog: renewing on %s raised", server.url)
            return [LockError(f"renewal on {server.url} raised {exc!r}")] * len(locks)

    def _note_server(self, server: Backend, failed: int, renewed: int, total: int, error: object) -> None:
        """Log a server's failures once when they start, then every few seconds, and its real recovery."""
        now = time.monotonic()
        streak = self._failing.get(server)
        if not failed:
            if streak is not None and renewed:  # only a renewal that really succeeded says it works again
                del self._failing[server]
                logger.warning("lock renewals on %s work again after %.1fs of failures", server.url, now - streak[0])
            return
        self.failed_rounds += 1
        if streak is None:
            self._failing[server] = [now, now]
            logger.warning(
                "renewing %d of %d lock(s) on %s failed; retrying every tick until each lock's deadline: %s",
                failed, total, server.url, error,
            )
        elif now - streak[1] >= _REWARN_EVERY:
            streak[1] = now
            logger.warning("lock renewals on %s still failing after %.1fs: %s", server.url, now - streak[0], error)

    def _overdue_reason(self, lock: Lock, overdue: float) -> str:
        reason = lock.overdue_reason()
        if overdue > STARVED_AFTER + self.tick:
            reason += (
                f"; the watchdog ran {overdue:.1f}s after the lock's deadline: its thread did not get to run "
                "(a CPU-bound task under gevent/eventlet starves it) or the process was stopped"
            )
        return reason
