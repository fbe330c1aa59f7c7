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
* **Merged calls** ``K:m:<entry>``: ``on_duplicate="coalesce"`` merges a duplicate into
  the waiter last in line (``line.park(..., merge=True)``, atomic with the look at
  the line), instead of adding a run. The waiter's run reads them when it starts
  (:func:`merged_calls`) and deletes them once it has settled them (:func:`drop_merged`).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import layout
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
  local owner = string.match(rec, '^..\\n%d+\\n%d+\\n([^\\n]*)\\n')
  if owner and owner ~= '' then return {2, owner} end
end
local held = redis.call('GET', KEYS[1])
-- a lock or a reservation names its call; a cooldown ('=') runs nothing: publish
local meta = held and string.match(held, '^[^=]%S* %d+ (.*)$')
if meta then
  local ok, value = pcall(cjson.decode, meta)
  if ok and type(value) == 'table' and value.owner then return {3, value.owner} end
end
redis.call('SET', KEYS[4], ARGV[1], 'PX', ARGV[2])
return {0}
"""

UNMARK = """
-- KEYS[1] publish mark; ARGV[1] task id. The mark goes if it is that call's. Returns 1 deleted, else 0.
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

TAKE_MERGED = """
-- KEYS[1] the merged calls of a waiter; ARGV[1] '1' to delete them (settled), '' to read them.
if ARGV[1] == '1' then return redis.call('DEL', KEYS[1]) end
return redis.call('LRANGE', KEYS[1], 0, -1)
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


def unmark(server: LockServer, name: str, task_id: str) -> bool:
    """Delete the key's publish mark if it is ``task_id``'s (its delivery started, or it was revoked)."""
    key = slot_safe(name)
    return int(server.run(UNMARK, (layout.publish_mark(key),), (task_id,))) == 1


def merged_calls(server: LockServer, name: str, entry: str) -> list[bytes]:
    """The parked messages of the calls merged into waiter ``entry``, oldest first."""
    key = slot_safe(name)
    return [bytes(m) for m in server.run(TAKE_MERGED, (layout.merged(key, entry),), ("",))]


def drop_merged(server: LockServer, name: str, entry: str) -> None:
    """Forget the calls merged into ``entry``: its run has settled them."""
    key = slot_safe(name)
    server.run(TAKE_MERGED, (layout.merged(key, entry),), ("1",))
