"""The Lua scripts of the waiting line: park, wait in a worker slot, leave, sweep, and the sweepers'
index. They share :mod:`.scripts`' prelude (``_KEYS``: lock, line, waiters, done) and its hand-off
(``_HAND_OFF``, the one way the key passes to the next waiter).
"""

from __future__ import annotations

from .kept import as_is, kept
from .scripts import _HAND_OFF, _KEYS

PARK = _KEYS + """
-- ARGV[1] entry id, ARGV[2] kind (t, s or p), ARGV[3] longest wait ms,
-- ARGV[4] lock ttl ms, ARGV[5] owner id, ARGV[6] message, ARGV[7] '1' to go first,
-- ARGV[8] '1' when the caller is the copy of this entry (it may park it again),
-- ARGV[9] '1' for a broker redelivery: if the entry left for good (a tombstone),
-- its turn was taken already and {3} is returned (nothing parked).
-- ARGV[10] '1' to merge instead (on_duplicate="coalesce"): if the last in line is a parked task,
-- the call joins that waiter's merged calls (LOCK:m:<its owner>; LOCK:mo:<task id> says where it
-- went, so it joins once) and {4, entry, owner} is returned.
-- ARGV[11] ms the task waits in its worker slot ('0' none): its mark LOCK:b:<entry> lives that long;
-- a hand-off meanwhile wakes it there (LOCK:wake:<entry>) instead of sending its message. Plain code
-- (kind p) always has a mark, which it renews while it waits: a plain waiter whose mark ran out died.
-- Returns {0} when the key is free and nobody waits (take it instead), {5} when the key is reserved
-- for this entry (its copy, ARGV[8]: claim it),
-- {2, place (0: out of line, its copy on its way)} when the entry is parked
-- already (a task's entry id comes from its task id: a redelivery of a parked
-- message must not park it twice), else {1, place in line}.
local kind, first = ARGV[2], ARGV[7]
if ARGV[9] == '1' and ARGV[8] ~= '1' and redis.call('ZSCORE', LOCK .. ':g', ARGV[1]) then
  return {3}  -- its turn was taken already (a claim in a worker slot leaves no tombstone)
end
if ARGV[10] == '1' then
  -- a redelivery of a call merged already: it stays merged (its waiter's run covers it, or did)
  local into = redis.call('GET', LOCK .. ':mo:' .. ARGV[5])
  if into then return {4, '', into} end
end
if ARGV[8] ~= '1' and redis.call('HEXISTS', WAITERS, ARGV[1]) == 1 then
  return {2, (redis.call('LPOS', LINE, ARGV[1]) or -1) + 1}
end
local held = redis.call('GET', LOCK)
if ARGV[8] == '1' and held and string.sub(held, 1, #ARGV[1] + 2) == '~' .. ARGV[1] .. ' ' then
  -- the entry's own copy, and the key was handed to it since it looked: it claims it (parking
  -- again would leave the key reserved for nobody who waits for it)
  return {5}
end
if not held and redis.call('EXISTS', LINE) == 0 then return {0} end
local now = clock()
if ARGV[10] == '1' then
  local last = redis.call('LINDEX', LINE, -1)
  local rec = last and redis.call('HGET', WAITERS, last)
  if rec then
    local kind, state, deadline, _, owner = parse(rec)
    -- parked, its turn not come, and not waiting in its worker slot (a run there takes no merged calls)
    if kind == 't' and state == 'p' and owner ~= ARGV[5] and redis.call('EXISTS', LOCK .. ':b:' .. last) == 0
        and string.sub(held or '', 1, #last + 2) ~= '~' .. last .. ' ' then
      -- LOCK:m:<owner>: the merged calls in order, each "<task id>\\n<message>"
      local calls = LOCK .. ':m:' .. owner
      redis.call('RPUSH', calls, ARGV[5] .. '\\n' .. ARGV[6])
      -- kept past the waiter's deadline and any reservation of its turn (turn timeout)
      local keep = math.max(deadline - now, 0) + 600000
      redis.call('SET', LOCK .. ':mo:' .. ARGV[5], owner, 'PX', keep)
      redis.call('PEXPIRE', calls, keep)
      redis.call('PEXPIRE', LOCK .. ':mm:' .. owner, keep)  -- (0.2 kept the messages of its merges there)
      return {4, last, owner}
    end
  end
end
local wait = tonumber(ARGV[3])
if (ARGV[11] or '0') ~= '0' then
  redis.call('SET', LOCK .. ':b:' .. ARGV[1], '1', 'PX', ARGV[11])
  redis.call('DEL', LOCK .. ':wake:' .. ARGV[1])  -- (a wake-up left from an earlier hand-off is not this one's)
end
local rec = kind .. 'p\\n' .. string.format('%.0f', now + wait) .. '\\n'
  .. ARGV[4] .. '\\n' .. ARGV[5] .. '\\n' .. ARGV[6]
redis.call('HSET', WAITERS, ARGV[1], rec)
redis.call('LREM', LINE, 1, ARGV[1])
local place = 1
if first == '1' then
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

SWEEP = _HAND_OFF + """
-- For the sweeper: pass the key on if its holder died or a reservation ran
-- out (a turn never sent, or sent longer ago than the turn timeout), and time
-- out EVERY waiter past its deadline, wherever it stands (also one whose turn
-- passed on while its copy was on its way), except the one the key is
-- reserved for: its turn came; and plain code whose mark ran out (it died). O(waiters) per look.
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
    if deadline <= now or (kind == 'p' and redis.call('EXISTS', LOCK .. ':b:' .. e) == 0) then
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

