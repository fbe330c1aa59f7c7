"""The lightest paths of ACQUIRE and RELEASE: what an uncontended task makes Redis run.

Each is a prefix of its script (:mod:`.scripts`), run before the script's shared functions are
even made, and it returns only where nothing else could be needed; any other case falls through
to the full script, which reads the key again. So a fresh delivery of a free key nobody waits for
costs EXISTS, TIME and SET NX, and its release GET and DEL, where the full scripts run more.

What makes skipping the line safe: only PARK adds a waiter, and it flags the holder's value it
parks behind (``,"line":1`` at the end of its metadata, ``holding()`` in the scripts); a holder
taken while a line exists is flagged when taken. A holder's value without the flag therefore
means nobody waited behind it.
"""

from __future__ import annotations

FRESH_ACQUIRE = """
-- The lightest path, first: a fresh delivery (no entry, no earlier token, no done record
-- to look up: the client asks for those only on a redelivery or a claim) of a key nobody
-- waits for: EXISTS, TIME, SET NX. Returns the fence alone (an integer) when taken.
-- The fence is the server clock in microseconds: strictly increasing per key across
-- holders (one holder's SET comes after the previous one's), also after an expiry.
if ARGV[5] == '' and ARGV[6] == '' and ARGV[7] ~= '1' and redis.call('EXISTS', KEYS[2]) == 0 then
  local t = redis.call('TIME')
  local fence = string.format('%.0f', tonumber(t[1]) * 1000000 + tonumber(t[2]))
  if redis.call('SET', KEYS[1], ARGV[1] .. ' ' .. fence .. ' ' .. ARGV[2], 'NX', 'PX', ARGV[3]) then
    return tonumber(fence)
  end
  return {0, redis.call('GET', KEYS[1]), redis.call('PTTL', KEYS[1])}
end
"""

FRESH_RELEASE = """
-- The lightest path, first (before the shared functions below are even made): our lock,
-- nobody parked behind it (no ',"line":1' flag: see holding()), no success to remember and
-- not a retry: GET, DEL, and the bare 1 that stands for {1} (deleted, no hand-offs).
-- Anything else falls through to the full RELEASE, which reads the key again.
if ARGV[4] == '0' and ARGV[6] ~= '1' then
  local held = redis.call('GET', KEYS[1])
  if held and string.sub(held, 1, #ARGV[1]) == ARGV[1] and string.sub(held, -10) ~= ',"line":1}' then
    redis.call('DEL', KEYS[1])
    return 1
  end
end
"""
