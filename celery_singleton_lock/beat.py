"""Leader election for celery beat: of N beat processes, only the one holding the leader lock sends.

    celery -A proj beat -S celery_singleton_lock.beat:LeaderScheduler

or, for another scheduler class (django-celery-beat's, say)::

    class LeaderDatabaseScheduler(LeaderMixin, DatabaseScheduler):
        pass

The design is etcd's election (``client/v3/concurrency``: a lease kept alive by
the session, and the leader key bound to it), on our lock engine: the leader
holds one lock, ``singleton_lock_beat_key``, with a short TTL
(``singleton_lock_beat_ttl``), and the process's watchdog keeps it alive.
If the leader dies, nobody renews it and it expires within the TTL. The others
are standbys: each of their ticks tries once to take the lock (one round trip,
every ``singleton_lock_beat_poll`` seconds) and sends nothing. So a standby
takes over at most TTL + poll after the leader died; at once (within a poll)
when the leader shuts down cleanly, since ``close()`` releases the lock.

Why standbys poll instead of waiting in the key's line (``queue.wait_turn``),
as etcd's campaigners wait on their predecessor's key: an etcd campaigner's
key is bound to its own lease, so a dead campaigner leaves the line by
itself. A waiter in our line stays until its deadline; a standby that died
while waiting would be handed the key on the leader's clean shutdown and hold
the hand-off up for its reservation's length. The line's gain (FIFO among
standbys, a wake-up on release) matters little here: there are a handful of
standbys, a clean hand-over is rare, and one acquire per second per standby
costs nothing. Polling also keeps the beat loop responsive: a standby's tick
never blocks, so SIGTERM and schedule syncs behave as in plain beat.

A leader that loses its lock stops at once. Before each send it confirms the
lock in Redis (a renewal, one round trip on a short timeout) and checks
``lock.lost`` (which the watchdog flips): a lock that expired, was deleted or
was taken sends nothing, and the process steps down (it stands again after
one TTL, which leaves the key to the standbys). If Redis cannot confirm, the
send is skipped: a missed tick is the failure mode, never a duplicate one.

The new leader continues its predecessor's schedule: each send is recorded
(``<beat key>:runs``, a hash of entry name -> send time) and a process that
becomes leader first raises its entries' ``last_run_at`` to those times. So a
takeover neither re-sends what the old leader sent nor loses the period of an
interval schedule. That is a wall clock shared between hosts: keep them in NTP.

Beat's leader election keeps two beats from sending the same tick; it does not
stop a slow run from overlapping the next one. For that, make the task itself a
``LockedTask`` (``on_duplicate="skip"``): docs/how-to/beat.md shows both.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from celery.beat import PersistentScheduler, SchedulingError
from celery.utils.time import maybe_make_aware
from redis.exceptions import RedisError

from .delivery import config
from .engine.backend import LockBackend
from .engine.lock import Holder, Lock, check_ttl, slot_safe
from .exceptions import LockError
from .watchdog.process import get_watchdog

if TYPE_CHECKING:
    from celery.beat import Scheduler as _Base
else:
    _Base = object

logger = logging.getLogger("celery_singleton_lock")

DEFAULT_TTL = 10.0
"""Seconds the leader lock lives without renewal: a dead leader is replaced within this (plus a poll)."""
DEFAULT_POLL = 1.0
"""Longest pause between two tries of a standby (a quarter of the TTL if that is shorter)."""
CONFIRM_TIMEOUT = 1.0
"""Longest wait for Redis to confirm the lock before a send (a quarter of the TTL if that is shorter)."""


@dataclass(frozen=True)
class BeatSettings:
    """The election's settings, resolved from the app's conf (see :func:`beat_settings`)."""

    key: str
    """``singleton_lock_beat_key``: the leader lock."""
    ttl: float
    """``singleton_lock_beat_ttl``: seconds the lock lives without renewal."""
    poll: float
    """``singleton_lock_beat_poll``: seconds between two tries of a standby."""
    lock: config.LockSettings
    """Where the lock lives: the tasks' own URL resolution, Redis options and watchdog settings."""

    @property
    def runs_key(self) -> str:
        """The hash of entry name -> last send time, in the lock's hash slot."""
        return slot_safe(self.key) + ":runs"


