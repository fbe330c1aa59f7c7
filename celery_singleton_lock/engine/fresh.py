"""The fresh path of ACQUIRE and RELEASE: what an uncontended task makes Redis run.

Each is the first lines of its script, run ahead of the kept reply's lookup (:func:`.kept.kept`'s
``ahead``), so a lock taken and released with nobody waiting leaves nothing behind. The client says
"fresh" by the number of arguments it sends: three for an acquire, one for a release; a call with
more is a claim, a take-back, a redelivery, or a release with something to remember, and runs the
whole script.

A fresh delivery takes the key with EXISTS on its line, TIME, and SET NX PX. Its fencing token is
drawn there, from the server's clock, so every lock knows its token from the acquire on (operators'
tools show it, and a holder reads it without a round trip). A key with waiters in line is never taken
by it: nobody jumps the line. Sent twice (its first reply lost), it finds the key held by its own token
and answers "taken" with the same fence: safe as it is.

Its release is GET, EXISTS on the line, and DEL: ours, and nobody waits. Anything else answers 0 and
does nothing, and the client sends the whole RELEASE. It is never sent twice: its second send would
find the key gone and could not tell "I deleted it" from "it expired". A release whose reply was lost
tries again as a whole RELEASE that knows its first try (see :mod:`.server`).

Skipping the line at release is safe because a waiter is only ever added to the line, and the
release looks at the line itself: an empty line means nobody waits behind the holder.
"""

from __future__ import annotations

FRESH_ACQUIRE = """
-- The fresh path: KEYS[1] lock, KEYS[2] line; ARGV[1] token, ARGV[2] metadata (JSON), ARGV[3] ttl ms,
-- and nothing more (no entry to claim, no earlier token to take back, no done record to look up).
-- Returns the fence alone (an integer) when taken; else {0, value, pttl} held, {0, '', -2} free but
-- waiters are in line (nobody jumps the line). The fence is the server clock in microseconds
-- (TIME's two parts side by side, as text: no float formatting), so it keeps increasing per key
-- across holders, also after an expiry, which no client's clock can promise.
if #ARGV == 3 then
  if redis.call('EXISTS', KEYS[2]) == 0 then
    local t = redis.call('TIME')
    local fence = t[1] .. string.sub('00000' .. t[2], -6)
    if redis.call('SET', KEYS[1], ARGV[1] .. ' ' .. fence .. ' ' .. ARGV[2], 'NX', 'PX', ARGV[3]) then
      return tonumber(fence)
    end
  end
  local held = redis.call('GET', KEYS[1])
  -- this very call sent twice (its first reply lost): its first send took the key, under its token
  if held and string.find(held, ARGV[1] .. ' ', 1, true) == 1 then
    return tonumber(string.match(held, '^%S+ (%d+)'))
  end
  if held then return {0, held, redis.call('PTTL', KEYS[1])} end
  return {0, '', -2}
end
"""

FRESH_RELEASE = """
-- The fresh path: KEYS[1] lock, KEYS[2] line; ARGV[1] "<token> ", and nothing more. Ours, and nobody in
-- line: DEL, and 1. Anything else: 0, nothing done (the client sends the whole RELEASE). One argument:
-- a script's every argument costs Redis time. The token is compared in place (string.find, plain,
-- anchored): string.sub would make, hash and intern a new string per call (counted by callgrind).
if #ARGV == 1 then
  local held = redis.call('GET', KEYS[1])
  if held and string.find(held, ARGV[1], 1, true) == 1 and redis.call('EXISTS', KEYS[2]) == 0 then
    redis.call('DEL', KEYS[1])
    return 1
  end
  return 0
end
"""
