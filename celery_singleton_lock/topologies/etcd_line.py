"""The waiting line on etcd: etcd's revision-ordered mutex, holding parked task messages.

A duplicate that finds the key held *parks* (:meth:`EtcdLine.park`): its message is put as a key of
its own under the lock key's line prefix (``layout.etcd_line``), with no lease (a parked task has no
process to keep one alive). Waiters are served in the order of their create revisions, which Raft
makes one order for the whole cluster, across leader changes too (band ``0`` first: a copy whose
turn came back). Where etcd's mutex has each waiter watch its predecessor, a parked task has nobody
to watch: the key is handed on instead, as on Redis.

* **Release.** The holder's txn deletes its key only while nobody waits (a compare on the line's
  range). If someone does, one look at the line's head and ONE txn delete the key and reserve it for
  the first live waiter (``etcd_turn(K)`` = its entry; :meth:`hand_over`), and the releaser sends its
  message. A key freed any other way (its holder's lease ran out) is handed on by :meth:`hand_on`,
  only while it is free and reserved for nobody: by the next caller, who finds the line (a fresh
  acquire compares that it is empty) and parks, or by a worker's sweeper.
* **Claim.** The waiter's message comes back carrying its entry; its acquire takes the key only
  while ``etcd_turn(K)`` names that entry, deleting its waiter key in the same txn (a tombstone,
  ``etcd_gone``, says it left for good, so a redelivery of its parked message is dropped).
* **Reservations run out.** A reservation lives on a lease of the waiter's lock TTL until its
  message was sent (:meth:`confirm`), then of ``turn_timeout``: after a releaser killed before the
  send, or a message lost by the broker, the sweeper hands the key on again (to the same waiter,
  still first in line: its message is sent again, and a second copy finds its entry gone).
* **Deadlines.** Each waiter carries its ``lock_max_wait`` deadline (this host's clock, ms); past it
  the sweeper takes it out and sends it back to fail with LockWaitTimeout.

Not on etcd: merging calls (``coalesce`` parks each call, and each runs in its turn) and waiting in a
worker slot (``lock_wait_in_slot``: the waiter parks at once). Plain ``held(..., wait=...)`` watches
the lock key instead (:mod:`.etcd_watch`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from ..engine import layout
from ..engine.line import Park, Parked
from ..engine.lock import Handoff, Holder, ms, slot_safe
from .etcd_session import DoneLeases, Transport, b64, unb64
from .etcd_txn import _compare_create, _compare_value, _kvs, _put, _range, prefix_range


class Server(Protocol):
    """What a line needs of its etcd lock server (:class:`.etcd.EtcdLockServer`)."""

    transport: Transport
    turn_timeout: float
    _done_leases: DoneLeases

    def dispatch(self, handoffs: Iterable[Handoff]) -> None: ...

Ops = list[dict[str, Any]]  # compares or operations of an etcd txn (the gateway's JSON)
HEADS = 32
"""Waiters one hand-on reads from the front of a line (the expired among them are left to the sweeper)."""
LOOK_EVERY = 1.0
"""Seconds a key's look is lent to one sweeper (its lease lives one to two seconds)."""
GONE_FOR = 600.0
"""Seconds a tombstone of an entry that left the line lives (as on Redis)."""


@dataclass(frozen=True)
class Waiter:
    """One parked waiter as etcd holds it."""

    name: str  # its etcd key
    entry: str
    record: layout.Waiter
    raw: bytes  # its value
    mod: int  # its mod revision: a txn that acts on it compares this

    def handoff(self, key: str, what: str) -> Handoff:
        r = self.record
        return Handoff(key, what, self.entry, r.kind, r.owner, r.ttl_ms, r.message)


def waiter_key(key: str, band: str, entry: str) -> str:
    return layout.etcd_line(key) + band + entry


def record(kind: str, deadline_ms: int, ttl_ms: int, owner: str, message: bytes) -> bytes:
    """A waiter's value: the same record as on Redis (``layout.Waiter``), state ``p``."""
    return f"{kind}p\n{deadline_ms}\n{ttl_ms}\n{owner}\n".encode() + message


def line_is_empty(key: str) -> dict[str, Any]:
    """The compare "nobody waits for ``key``" (etcd compares every key of a range; none: true)."""
    prefix = layout.etcd_line(key)
    return {"key": b64(prefix), "range_end": b64(layout.prefix_end(prefix)), "target": "CREATE",
            "result": "EQUAL", "create_revision": "0"}


