"""Operators' changes to a line: what a revoke and ``celery locks drop`` do to Redis.

A parked task has no message in any worker, so nothing in Celery can take it
out of the line by itself: :func:`remove` does, in one script on the key's
slot (every record of that task id goes; if the key was reserved for it, the
key passes to the next waiter at once, as a release would), or through the
backend's own line (etcd's), and :func:`remove_everywhere` looks for the task
id in every line that has waiters (the sweeper's index: one round trip per such
key). ``celery locks release`` is each backend's own ``force_release`` (on one
Redis: :meth:`.server.LockServer.force_release`). Engine code: it knows nothing of Celery;
:mod:`celery_singleton_lock.worker.revoke` and :mod:`celery_singleton_lock.ops` call it.
"""

from __future__ import annotations

from . import scripts
from .backend import LockBackend
from .kept import kept
from .line import own_line
from .lock import Handoff, slot_safe
from .refusals import REDIS_ERRORS
from .server import LockServer

REMOVE = scripts._HAND_OFF + """
-- ARGV[1] an owner id (a task id). Every waiter of that owner leaves the line:
-- parked, a redelivered copy, or one whose turn was handed (sent or not). If
-- the key was reserved for one of them, it passes to the next waiter here.
-- Plain code (kind p) is left alone: it leaves by itself. A call merged into a waiter
-- (on_duplicate="coalesce") leaves its merged calls. O(waiters).
-- Returns {removed, hand-offs...}.
local held = redis.call('GET', LOCK) or ''
local removed, reserved = 0, false
local into = redis.call('GET', LOCK .. ':mo:' .. ARGV[1])
if into then                                                    -- a merged call: "<task id>\\n<message>"
  local calls = LOCK .. ':m:' .. into
  for _, call in ipairs(redis.call('LRANGE', calls, 0, -1)) do
    if string.sub(call, 1, #ARGV[1] + 1) == ARGV[1] .. '\\n' or call == ARGV[1] then  -- (0.2: the id alone)
      removed = redis.call('LREM', calls, 1, call)
    end
  end
end
local flat = redis.call('HGETALL', WAITERS)
for i = 1, #flat, 2 do
  local e = flat[i]
  local kind, _, _, _, owner = parse(flat[i + 1])
  if owner == ARGV[1] and kind ~= 'p' then
    redis.call('LREM', LINE, 0, e)
    gone(e)
    removed = removed + 1
    if string.sub(held, 1, #e + 2) == '~' .. e .. ' ' then reserved = true end
  end
end
if not reserved then return {removed} end
redis.call('DEL', LOCK)
return hand_off(clock(), '', {removed})
"""


def remove(server: LockBackend, name: str, owner_id: str, request_id: str = "") -> tuple[int, tuple[Handoff, ...]]:
    """Take task ``owner_id`` out of ``name``'s line; (how many of its entries went, the hand-offs
    made, already sent through ``server.dispatch``). Callers ask ``supports_line`` first.
    ``request_id``: sent again with the one of a try whose answer was lost, it answers as that try
    did (see :mod:`.kept`)."""
    if not owner_id or "\n" in owner_id:
        raise ValueError(f"a task id must be a non-empty line of text, got {owner_id!r}")
    own = own_line(server)
    if own is not None:
        return own.drop(name, owner_id)
    assert isinstance(server, LockServer)
    key = slot_safe(name)
    reply = server.run(REMOVE, server.keys_for(key), (owner_id,), request_id=request_id)
    handoffs = tuple(Handoff.parse(key, item) for item in reply[1:])
    server.dispatch(handoffs)
    return int(reply[0]), handoffs


def remove_everywhere(server: LockServer, index: str, owner_id: str, request_id: str = "",
                      answered: dict[str, int | None] | None = None) -> list[str]:
    """Take task ``owner_id`` out of every line listed in the sweeper's ``index``; the keys it left.

    A look that fails part way is tried again with the same ``request_id`` and ``answered`` (each key's
    answer so far, filled in here; None: asked, no answer came): a key answered already is not asked
    again (its hand-offs were sent), and one whose answer was lost is asked again even if it has left
    the index since (a REMOVE that emptied its line lets a sweeper drop it), and answers as it did the
    first time (its REMOVE is kept)."""
    answered = {} if answered is None else answered
    try:
        listed = server.client.zrange(index, 0, -1)
    except REDIS_ERRORS as exc:
        raise server.error(exc, index) from exc
    unanswered = [key for key, removed in answered.items() if removed is None]
    for key in dict.fromkeys([*unanswered, *(k.decode() if isinstance(k, bytes) else str(k) for k in listed)]):
        if answered.get(key) is None:
            answered[key] = None  # asked: if no answer comes, a look tried again asks it again
            answered[key] = remove(server, key, owner_id, request_id)[0]
    return [key for key, removed in answered.items() if removed]


REMOVE = kept(REMOVE)  # safe to send twice: its reply is kept under its request id (engine/kept.py)
