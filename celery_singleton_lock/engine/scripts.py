"""The Lua scripts of one lock: take it, release it (passing the key on), renew it.
The waiting line's own scripts (park, sweep, leave...) are in :mod:`.line_scripts`.

Where each key lives and what its records hold is :mod:`celery_singleton_lock.engine.layout`
(the one place that knows the layout); the scripts' keys follow it: ``KEYS`` lock, line,
waiters, done (``layout.lock_keys``).
"""

from __future__ import annotations

from typing import Any

from .fresh import FRESH_ACQUIRE, FRESH_RELEASE
from .kept import as_is, kept

# Shared by every script of one lock. KEYS: lock, line, waiters, done.
_KEYS = """
local LOCK, LINE, WAITERS, DONE = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
-- the server clock in ms (and the raw TIME reply, for microseconds)
local function clock()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), t
end
-- a new holder's fencing token: the server clock in microseconds (a raw TIME reply)
local function fence_of(t)
  return string.format('%.0f', tonumber(t[1]) * 1000000 + tonumber(t[2]))
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
local presend = false                                           -- RELEASE: send the next one ahead
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
    elseif kind == 'p' and redis.call('EXISTS', LOCK .. ':b:' .. e) == 0 then
      -- plain code whose mark ran out: it stopped renewing it (it died): it leaves
      redis.call('LPOP', LINE)
      gone(e)
    else
      local reserved = cjson.encode({owner = owner, reserved = true, by = handed_by})
      redis.call('SET', LOCK, '~' .. e .. ' 0 ' .. reserved, 'PX', ttl)
      if state == 'p' and redis.call('DEL', LOCK .. ':b:' .. e) == 1 then
        -- a task still waiting in its worker slot, or plain code (its mark lived): woken there to
        -- claim the key reserved for it, its mark gone (nothing to send; if a task never claims, the
        -- reservation runs out and SWEEP sends its message, as for any parked task)
        redis.call('RPUSH', LOCK .. ':wake:' .. e, '1')
        redis.call('PEXPIRE', LOCK .. ':wake:' .. e, ttl)
      elseif state == 'n' then
        -- its message went ahead of its turn (see presend): the key waits for that copy
        redis.call('HSET', WAITERS, e, kind .. 'c' .. string.sub(rec, 3))
      else
        redis.call('HSET', WAITERS, e, kind .. 'h' .. string.sub(rec, 3))
        out[#out + 1] = {'run', e, rec}
      end
      if presend then
        -- a short hold (RELEASE sets presend): the next task in line is sent now, to wait for its
        -- turn in a worker slot, woken there by the next release rather than sent by it
        local n = redis.call('LINDEX', LINE, 1)
        local nrec = n and redis.call('HGET', WAITERS, n)
        if nrec and string.sub(nrec, 1, 2) == 'tp' and redis.call('EXISTS', LOCK .. ':b:' .. n) == 0 then
          redis.call('HSET', WAITERS, n, 'tn' .. string.sub(nrec, 3))
          out[#out + 1] = {'next', n, nrec}
        end
      end
      return out
    end
  end
end
"""

ACQUIRE = _HAND_OFF + """
-- ARGV[1] token, ARGV[2] metadata (JSON), ARGV[3] ttl ms, ARGV[4] owner id,
-- ARGV[5] entry id when a waiter claims its turn ('' otherwise),
-- ARGV[6] the token of an earlier attempt whose reply was lost ('' none),
-- ARGV[7] '1' to drop the owner if it already succeeded here (a redelivery),
-- ARGV[8] '1' when the entry's first delivery claims from its worker slot (see below).
-- (A fresh delivery sends three arguments, and is answered ahead of this: fresh.FRESH_ACQUIRE.)
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
    local fence = string.match(held, '^%S+ (%d+)')
    -- ours since the lost reply. Taken back under the NEW token: a second message
    -- carrying the old one (a redelivery of the re-send) finds it held
    redis.call('SET', LOCK, ARGV[1] .. ' ' .. fence .. ' ' .. ARGV[2], 'PX', ARGV[3])
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
      local kind = parse(rec)
      if kind ~= 'p' or redis.call('EXISTS', LOCK .. ':b:' .. head) == 1 then break end  -- a live waiter ahead
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
  redis.call('LREM', LINE, 1, entry)
  redis.call('DEL', LOCK .. ':b:' .. entry)
  if ARGV[8] == '1' then
    -- the entry's first delivery claims from its slot and runs there: no tombstone, so a broker
    -- redelivery of that delivery is met as a fresh task's is (held by its own task, or free). (A copy
    -- leaves one: the process that parked the entry first looks for it.)
    redis.call('HDEL', WAITERS, entry)
  else
    gone(entry)
  end
end
local fence = fence_of(t)
redis.call('SET', LOCK, ARGV[1] .. ' ' .. fence .. ' ' .. ARGV[2], 'PX', ARGV[3])
return {1, fence}
"""

