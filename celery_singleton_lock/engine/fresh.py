"""The lightest paths of ACQUIRE and RELEASE: what an uncontended task makes Redis run.

A fresh delivery (no entry to claim, no earlier token to take back, no done record to look up:
the client knows) takes the key with ACQUIRE_FRESH: EXISTS on its line, TIME, and SET NX PX, in
one EVALSHA. Its fencing token is drawn there, from the server's clock, so every lock knows its
token from the acquire on (operators' tools show it, and a holder reads it without a round trip).
A key with waiters in line is never taken by it: nobody jumps the line.

FRESH_RELEASE is a prefix of RELEASE, run before the script's shared functions are even made, and
it returns only where nothing else could be needed; any other case falls through to the full
RELEASE, which reads the key again. RELEASE_FRESH is that prefix alone, for a lock taken fresh with
nothing to remember: two keys (the lock and its line) and one argument. So a fresh task costs Redis
EXISTS, TIME and SET in one EVALSHA, and GET, EXISTS and DEL in another.

Skipping the line at release is safe because a waiter is only ever added to the line, and the
release looks at the line itself: an empty line means nobody waits behind the holder.
"""

from __future__ import annotations

from .kept import as_is

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
-- this very call sent twice (its first reply lost): its first send took the key, under its token
if held and string.find(held, ARGV[1] .. ' ', 1, true) == 1 then return tonumber(string.match(held, '^%S+ (%d+)')) end
if held then return {0, held, redis.call('PTTL', KEYS[1])} end
return {0, '', -2}
"""

FRESH_RELEASE = """
-- The lightest path, first (before the shared functions below are even made): our lock,
-- nobody in line, no success to remember, no cooldown and not a retry: GET, EXISTS, DEL, and the
-- bare 1 that stands for {1} (deleted, no hand-offs). Anything else falls through to the full
-- RELEASE, which reads the key again.
if ARGV[4] == '0' and ARGV[6] ~= '1' and (ARGV[8] or '0') == '0' then
  local held = redis.call('GET', KEYS[1])
  if held and string.find(held, ARGV[1], 1, true) == 1 and redis.call('EXISTS', KEYS[2]) == 0 then
    redis.call('DEL', KEYS[1])
    return 1
  end
end
"""

RELEASE_FRESH = """
-- KEYS[1] lock, KEYS[2] line; ARGV[1] "<token> ". The release of a lock taken fresh (ACQUIRE_FRESH),
-- when nothing is to be remembered: ours, and nobody in line: DEL, and 1. Anything else: 0, nothing
-- done, and the client sends the full RELEASE. One argument: a script's every argument costs Redis
-- time. The token is compared in place (string.find, plain, anchored): string.sub would make, hash
-- and intern a new string per call (counted by callgrind).
local held = redis.call('GET', KEYS[1])
if held and string.find(held, ARGV[1], 1, true) == 1 and redis.call('EXISTS', KEYS[2]) == 0 then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""


# Safe to send twice as it is (engine/kept.py): ACQUIRE_FRESH finds its own token and answers its
# fence. RELEASE_FRESH is never sent twice by the client: a release that lost its reply tries again
# as a full RELEASE that knows its first try.
ACQUIRE_FRESH = as_is(ACQUIRE_FRESH)