def beat_settings(app: Any) -> BeatSettings:
    """Read and check the beat settings; a bad one raises ValueError naming the setting and value.

    The lock Redis is found exactly as the tasks find theirs (``singleton_lock_url``, else a
    Redis result backend or broker; ``singleton_lock_redis_options``), so beat and the
    workers' locks share one Redis.
    """
    conf = app.conf
    lock_settings = config.app_settings(app)
    raw_ttl = conf.get("singleton_lock_beat_ttl")
    ttl = DEFAULT_TTL if raw_ttl is None else check_ttl(raw_ttl, "setting singleton_lock_beat_ttl")
    raw_poll = conf.get("singleton_lock_beat_poll")
    if raw_poll is None:
        poll = min(DEFAULT_POLL, ttl / 4)
    else:
        poll = check_ttl(raw_poll, "setting singleton_lock_beat_poll")
        if poll > ttl:
            raise ValueError(
                f"setting singleton_lock_beat_poll ({raw_poll!r}) must not be longer than singleton_lock_beat_ttl "
                f"({ttl:g}s): a standby would try less often than a dead leader's lock expires"
            )
    key = conf.get("singleton_lock_beat_key")
    if key is None:
        main = app.main if app.main and app.main != "__main__" else "celery"
        key = f"{lock_settings.prefix}:beat-leader:{{{main}}}"
    if not isinstance(key, str) or not key.strip():
        raise ValueError(f"setting singleton_lock_beat_key must be a non-empty str, got {key!r}")
    try:
        slot_safe(key)
    except ValueError as exc:
        raise ValueError(f"setting singleton_lock_beat_key: {exc}") from None
    return BeatSettings(key=key, ttl=ttl, poll=poll, lock=lock_settings)


@dataclass
class _Election:
    settings: BeatSettings
    server: LockBackend
    checker: LockBackend
    """The server's twin with short timeouts (a stalled Redis must not stall beat): every election call."""
    owner: str


