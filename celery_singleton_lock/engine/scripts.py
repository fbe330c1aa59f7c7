"""The Lua scripts: every change to the lock and its waiting line is one of these.

Where each key lives and what its records hold is :mod:`celery_singleton_lock.engine.layout`
(the one place that knows the layout); the scripts' keys follow it: ``KEYS`` lock, line,
waiters, done (``layout.lock_keys``).
"""

from __future__ import annotations

from .fresh import ACQUIRE_FRESH as ACQUIRE_FRESH  # re-exported: the fresh delivery's ACQUIRE
from .fresh import FRESH_RELEASE

# Shared by every script of one lock. KEYS: lock, line, waiters, done.
_KEYS = """
local LOCK, LINE, WAITERS, DONE = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
-- the server clock in ms (and the raw TIME reply, for microseconds)
local function clock()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), t
end
-- A waiter leaves for good (it ran, timed out, gave up, was dropped): its record
-- goes, and a tombstone in LOCK:g says so for ten minutes, so a process that
-- remembers the entry tells "it left" from "it was lost with the data".
local function gone(e)
  redis.call('HDEL', WAITERS, e)
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  redis.call('ZADD', LOCK .. ':g', now, e)
  redis.call('ZREMRANGEBYSCORE', LOCK .. ':g', '-inf', now - 600000)
  redis.call('PEXPIRE', LOCK .. ':g', 600000)
end
-- A holder's value. While a waiting line exists it carries ',"line":1' in its metadata
-- (PARK adds it to the holder it parks behind), so RELEASE looks at the line only then.
local function holding(token, fence, meta)
  if redis.call('EXISTS', LINE) == 1 then meta = string.sub(meta, 1, -2) .. ',"line":1}' end
  return token .. ' ' .. fence .. ' ' .. meta
end
-- kind, state, deadline, ttl, owner of a waiter's record
local function parse(rec)
  local kind, state, deadline, ttl, owner = string.match(rec, '^(.)(.)\\n(%d+)\\n(%d+)\\n([^\\n]*)\\n')
  return kind, state, tonumber(deadline), ttl, owner
end
"""

# Shared by the scripts that pass the key on.
_HAND_OFF = _KEYS + """
-- Give the free key to the first waiter in line, reserved for it, so no
-- newcomer can take it first. On the way, drop copies of a task that just
-- succeeded (drop_owner) and waiters past their deadline (task ones are
-- returned as 'expired', for the caller to fail them). Appends
-- {what, entry, record} to out and returns it.
local handed_by = ''                                            -- RELEASE: the releasing token
local function hand_off(now, drop_owner, out)
  while true do
    local e = redis.call('LINDEX', LINE, 0)
    if not e then return out end
    local rec = redis.call('HGET', WAITERS, e)
    local kind, state, deadline, ttl, owner
    if rec then kind, state, deadline, ttl, owner = parse(rec) end
    if not rec then
      redis.call('LPOP', LINE)                                  -- it left the line already
    elseif state == 'c' then
      -- handed and sent, but not claimed in time: it keeps its record and claims when it comes
      redis.call('LPOP', LINE)
    elseif kind == 's' and owner == drop_owner then             -- a copy of the task that just succeeded: dropped
      redis.call('LPOP', LINE)
      gone(e)
    elseif deadline <= now then
      redis.call('LPOP', LINE)
      gone(e)
      if kind == 't' then out[#out + 1] = {'expired', e, rec} end
    else
      local reserved = cjson.encode({owner = owner, reserved = true, by = handed_by})
      redis.call('SET', LOCK, '~' .. e .. ' 0 ' .. reserved, 'PX', ttl)
      redis.call('HSET', WAITERS, e, kind .. 'h' .. string.sub(rec, 3))
      if kind == 'p' then
        redis.call('RPUSH', LOCK .. ':wake:' .. e, '1')
        redis.call('PEXPIRE', LOCK .. ':wake:' .. e, ttl)
      end
      out[#out + 1] = {'run', e, rec}
      return out
    end
  end
end
"""

