"""Waiting: a key's first-come-first-served line, and what keeps it moving.

A waiter that finds the key held *parks*: it joins the key's line in Redis
(:func:`park`) and stops. When the holder releases, the release script itself
hands the key to the first in line, reserved for it so that no newcomer can
take it first, and returns the waiter to the releaser, which sends it on (a
task's message is published again; plain code blocked in :func:`wait_turn` is
woken through its own wake-up list). That is Redisson's fair lock and etcd's
revision-ordered mutex, on one Redis key slot.

Three things keep a line moving when nobody releases:

* a holder that died (SIGKILL, a lost host) releases nothing: its lock
  expires within its TTL, and the :class:`Sweeper` that runs in every worker
  process then passes the key on. It finds the keys to look at in a small
  index, ``<prefix>:{waiting}``, scored by when each key is next worth a look
  (its holder's expiry, its waiters' soonest deadline), and lends the due ones
  to one sweeper at a time;
* a releaser killed between the hand-off and the publish leaves the waiter
  "handed but not sent": when the reservation (one lock TTL) runs out
  unclaimed, the sweeper sends it again. A waiter whose message was sent
  keeps the key reserved until it arrives, however slow the broker, up to the
  server's ``turn_timeout``; past that the key passes on, and the late copy,
  if it comes, goes back to the head of the line;
* every waiter past its ``lock_max_wait`` deadline (counted from its first
  park), wherever it stands, is timed out by the sweeper's look at the key.

And if the lock Redis loses its data (a restart without persistence, a
failover to a lagging replica, a Cluster shard restarted empty), the parked
messages go with it. Each process remembers the messages it parked until they
leave the line (:meth:`Sweeper.remember`); an entry that leaves for good
leaves a tombstone, so the sweeper tells an entry that left from one that was
lost, and sends the lost ones again (:meth:`Sweeper._prune`).

Plain code that waits (:func:`wait_turn`) blocks on BLPOP of its wake-up
list: woken by the release, never sleep-polling. It looks again when the
holder's TTL runs out, in case the holder died. It waits as a task in its
worker slot does, with a mark that says it is there; it renews the mark while
it lives, so a waiter that died is passed over once its mark runs out.
"""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol, cast

from ..exceptions import LockBackendUnavailable, LockError
from . import layout, line_scripts
from .backend import LockBackend
from .lock import Handoff, Holder, Lock, Verdict, ms, slot_safe
from .refusals import REDIS_ERRORS
from .server import LockServer

logger = logging.getLogger("celery_singleton_lock")

SWEEP_INTERVAL = 1.0
"""Seconds between two looks of a process's sweeper at the keys that have waiters."""
SWEEP_LEASE = 5.0
"""Seconds a key stays lent to the sweeper that took it, so sweepers don't all look at once."""
SWEEP_BATCH = 100
"""Keys one sweeper looks at per round trip."""
LONGEST_BLOCK = 5.0
"""Longest single BLPOP of a plain waiter (below the client's socket timeout)."""
PLAIN_LEASE = 2 * LONGEST_BLOCK + 1.0
"""Seconds a plain waiter's mark (``K:b:<entry>``, as a task waiting in its worker slot has) outlives
its last sign of life: it renews it every LONGEST_BLOCK, so a waiter that died stops blocking the key
after this, not after its whole ``wait``."""


class Park(Enum):
    """What a park found: PARK's reply codes, decoded once (:func:`park`)."""

    FREE = 0
    """The key is free and nobody waits: take it instead."""
    PARKED = 1
    """Parked, at ``place``."""
    ALREADY = 2
    """Parked already (a redelivery of a parked message, its ack lost): at ``place``, 0 out of line."""
    TOOK_ITS_TURN = 3
    """A broker redelivery whose entry left the line for good already: its turn was taken."""
    MERGED = 4
    """Merged (``merge``) into the calls of the waiter last in line, named by ``into_owner``."""
    CLAIM = 5
    """The key was reserved for this entry meanwhile (its own copy, ``again``): claim it rather than park."""