def anyone_waits(key: str) -> dict[str, Any]:
    """The read whose reply says whether anyone waits for ``key`` (at most one key, no value)."""
    return prefix_range(layout.etcd_line(key), limit=1, keys_only=True)


def _keys(name: str) -> dict[str, Any]:  # the read of whether ``name`` exists (no value)
    return {"request_range": {"key": b64(name), "keys_only": True}}


def _delete(name: str) -> dict[str, Any]:
    return {"request_delete_range": {"key": b64(name)}}


def _count(response: dict[str, Any]) -> int:
    return int((response.get("response_range") or {}).get("count", 0) or 0)


def _now_ms() -> int:
    return int(time.time() * 1000)


class EtcdLine:
    """The waiting lines of one etcd lock server (see the module doc)."""

    def __init__(self, server: Server) -> None:
        self.server = server

    def _txn(self, compare: list[dict[str, Any]], success: list[dict[str, Any]],
             failure: list[dict[str, Any]], key: str) -> dict[str, Any]:
        return self.server.transport.txn(compare, success, failure, key)

    def _lease(self, seconds: float) -> int:
        return self.server._done_leases.lease_for(self.server.transport, seconds)

    def _waiters(self, key: str, responses: list[dict[str, Any]]) -> list[Waiter]:
        prefix = layout.etcd_line(key)
        out = []
        for response in responses:
            for kv in _kvs(response):
                name, raw = unb64(kv["key"]).decode(), unb64(kv.get("value"))
                out.append(Waiter(name, name[len(prefix) + 1:], layout.Waiter.parse(raw), raw,
                                  int(kv.get("mod_revision", 0))))
        return out

    # -- what the acquire adds -----------------------------------------------------------

    def free(self, key: str, entry: str | None) -> list[dict[str, Any]]:
        """The acquire's compares: a fresh one takes the key only if nobody waits or holds a turn;
        a claim (``entry``) only while the key is reserved for that entry."""
        turn = layout.etcd_turn(key)
        if entry:
            return [_compare_value(turn, entry)]
        return [_compare_create(turn, 0), line_is_empty(key)]

    def taken(self, key: str, entry: str | None) -> list[dict[str, Any]]:
        """The claim's writes beside the lock's put: the turn and the waiter go, a tombstone stays."""
        if not entry:
            return []
        return [_delete(layout.etcd_turn(key)), *(_delete(waiter_key(key, b, entry)) for b in layout.ETCD_BANDS),
                _put(layout.etcd_gone(key, entry), b"", self._lease(GONE_FOR))]

    def looks(self, key: str, entry: str | None) -> list[dict[str, Any]]:
        """The acquire's reads when it did not take the key (see :meth:`refused`)."""
        reads = [_range(layout.etcd_turn(key)), anyone_waits(key)]
        if entry:
            reads += [_range(waiter_key(key, b, entry)) for b in layout.ETCD_BANDS]
        return reads

    def refused(self, key: str, entry: str | None, responses: list[dict[str, Any]]) -> Holder | str | None:
        """Why a free key was not taken, from :meth:`looks`' replies: a queued Holder (a turn is
        reserved, or waiters are in line), ``"gone"`` (the claiming entry left the line), ``"first"``
        (the claim's reservation ran out: it may still go if it is first), None (nothing: try again)."""
        turn, line = _kvs(responses[0]), _kvs(responses[1])
        if entry:
            if not (_kvs(responses[2]) or _kvs(responses[3])):
                return "gone"
            return Holder.parse(key, "", -2) if turn else "first"
        return Holder.parse(key, "", -2) if turn or line else None

    def reserve_if_first(self, key: str, entry: str) -> bool:
        """A claim whose reservation ran out: reserve the key for it again if it is the first live
        waiter (no message is sent: its copy is here). False if someone is ahead."""
        return self._reserve(key, lambda w: w.entry == entry) is not None

    # -- parking ---------------------------------------------------------------------------

    def park(self, name: str, entry: str, *, kind: str, wait: float, ttl: float, owner_id: str,
             message: bytes = b"", first: bool = False, again: bool = False, redelivered: bool = False,
             **_: Any) -> Parked:
        """Join ``name``'s line (see :func:`celery_singleton_lock.engine.line.park`, whose answers
        these are).
        ``merge`` and ``block`` are Redis-only and ignored (see the module doc)."""
        key = slot_safe(name)
        lock, turn = layout.etcd_lock(key), layout.etcd_turn(key)
        mine = [waiter_key(key, b, entry) for b in layout.ETCD_BANDS]
        reads = [_range(lock), _range(turn), *(_range(m) for m in mine), _range(layout.etcd_gone(key, entry)),
                 anyone_waits(key)]
        r = self._txn([], reads, [], key).get("responses") or []
        held, reserved, parked = bool(_kvs(r[0])), _kvs(r[1]), bool(_kvs(r[2]) or _kvs(r[3]))
        if redelivered and not again and _kvs(r[4]):
            return Parked(Park.TOOK_ITS_TURN)
        if parked and not again:
            return Parked(Park.ALREADY)
        if again and reserved and unb64(reserved[0].get("value")).decode() == entry and not held:
            return Parked(Park.CLAIM)
        if not held and not reserved and not _kvs(r[5]):
            return Parked(Park.FREE)
        band = "0" if first else "1"
        value = record(kind, _now_ms() + ms(wait), ms(ttl), owner_id, message)
        ops = [_put(waiter_key(key, band, entry), value, 0), _put(layout.ETCD_WAITING + key, b"", 0)]
        if again:  # the copy of a waiter moves to its band
            ops.append(_delete(waiter_key(key, "1" if first else "0", entry)))
        ops += [_keys(lock), _keys(turn),
                prefix_range(layout.etcd_line(key) + "0", count_only=True),
                prefix_range(layout.etcd_line(key) + "1", count_only=True)]
        r = self._txn([], ops, [], key).get("responses") or []
        n = len(ops) - 4
        place = _count(r[n + 2]) + (_count(r[n + 3]) if band == "1" else 0)
        if not _kvs(r[n]) and not _kvs(r[n + 1]):  # free and reserved for nobody: nobody else hands it on
            self.server.dispatch(self.hand_on(key))
        return Parked(Park.PARKED, max(1, place))

    def leave(self, name: str, entry: str) -> bool:
        """``entry`` gives up its place; if the key was reserved for it, it passes on. True if it was."""
        reserved, handoffs = self._leave(slot_safe(name), entry)
        self.server.dispatch(handoffs)
        return reserved

    def _leave(self, key: str, entry: str, request_id: str = "") -> tuple[bool, list[Handoff]]:
        turn = layout.etcd_turn(key)
        out = [*(_delete(waiter_key(key, b, entry)) for b in layout.ETCD_BANDS),
               _put(layout.etcd_gone(key, entry), request_id.encode(), self._lease(GONE_FOR)),
               *([_put(layout.etcd_left(request_id, key), b"", self._lease(GONE_FOR))] if request_id else [])]
        reply = self._txn([_compare_value(turn, entry)], [_delete(turn), *out], out, key)
        if not reply.get("succeeded"):
            return False, []
        return True, self.hand_on(key)

    def drop(self, name: str, owner_id: str) -> tuple[int, tuple[Handoff, ...]]:
        """Take task ``owner_id`` out of ``name``'s line (``celery locks drop``): how many of its
        entries went, and the hand-offs made (sent already)."""
        key = slot_safe(name)
        removed, handoffs = 0, []
        for w in self.records(key)[0]:
            if w.record.owner == owner_id and w.record.kind != "p":
                handoffs += self._leave(key, w.entry)[1]
                removed += 1
        self.server.dispatch(handoffs)
        return removed, tuple(handoffs)

    def records(self, name: str) -> tuple[list[Waiter], str]:
        """``name``'s waiters, first to last, and the entry the key is reserved for ('' none)."""
        key = slot_safe(name)
        reads = [_range(layout.etcd_turn(key)),
                 *(prefix_range(layout.etcd_line(key) + b, by_revision=True) for b in layout.ETCD_BANDS)]
        r = self._txn([], reads, [], key).get("responses") or []
        reserved = unb64(_kvs(r[0])[0].get("value")).decode() if _kvs(r[0]) else ""
        return self._waiters(key, r[1:]), reserved

    def line(self, name: str) -> list[str]:
        """The owner ids of ``name``'s waiters, next first (for operators and tests)."""
        return [w.record.owner for w in self.records(name)[0]]

    def count(self, name: str) -> int:
        """How many wait for ``name``."""
        key = slot_safe(name)
        reply = self.server.transport.call("/kv/range", prefix_range(layout.etcd_line(key), count_only=True)
                                           ["request_range"], key)
        return int(reply.get("count", 0) or 0)

    # -- handing on ------------------------------------------------------------------------

    def hand_on(self, key: str) -> list[Handoff]:
        """Reserve the free key for its first live waiter and return the hand-off to send (none when
        the key is held or reserved, or nobody waits)."""
        chosen = self._reserve(key, lambda w: True)
        return [chosen.handoff(key, "run")] if chosen is not None else []

    def _reserve(self, key: str, pick: Callable[[Waiter], bool]) -> Waiter | None:
        """Reserve the free key for the first waiter not past its deadline, if ``pick`` accepts it."""
        lock, turn = layout.etcd_lock(key), layout.etcd_turn(key)
        for _ in range(8):  # a waiter that left between the look and the txn: look again
            reads = [_keys(lock), _keys(turn),
                     *(prefix_range(layout.etcd_line(key) + b, limit=HEADS, by_revision=True)
                       for b in layout.ETCD_BANDS)]
            r = self._txn([], reads, [], key).get("responses") or []
            if _kvs(r[0]) or _kvs(r[1]):
                return None
            now = _now_ms()
            chosen = next((w for w in self._waiters(key, r[2:]) if w.record.deadline_ms > now), None)
            if chosen is None or not pick(chosen):
                return None
            compare, reserve = self._reservation(key, chosen)
            if self._txn([_compare_create(lock, 0), *compare], reserve, [], key).get("succeeded"):
                return chosen
        return None

    def _reservation(self, key: str, chosen: Waiter) -> tuple[Ops, Ops]:
        """What reserves the free key for ``chosen``, in a txn: the compares (nobody holds the turn,
        and its record is as read) and the puts (the turn, on a lease of its TTL; its record says
        "handed", and its mod revision moves, so a sweeper that read it before cannot time it out
        now; a put keeps its create revision: its place)."""
        turn = layout.etcd_turn(key)
        compare = [_compare_create(turn, 0),
                   {"key": b64(chosen.name), "target": "MOD", "result": "EQUAL", "mod_revision": str(chosen.mod)}]
        handed = _put(chosen.name, chosen.raw[:1] + b"h" + chosen.raw[2:], 0)
        return compare, [_put(turn, chosen.entry, self._lease(chosen.record.ttl_ms / 1000)), handed]

    def hand_over(self, key: str, ours: Ops, release: Ops) -> tuple[bool, list[Handoff]]:
        """The holder's release when someone waits: delete the lock (``release``, while ``ours`` holds)
        AND reserve the key for the first live waiter in ONE txn, so that no sweeper or newcomer acts in
        between. (Whether it released, the hand-off to send.)"""
        for _ in range(8):  # a waiter that left between the look and the txn: look again
            reads = [prefix_range(layout.etcd_line(key) + b, limit=HEADS, by_revision=True) for b in layout.ETCD_BANDS]
            now = _now_ms()
            waiters = self._waiters(key, self._txn([], reads, [], key).get("responses") or [])
            chosen = next((w for w in waiters if w.record.deadline_ms > now), None)
            if chosen is None:  # nobody live waits (the sweepers time the others out)
                break
            compare, reserve = self._reservation(key, chosen)
            if self._txn([*ours, *compare], [*release, *reserve], [], key).get("succeeded"):
                return True, [chosen.handoff(key, "run")]
            if not self._txn(ours, [], [], key).get("succeeded"):
                return False, []  # no longer ours (it expired meanwhile)
        released = bool(self._txn(ours, release, [], key).get("succeeded"))
        return released, self.hand_on(key) if released else []

    def confirm(self, key: str, entry: str) -> bool:
        """The hand-off's message was sent: the key stays reserved for it up to ``turn_timeout``."""
        turn = layout.etcd_turn(key)
        lease = self._lease(self.server.turn_timeout)
        return bool(self._txn([_compare_value(turn, entry)], [_put(turn, entry, lease)], [], key).get("succeeded"))

    def drop_copy(self, key: str, entry: str) -> None:
        """The holder succeeded: its redelivered copy parked in line (``entry``) must never run."""
        for band in layout.ETCD_BANDS:
            name = waiter_key(key, band, entry)
            self._txn([{"key": b64(name), "target": "VERSION", "result": "GREATER", "version": "0"}],
                      [_delete(name), _put(layout.etcd_gone(key, entry), b"", self._lease(GONE_FOR))], [], key)

    # -- the sweepers ----------------------------------------------------------------------

    def sweep_all(self, sweepable: Callable[[str], bool]) -> int:
        """One look at every key with a line: time out the waiters past their deadline, hand on a
        free key, drop the key from the index once its line is empty. Returns the hand-offs made."""
        reply = self.server.transport.call("/kv/range", prefix_range(layout.ETCD_WAITING, keys_only=True)
                                           ["request_range"])
        made = 0
        for kv in reply.get("kvs") or []:
            key = unb64(kv["key"]).decode()[len(layout.ETCD_WAITING):]
            if sweepable(key) and self._lend(key):
                handoffs = self.sweep(key)
                made += sum(1 for h in handoffs if h.what == "run")
                self.server.dispatch(handoffs)
        return made

    def _lend(self, key: str) -> bool:
        """Take ``key``'s look for this sweeper for a second or two (a key on a shared lease), so that
        the sweepers of every worker process do not all read a long line every second."""
        lent = layout.ETCD_ROOT + "sweep/" + key
        return bool(self._txn([_compare_create(lent, 0)], [_put(lent, b"", self._lease(LOOK_EVERY))], [],
                              key).get("succeeded"))

    def sweep(self, key: str) -> list[Handoff]:
        """One look at ``key``'s line (see :meth:`sweep_all`); the hand-offs to send."""
        reads = [_range(layout.etcd_turn(key))] + [
            prefix_range(layout.etcd_line(key) + b, by_revision=True) for b in layout.ETCD_BANDS]
        r = self._txn([], reads, [], key).get("responses") or []
        reserved = unb64(_kvs(r[0])[0].get("value")).decode() if _kvs(r[0]) else ""
        now, out = _now_ms(), []
        waiters = self._waiters(key, r[1:])
        for w in waiters:
            if w.record.deadline_ms > now or w.entry == reserved:  # its turn came: it claims, or it runs out
                continue
            ok = self._txn([{"key": b64(w.name), "target": "MOD", "result": "EQUAL", "mod_revision": str(w.mod)}],
                           [_delete(w.name), _put(layout.etcd_gone(key, w.entry), b"", self._lease(GONE_FOR))],
                           [], key).get("succeeded")
            if ok and w.record.kind == "t":
                out.append(w.handoff(key, "expired"))
        index = layout.ETCD_WAITING + key
        if self._txn([line_is_empty(key)], [_delete(index)], [], key).get("succeeded"):
            return out
        return out + self.hand_on(key)

    def remove(self, owner_id: str, request_id: str = "") -> list[str]:
        """Take task ``owner_id`` out of every line (a revoke): the keys it left, also those a look with
        the same ``request_id`` left before (tried again after a lost reply, or another worker's: the looks
        of one revoke share it; see :func:`.layout.etcd_left`), which it moves on."""
        left = self._left_by(request_id) if request_id else []
        for key in left:
            self.server.dispatch(self.hand_on(key))  # (the lost try's own hand-on may not have run)
        prefix = layout.ETCD_ROOT + "line/"
        reply = self.server.transport.call("/kv/range", prefix_range(prefix)["request_range"])
        for kv in reply.get("kvs") or []:
            waiter = layout.Waiter.parse(unb64(kv.get("value")))
            if waiter.owner != owner_id or waiter.kind == "p":
                continue
            key, _, rest = unb64(kv["key"]).decode()[len(prefix):].partition("\x00")
            self.server.dispatch(self._leave(key, rest[1:], request_id)[1])
            left.append(key)
        return list(dict.fromkeys(left))

    def _left_by(self, request_id: str) -> list[str]:
        """The keys whose waiters a look with ``request_id`` took out."""
        prefix = layout.etcd_left(request_id, "")
        reply = self.server.transport.call("/kv/range", prefix_range(prefix, keys_only=True)["request_range"])
        return [unb64(kv["key"]).decode()[len(prefix):] for kv in reply.get("kvs") or []]
