"""Duplicates stopped before they run: the publish mark, and the calls merged into a waiter.

Two records beside a lock, in its hash slot (see :mod:`.layout`):

* **The publish mark** ``K:p``, the id of the call published for the key and not yet
  started. :func:`mark` is one round trip at publish: it answers with the call the
  key already has (marked and queued, waiting in its line, or running), or sets the
  mark for the caller's new task id. The mark is deleted (:func:`unmark`) as soon as
  that call's delivery has taken the lock, parked, or been refused: from then on the
  lock or the line says what the key has. A message lost in the broker (purged,
  dead-lettered, never consumed) leaves the mark until its expiry, the one bound on
  how long it can block publishes; the lock taken at execution still guards anything
  published past it.
* **Merged calls** ``K:m:<owner>``: ``on_duplicate="coalesce"`` merges a duplicate into
  the waiter last in line (``line.park(..., merge=True)``, atomic with the look at
  the line), instead of adding a run. The waiter's run reads them when it starts
  (:func:`merged_calls`) and deletes them once it has settled them (:func:`drop_merged`):
  plain commands, each safe to send twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from redis.exceptions import RedisError

from . import layout
from .kept import kept
from .lock import slot_safe
from .server import LockServer

PUBLISH = """
-- KEYS[1] lock, KEYS[2] line, KEYS[3] waiters, KEYS[4] publish mark; ARGV[1] the new call's
-- task id, ARGV[2] the mark's ttl ms.
-- Returns {1, id} a call is published and not started, {2, id} one waits in line (the last),
-- {3, id} one runs: join that one. Else the mark is set for ARGV[1] and {0} returned: publish.
local mark = redis.call('GET', KEYS[4])
if mark then return {1, mark} end
local last = redis.call('LINDEX', KEYS[2], -1)
local rec = last and redis.call('HGET', KEYS[3], last)
if rec then
  local kind, owner = string.match(rec, '^(.).\\n%d+\\n%d+\\n([^\\n]*)\\n')
  if kind ~= 'p' and owner and owner ~= '' then return {2, owner} end    -- a task, not plain code
end
local held = redis.call('GET', KEYS[1])
-- a lock or a reservation names its call; a cooldown ('=') runs nothing: publish
local meta = held and string.match(held, '^[^=]%S* %d+ (.*)$')
if meta then
  local ok, value = pcall(cjson.decode, meta)
  if ok and type(value) == 'table' and type(value.owner) == 'string' and value.owner ~= '' then
    return {3, value.owner}
  end
end
redis.call('SET', KEYS[4], ARGV[1], 'PX', ARGV[2])
return {0}
"""

UNMARK = """
-- KEYS[1] publish mark; ARGV[1] task id. The mark goes if it is that call's. Returns 1 deleted, else 0.
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

JOINED = {1: "queued", 2: "waiting", 3: "running"}


@dataclass(frozen=True)
class Pending:
    """The call a publish found for its key: ``task_id``, and whether it is queued, waiting or running."""

    task_id: str
    state: str


def mark(server: LockServer, name: str, task_id: str, ttl_ms: int) -> Pending | None:
    """Mark ``task_id`` as the key's published call, unless the key has one: then that one."""
    key = slot_safe(name)
    reply = server.run(PUBLISH, (key, layout.line(key), layout.waiters(key), layout.publish_mark(key)),
                       (task_id, ttl_ms))
    status = int(reply[0])
    if status == 0:
        return None
    found = reply[1].decode() if isinstance(reply[1], bytes) else str(reply[1])
    return Pending(found, JOINED[status])


def remark(server: LockServer, name: str, task_id: str, ttl_ms: int) -> None:
    """Mark ``task_id`` again, unless another call is marked: it is queued again (a back-off re-send)."""
    key = slot_safe(name)
    try:
        server.client.set(layout.publish_mark(key), task_id, nx=True, px=ttl_ms)
    except RedisError as exc:
        raise server.error(exc, key) from exc


def unmark(server: LockServer, name: str, task_id: str) -> bool:
    """Delete the key's publish mark if it is ``task_id``'s (its delivery started, or it was revoked)."""
    key = slot_safe(name)
    return int(server.run(UNMARK, (layout.publish_mark(key),), (task_id,))) == 1


def merged_calls(server: LockServer, name: str, owner: str) -> list[bytes]:
    """The parked messages of the calls merged into waiting task ``owner``, oldest first: one LRANGE,
    safe to send twice. (A call merged by a worker of release 0.2 is its bare task id, and its message
    is in ``K:mm:<owner>``, read for a rolling upgrade.)"""
    key = slot_safe(name)
    try:
        calls: list[bytes] = server.client.lrange(layout.merged(key, owner), 0, -1)  # type: ignore[assignment]
        old = [c for c in calls if b"\n" not in c]
        messages: list[bytes | None] = server.client.hmget(_v02(key, owner), old) if old else []  # type: ignore[assignment]
    except RedisError as exc:
        raise server.error(exc, key) from exc
    olds = dict(zip(old, messages, strict=True))
    out = [c.split(b"\n", 1)[1] if b"\n" in c else olds.get(c) for c in calls]
    return [m for m in out if m is not None]  # (a 0.2 call revoked since: gone)


def drop_merged(server: LockServer, name: str, owner: str, sent_again: Sequence[str] = ()) -> None:
    """Forget the calls merged into ``owner``: its run has settled them, or they were published again
    as they were (``sent_again``: their task ids), and a copy of one must not find itself merged still.
    One DEL, safe to send twice. A settled call's "merged into" record stays until it expires, so a
    redelivery of it stays merged (covered)."""
    key = slot_safe(name)
    try:
        server.client.delete(layout.merged(key, owner), _v02(key, owner),
                             *(layout.merged_into(key, task_id) for task_id in sent_again))
    except RedisError as exc:
        raise server.error(exc, key) from exc


def _v02(key: str, owner: str) -> str:
    """Where release 0.2 kept the messages of the calls merged into ``owner`` (read while upgrading)."""
    return f"{key}:mm:{owner}"

# Each call of these is safe to send twice: its reply is kept under its request id (engine/kept.py).
PUBLISH, UNMARK = map(kept, (PUBLISH, UNMARK))