@dataclass(frozen=True)
class Parked:
    """What :func:`park` did (a backend with lines of its own answers the same)."""

    found: Park
    place: int = 0
    """The place in line, 1 = next (PARKED and ALREADY; 0 out of line)."""
    into_owner: str = ""


class Slot(Enum):
    """How a wait in the worker slot ended (UNBLOCK's reply codes, decoded once: :func:`wait_in_slot`)."""

    WOKEN = 2
    """The key is reserved for it: claim it now."""
    PARKED = 1
    """Still parked: its message goes when its turn comes."""
    SENT = 0
    """Its turn came as a message already (or it left the line): this delivery ends."""
    UNKNOWN = -1
    """Neither its record nor its tombstone is there: it never parked, or the lock Redis lost its data (the
    sweeper of the process that parked it sends it again)."""


class Waiting(Protocol):
    """A backend's own waiting lines (etcd: :mod:`celery_singleton_lock.topologies.etcd_line`), which
    :func:`park`, :func:`leave`, :func:`line`, the sweeper, a revoke and an operator's drop
    (:func:`.line_ops.remove`) use instead of the scripts here. A backend that has one names it
    ``waiting``; a Redis server has none."""

    def park(self, name: str, entry: str, *, kind: str, wait: float, ttl: float, owner_id: str,
             message: bytes = b"", first: bool = False, again: bool = False, redelivered: bool = False,
             **redis_only: Any) -> Parked: ...

    def leave(self, name: str, entry: str) -> bool: ...

    def line(self, name: str) -> list[str]: ...

    def sweep_all(self, sweepable: Callable[[str], bool]) -> int: ...

    def remove(self, owner_id: str, request_id: str = "") -> list[str]: ...

    def drop(self, name: str, owner_id: str) -> tuple[int, tuple[Handoff, ...]]: ...


def own_line(server: Any) -> Waiting | None:
    """``server``'s own waiting lines, or None: the scripts here (one Redis)."""
    return cast("Waiting | None", getattr(server, "waiting", None))


def new_entry() -> str:
    return uuid.uuid4().hex


def entry_for(task_id: str, retries: int = 0) -> str:
    """A task's waiter entry id, derived from its task id and Celery's retry count: one message parks
    at most one entry, so a redelivery of a parked message (its ack lost) finds its entry (or its
    tombstone) instead of parking twice; the task's own ``self.retry()`` is another message."""
    return "t" + hashlib.sha1(f"{task_id}\n{int(retries or 0)}".encode()).hexdigest()


def park(
    server: LockBackend,
    name: str,
    entry: str,
    *,
    kind: str,
    wait: float,
    ttl: float,
    owner_id: str,
    message: bytes = b"",
    first: bool = False,
    again: bool = False,
    redelivered: bool = False,
    merge: bool = False,
    block: float = 0.0,
) -> Parked:
    """Put a waiter in ``name``'s line (:class:`Park` says what happened). ``again``: the caller is the
    entry's own copy, which may park it anew (else an entry parked already is ALREADY).
    ``redelivered`` (a broker redelivery of a parked message): TOOK_ITS_TURN if the entry left for good.

    ``kind``: "t" a task (``message`` is what to send when its turn comes), "s"
    a redelivered copy of the running task (dropped if the holder succeeds),
    "p" plain code. ``first`` goes ahead of everyone (a copy of the running task
    is its continuation). ``wait`` is how long it may wait before it is timed out.
    ``merge`` (``on_duplicate="coalesce"``): if the last in line is a parked task, the
    message joins its merged calls instead (MERGED; see :mod:`.dedupe`).
    ``block`` > 0: the task goes on waiting in its worker slot that many seconds
    (:func:`wait_in_slot`); a hand-off meanwhile wakes it there, to claim the key, instead of sending
    its message. Plain code parks with its lease as ``block``, and renews it while it waits.
    """
    if "\n" in owner_id:
        raise ValueError(f"an owner id cannot contain a newline: {owner_id!r}")
    own = own_line(server)
    if own is not None:
        return own.park(name, entry, kind=kind, wait=wait, ttl=ttl, owner_id=owner_id, message=message,
                        first=first, again=again, redelivered=redelivered)
    assert isinstance(server, LockServer)
    key = slot_safe(name)
    reply = server.run(
        line_scripts.PARK, server.keys_for(key),
        (entry, kind, ms(wait), ms(ttl), owner_id, message, "1" if first else "0", "1" if again else "0",
         "1" if redelivered else "0", "1" if merge else "0", str(ms(block)) if block > 0 else "0"),
    )
    found = Park(int(reply[0]))
    if found is Park.MERGED:
        owner = reply[2]  # (reply[1]: the waiter's entry)
        return Parked(found, 0, into_owner=owner.decode() if isinstance(owner, bytes) else owner)
    return Parked(found, int(reply[1]) if found in (Park.PARKED, Park.ALREADY) else 0)


