"""What ``celery locks`` reads of an etcd lock server: :class:`EtcdListing`.

Its locks are etcd keys, not keys on Redis servers the commands could SCAN, so the backend lists
them itself (:class:`~celery_singleton_lock.engine.backend.Listing`): one range read over the lock
prefix, then, for the locks wanted only, one lease read per holding process (a lock lives as long
as its holder's lease) and one count read of its line.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from ..engine import layout
from ..engine.backend import Listed
from ..engine.lock import Holder
from ..exceptions import LockError
from .etcd_line import EtcdLine
from .etcd_session import Transport


class Server(Protocol):
    """What the listing needs of its etcd lock server (:class:`.etcd.EtcdLockServer`)."""

    transport: Transport
    waiting: EtcdLine

    def locks(self, limit: int = 0) -> list[tuple[Holder, int]]: ...

    def holder_and_lease(self, name: str) -> tuple[Holder, int] | None: ...


class EtcdListing:
    """The locks of one etcd lock server, and their lines, as the operators' commands read them."""

    def __init__(self, server: Server) -> None:
        self.server = server

    def held_locks(self, wanted: Callable[[str], bool]) -> list[Listed]:
        ttls: dict[int, int] = {}  # a lease is read once, however many locks hang on it
        return [self._listed(holder, lease, ttls) for holder, lease in self.server.locks() if wanted(holder.key)]

    def held_lock(self, key: str) -> Listed | None:
        found = self.server.holder_and_lease(key)
        return None if found is None else self._listed(found[0], found[1], {})

    def waiters(self, key: str) -> tuple[list[tuple[str, layout.Waiter]], str]:
        found, reserved = self.server.waiting.records(key)
        return [(w.entry, w.record) for w in found], reserved

    def _listed(self, holder: Holder, lease: int, ttls: dict[int, int]) -> Listed:
        if lease not in ttls:
            ttls[lease] = self._lease_ttl_ms(lease)
        return Listed(holder, ttls[lease], self.server.waiting.count(holder.key))

    def _lease_ttl_ms(self, lease: int) -> int:
        """The remaining life of ``lease`` (-1: no lease, or it could not be read; -2: gone)."""
        if not lease:
            return -1
        try:
            reply = self.server.transport.call("/kv/lease/timetolive", {"ID": str(lease)})
        except LockError:
            return -1
        ttl = int(reply.get("TTL", -1) or -1)
        return ttl * 1000 if ttl >= 0 else -2
