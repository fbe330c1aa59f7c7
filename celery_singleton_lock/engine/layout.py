"""Where a lock's data lives in Redis, and how its records read: the one home of the key layout.

Layout in Redis for a lock named ``K`` (``K`` carries a cluster hash tag, so
every key below lives in K's hash slot and no script touches two slots):

``K``
    the lock: ``"<token> <fence> <json: owner, host, pid>"`` with a PX expiry;
    or, while it is being handed to a waiter, a reservation
    ``"~<entry> 0 <json: owner, reserved>"`` that only that waiter can claim.
    The fence is the server clock in microseconds when the lock was taken. A release
    looks at the line (``K:q``) itself: while it is empty, nobody waits.
``K:q``
    the waiting line: a LIST of entry ids, first in line at the head.
``K:w``
    the waiters: a HASH entry id -> ``"<kind><state>\\n<deadline ms>\\n<ttl ms>\\n<owner>\\n<message>"``.
    kind ``t`` a parked task (message: the task message to send again),
    ``s`` a redelivered copy of the running task (dropped if it succeeds),
    ``p`` plain code blocked in ``held(..., wait=...)`` (woken through
    ``K:wake:<entry>``, and there while its ``K:b:<entry>``, which it renews, lives);
    state ``p`` parked (a task still waiting in its worker
    slot while ``K:b:<entry>`` lives, ``lock_wait_in_slot``, is woken there through
    ``K:wake:<entry>`` to claim the key reserved for it, and no message is sent unless
    the reservation runs out), ``n`` sent ahead of its turn, ``h`` handed the key (its
    message not yet known to be sent: the reservation lasts one lock TTL, then
    the sweeper sends it again), ``c`` handed and sent (the reservation lasts
    until the copy arrives, up to the turn timeout; then the key passes on,
    and the record stays, out of the line, until its deadline).
``K:g``
    tombstones: a ZSET entry id -> when it left the line for good (kept ten
    minutes), so a process that parked it tells "it left" from "it was lost".
``K:d``
    done records, only for tasks that can be redelivered after success
    (``acks_late``): a ZSET owner id -> until when (ms) to drop its redeliveries.
``K:d:<owner id>``
    what that owner's body returned (``"<content type>\n<encoding>\n<data>"``,
    the task's result serializer), kept as long as its done record: a redelivery
    that finds the result never stored (the process died between the release and
    Celery's store) stores this value and sends the chain without running the body.

Every key expires on its own: nothing is left behind once a lock is released
and its line is empty. Times in the line are the server's clock (ms), so every
client agrees on them.

``K:p``
    the publish mark (``lock_publish``): the id of the call published for ``K`` and not
    yet started, with a PX expiry (``lock_publish_ttl``): a message lost in the broker
    blocks publishes no longer than that.
``K:m:<owner>``, ``K:mo:<task id>``
    the calls merged into waiting task ``owner`` (``on_duplicate="coalesce"``): a LIST of
    ``"<task id>\\n<message>"``, oldest first; the waiter's run settles them, then deletes it.
    ``K:mo:<task id>`` names the waiter a call went into, so a redelivery of it stays merged
    (it joins once), and a revoke finds it.

A cooldown (``lock_cooldown``) keeps ``K`` as ``"= <fence> <json: owner, cooldown>"``
with a PX expiry: ``=`` is no token, so nobody holds it, and the line waits for the
sweeper to hand the key on once it expires.

Outside the slot, for the sweeper (see sweeper.py): ``<prefix>:{waiting}``, a
ZSET of lock keys that have waiters, scored by when to look at them next, and
``<prefix>:{waiting}:epoch``, which changes when the lock Redis lost its data.

On etcd (:mod:`celery_singleton_lock.topologies.etcd`) a lock ``K`` is the key ``ETCD_LOCKS + K``,
``"<token> <ttl ms> <json: owner, host, pid>"``, put on its process's session lease; its fencing
token is the key's create revision. A done record is ``ETCD_DONE + K + "/" + <owner id>``, holding
what the body returned, on a lease of its own; ``ETCD_ROOT + "tomb/" + K + "/" + <token>`` the tombstone
of an acquire attempt whose reply never came (see :mod:`celery_singleton_lock.topologies.etcd_txn`).
Its waiting line (see :mod:`celery_singleton_lock.topologies.etcd_line`): each waiter is a key
``etcd_line(K) + <band> + <entry>`` holding its :class:`Waiter` record, with no lease (band ``0``
goes first, ``1`` is the rest; within a band, by create revision); ``etcd_turn(K)`` the entry the
key is reserved for, on a lease; ``etcd_gone(K, entry)`` the tombstone of an entry that left for
good; ``ETCD_WAITING + K`` the sweepers' index of keys with waiters.

Quorum mode (one plain Redis per member) adds ``K:f``, the member's fencing floor, and
``K:x:<token>``, a release's tombstone for an acquire still on its way (see
:mod:`celery_singleton_lock.topologies.quorum`).
"""

from __future__ import annotations

from dataclasses import dataclass