class LeaderMixin(_Base):
    """Mix in *before* a celery beat Scheduler class: only the elected leader sends.

    ``class MyScheduler(LeaderMixin, SomeScheduler)``. It overrides ``tick`` (a
    standby tries to become leader and sends nothing), ``apply_entry`` /
    ``apply_async`` (a leader confirms its lock before each send, and records the
    send for its successor) and ``close`` (the leader resigns: its lock is
    released, so a standby takes over within a poll). Everything else is the
    base scheduler's. Override :meth:`restore_last_runs` if the base keeps
    ``last_run_at`` somewhere the default cannot reach.

    Settings (``app.conf``): ``singleton_lock_beat_key`` (default
    ``"<singleton_lock_prefix>:beat-leader:{<app main name>}"``), ``singleton_lock_beat_ttl``
    (10 s), ``singleton_lock_beat_poll`` (1 s, or TTL/4 if shorter); the lock Redis and
    the watchdog settings are the tasks' (``singleton_lock_url`` ...).
    """

    leader_lock: Lock | None = None
    """The leader lock while this process leads (None while it stands by)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.leader_lock = None
        self._election: _Election | None = None  # set up on the first tick: beat makes lazy instances too
        self._campaign_after = 0.0
        self._confirmed = False
        self._seen_leader: str | None = ""
        self._failing = False
        self._attempt_token: str | None = None
        super().__init__(*args, **kwargs)

    # -- what beat calls -------------------------------------------------------------

    @property
    def is_leader(self) -> bool:
        lock = self.leader_lock
        return lock is not None and not lock.lost

    def tick(self, *args: Any, **kwargs: Any) -> float:
        """A standby tries to take the lead (and sends nothing); the leader ticks as its base does.

        Either way beat is back within a poll interval: a standby to try again, the
        leader to notice a lost lock and stand down.
        """
        election = self._election or self._set_up()
        poll = election.settings.poll
        if not self._lead(election):
            return float(min(poll, self.max_interval))
        interval = super().tick(*args, **kwargs)
        return float(min(interval, poll)) if interval is not None else poll

    def apply_entry(self, entry: Any, producer: Any = None) -> None:
        if not self._may_send(entry):
            return
        self._confirmed = True
        try:
            super().apply_entry(entry, producer=producer)
        finally:
            self._confirmed = False
        self._remember(entry)

    def apply_async(self, entry: Any, producer: Any = None, advance: bool = True, **kwargs: Any) -> Any:
        """Every send goes through here: a direct caller gets the same leadership check."""
        if self._confirmed:  # apply_entry has just confirmed this send
            return super().apply_async(entry, producer=producer, advance=advance, **kwargs)
        if not self._may_send(entry):
            raise SchedulingError(f"beat: {entry.name} not sent: this process is not the beat leader")
        result = super().apply_async(entry, producer=producer, advance=advance, **kwargs)
        self._remember(entry)
        return result

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._resign()

    @property
    def info(self) -> str:
        base = str(super().info or "")
        try:
            settings = beat_settings(self.app)
        except Exception as exc:  # the banner must not crash on a bad setting; the first tick says it
            return base + f"\n    . leader lock -> (bad settings: {exc})"
        line = f"    . leader lock -> {settings.key} (ttl {settings.ttl:g}s, standbys try every {settings.poll:g}s)"
        return f"{base}\n{line}" if base else line

    def restore_last_runs(self, runs: dict[str, datetime]) -> None:
        """Take over the previous leader's send times: ``last_run_at`` only ever moves forward.

        ``runs`` maps entry name -> when the leader last sent it (aware, UTC). Called
        once each time this process becomes leader, before its first tick as leader.
        """
        schedule = self.schedule
        for name, when in runs.items():
            entry = schedule.get(name)
            if entry is None:
                continue
            last = entry.last_run_at
            if last is None or maybe_make_aware(last) < when:
                entry.last_run_at = when.astimezone(self.app.timezone)

    # -- the election ---------------------------------------------------------------

    def _set_up(self) -> _Election:
        settings = beat_settings(self.app)
        server = config.server_for(settings.lock)
        checker = server.with_timeout(min(CONFIRM_TIMEOUT, settings.ttl / 4))
        owner = f"beat@{socket.gethostname()}/{os.getpid()}/{secrets.token_hex(4)}"
        self._election = _Election(settings, server, checker, owner)
        logger.info(
            "beat %s: electing a leader on lock %s at %s (ttl %gs, standbys try every %gs)",
            owner, settings.key, server.url, settings.ttl, settings.poll,
        )
        return self._election

    def _lead(self, election: _Election) -> bool:
        """True if this process leads (taking the lock if it is free); one round trip for a standby."""
        lock = self.leader_lock
        if lock is not None:
            if not lock.lost:
                return True
            self._step_down(lock.lost_reason or "the lock is lost")
        if time.monotonic() < self._campaign_after:
            return False
        settings = election.settings
        # an attempt whose reply was lost may have taken the lock: the next one retakes it by its token
        token = self._attempt_token or secrets.token_hex(16)
        try:
            outcome = election.checker.acquire(settings.key, settings.ttl, owner_id=election.owner, token=token)
        except LockError as exc:
            self._attempt_token = token
            if not self._failing:
                self._failing = True
                logger.warning("beat %s: cannot reach the leader lock %s (%s); trying every %gs",
                               election.owner, settings.key, exc, settings.poll)
            return False
        self._failing = False
        self._attempt_token = None
        if isinstance(outcome, Lock):
            self._take_office(election, outcome)
            return True
        leader = outcome.owner_id if isinstance(outcome, Holder) else None
        if leader != self._seen_leader:
            self._seen_leader = leader
            logger.info("beat %s: standing by; %s leads (lock %s)", election.owner, leader, settings.key)
        return False

    def _take_office(self, election: _Election, lock: Lock) -> None:
        self.leader_lock = lock
        self._seen_leader = election.owner
        get_watchdog(**election.settings.lock.watchdog_options).track(lock, self._on_lost)
        try:
            raw = election.checker.client.hgetall(election.settings.runs_key)
            runs = {
                (k.decode() if isinstance(k, bytes) else str(k)): datetime.fromtimestamp(float(v), tz=timezone.utc)
                for k, v in raw.items()
            }
        except (RedisError, ValueError) as exc:
            logger.warning("beat %s: could not read the previous leader's send times (%s); going by this "
                           "process's own schedule", election.owner, exc)
            runs = {}
        if runs:
            self.restore_last_runs(runs)
        self._heap = None  # rebuilt from the (restored) entries on this tick
        logger.warning("beat %s: now the LEADER (lock %s, fencing token %d): sending", election.owner, lock.key,
                       lock.fencing_token)

    def _on_lost(self, lock: Lock, reason: str) -> None:
        # on the watchdog's reporter thread: beat's own thread stands down on its next look at lock.lost
        logger.warning("beat: no longer the leader (lock %s lost: %s); sending nothing from now on", lock.key, reason)

    def _may_send(self, entry: Any) -> bool:
        """Confirm the lead just before a send: the local flag, then Redis (one renewal)."""
        election = self._election
        lock = self.leader_lock
        if election is None or lock is None or lock.lost:
            if lock is not None:
                self._step_down(lock.lost_reason or "the lock is lost")
            logger.info("beat: %s not sent: this process is not the leader", getattr(entry, "name", entry))
            return False
        try:
            ours = election.checker.renew(lock)
        except LockError as exc:
            logger.warning("beat %s: %s not sent: Redis did not confirm the leader lock (%s)", election.owner,
                           entry.name, exc)
            return False
        if not ours:
            lock.mark_lost(f"found before sending {entry.name}: the leader lock is no longer this process's "
                           "(expired, deleted or taken)")
            self._step_down("the lock was no longer ours")
            return False
        return True

    def _remember(self, entry: Any) -> None:
        """Record the send for a successor (best effort: without it a successor goes by its own schedule)."""
        election = self._election
        if election is None:
            return
        try:
            election.checker.client.hset(election.settings.runs_key, entry.name, repr(time.time()))
        except RedisError as exc:
            logger.warning("beat %s: could not record the send of %s: %s", election.owner, entry.name, exc)

    def _step_down(self, reason: str) -> None:
        lock, self.leader_lock = self.leader_lock, None
        election = self._election
        if lock is None or election is None:
            return
        get_watchdog().forget(lock)
        try:
            election.checker.release(lock)  # token-checked: frees the key only if it is still ours
        except LockError:
            pass  # it expires within its ttl
        self._campaign_after = time.monotonic() + election.settings.ttl
        self._seen_leader = ""
        logger.warning(
            "beat %s: stepped down (%s); a standby takes over; this process stands again in %gs",
            election.owner, reason, election.settings.ttl,
        )

    def _resign(self) -> None:
        """Shutting down: release the lock, so a standby takes over within its poll, not a TTL."""
        lock, self.leader_lock = self.leader_lock, None
        election = self._election
        if lock is None or election is None:
            return
        get_watchdog().forget(lock)
        # a connection of its own: close() may run in a signal handler, in the middle of a call on the others
        server = election.server.with_timeout(min(CONFIRM_TIMEOUT, election.settings.ttl / 4))
        try:
            server.release(lock)
        except LockError as exc:
            logger.warning("beat %s: could not release the leader lock %s (%s); it expires within %gs",
                           election.owner, lock.key, exc, lock.ttl)
            return
        finally:
            server.close()
        logger.info("beat %s: resigned; lock %s released for a standby", election.owner, lock.key)


class LeaderScheduler(LeaderMixin, PersistentScheduler):
    """Celery's default scheduler (schedule kept in a local shelve file), sending only while leader.

    ``celery -A proj beat -S celery_singleton_lock.beat:LeaderScheduler``
    """


__all__ = ["LeaderMixin", "LeaderScheduler", "BeatSettings", "beat_settings"]
