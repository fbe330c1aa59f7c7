"""The contract every lock backend meets: :class:`LockBackend`, and what its operators' side returns.

It lives apart from :mod:`.server` (one Redis, the first backend) because the Celery side, the
watchdog, ``held()`` and the operators' commands are written against it, never against a backend's
class: they ask what a backend offers (its capability flags and methods here), so a new topology
needs no change anywhere above it. See CONTRIBUTING.md, "Writing a backend".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, Protocol

from ..exceptions import LockError
from . import layout
from .lock import Backend, Done, Forced, Handoff, Holder, Lock, Verdict

HandoffSender = Callable[[Any, Handoff], bool]
"""How a server sends a waiter's message (the Celery side's ``handoff.send``): (server, hand-off) -> sent."""


class ForceReleased(NamedTuple):
    """What an operator's force-release did (``celery locks release``): its ``status``, ``value`` what
    the key held, ``on`` how many servers it was deleted on (a quorum's members; else 1, or 0 when
    nothing was), ``handoffs`` the waiters the key passed to, sent already."""

    status: Forced
    value: bytes
    on: int = 0
    handoffs: tuple[Handoff, ...] = ()


class Listed(NamedTuple):
    """One held lock, as a backend that lists its own locks reads it for operators (:class:`Listing`)."""

    holder: Holder
    ttl_ms: int
    """How long it lives on unless renewed, as Redis's PTTL says it (-1: no expiry known, -2: gone)."""
    waiters: int


class Listing(Protocol):
    """The operators' reads of a backend whose locks are not keys on Redis servers (etcd's). The
    commands SCAN and read the keys on each of :meth:`LockBackend.nodes` otherwise; such a backend
    has no such nodes, so it lists its locks and their waiters itself."""

    def held_locks(self, wanted: Callable[[str], bool]) -> list[Listed]:
        """Every lock held now whose key ``wanted`` accepts (the others are read no further)."""
        ...

    def held_lock(self, key: str) -> Listed | None: ...

    def waiters(self, key: str) -> tuple[list[tuple[str, layout.Waiter]], str]:
        """``key``'s waiters, next first, as (entry, record); and the entry the key is reserved for ('' none)."""
        ...


class LockBackend(Backend, Protocol):
    """What the Celery side, the watchdog, ``held()`` and ``celery locks`` need of a lock server, whatever its
    topology: :class:`~.server.LockServer` (one Redis, and its Sentinel and Cluster subclasses), the
    quorum of masters (:class:`~celery_singleton_lock.topologies.quorum.QuorumLockServer`, which is
    not a LockServer: it has no single Redis to run a script on), and etcd. One Redis orders its
    waiting line with the scripts of :mod:`.line`; etcd has lines of its own (``waiting``: see
    :class:`.line.Waiting`); a quorum has none (``supports_line`` False). It is all a
    :class:`.lock.Lock` needs of its server (:class:`.lock.Backend`: release, renew, renew_many), and more."""

    client: Any
    """A plain client for reads that take no lock (operators, beat's run record): a quorum's first member's."""
    # What the backend can do (the Celery side asks these, never the backend's class; see CONTRIBUTING):
    supports_line: bool  # keys can have a waiting line (a quorum of independent masters cannot order one)
    supports_slot_wait: bool  # a waiter can block on its wake-up list (BLPOP): lock_wait_in_slot, eager waits
    supports_merge: bool  # calls can merge into a waiter (coalesce; elsewhere each call parks)
    supports_publish: bool  # publish marks (lock_publish)
    supports_cooldown: bool  # the key can stay taken after a release (lock_cooldown)
    may_lose_data: bool  # a restart without persistence can empty it (checked at worker start)
    majority: int  # servers that must hold a key under one token for it to be held (a quorum's); 0: one decides
    send_handoff: HandoffSender | None
    turn_timeout: float
    min_replicas: int
    replica_timeout: float

    def acquire(self, name: str, ttl: float, *, owner_id: str | None = None, token: str | None = None,
                entry: str | None = None, check_done: bool = False,
                retake: str | None = None, slot_claim: bool = False) -> Lock | Holder | Verdict | Done: ...

    def with_timeout(self, seconds: float) -> LockBackend: ...

    def holder(self, name: str) -> Holder | None: ...

    def wait_for_change(self, name: str, holder: Holder, seconds: float) -> bool:
        """Plain code's wait where no line wakes it (``held(..., wait=...)`` off one Redis): block until
        ``name``, found held by ``holder``, may have changed hands, for ``seconds`` at most. False if
        this backend cannot tell: the caller backs off before it tries again."""
        ...

    def dispatch(self, handoffs: Iterable[Handoff]) -> None: ...

    def error(self, exc: Exception, key: str) -> LockError: ...

    def close(self) -> None: ...

    # -- for operators (celery locks ...): asked too, never told apart by class ---------------

    def nodes(self, key: str | None = None) -> list[tuple[str, Any]]:
        """The Redis servers its locks are keys on, as (label, client), for the operators' reads: each
        master of a Cluster, each member of a quorum; with ``key``, the one to read it on first (its
        slot's master). None where the locks are not Redis keys: see :meth:`listing`."""
        ...

    def listing(self) -> Listing | None:
        """How to read its locks when they are not Redis keys (etcd); None: read them on :meth:`nodes`."""
        ...

    def force_release(self, key: str, expected: str = "") -> ForceReleased:
        """Delete ``key``'s lock whoever holds it (only if its value still starts with ``expected``,
        when given: the holder an operator was shown), and hand the key on as a release would."""
        ...