RELEASE = _HAND_OFF + """
-- ARGV[1] "<token> ", ARGV[2] owner id, ARGV[3] '1' if the holder succeeded,
-- ARGV[4] ms to remember that success ('0': not needed), ARGV[5] what the body
-- returned, serialised ('' none), ARGV[6] '1' when this is a retry of a release
-- whose first try may have run (its reply was lost), ARGV[7] the holder's retry
-- count (its redelivered copy, if parked, is entry 't' .. sha1 of owner, newline, retries),
-- ARGV[8] ms of cooldown ('0' none): the key stays taken that long, by nobody,
-- ARGV[9] '1' when the hold was short (the client measured it against lock_wait_in_slot): the task
-- second in line is sent ahead of its turn (state 'n'), to wait for it in a worker slot.
-- (A fresh lock's release sends one argument, and is answered ahead of this: fresh.FRESH_RELEASE.)
-- Returns {deleted, hand-offs...}: deleted 1 it was ours, 0 it was gone already, -1 another holds it.
-- The key passes to the next waiter here, or, after a cooldown, through the sweeper once the cooldown
-- has run out.
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
      if rec and string.sub(rec, 2, 2) == 'h' then return {1, {'run', e, rec}} end  -- ('p': woken, not sent)
      return {1}
    end
    local cool = string.match(held, '^= %d+ (.*)$')
    if ARGV[6] == '1' and cool and cjson.decode(cool).owner == ARGV[2] then return {1} end  -- our first try's cooldown
    return {-1}
  end
  deleted = 1
  if (ARGV[8] or '0') ~= '0' then
    -- a cooldown: the key stays taken by nobody ('=' is no token), its fence kept, until it expires
    local fence = string.match(held, '^%S+ (%d+)') or '0'
    local cool = cjson.encode({owner = ARGV[2], cooldown = true})
    redis.call('SET', LOCK, '= ' .. fence .. ' ' .. cool, 'PX', ARGV[8])
  else
    redis.call('DEL', LOCK)
  end
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
if redis.call('EXISTS', LOCK) == 1 then return {deleted} end  -- a cooldown: the sweeper hands it on after
presend = deleted == 1 and ARGV[9] == '1'  -- a short hold (the holder measured it): send the next ahead
return hand_off(now, drop, {deleted})
"""

RENEW_MANY = """
-- KEYS[i] lock keys; ARGV[2i-1] the i-th key's "<token> " prefix, ARGV[2i] its ttl ms
-- (side by side: the watchdog packs each lock's pair once, see wire.pack_renewals).
-- Sets each ttl (replaces it, does not add) while the token still holds it.
-- Returns ONE string, a character per key: '1' renewed, '0' not the owner (gone or
-- taken); a 500-element array would cost the client more to read than Redis to run.
local out = {}
for i = 1, #KEYS do
  local prefix = ARGV[2 * i - 1]
  local held = redis.call('GET', KEYS[i])
  if held and string.sub(held, 1, #prefix) == prefix then
    redis.call('PEXPIRE', KEYS[i], ARGV[2 * i])
    out[i] = '1'
  else
    out[i] = '0'
  end
end
return table.concat(out)
"""


def renewed(reply: Any) -> list[bool]:
    """RENEW_MANY's reply read: one flag per key, True renewed, False not the owner."""
    if isinstance(reply, str):  # a client that decodes replies
        reply = reply.encode()
    return [c == 49 for c in reply]  # b"1"


# Each call of these is safe to send twice (engine/kept.py): the changes keep their reply under the
# call's request id; the renewal only extends what its token still holds.
ACQUIRE = kept(ACQUIRE, ahead=FRESH_ACQUIRE)
RELEASE = kept(RELEASE, ahead=FRESH_RELEASE)
RENEW_MANY = as_is(RENEW_MANY)
