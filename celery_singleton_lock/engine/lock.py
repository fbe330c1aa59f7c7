"""Exclusion: the lock handle and the values the lock operations return.

A :class:`Lock` is what an execution holds; :class:`Holder` says who holds a
key we did not get; :class:`Released` says what a release did, including the
waiters the key was handed to (:class:`Handoff`). The operations themselves
are :class:`~celery_singleton_lock.engine.server.LockServer`'s, and the keys and the
Lua behind them are described in :mod:`celery_singleton_lock.engine.scripts`.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

from ..exceptions import LockError, LockLost
from . import layout, notify, reentry, timing

logger = logging.getLogger("celery_singleton_lock")

MAX_TTL = 10 * 365 * 24 * 3600.0  # ten years: beyond that Redis may refuse the expiry


def check_ttl(ttl: Any, what: str = "ttl") -> float:
    """Return ``ttl`` as seconds, or raise ValueError naming the bad value."""
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)):
        raise ValueError(f"{what} must be a number of seconds > 0, got {ttl!r}")
    if not 0 < ttl <= MAX_TTL:
        raise ValueError(f"{what} must be a number of seconds > 0 and <= {MAX_TTL:g}, got {ttl!r}")
    return float(ttl)


def slot_safe(name: str) -> str:
    """``name`` with a cluster hash tag, so the lock and its line share a slot."""
    start = name.find("{")
    if start != -1:
        end = name.find("}", start + 1)
        if end > start + 1:
            return name
    tagged = "{" + name + "}"
    if tagged.startswith("{}"):
        raise ValueError(f"lock name {name!r} cannot carry a cluster hash tag")
    return tagged


class Verdict(Enum):
    """An acquire that neither took the lock nor found it held."""

    ALREADY_SUCCEEDED = "this owner already succeeded under this key"
    ENTRY_GONE = "this waiter's entry is gone: it already ran, or it left the line"


class Release(Enum):
    """What a release found: RELEASE's status, decoded once."""

    DELETED = 1
    """It was ours, and is gone (or passed on to the next waiter, or kept for a cooldown)."""
    GONE = 0
    """It had expired already."""
    TAKEN = -1
    """Another token holds the key."""
    NOT_HERE = -2
    """Not this process's lock (a forked child's copy): nothing was done."""
    REFUSED = -3
    """The lock server refused the release (e.g. WRONGTYPE); only the task side's release says so."""


class Forced(Enum):
    """What an operator's force-release found (a RELEASE in the holder's name: its status), decoded once."""

    RELEASED = 1
    """The key's lock is deleted (and the key passed on, as a release would)."""
    NO_LOCK = 0
    """Nothing held the key."""
    CHANGED_HANDS = -1
    """Nothing deleted: the key no longer starts with the holder the operator was shown."""


@dataclass(frozen=True)
class Done:
    """An acquire that found this owner already succeeded here, with what its body returned
    (serialised; see ``release(value=...)``)."""

    value: bytes


@dataclass(frozen=True)
class Holder:
    """Who holds a lock that we did not get (``queued``: nobody, but waiters are in line)."""

    key: str
    owner_id: str | None
    host: str | None
    pid: int | None
    ttl_ms: int
    """The key's PTTL when it was read."""
    raw: str
    fencing_token: int | None = None
    reserved: bool = False
    """The key is being handed to the waiter ``owner_id``."""
    queued: bool = False
    cooldown: bool = False
    """Nobody holds it: the run of ``owner_id`` ended, and the key stays taken until its cooldown runs out."""

    @classmethod
    def parse(cls, key: str, value: str | bytes, ttl_ms: int) -> Holder:
        text = value.decode() if isinstance(value, bytes) else value
        if not text:
            return cls(key, None, None, None, int(ttl_ms), "", queued=True)
        token, _, rest = text.partition(" ")
        fence, _, meta_text = rest.partition(" ")
        try:
            meta = json.loads(meta_text) if meta_text else {}
        except ValueError:  # someone else's value format; show it raw
            meta = {}
        if not isinstance(meta, dict):
            meta = {}
        return cls(
            key, meta.get("owner"), meta.get("host"), meta.get("pid"), int(ttl_ms), text,
            fencing_token=int(fence) if fence.isdigit() and fence != "0" else None,
            reserved=token.startswith("~"),
            cooldown=token == "=" and bool(meta.get("cooldown")),
        )


