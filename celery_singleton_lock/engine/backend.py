"""The contract every lock backend meets: :class:`LockBackend`.

It lives apart from :mod:`.server` (one Redis, the first backend) because the Celery side, the
watchdog and ``held()`` are written against it, never against a backend's class: they
ask what a backend offers (its capability flags and methods here), so a new topology needs no
change anywhere above it. See CONTRIBUTING.md, "Writing a backend".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

from ..exceptions import LockError
from .lock import Backend, Done, Handoff, Holder, Lock, Verdict

HandoffSender = Callable[[Any, Handoff], bool]
"""How a server sends a waiter's message (the Celery side's ``handoff.send``): (server, hand-off) -> sent."""


class LockBackend(Backend, Protocol):
    """What the Celery side, the watchdog and ``held()`` need of a lock server, whatever its
    topology: :class:`~.server.LockServer` (one Redis, and its Sentinel and Cluster subclasses), the
    quorum of masters (:class:`~celery_singleton_lock.topologies.quorum.QuorumLockServer`, which is
    not a LockServer: it has no single Redis to run a script on), and etcd. One Redis orders its waiting line with the
    scripts of :mod:`.line`; etcd has lines of its own (``waiting``: see :class:`.line.Waiting`); a
    quorum has none (``supports_line`` False). It is all a :class:`.lock.Lock` needs of its server
    (:class:`.lock.Backend`: release, renew, renew_many), and more."""

    client: Any
    """A plain client for reads that take no lock (operators, beat's run record): a quorum's first member's."""
    # What the backend can do (the Celery side asks these, never the backend's class; see CONTRIBUTING):
    supports_line: bool  # keys can have a waiting line (a quorum of independent masters cannot order one)
    supports_slot_wait: bool  # a waiter can block on its wake-up list (BLPOP): lock_wait_in_slot, eager waits
    supports_merge: bool  # calls can merge into a waiter (coalesce; elsewhere each call parks)
    supports_publish: bool  # publish marks (lock_publish)
    supports_cooldown: bool  # the key can stay taken after a release (lock_cooldown)
    may_lose_data: bool  # a restart without persistence can empty it (checked at worker start)
    send_handoff: HandoffSender | None
    turn_timeout: float
    min_replicas: int
    replica_timeout: float

    def acquire(self, name: str, ttl: float, *, owner_id: str | None = None, token: str | None = None,
                entry: str | None = None, check_done: bool = False,
                retake: str | None = None, slot_claim: bool = False) -> Lock | Holder | Verdict | Done: ...

    def with_timeout(self, seconds: float) -> LockBackend: ...

    def holder(self, name: str) -> Holder | None: ...

    def dispatch(self, handoffs: Iterable[Handoff]) -> None: ...

    def error(self, exc: Exception, key: str) -> LockError: ...

    def close(self) -> None: ...