ACQUIRE = _KEYS + """
-- ARGV[1] token, ARGV[2] metadata (JSON), ARGV[3] ttl ms, ARGV[4] owner id,
-- ARGV[5] entry id when a waiter claims its turn ('' otherwise),
-- ARGV[6] the token of an earlier attempt whose reply was lost ('' none),
-- ARGV[7] '1' to drop the owner if it already succeeded here (a redelivery).
-- (A fresh delivery runs ACQUIRE_FRESH instead.)
-- Returns {1, fence} taken; {0, value, pttl} held (value '' and pttl -2: free,
-- but waiters are in line); {2, value or nil} already succeeded (value: what
-- its body returned, if recorded); {3} the entry is gone.
local now, t = clock()
if ARGV[7] == '1' then
  local until_ms = redis.call('ZSCORE', DONE, ARGV[4])
  if until_ms and tonumber(until_ms) > now then return {2, redis.call('GET', DONE .. ':' .. ARGV[4])} end
end
local entry = ARGV[5]
local held = redis.call('GET', LOCK)
if held then
  local old = ARGV[6]
  if old ~= '' and string.sub(held, 1, #old + 1) == old .. ' ' then
    -- ours since the lost reply. Taken back under the NEW token: a second message
    -- carrying the old one (a redelivery of the re-send) finds it held
    local fence = string.match(held, '^%S+ (%d+)')
    redis.call('SET', LOCK, holding(ARGV[1], fence, ARGV[2]), 'PX', ARGV[3])
    return {1, fence}
  end
  if entry ~= '' and redis.call('HEXISTS', WAITERS, entry) == 0 then return {3} end
  if entry == '' or string.sub(held, 1, #entry + 2) ~= '~' .. entry .. ' ' then
    return {0, held, redis.call('PTTL', LOCK)}
  end
elseif entry ~= '' then
  if redis.call('HEXISTS', WAITERS, entry) == 0 then return {3} end
  -- its reservation ran out: it may still go if nobody live is ahead of it
  local head = redis.call('LINDEX', LINE, 0)
  while head and head ~= entry do
    local rec = redis.call('HGET', WAITERS, head)
    if rec then
      local kind, state, deadline = parse(rec)
      if kind ~= 'p' or deadline > now then break end           -- a live waiter ahead
    end
    redis.call('LPOP', LINE)                                    -- a dead plain waiter
    redis.call('HDEL', WAITERS, head)
    head = redis.call('LINDEX', LINE, 0)
  end
  -- a live waiter ahead, or, for a copy whose turn passed on while it travelled, a live waiter at all
  if head and head ~= entry then return {0, '', -2} end
elseif redis.call('EXISTS', LINE) == 1 then
  return {0, '', -2}                                            -- nobody jumps the line
end
if entry ~= '' then
  gone(entry)
  redis.call('LREM', LINE, 1, entry)
end
local fence = string.format('%.0f', tonumber(t[1]) * 1000000 + tonumber(t[2]))
redis.call('SET', LOCK, holding(ARGV[1], fence, ARGV[2]), 'PX', ARGV[3])
return {1, fence}
"""

