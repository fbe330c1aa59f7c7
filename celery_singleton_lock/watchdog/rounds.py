"""What one renewal round does: the watchdog's thread (:mod:`.renewer`) calls it on each tick
with what came due there.

* locks renewed one by one (Redis): every due lock of a server in ONE pipelined
  round trip (``renew_many``, chunked; each lock's part of the command packed
  once), on the watchdog's own connections with short socket timeouts; a server
  that failed last round goes last, so it cannot delay the healthy ones. The
  renewed are rescheduled together, per TTL. "Not owner" means lost at once; a
  transport error or a failed chunk means try again on the next tick (the locks
  of a chunk Redis refused are retried alone, so one bad key cannot take its
  chunk-mates down);
* locks on a shared lease (etcd's session, :class:`~celery_singleton_lock.engine.lock.Shared`):
  the LEASE is on the wheel, not its locks. One keep-alive per period confirms
  every lock on it at once (each lock reads the lease's confirmation as its
  own), so 10,000 locks held cost one timer and one keep-alive, with no
  per-lock work; a lease found gone loses every lock on it;
* either way nothing is due after its deadline
  (:mod:`~celery_singleton_lock.engine.timing`), so a lock that passes it
  unconfirmed is found lost on time, even while the server is unreachable.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import cast

from ..engine.lock import Backend, Lock, Shared
from ..exceptions import LockBackendUnavailable, LockError
from .wheel import TimerWheel

logger = logging.getLogger("celery_singleton_lock.watchdog")  # pinned: the name users filter on

STARVED_AFTER = 1.0
"""A lock found past its deadline this many seconds (plus a tick) late means
the watchdog itself did not run in time, and the loss reason says so."""

_REWARN_EVERY = 10.0  # seconds between two warnings about one server that keeps failing
ROUND_HOOKS: list[Callable[[Backend, float, int, int], None]] = []
"""Called after each server's renewal round trip, on the watchdog's thread, with (server,
seconds, renewed, failed): for metrics. Keep them fast."""


class Rounds:
    """The rounds of :class:`~celery_singleton_lock.watchdog.renewer.Watchdog` (its base: the
    thread and the API are there, and so is the state below)."""

    tick: float
    chunk: int
    socket_timeout: float
    batches: int
    losses: int
    failed_rounds: int
    _cond: threading.Condition
    _wheel: TimerWheel[Lock | Shared]
    _tracked: set[Lock]
    _shared: dict[Shared, set[Lock]]
    _leases: dict[Shared, int]
    _in_flight: set[Lock | Shared]
    _failing: dict[Backend, list[float]]
    _suspects: set[Lock]

    def _lose(self, lock: Lock, reason: str) -> None:
        """Stop tracking ``lock`` and report it lost from the reporter thread (under the condition)."""
        self._tracked.discard(lock)
        self._wheel.cancel(lock)
        self._unshare(lock)
        self._suspects.discard(lock)
        self.losses += 1
        lock.mark_lost(reason, defer=True)

    def _round(self, due: list[Lock | Shared], round_time: float) -> None:
        """Renew what came due on one tick: one round trip per server, one keep-alive per shared lease."""
        if self._shared:  # (a process of Redis locks only has none: no look at each item)
            for item in due:
                if not isinstance(item, Lock):
                    self._keep(item, round_time)
            due = [item for item in due if isinstance(item, Lock)]
        by_server: dict[Backend, list[Lock]] = {}
        with self._cond:
            now, tracked, server, part = time.monotonic(), self._tracked, None, []
            for lock in cast("list[Lock]", due):
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

    # -- shared leases (etcd's session): one timer and one keep-alive for all the locks on one ----

    def _share(self, lock: Lock, shared: Shared) -> bool:
        """Count ``lock`` among its lease's locks (under the condition); True when the lease's
        timer is already set or its keep-alive in flight."""
        members = self._shared.get(shared)
        if members is None:
            self._shared[shared] = {lock}
            self._leases[shared] = shared.lease
            return False
        members.add(lock)
        return shared in self._wheel or shared in self._in_flight

    def _unshare(self, lock: Lock) -> None:
        """Take ``lock`` off its lease's locks (under the condition); the last one takes the timer."""
        shared = lock.shared
        members = self._shared.get(shared) if shared is not None else None
        if shared is not None and members is not None:
            members.discard(lock)
            if not members:
                del self._shared[shared], self._leases[shared]
                self._wheel.cancel(shared)

    def _keep(self, shared: Shared, round_time: float) -> None:
        """A shared lease's round: its keep-alive confirms every lock on it at once (each lock reads
        the lease's confirmation as its own); a lease gone, or unconfirmed by the deadline, loses them all."""
        with self._cond:
            locks = list(self._shared.get(shared, ()))
            first = locks[0] if locks else None
            overdue = -1.0 if first is None else \
                time.monotonic() - (shared.confirmed_at + first.ttl - first.margin - first.extra_margin)
            for lock in locks if overdue >= 0 else ():
                self._lose(lock, self._overdue_reason(lock, overdue))
            if first is None or overdue >= 0:
                self._in_flight.discard(shared)
                return
        started = time.monotonic()
        self.batches += 1
        try:
            alive, gone = shared.keep(locks, self.socket_timeout)
        except Exception as exc:  # keep reports errors; this is a bug, not a reason to stop
            logger.exception("celery-singleton-lock watchdog: keeping a lease on %s alive raised", first.server.url)
            alive, gone = LockError(f"keeping a lease on {first.server.url} alive raised {exc!r}"), []
        with self._cond:
            self._in_flight.discard(shared)
            for lock in gone:
                if lock in self._tracked:
                    self._lose(lock, "no longer the owner (deleted or taken)")
            if self._leases.get(shared, shared.lease) != shared.lease:  # gone (and maybe granted anew)
                for lock in [lock for lock in self._shared[shared] if lock.lease != shared.lease]:
                    self._lose(lock, lock.lost_reason or "its etcd lease expired")
                if shared in self._leases:
                    self._leases[shared] = shared.lease
            members = self._shared.get(shared, set())
            failed = 0 if isinstance(alive, bool) else len(members)
            for lock in members if failed or first.last_error else ():
                lock.last_error = str(alive) if failed else None
            if members:  # the next period after its confirmation (or the next tick, to try again)
                when = time.monotonic() if failed else min(round_time, shared.confirmed_at) + first.ttl / 3
                self._wheel.schedule(shared, min(when, shared.confirmed_at + first.ttl - first.margin))
            self._cond.notify_all()
        self._note_server(first.server, failed, len(members) - failed, len(locks), alive if failed else None)
        for hook in ROUND_HOOKS:
            try:
                hook(first.server, time.monotonic() - started, len(members) - failed, failed)
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