_lost_lock = threading.Lock()


class Backend(Protocol):
    """What a :class:`Lock` needs of the server that granted it (a LockServer of any topology).

    The handle is typed by this small Protocol, not by the class that creates it: server.py
    imports this module, and this module needs nothing of server.py."""

    url: str

    def release(self, lock: Lock, *, succeeded: bool = False, remember: float = 0.0, value: bytes = b"",
                again: bool = False, retries: int = 0, cooldown: float = 0.0,
                presend: float = 0.0, request_id: str = "") -> Released: ...

    def renew(self, lock: Lock) -> bool: ...

    def renew_many(self, locks: Sequence[Lock], *, chunk: int = 500) -> list[bool | LockError]: ...

    def with_timeout(self, seconds: float) -> Backend: ...


class Shared(Protocol):
    """A lease that many locks of this process hang on (etcd's session). The watchdog keeps it
    alive as one, on one timer, and never renews the locks on it one by one: with 10,000 locks
    held, one keep-alive per period and no per-lock work (the locks take its confirmation as theirs)."""

    lease: int
    """Which lease it is now (it changes when the lease is found gone and granted again)."""
    confirmed_at: float
    """``time.monotonic()`` when its last confirmed grant or keep-alive was SENT."""

    def __hash__(self) -> int: ...

    def keep(self, locks: Sequence[Lock], timeout: float) -> tuple[bool | LockError, list[Lock]]:
        """One keep-alive (none if confirmed within the period): True alive, False gone, or the error;
        and which of ``locks`` (the watchdog passes them only when few) are no longer held."""
        ...