RELEASE = FRESH_RELEASE + _HAND_OFF + """
-- ARGV[1] "<token> ", ARGV[2] owner id, ARGV[3] '1' if the holder succeeded,
-- ARGV[4] ms to remember that success ('0': not needed), ARGV[5] what the body
-- returned, serialised ('' none), ARGV[6] '1' when this is a retry of a release
-- whose first try may have run (its reply was lost), ARGV[7] the holder's retry
-- count (its redelivered copy, if parked, is entry 't' .. sha1 of owner, newline, retries).
-- Returns {deleted, hand-offs...} (or a bare 1: deleted, nothing else to do): deleted 1 it was ours, 0 it was gone
-- already, -1 another holds it. The key passes to the next waiter here.
handed_by = string.sub(ARGV[1], 1, -2)
local held = redis.call('GET', LOCK)
local deleted = 0
if held then
  if string.sub(held, 1, #ARGV[1]) ~= ARGV[1] then
    local e, meta = string.match(held, '^~(%S+) %d+ (.*)$')
    if ARGV[6] == '1' and e and cjson.decode(meta).by == handed_by then
      -- our first try ran and handed the key on, its reply lost: it was ours, and
      -- the waiter it was handed to is sent now rather than after the reservation
      local rec = redis.call('HGET', WAITERS, e)
      if rec and string.sub(rec, 2, 2) == 'h' then return {1, {'run', e, rec}} end
      return {1}
    end
    return {-1}
  end
  redis.call('DEL', LOCK)
  deleted = 1
end
local now = 0
if ARGV[3] == '1' and ARGV[4] ~= '0' then
  now = clock()
  redis.call('ZADD', DONE, now + tonumber(ARGV[4]), ARGV[2])
  redis.call('ZREMRANGEBYSCORE', DONE, '-inf', now)
  redis.call('PEXPIRE', DONE, ARGV[4])
  if (ARGV[5] or '') ~= '' then redis.call('SET', DONE .. ':' .. ARGV[2], ARGV[5], 'PX', ARGV[4]) end
end
if redis.call('EXISTS', LINE) == 0 then return {deleted} end
if now == 0 then now = clock() end
local drop = ''
if ARGV[3] == '1' then
  drop = ARGV[2]
  -- its redelivered copy goes wherever it stands in the line, not only at the head
  local mine = 't' .. redis.sha1hex(ARGV[2] .. '\\n' .. (ARGV[7] or '0'))
  local rec = redis.call('HGET', WAITERS, mine)
  if rec and string.sub(rec, 1, 1) == 's' then
    redis.call('LREM', LINE, 0, mine)
    gone(mine)
  end
end
return hand_off(now, drop, {deleted})
"""

RENEW_MANY = """
-- KEYS[i] lock keys; ARGV[i] their "<token> " prefixes, ARGV[#KEYS+i] ttls ms
-- Sets each ttl (replaces it, does not add) while the token still holds it.
-- Returns one entry per key: 1 renewed, 0 not the owner (gone or taken).
local out = {}
local n = #KEYS
for i = 1, n do
  local held = redis.call('GET', KEYS[i])
  if held and string.sub(held, 1, #ARGV[i]) == ARGV[i] then
    redis.call('PEXPIRE', KEYS[i], ARGV[n + i])
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
"""

PARK = _KEYS + """
-- ARGV[1] entry id, ARGV[2] kind (t, s or p), ARGV[3] longest wait ms,
-- ARGV[4] lock ttl ms, ARGV[5] owner id, ARGV[6] message, ARGV[7] '1' to go first,
-- ARGV[8] '1' when the caller is the copy of this entry (it may park it again),
-- ARGV[9] '1' for a broker redelivery: if the entry left for good (a tombstone),
-- its turn was taken already and {3} is returned (nothing parked).
-- Returns {0} when the key is free and nobody waits (take it instead),
-- {2, place (0: out of line, its copy on its way)} when the entry is parked
-- already (a task's entry id comes from its task id: a redelivery of a parked
-- message must not park it twice), else {1, place in line}.
if ARGV[9] == '1' and ARGV[8] ~= '1' and redis.call('ZSCORE', LOCK .. ':g', ARGV[1]) then return {3} end
if ARGV[8] ~= '1' and redis.call('HEXISTS', WAITERS, ARGV[1]) == 1 then
  return {2, (redis.call('LPOS', LINE, ARGV[1]) or -1) + 1}
end
local held = redis.call('GET', LOCK)
if not held and redis.call('EXISTS', LINE) == 0 then return {0} end
-- a holder (not a reservation) is flagged: its RELEASE must look at the line (see holding())
if held and string.sub(held, 1, 1) ~= '~' and string.sub(held, -10) ~= ',"line":1}' then
  redis.call('SET', LOCK, string.sub(held, 1, -2) .. ',"line":1}', 'KEEPTTL')
end
local now = clock()
local wait = tonumber(ARGV[3])
local rec = ARGV[2] .. 'p\\n' .. string.format('%.0f', now + wait) .. '\\n'
  .. ARGV[4] .. '\\n' .. ARGV[5] .. '\\n' .. ARGV[6]
redis.call('HSET', WAITERS, ARGV[1], rec)
redis.call('LREM', LINE, 1, ARGV[1])
local place = 1
if ARGV[7] == '1' then
  redis.call('LPUSH', LINE, ARGV[1])
else
  place = redis.call('RPUSH', LINE, ARGV[1])
end
-- the line outlives its last waiter's deadline by a minute, and no longer
local keep = wait + 60000
for _, key in ipairs({WAITERS, LINE}) do
  if redis.call('PTTL', key) < keep then redis.call('PEXPIRE', key, keep) end
end
return {1, place}
"""