def wait_in_slot(server: LockServer, name: str, entry: str, seconds: float) -> Slot:
    """Wait in the worker slot for the hand-off of a task parked with ``block``, up to ``seconds``.

    The hot-key fast path: a release wakes the waiter through its wake-up list in the same round trip
    that reserves the key for it, and it claims the key at once, with no message through the broker.
    Past ``seconds`` it stops waiting there (one script decides, atomically, against a hand-off landing
    meanwhile). A wake-up whose reply was lost is found there too: the key is reserved for the waiter.
    """
    try:
        if server.client.blpop([layout.wake(slot_safe(name), entry)], timeout=seconds):
            return Slot.WOKEN
    except REDIS_ERRORS as exc:
        logger.warning("lock %s: waiting in the worker slot failed (%s); parked instead", name, exc)
    return stop_waiting(server, name, entry)


def stop_waiting(server: LockServer, name: str, entry: str) -> Slot:
    """End ``entry``'s wait in its worker slot, atomically against a hand-off (UNBLOCK): what
    :func:`wait_in_slot` returns."""
    key = slot_safe(name)
    return Slot(int(server.run(line_scripts.UNBLOCK, server.keys_for(key), (entry,))))


def leave(server: LockBackend, name: str, entry: str, request_id: str = "") -> bool:
    """Take ``entry`` out of the line (it gave up); True if the key had been reserved for it
    (it then passes to the next waiter). ``request_id``: see :func:`.kept.tried`."""
    own = own_line(server)
    if own is not None:
        return own.leave(name, entry)
    assert isinstance(server, LockServer)
    key = slot_safe(name)
    reply = server.run(line_scripts.LEAVE, server.keys_for(key), (entry, ""), request_id=request_id)
    server.dispatch(tuple(Handoff.parse(key, item) for item in reply[2:]))
    return int(reply[1]) == 1


def sweep(server: LockServer, name: str) -> tuple[int, tuple[Handoff, ...]]:
    """Pass the key on if its holder died, and time out waiters past their deadline.
    Returns (when to look again, server clock in ms, 0 when nobody waits; the hand-offs made)."""
    key = slot_safe(name)
    reply = server.run(line_scripts.SWEEP, server.keys_for(key), ())
    handoffs = tuple(Handoff.parse(key, item) for item in reply[1:])
    server.dispatch(handoffs)
    return int(reply[0]), handoffs


def line(server: LockBackend, name: str) -> list[str]:
    """The owner ids of ``name``'s waiters, next first (for operators and tests)."""
    own = own_line(server)
    if own is not None:
        return own.line(name)
    assert isinstance(server, LockServer)
    key = slot_safe(name)
    try:
        entries = server.client.lrange(layout.line(key), 0, -1)
        records = server.client.hmget(layout.waiters(key), entries) if entries else []
    except REDIS_ERRORS as exc:
        raise server.error(exc, key) from exc
    return [layout.Waiter.parse(rec).owner for rec in records if isinstance(rec, bytes)]


def index_key(prefix: str) -> str:
    """The sweeper's index of keys with waiting tasks (its own hash slot)."""
    return f"{prefix}:{{waiting}}"


