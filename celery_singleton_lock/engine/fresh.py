"""The lightest paths of ACQUIRE and RELEASE: what an uncontended task makes Redis run.

ACQUIRE_FRESH is a script of its own, small (2 keys, 3 arguments): the client knows when a delivery
is fresh. FRESH_RELEASE is a prefix of RELEASE, run before the script's shared functions are even
made, and it returns only where nothing else could be needed; any other case falls through to the
full RELEASE, which reads the key again. So a fresh delivery of a free key nobody waits for
costs EXISTS, TIME and SET NX, and its release GET and DEL, where the full scripts run more.

What makes skipping the line safe: only PARK adds a waiter, and it flags the holder's value it
parks behind (``,"line":1`` at the end of its metadata, ``holding()`` in the scripts); a holder
taken while a line exists is flagged when taken. A holder's value without the flag therefore
means nobody waited behind it.
"""

from __future__ import annotations

ACQUIRE_FRESH = """
-- KEYS[1] lock, KEYS[2] line; ARGV[1] token, ARGV[2] metadata (JSON), ARGV[3] ttl ms.
-- ACQUIRE for a fresh delivery: no entry to claim, no earlier token to take back, no done
-- record to look up (the client sends ACQUIRE itself for those): EXISTS, TIME, SET NX PX.
-- Returns the fence alone (an integer) when taken; else what ACQUIRE returns: {0, value,
-- pttl} held, {0, '', -2} free but waiters are in line (nobody jumps the line).
-- The fence is the server clock in microseconds (TIME's two parts side by side, as text:
-- no float formatting), so it keeps increasing per key across holders, also after an
-- expiry, which no client's clock can promise.
if redis.call('EXISTS', KEYS[2]) == 0 then
  local t = redis.call('TIME')
  local fence = t[1] .. string.sub('00000' .. t[2], -6)
  if redis.call('SET', KEYS[1], ARGV[1] .. ' ' .. fence .. ' ' .. ARGV[2], 'NX', 'PX', ARGV[3]) then
    return tonumber(fence)
  end
end
local held = redis.call('GET', KEYS[1])
if held then return {0, held, redis.call('PTTL', KEYS[1])} end
return {0, '', -2}
"""

FRESH_RELEASE = """
-- The lightest path, first (before the shared functions below are even made): our lock,
-- nobody parked behind it (no ',"line":1' flag: see holding()), no success to remember, no
-- cooldown and not a retry: GET, DEL, and the bare 1 that stands for {1} (deleted, no hand-offs).
-- Anything else falls through to the full RELEASE, which reads the key again.
if ARGV[4] == '0' and ARGV[6] ~= '1' and (ARGV[8] or '0') == '0' then
  local held = redis.call('GET', KEYS[1])
  if held and string.sub(held, 1, #ARGV[1]) == ARGV[1] and string.sub(held, -10) ~= ',"line":1}' then
    redis.call('DEL', KEYS[1])
    return 1
  end
end
"""