TOUCH = _KEYS + """
-- ARGV[1] entry id, ARGV[2] lease ms. A plain waiter (held(..., wait=...)) is
-- alive: its record's deadline moves to now + lease, so one that died leaves the
-- line within its lease, not its whole wait. Returns 1, or 0 if it is gone.
local rec = redis.call('HGET', WAITERS, ARGV[1])
if not rec then return 0 end
local head, rest = string.match(rec, '^(..)\\n%d+\\n(.*)$')
local until_ms = string.format('%.0f', clock() + tonumber(ARGV[2]))
redis.call('HSET', WAITERS, ARGV[1], head .. '\\n' .. until_ms .. '\\n' .. rest)
local keep = tonumber(ARGV[2]) + 60000                          -- as PARK: the line outlives it
for _, key in ipairs({WAITERS, LINE}) do
  if redis.call('PTTL', key) < keep then redis.call('PEXPIRE', key, keep) end
end
return 1
"""

SWEEP = _HAND_OFF + """
-- For the sweeper: pass the key on if its holder died or a reservation ran
-- out (a turn never sent, or sent longer ago than the turn timeout), and time
-- out EVERY waiter past its deadline, wherever it stands (also one whose turn
-- passed on while its copy was on its way), except the one the key is
-- reserved for: its turn came. O(waiters) per look.
-- Returns {next look (ms; 0: nobody waits), hand-offs...}.
if redis.call('EXISTS', LINE) == 0 and redis.call('EXISTS', WAITERS) == 0 then return {0} end
local now = clock()
local out = {0}
if redis.call('PTTL', LOCK) < 0 then out = hand_off(now, '', out) end
local held = redis.call('GET', LOCK) or ''
local pttl = redis.call('PTTL', LOCK)
local soonest = now + 1000
if pttl > 0 then soonest = now + pttl end
local flat = redis.call('HGETALL', WAITERS)
for i = 1, #flat, 2 do
  local e, rec = flat[i], flat[i + 1]
  local kind, state, deadline = parse(rec)
  if string.sub(held, 1, #e + 2) ~= '~' .. e .. ' ' then
    if deadline <= now then
      redis.call('LREM', LINE, 1, e)
      gone(e)
      if kind == 't' then out[#out + 1] = {'expired', e, rec} end
    elseif deadline < soonest then
      soonest = deadline
    end
  end
end
if redis.call('EXISTS', WAITERS) == 0 then
  redis.call('DEL', LINE)
  out[1] = 0
else
  out[1] = soonest
end
return out
"""

