"""Liveness: one thread per process renews every lock the process holds.

Locks are kept with a short TTL so that a crashed worker frees them quickly;
the watchdog keeps a running execution's lock alive. It is one thread driving
a :class:`~celery_singleton_lock.watchdog.wheel.TimerWheel`, whatever the number of
locks (python-redis-lock starts a thread per lock):

* a lock is due TTL/3 after the send time of its acquire or last renewal, on a
  fixed schedule of ticks (a slow batch or a late wake-up does not stretch the
  period), which leaves two more tries before its deadline;
* on each tick, what came due is renewed (:mod:`.rounds`): a Redis server's
  due locks in ONE pipelined round trip, a shared lease (etcd's session) with
  ONE keep-alive for every lock on it. A lock is never due after its deadline
  (:mod:`~celery_singleton_lock.engine.timing`), so one that passes it
  unconfirmed is found lost on time, even while the server is unreachable.

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
from ..engine.lock import Backend, Lock, Shared
from ..engine.timing import DEFAULT_SOCKET_TIMEOUT, DEFAULT_TICK
from ..exceptions import LockError
from .rounds import Rounds
from .wheel import TimerWheel

logger = logging.getLogger("celery_singleton_lock.watchdog")  # pinned: the name users filter on

OnLost = Callable[[Lock, str], None]

DEFAULT_CHUNK = 500
"""Locks per EVALSHA in a round's pipeline."""

IDLE_WAIT = 1.0
"""Seconds an idle watchdog sleeps before it looks again (track() wakes it sooner if a lock needs it)."""


def _positive(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"watchdog {name} must be a number of seconds > 0, got {value!r}")
    return float(value)


class Watchdog(Rounds):
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
        self._wheel: TimerWheel[Lock | Shared] = TimerWheel(self.tick, start=time.monotonic())
        self._tracked: set[Lock] = set()
        self._shared: dict[Shared, set[Lock]] = {}  # a lease many locks hang on (etcd) -> its tracked locks
        self._leases: dict[Shared, int] = {}  # the lease it had when last kept (a new one loses the old locks)
        self._in_flight: set[Lock | Shared] = set()
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
            shared = lock.shared
            if shared is None:
                self._wheel.schedule(lock, due)
            elif self._share(lock, shared):  # the lease's own timer is already set (or in flight)
                due = math.inf
            else:
                self._wheel.schedule(shared, due)
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
            self._unshare(lock)  # (a lease's keep-alive in flight renews no key: nothing to wait for)
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
                    for item in due:
                        if (item in self._tracked or item in self._shared) and item not in self._wheel:
                            self._wheel.schedule(item, time.monotonic())
            finally:
                with self._cond:
                    self.last_round_seconds = time.monotonic() - started
                    self._in_flight.difference_update(due)
                    self._cond.notify_all()