UNBLOCK = _KEYS + """
-- ARGV[1] entry id: a task that waited in its worker slot stops waiting there (see PARK's ARGV[11]).
-- Returns 1 parked now (its message is sent when its turn comes), 2 it was woken: the key is reserved
-- for it, claim it now, 0 its turn came as a message (or it left the line): this delivery ends;
-- -1 no record and no tombstone (never parked, or lost with the data).
redis.call('DEL', LOCK .. ':b:' .. ARGV[1], LOCK .. ':wake:' .. ARGV[1])
local rec = redis.call('HGET', WAITERS, ARGV[1])
if not rec then return redis.call('ZSCORE', LOCK .. ':g', ARGV[1]) and 0 or -1 end
if string.sub(rec, 2, 2) ~= 'p' then return 0 end
-- still parked: woken if the key is reserved for it (a hand-off reserves it and sends nothing)
local held = redis.call('GET', LOCK)
if held and string.sub(held, 1, #ARGV[1] + 2) == '~' .. ARGV[1] .. ' ' then return 2 end
return 1
"""

CONFIRM = """
-- KEYS[1] lock, KEYS[2] waiters; ARGV[1] entry id, ARGV[2] turn timeout ms.
-- The hand-off's message was sent: the sweeper must not send it again, and the
-- key stays reserved for it until it arrives, however deep the queue, up to
-- the turn timeout (a purged queue must not block the key forever). Its record
-- lives at least as long. Returns 1 marked (or marked already: this call sent twice), 0 no such
-- handed entry.
local rec = redis.call('HGET', KEYS[2], ARGV[1])
if not rec or (string.sub(rec, 2, 2) ~= 'h' and string.sub(rec, 2, 2) ~= 'c') then return 0 end
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
-- Waiters leave the line for good. ARGV[1] an entry id: that waiter (it gave up). Or ARGV[1] '' and
-- ARGV[2] an owner id (a task id: a revoke, `celery locks drop`): every waiter of that task, parked,
-- a redelivered copy, or one whose turn was handed (sent or not), and the calls merged into a
-- waiter (on_duplicate="coalesce"); plain code (kind p) is left alone, it leaves by itself.
-- O(1) by entry, O(waiters) by owner. If the key was reserved for one that left, it passes to the
-- next waiter here. Returns {how many left, 1 if the key was reserved for one of them, hand-offs...}.
local held = redis.call('GET', LOCK) or ''
local left, reserved = 0, 0
local function leave(e)
  redis.call('LREM', LINE, 0, e)
  gone(e)
  redis.call('DEL', LOCK .. ':wake:' .. e)
  left = left + 1
  if string.sub(held, 1, #e + 2) == '~' .. e .. ' ' then reserved = 1 end
end
if ARGV[1] ~= '' then
  leave(ARGV[1])
else
  local into = redis.call('GET', LOCK .. ':mo:' .. ARGV[2])
  if into then                                                  -- a merged call: "<task id>\\n<message>"
    local calls = LOCK .. ':m:' .. into
    for _, call in ipairs(redis.call('LRANGE', calls, 0, -1)) do
      if string.sub(call, 1, #ARGV[2] + 1) == ARGV[2] .. '\\n' or call == ARGV[2] then  -- (0.2: the id alone)
        left = left + redis.call('LREM', calls, 1, call)
      end
    end
  end
  local flat = redis.call('HGETALL', WAITERS)
  for i = 1, #flat, 2 do
    local kind, _, _, _, owner = parse(flat[i + 1])
    if owner == ARGV[2] and kind ~= 'p' then leave(flat[i]) end
  end
end
if reserved == 0 then return {left, 0} end
redis.call('DEL', LOCK)
return hand_off(clock(), '', {left, 1})
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

# Every call of these is safe to send twice (engine/kept.py). These keep their reply under the call's
# request id: a second send returns the first one's.
PARK, SWEEP, UNBLOCK, LEAVE = map(kept, (PARK, SWEEP, UNBLOCK, LEAVE))
# These are safe as they are, and keep nothing: CONFIRM finds its mark made; INDEX_DONE sets scores;
# INDEX_DUE sent twice finds the keys its first send leased (their score moved), so they are looked at
# when that lease ends, SWEEP_LEASE later. (A key joins the index by a plain ZADD, score 0:
# line.announce; a plain waiter renews its mark by a plain PEXPIRE: line._wait_step.)
CONFIRM, INDEX_DUE, INDEX_DONE = map(as_is, (CONFIRM, INDEX_DUE, INDEX_DONE))
