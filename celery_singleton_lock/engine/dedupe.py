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
* **Merged calls** ``K:m:<owner>`` (and ``K:mo:<task id>``, where each went):
  ``on_duplicate="coalesce"`` merges a duplicate into the waiter last in line
  (``line.park(..., merge=True)``, atomic with the look at the line), instead of adding a run.
  The waiter's run reads them when it starts (:func:`merged_calls`) and deletes them once it
  has settled them (:func:`drop_merged`).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import layout
from .kept import kept
from .lock import slot_safe
from .refusals import REDIS_ERRORS
from .server import LockServer

PUBLISH = """
-- KEYS[1] lock, KEYS[2] line, KEYS[3] waiters, KEYS[4] publish mark; ARGV[1] the new call's
-- task id, ARGV[2] the mark's ttl ms, ARGV[3..] calls known to have ended (passed over: a mark,
-- waiter or lock that names one was left by a delete or release that could not reach Redis).
-- Returns {1, id} a call is published and not started, {2, id} one waits in line (the last),
-- {3, id} one runs: join that one. Else the mark is set for ARGV[1] and {0} returned: publish.
local ended = {}
for i = 3, #ARGV do ended[ARGV[i]] = true end
local mark = redis.call('GET', KEYS[4])
if mark then
  if not ended[mark] then return {1, mark} end
  redis.call('DEL', KEYS[4])                                    -- it names a call that ended: it goes
end
local last = redis.call('LINDEX', KEYS[2], -1)
local rec = last and redis.call('HGET', KEYS[3], last)
if rec then
  local kind, owner = string.match(rec, '^(.).\\n%d+\\n%d+\\n([^\\n]*)\\n')
  if kind ~= 'p' and owner and owner ~= '' and not ended[owner] then return {2, owner} end  -- a task
end
local held = redis.call('GET', KEYS[1])
-- a lock or a reservation names its call; a cooldown ('=') runs nothing: publish
local meta = held and string.match(held, '^[^=]%S* %d+ (.*)$')
if meta then
  local ok, value = pcall(cjson.decode, meta)
  if ok and type(value) == 'table' and type(value.owner) == 'string' and value.owner ~= ''
      and not ended[value.owner] then
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

TAKE_MERGED = """
-- KEYS[1] the calls merged into a waiter (each "<task id>\\n<message>", oldest first), KEYS[2] the
-- lock; ARGV[1] '' to read them (the messages), '1' to delete them (settled: a redelivery of one
-- stays merged until LOCK:mo:<id> expires), '2' to delete them and where they went (sent again),
-- '3' to read them and delete them and where they went, in one call (taken, to be sent again: two
-- workers that both take them get them once between them).
-- (0.2 kept a call's id alone there, its message in LOCK:mm:<owner>: still read, so that calls
-- merged before an upgrade are not lost)
local before = KEYS[2] .. ':mm:' .. string.sub(KEYS[1], #KEYS[2] + 4)
local calls = redis.call('LRANGE', KEYS[1], 0, -1)
local out = {}
for _, call in ipairs(calls) do
  local at = string.find(call, '\\n', 1, true)
  local id, message = call, nil
  if at then id, message = string.sub(call, 1, at - 1), string.sub(call, at + 1)
  else message = redis.call('HGET', before, call) end
  if ARGV[1] == '2' or ARGV[1] == '3' then redis.call('DEL', KEYS[2] .. ':mo:' .. id) end
  if message then out[#out + 1] = message end
end
if ARGV[1] ~= '' then redis.call('DEL', KEYS[1], before) end
if ARGV[1] == '1' or ARGV[1] == '2' then return #calls end
return out
"""

JOINED = {1: "queued", 2: "waiting", 3: "running"}


@dataclass(frozen=True)
class Pending:
    """The call a publish found for its key: ``task_id``, and whether it is queued, waiting or running."""

    task_id: str
    state: str


def mark(server: LockServer, name: str, task_id: str, ttl_ms: int, ended: tuple[str, ...] = ()) -> Pending | None:
    """Mark ``task_id`` as the key's published call, unless the key has one: then that one. The calls
    in ``ended`` are passed over (the caller knows they ended: what names them was left behind)."""
    key = slot_safe(name)
    reply = server.run(PUBLISH, (key, layout.line(key), layout.waiters(key), layout.publish_mark(key)),
                       (task_id, ttl_ms, *ended))
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
    except REDIS_ERRORS as exc:
        raise server.error(exc, key) from exc


def unmark(server: LockServer, name: str, task_id: str) -> bool:
    """Delete the key's publish mark if it is ``task_id``'s (its delivery started, or it was revoked)."""
    key = slot_safe(name)
    return int(server.run(UNMARK, (layout.publish_mark(key),), (task_id,))) == 1


def merged_calls(server: LockServer, name: str, owner: str) -> list[bytes]:
    """The parked messages of the calls merged into waiting task ``owner``, oldest first."""
    key = slot_safe(name)
    return [bytes(m) for m in server.run(TAKE_MERGED, (layout.merged(key, owner), key), ("",))]


def take_merged(server: LockServer, name: str, owner: str, request_id: str = "") -> list[bytes]:
    """The parked messages of the calls merged into ``owner``, oldest first, forgotten in the same call
    (with where they went): for sending them again, by whichever process takes them first.
    ``request_id``: see :func:`.kept.tried` (a take whose answer was lost, asked again, answers as it did)."""
    key = slot_safe(name)
    return [bytes(m) for m in server.run(TAKE_MERGED, (layout.merged(key, owner), key), ("3",),
                                         request_id=request_id)]


def drop_merged(server: LockServer, name: str, owner: str, *, sent_again: bool = False, request_id: str = "") -> None:
    """Forget the calls merged into ``owner``: its run has settled them, or (``sent_again``) they were
    published again as they were, and a copy of one must not find itself merged still.
    ``request_id``: see :func:`.kept.tried`."""
    key = slot_safe(name)
    server.run(TAKE_MERGED, (layout.merged(key, owner), key), ("2" if sent_again else "1",), request_id=request_id)

# Each call of these is safe to send twice: its reply is kept under its request id (engine/kept.py).
PUBLISH, UNMARK, TAKE_MERGED = map(kept, (PUBLISH, UNMARK, TAKE_MERGED))
