"""The quorum's Lua: what each member of a quorum of independent masters runs (see :mod:`.quorum`).

Each member is a plain Redis of its own, so these scripts know nothing of the waiting line; they
keep a lock, a fencing floor (``K:f``), a tombstone for a release that did not find its lock
(``K:x:<token>``) and, per member, when its data began (``SINCE``): see
:mod:`celery_singleton_lock.engine.layout`. The batched renewal is the single server's own
(``RENEW_MANY`` in the engine's scripts).
"""

from __future__ import annotations

Q_ACQUIRE = """
-- KEYS[1] lock, KEYS[2] its fencing floor, KEYS[3] done records, KEYS[4] when this server's data
-- began (its first use since it started empty); ARGV[1] token, ARGV[2] metadata, ARGV[3] ttl ms,
-- ARGV[4] owner id, ARGV[5] '1' to drop an owner that already succeeded here, ARGV[6] the token of
-- an earlier attempt whose reply was lost ('' none): its lock is taken back under ARGV[1].
-- KEYS[5] this attempt's tombstone (Q_RELEASE), ARGV[7] ms since 1970 after which this attempt
-- is too late to take anything (a member that was stopped or slow runs it long after it was sent).
-- ARGV[8] the client's proposed fence (its clock in microseconds), ARGV[9] how far (microseconds)
-- it may be from this server's clock, ARGV[10] ms to keep the floor, ARGV[11] ms after its data
-- began during which this server's vote alone is not trusted (at least the ttl).
-- Returns {1, fence} taken (our own token: taken back), {4, fence} taken by a server whose data
-- is younger than ARGV[11] (it may have lost a lock it granted before: its vote alone is not
-- trusted), {0, value, pttl} held, {2} already succeeded, {3} too late: released or past ARGV[7].
-- The fence is the client's proposal, kept within ARGV[9] of this server's clock, and above its
-- floor; the floor rises to it here. Members that agree answer the same fence, and each already
-- keeps it as its floor: then no second round trip writes it back (see Q_FENCE).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if redis.call('EXISTS', KEYS[5]) == 1 or now > tonumber(ARGV[7]) then return {3} end
local since = tonumber(redis.call('GET', KEYS[4]) or '0')
if since == 0 then
  redis.call('SET', KEYS[4], now)
  since = now
end
local taken = 1
if now - since < tonumber(ARGV[11]) then taken = 4 end
if ARGV[5] == '1' then
  local until_ms = redis.call('ZSCORE', KEYS[3], ARGV[4])
  if until_ms and tonumber(until_ms) > now then return {2} end
end
local held = redis.call('GET', KEYS[1])
if held then
  local old = ARGV[6] or ''
  if old ~= '' and string.sub(held, 1, #old + 1) == old .. ' ' then
    -- taken back under the new token: a second message carrying the old one finds it held
    redis.call('SET', KEYS[1], ARGV[1] .. ' ' .. string.match(held, '^%S+ (.*)$'), 'PX', ARGV[3])
    return {taken, string.match(held, '^%S+ (%d+)')}
  end
  if string.sub(held, 1, #ARGV[1] + 1) == ARGV[1] .. ' ' then
    redis.call('PEXPIRE', KEYS[1], ARGV[3])
    return {taken, string.match(held, '^%S+ (%d+)')}
  end
  return {0, held, redis.call('PTTL', KEYS[1])}
end
local floor = tonumber(redis.call('GET', KEYS[2]) or '0')
local clock = tonumber(t[1]) * 1000000 + tonumber(t[2])
local near = math.min(math.max(tonumber(ARGV[8]), clock - tonumber(ARGV[9])), clock + tonumber(ARGV[9]))
local fence = string.format('%.0f', math.max(near, floor + 1))
redis.call('SET', KEYS[2], fence, 'PX', ARGV[10])
redis.call('SET', KEYS[1], ARGV[1] .. ' ' .. fence .. ' ' .. ARGV[2], 'PX', ARGV[3])
return {taken, fence}
"""

Q_RELEASE = """
-- KEYS[1] lock, KEYS[2] done records, KEYS[3] the tombstone of ARGV[1]'s attempt; ARGV[1] "<token> ",
-- ARGV[2] owner id, ARGV[3] '1' if the holder succeeded, ARGV[4] ms to remember that success ('0':
-- not needed), ARGV[5] ms to keep the tombstone, ARGV[6] ms of cooldown ('0' none: the key stays
-- taken that long, by nobody). Returns 1 deleted (ours), 0 gone, -1 another's.
-- Where the lock is not ours, our acquire may still be on its way to this member (it was stopped or
-- slow, or the acquire's connection timed out and this release came on another one): a tombstone
-- makes that acquire take nothing when it runs, so a finished lock never lingers here.
local held = redis.call('GET', KEYS[1])
local status = 0
if held and string.sub(held, 1, #ARGV[1]) == ARGV[1] then
  if (ARGV[6] or '0') ~= '0' then                              -- a cooldown, as RELEASE keeps it
    local cool = cjson.encode({owner = ARGV[2], cooldown = true})
    redis.call('SET', KEYS[1], '= ' .. (string.match(held, '^%S+ (%d+)') or '0') .. ' ' .. cool, 'PX', ARGV[6])
  else
    redis.call('DEL', KEYS[1])
  end
  status = 1
else
  if held then status = -1 end
  redis.call('SET', KEYS[3], '1', 'PX', ARGV[5])
end
if ARGV[3] == '1' and ARGV[4] ~= '0' then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  redis.call('ZADD', KEYS[2], now + tonumber(ARGV[4]), ARGV[2])
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  redis.call('PEXPIRE', KEYS[2], ARGV[4])
end
return status
"""

Q_FENCE = """
-- KEYS[1] lock, KEYS[2] its fencing floor; ARGV[1] "<token> ", ARGV[2] the quorum's fencing token
-- (the majority's highest answer), ARGV[3] keep ms. While the token holds the lock: the floor rises
-- to the fencing token (never falls), and the lock's value shows it. Returns 1 written, 0 not ours (any more).
local held = redis.call('GET', KEYS[1])
if not held or string.sub(held, 1, #ARGV[1]) ~= ARGV[1] then return 0 end
if tonumber(ARGV[2]) > tonumber(redis.call('GET', KEYS[2]) or '0') then
  redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
end
local rest = string.match(held, '^%S+ %d+ (.*)$') or ''
redis.call('SET', KEYS[1], ARGV[1] .. ARGV[2] .. ' ' .. rest, 'KEEPTTL')
return 1
"""


Q_FORCE = """
-- For operators (`celery locks release`): KEYS[1] lock; ARGV[1] the value's expected start (the holder's
-- "<token> " the operator was shown), or '' for whoever holds it now. A member keeps no line: nothing is
-- handed on. Returns {1, value} deleted, {0, ''} no lock, {-1, value} another holds it (nothing done).
local held = redis.call('GET', KEYS[1])
if not held then return {0, ''} end
if ARGV[1] ~= '' and string.sub(held, 1, #ARGV[1]) ~= ARGV[1] then return {-1, held} end
redis.call('DEL', KEYS[1])
return {1, held}
"""