def lock_keys(key: str) -> tuple[str, str, str, str]:
    """The keys every script of one lock takes, in order: lock, line, waiters, done records."""
    return key, key + ":q", key + ":w", key + ":d"


def line(key: str) -> str:
    """``K:q``: the waiting line."""
    return key + ":q"


def waiters(key: str) -> str:
    """``K:w``: the waiters' records."""
    return key + ":w"


def done(key: str) -> str:
    """``K:d``: the done records."""
    return key + ":d"


def gone(key: str) -> str:
    """``K:g``: the tombstones of waiters that left the line for good."""
    return key + ":g"


def wake(key: str, entry: str) -> str:
    """``K:wake:<entry>``: where a waiter in its slot, or plain code, blocks until it is handed the key."""
    return f"{key}:wake:{entry}"


def publish_mark(key: str) -> str:
    """``K:p``: the id of the call published for ``K`` and not yet started (``lock_publish``)."""
    return key + ":p"


def merged(key: str, owner: str) -> str:
    """``K:m:<owner>``: the calls merged into waiting task ``owner`` (``on_duplicate="coalesce"``),
    oldest first, each ``"<task id>\\n<message>"``."""
    return f"{key}:m:{owner}"


def merged_into(key: str, task_id: str) -> str:
    """``K:mo:<task id>``: the waiting task a call was merged into (a redelivery of it stays merged)."""
    return f"{key}:mo:{task_id}"


def blocking(key: str, entry: str) -> str:
    """``K:b:<entry>``: waiter ``entry`` still waits in its worker slot (``lock_wait_in_slot``), or plain code
    in ``held(..., wait=...)``, while this lives."""
    return f"{key}:b:{entry}"


def reply(key: str, request_id: str) -> str:
    """``K:r:<request id>``: one call's reply, kept a short while for a second send of it (kept.py)."""
    return f"{key}:r:{request_id}"


def floor(key: str) -> str:
    """``K:f``: a quorum member's fencing floor."""
    return key + ":f"


def tomb(key: str, token: str) -> str:
    """``K:x:<token>``: a quorum release's tombstone of ``token``'s attempt (set where the lock was not)."""
    return f"{key}:x:{token}"


ETCD_ROOT = "celery_singleton_lock/"
ETCD_LOCKS = ETCD_ROOT + "lock/"
"""etcd: every lock key starts with this (operators list them by this prefix)."""
ETCD_DONE = ETCD_ROOT + "done/"


def etcd_lock(key: str) -> str:
    """etcd: the lock key of ``key``."""
    return ETCD_LOCKS + key


def etcd_tomb(key: str, token: str) -> str:
    """etcd: the tombstone of an acquire attempt in doubt (``token``'s), under ``key``."""
    return f"{ETCD_ROOT}tomb/{key}/{token}"


def etcd_done(key: str, owner: str) -> str:
    """etcd: ``owner``'s done record under ``key``."""
    return f"{ETCD_DONE}{key}/{owner}"


ETCD_WAITING = ETCD_ROOT + "waiting/"
"""etcd: the sweepers' index, one key per lock key with a line (``ETCD_WAITING + K``)."""
ETCD_BANDS = ("0", "1")
"""etcd: a line's two bands, in the order they are served (``0`` the waiters that go first)."""


def etcd_line(key: str) -> str:
    """etcd: the prefix of ``key``'s waiters (``+ band + entry``). NUL ends the lock key, so the line
    of ``a`` never holds the waiters of ``a/b``."""
    return f"{ETCD_ROOT}line/{key}\x00"


def etcd_turn(key: str) -> str:
    """etcd: the entry ``key`` is reserved for (the waiter whose turn came)."""
    return f"{ETCD_ROOT}turn/{key}"


def etcd_left(request_id: str, key: str) -> str:
    """etcd: ``key``, whose waiter the revoke look ``request_id`` took out (beside the tombstone, for a
    look with that id to find it without reading every tombstone)."""
    return f"{ETCD_ROOT}left/{request_id}\x00{key}"


def etcd_gone(key: str, entry: str) -> str:
    """etcd: the tombstone of ``entry``, a waiter of ``key`` that left the line for good."""
    return f"{ETCD_ROOT}gone/{key}\x00{entry}"


def prefix_end(prefix: str) -> str:
    """etcd: the end of the range of keys that start with ``prefix`` (its last character plus one)."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


@dataclass(frozen=True)
class Waiter:
    """One record of ``K:w``: ``"<kind><state>\\n<deadline ms>\\n<ttl ms>\\n<owner>\\n<message>"``."""

    kind: str
    state: str
    deadline_ms: int
    ttl_ms: int
    owner: str
    message: bytes

    @classmethod
    def parse(cls, record: bytes) -> Waiter:
        head, deadline, ttl, owner, message = record.split(b"\n", 4)
        return cls(chr(head[0]), chr(head[1]), int(deadline), int(ttl), owner.decode(), message)


def split_message(packed: bytes) -> tuple[str, str, bytes]:
    """A parked message or a kept return value, ``"<content type>\\n<encoding>\\n<data>"``: its parts."""
    content_type, encoding, data = packed.split(b"\n", 2)
    return content_type.decode(), encoding.decode(), data