CONFIRM = """
-- KEYS[1] lock, KEYS[2] waiters; ARGV[1] entry id, ARGV[2] turn timeout ms.
-- The hand-off's message was sent: the sweeper must not send it again, and the
-- key stays reserved for it until it arrives, however deep the queue, up to
-- the turn timeout (a purged queue must not block the key forever). Its record
-- lives at least as long. Returns 1 marked, 0 no such handed entry.
local rec = redis.call('HGET', KEYS[2], ARGV[1])
if not rec or string.sub(rec, 2, 2) ~= 'h' then return 0 end
redis.call('HSET', KEYS[2], ARGV[1], string.sub(rec, 1, 1) .. 'c' .. string.sub(rec, 3))
local turn = tonumber(ARGV[2])
local held = redis.call('GET', KEYS[1])
if held and string.sub(held, 1, #ARGV[1] + 2) == '~' .. ARGV[1] .. ' ' and redis.call('PTTL', KEYS[1]) < turn then
  redis.call('PEXPIRE', KEYS[1], turn)
end
if redis.call('PTTL', KEYS[2]) < turn + 60000 then redis.call('PEXPIRE', KEYS[2], turn + 60000) end
return 1
"""

LEAVE = _HAND_OFF + """
-- ARGV[1] entry id: a waiter gives up. If the key was already reserved for
-- it, the key goes to the next in line. Returns {was reserved (1/0), hand-offs...}.
redis.call('LREM', LINE, 1, ARGV[1])
gone(ARGV[1])
redis.call('DEL', LOCK .. ':wake:' .. ARGV[1])
local held = redis.call('GET', LOCK)
if not held or string.sub(held, 1, #ARGV[1] + 2) ~= '~' .. ARGV[1] .. ' ' then return {0} end
redis.call('DEL', LOCK)
return hand_off(clock(), '', {1})
"""

INDEX_ADD = """
-- KEYS[1] the waiting index; ARGV[1] a lock key with waiters: look at it now.
local t = redis.call('TIME')
redis.call('ZADD', KEYS[1], tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), ARGV[1])
return 1
"""

INDEX_DUE = """
-- KEYS[1] the waiting index, KEYS[2] its epoch; ARGV[1] how many, ARGV[2] lease ms,
-- ARGV[3] a new epoch value, used if none is set (the data was lost, or first use).
-- Lends the keys that are due to this sweeper: other sweepers skip them until
-- the lease ends. Returns {epoch, lease score, keys...}.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('SET', KEYS[2], ARGV[3], 'NX')
local out = {redis.call('GET', KEYS[2]), string.format('%.0f', now + tonumber(ARGV[2]))}
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
for _, key in ipairs(due) do
  redis.call('ZADD', KEYS[1], out[2], key)
  out[#out + 1] = key
end
return out
"""

INDEX_DONE = """
-- KEYS[1] the waiting index; ARGV[1] the lease score; then pairs (key, next ms;
-- 0 to drop it). A key parked on since the lease (its score changed) is left alone.
for i = 2, #ARGV, 2 do
  if redis.call('ZSCORE', KEYS[1], ARGV[i]) == ARGV[1] then
    if ARGV[i + 1] == '0' then
      redis.call('ZREM', KEYS[1], ARGV[i])
    else
      redis.call('ZADD', KEYS[1], ARGV[i + 1], ARGV[i])
    end
  end
end
return 1
"""

FORCE_RELEASE = _HAND_OFF + """
-- For operators (`celery locks release`): delete the lock whoever holds it, then
-- pass the key to the next waiter exactly as RELEASE does.
-- ARGV[1] the value's expected start (the holder's "<token> " the operator was
-- shown), or '' for whoever holds it now.
-- Returns {deleted, value, hand-offs...}: deleted 1 (value: what was deleted),
-- 0 there was no lock, -1 another holder took it since it was shown (nothing done).
local held = redis.call('GET', LOCK)
local deleted = 0
if held then
  if ARGV[1] ~= '' and string.sub(held, 1, #ARGV[1]) ~= ARGV[1] then return {-1, held} end
  redis.call('DEL', LOCK)
  deleted = 1
end
if redis.call('EXISTS', LINE) == 0 then return {deleted, held or ''} end
return hand_off(clock(), '', {deleted, held or ''})
"""

# -- quorum mode (quorum.py): the same lock value on each of N independent masters ------------------