def announce(server: LockBackend, index: str, name: str) -> None:
    """Tell the sweepers that ``name`` has a waiting task (after every park of one; a backend with
    its own lines indexes them as it parks)."""
    if own_line(server) is not None:
        return
    assert isinstance(server, LockServer)
    try:  # score 0: due at once (safe to send twice: the same score again)
        server.client.zadd(index, {slot_safe(name): 0})
    except REDIS_ERRORS as exc:
        raise server.error(exc, index) from exc


# -- plain code: block until handed the key -------------------------------------


def wait_turn(server: LockBackend, name: str, ttl: float, *, owner_id: str | None, wait: float,
              on_unreachable: Callable[[LockBackendUnavailable], None] | None = None) -> Lock | Holder:
    """Take ``name``, waiting up to ``wait`` seconds in line; the Lock, or the last Holder seen
    if the wait ran out.

    While it waits it holds a place in the line and blocks on its wake-up
    list, so it is woken by the release that hands it the key, in its turn: on a server that
    offers that (``supports_slot_wait``: one Redis), which callers ask before they come here.
    ``on_unreachable``: called when Redis cannot be reached (it sleeps, or raises to give up); the
    waiter keeps its place and goes on. Without it, the error is raised and the place left.
    """
    assert isinstance(server, LockServer)
    deadline = time.monotonic() + wait
    at = _Place()
    try:
        while True:
            try:
                got = _wait_step(server, name, ttl, owner_id, deadline, at)
            except LockBackendUnavailable as exc:
                if on_unreachable is None:
                    raise
                on_unreachable(exc)
                continue
            if got is not None:
                return got
    finally:
        if at.entry is not None:
            try:
                leave(server, name, at.entry)
            except LockError as exc:
                logger.warning("lock %s: could not leave the line (%s); the entry times out by itself", name, exc)


@dataclass
class _Place:
    """A plain waiter's place: its ``entry`` (None: not in line), the last holder seen, and when it
    last said it is alive."""

    entry: str | None = None
    last: Holder | None = None
    alive_at: float = 0.0


def _wait_step(server: LockServer, name: str, ttl: float, owner_id: str | None, deadline: float,
               at: _Place) -> Lock | Holder | None:
    """One look of :func:`wait_turn`: the Lock, the last Holder once the wait ran out, or None (wait on)."""
    outcome = server.acquire(name, ttl, owner_id=owner_id, entry=at.entry)
    if isinstance(outcome, Lock):
        at.entry = None  # claimed: it left the line
        return outcome
    if outcome is Verdict.ENTRY_GONE:  # timed out of the line by a sweep
        at.entry = None
    elif isinstance(outcome, Holder):
        at.last = outcome
    left = deadline - time.monotonic()
    if left <= 0:
        return at.last or Holder(slot_safe(name), None, None, None, 0, "", queued=True)
    if at.entry is None:
        at.entry = new_entry()
        at.alive_at = time.monotonic()
        if park(server, name, at.entry, kind="p", wait=left, ttl=ttl, owner_id=owner_id or at.entry,
                block=PLAIN_LEASE).found is Park.FREE:
            at.entry = None  # it was freed meanwhile: take it
        return None
    if time.monotonic() - at.alive_at >= LONGEST_BLOCK:  # still here: its mark lives on
        at.alive_at = time.monotonic()
        mark = layout.blocking(slot_safe(name), at.entry)
        try:  # (each safe to send twice) its mark gone: woken (its claim deletes the new one), or it ran
            # out in a stall (set again, so it is not passed over while it lives), or it was dropped
            if not server.client.pexpire(mark, ms(PLAIN_LEASE)):
                server.client.set(mark, "1", nx=True, px=ms(PLAIN_LEASE))
        except REDIS_ERRORS as exc:
            raise server.error(exc, name) from exc
    # woken by the hand-off, or look again when the holder would expire if it died
    expiry = (at.last.ttl_ms / 1000 if at.last is not None and at.last.ttl_ms > 0 else LONGEST_BLOCK) + 0.05
    block = max(0.01, min(left, expiry, LONGEST_BLOCK))
    try:
        server.client.blpop([layout.wake(slot_safe(name), at.entry)], timeout=block)
    except REDIS_ERRORS as exc:
        raise server.error(exc, name) from exc
    return None