@dataclass(eq=False)
class Lock:
    """One held lock: the handle an execution keeps while it runs.

    ``lost`` is the truth at the moment it is read: True once the watchdog
    learnt the lock is gone, and also as soon as the local clock passes the
    lock's deadline (see :mod:`celery_singleton_lock.engine.timing`) without a
    confirmed renewal. Code about to do something that must be exclusive calls
    :meth:`ensure`, and hands :attr:`fencing_token` to any store that can reject
    writes from an older holder. Every loss, however it is found, is logged at
    ERROR and handed to ``on_lost`` exactly once.
    """

    server: Backend
    key: str
    token: str
    fencing_token: int
    ttl: float
    owner_id: str | None = None
    confirmed_at: float = 0.0
    """``time.monotonic()`` when the last confirmed acquire/renewal was SENT."""
    margin: float = -1.0
    """How long before ``confirmed_at + ttl`` the lock stops being trusted (set by the watchdog)."""
    extra_margin: float = 0.0
    """Added to ``margin`` by the server that granted it, kept when the watchdog sets ``margin``
    (a quorum's clock-drift allowance, Redlock's drift factor)."""
    pid: int = field(default_factory=os.getpid)
    """The process that took it: a forked child never releases or renews its parent's lock."""
    lost_reason: str | None = None
    released: bool = False
    on_lost: Callable[[Lock, str], None] | None = None
    last_error: str | None = None
    """The last renewal error since the last confirmed renewal (for the loss reason)."""
    lease: int = 0
    """On etcd, the lease its key was put with (its session's): renewed with that lease (0 elsewhere)."""
    shared: Shared | None = field(default=None, repr=False)
    """The lease it shares with the process's other locks (etcd's session), which the watchdog keeps
    alive instead of this lock (None: the lock is renewed on its own, as on Redis)."""
    renewal_parts: tuple[bytes, bytes] | None = field(default=None, repr=False)
    """Its part of a renewal command, packed once by :func:`~celery_singleton_lock.engine.wire.pack_renewals`."""
    acquired_at: float = field(default=-1.0, repr=False)
    """``time.monotonic()`` when the acquire was sent (how long it was held: RELEASE's ``presend``)."""
    fresh: bool = field(default=False, repr=False)
    """Taken by a fresh delivery's acquire (fresh.py): nobody was in line, so its release tries the
    fresh path first (fresh.py)."""
    depth: int = 1
    """How many nested holds of its thread share this handle (see :mod:`~celery_singleton_lock.engine.reentry`):
    1 for the outermost; only the outermost exit releases."""

    def __post_init__(self) -> None:
        if self.margin < 0:
            self.margin = timing.margin(self.ttl)
        if self.acquired_at < 0:
            self.acquired_at = self.confirmed_at

    @property
    def prefix(self) -> str:
        return self.token + " "

    @property
    def deadline(self) -> float:
        """Local monotonic time after which Redis may have let the lock expire."""
        return self.confirmed_at + self.ttl - self.margin - self.extra_margin

    @property
    def lost(self) -> bool:
        if self.lost_reason is None and not self.released and time.monotonic() >= self.deadline:
            self.mark_lost(self.overdue_reason())
        return self.lost_reason is not None

    def overdue_reason(self) -> str:
        reason = (
            f"not confirmed by its deadline (ttl {self.ttl:g}s minus a {self.margin + self.extra_margin:.2f}s margin; "
            "last confirmed "
            f"{time.monotonic() - self.confirmed_at:.2f}s ago): Redis unreachable or too slow, or this process "
            "was stopped or starved"
        )
        if self.last_error:
            reason += f"; last error: {self.last_error}"
        return reason

    def ensure(self) -> None:
        """Raise :class:`LockLost` if this lock is gone, or may be."""
        if self.lost:
            raise LockLost(self.key, self.lost_reason or "unknown")

    def mark_lost(self, reason: str, *, defer: bool = False) -> bool:
        """Record the loss and report it (ERROR line, ``on_lost``); True the first time only.

        ``defer`` reports on the reporter thread instead of this one (the watchdog's way).
        """
        with _lost_lock:
            if self.lost_reason is not None:
                return False
            self.lost_reason = reason
        if defer:
            notify.submit(lambda: self._report(reason))
        else:
            self._report(reason)
        return True

    def _report(self, reason: str) -> None:
        logger.error("lock %s held by %s was LOST: %s", self.key, self.owner_id, reason)
        if self.on_lost is not None:
            try:
                self.on_lost(self, reason)
            except Exception:
                logger.exception("lock-lost callback for %s failed", self.key)

    def known_fence(self) -> int | None:
        """The fencing token if it is known here without asking the server (for operators' views)."""
        return self.fencing_token

    def release(self, **kwargs: Any) -> Released:
        return self.server.release(self, **kwargs)

    def reenter(self) -> AbstractContextManager[Lock]:
        """``with lock.reenter(): ...``: hold this lock once more, nested (``depth`` + 1, no round trip).

        Only in the thread that holds it; raises :class:`LockLost` if it is already lost.
        What ``held(server, key, owner_id=...)`` does when this thread already holds the key.
        """
        return reentry.again(self)

    def renew(self) -> bool:
        return self.server.renew(self)


@dataclass(frozen=True)
class Handoff:
    """A waiter the key was just passed to (``what="run"``), or one that waited too long
    (``"expired"``). ``message`` is what its owner parked (for a task: the message to send)."""

    key: str
    what: str
    entry: str
    kind: str
    owner_id: str
    ttl_ms: int
    message: bytes

    @classmethod
    def parse(cls, key: str, item: Sequence[Any]) -> Handoff:
        what, entry, record = (x if isinstance(x, bytes) else str(x).encode() for x in item)
        waiter = layout.Waiter.parse(record)
        return cls(key, what.decode(), entry.decode(), waiter.kind, waiter.owner, waiter.ttl_ms, waiter.message)


@dataclass(frozen=True)
class Released:
    """What a release did. True when it deleted our lock."""

    status: Release
    handoffs: tuple[Handoff, ...] = ()

    def __bool__(self) -> bool:
        return self.status is Release.DELETED




def ms(seconds: float) -> int:
    """Seconds as Redis milliseconds (at least 1)."""
    return max(1, int(round(seconds * 1000)))
