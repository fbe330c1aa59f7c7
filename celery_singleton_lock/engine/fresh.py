"""The lightest paths of ACQUIRE and RELEASE: what an uncontended task makes Redis run.

A fresh delivery (no entry to claim, no earlier token to take back, no done record to look up:
the client knows) takes the key with NO script where the server's SET takes NX with GET (Redis
>= 7, Valkey) and the server is one Redis (a Sentinel master could be a demoted one still taking
writes, where a fence drawn later could run backwards; a Cluster follows redirects per script
call): :func:`take` sends ``SET lock "<token> 0 <meta>" NX GET PX ttl`` and ``EXISTS
line`` in one write, one round trip. The value's fence is 0: the fencing token is drawn from the
server's clock by FENCE the first time it is read (:class:`FencedLater`), while the lock is still
held, so it stays greater than every earlier holder's and smaller than every later one's, and a
task that never reads it never pays for it. A key taken while waiters are in line (their holder
died) is given back at once, handed to the first of them: nobody jumps the line. On Redis 6.2 the
small script ACQUIRE_FRESH does the same in one call.

FRESH_RELEASE is a prefix of RELEASE, run before the script's shared functions are even made, and
it returns only where nothing else could be needed; any other case falls through to the full
RELEASE, which reads the key again. So a fresh task costs Redis SET, EXISTS, and GET and DEL in
one EVALSHA: five commands, where the full scripts run more.

What makes skipping the line safe at release: only PARK adds a waiter, and it flags the holder's
value it parks behind (``,"line":1`` at the end of its metadata, ``holding()`` in the scripts); a
holder taken while a line exists is flagged when taken (or, by :func:`take`, given back). A
holder's value without the flag therefore means nobody waited behind it.
"""

from __future__ import annotations

import time
from typing import Any

from redis.exceptions import RedisError, ResponseError

from ..exceptions import LockError, LockLost
from . import layout, wire
from .kept import as_is
from .lock import Lock, ms

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
-- nobody parked behind it (no ',"line":1' flag: see holding()), no success to remember, no
-- cooldown and not a retry: GET, DEL, and the bare 1 that stands for {1} (deleted, no hand-offs).
-- Anything else falls through to the full RELEASE, which reads the key again.
if ARGV[4] == '0' and ARGV[6] ~= '1' and (ARGV[8] or '0') == '0' then
  local held = redis.call('GET', KEYS[1])
  if held and string.find(held, ARGV[1], 1, true) == 1 and not string.find(held, ',"line":1}', -10, true) then
    redis.call('DEL', KEYS[1])
    return 1
  end
end
"""

FENCE = """
-- KEYS[1] lock; ARGV[1] "<token> ". The fencing token of a lock taken by a plain SET, drawn now
-- from the server clock (microseconds, as ACQUIRE draws it) while the lock is still ours, and
-- kept in its value (its TTL kept). Returns the fence; 0 when the lock is no longer ours.
local held = redis.call('GET', KEYS[1])
if not held or string.sub(held, 1, #ARGV[1]) ~= ARGV[1] then return 0 end
local fence, meta = string.match(held, '^%S+ (%d+) (.*)$')
if not fence then return 0 end  -- (not a value of ours: treated as not held)
if fence ~= '0' then return tonumber(fence) end
local t = redis.call('TIME')
fence = t[1] .. string.sub('00000' .. t[2], -6)
redis.call('SET', KEYS[1], ARGV[1] .. fence .. ' ' .. meta, 'KEEPTTL')
return tonumber(fence)
"""

RELEASE_FRESH = """
-- KEYS[1] lock; ARGV[1] "<token> ". The release of a lock taken by a plain SET, when nothing is
-- to be remembered: ours, and nobody parked behind it (no ',"line":1' flag, see holding()): DEL,
-- and 1. Anything else: 0, nothing done, and the client sends the full RELEASE. One key and one
-- argument, as the cookbook's release: a script's every argument costs Redis time. The two tests
-- compare in place (string.find, plain, anchored): string.sub would make, hash and intern two new
-- strings per call (1.5 % of the server's instructions per task, counted by callgrind).
local held = redis.call('GET', KEYS[1])
if held and string.find(held, ARGV[1], 1, true) == 1 and not string.find(held, ',"line":1}', -10, true) then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""

JUMPED = object()
"""What :func:`take` says when it took a free key while waiters are in line: to be given back."""


def take(server: Any, key: str, line: str, token: str, meta: str, ttl_ms: int) -> Any:
    """The fresh delivery's acquire without a script (see the module doc), on ``server``'s held
    connection: ACQUIRE_FRESH's reply (0 for the fence: drawn later), JUMPED, or None when the
    server refuses NX with GET (Redis 6.2: run ACQUIRE_FRESH). A held key's TTL is not read (-1)."""
    took, waiting = server.plain(("SET", key, f"{token} 0 {meta}", "NX", "GET", "PX", str(ttl_ms)),
                                 ("EXISTS", line))
    if isinstance(took, ResponseError):
        if "syntax" in str(took).lower():
            return None
        raise took
    if isinstance(took, str):  # (a client made with decode_responses=True)
        took = took.encode()
    if took is not None and not took.startswith(token.encode() + b" "):  # (ours: a send repeated after
        return [0, took, -1]                                            # a broken connection took it)
    if isinstance(waiting, ResponseError) or waiting:
        return JUMPED
    return 0


def with_fence(server: Any, key: str, value: bytes) -> bytes | None:
    """``value``, a lock read by an operator's tool, with its fencing token: drawn now by FENCE if a
    fresh task took the lock and has not read it yet. FENCE runs only while that token holds the key,
    so the token drawn is the one its holder will read. None if the key is no longer that token's.
    A reservation (``~``) or a cooldown (``=``) has no fence to draw, and is returned as it is."""
    parts = value.split(b" ", 2)
    if len(parts) < 3 or parts[1] != b"0" or value[:1] in (b"~", b"="):  # (not a fresh task's, or not ours)
        return value
    token, _, meta = parts
    drawn = int(server.run(FENCE, (key,), (token.decode() + " ",)))
    return b" ".join((token, str(drawn).encode(), meta)) if drawn else None


def take_plain(server: Any, key: str, token: str, owner_id: str | None, ttl: float) -> Any:
    """The fresh acquire without a script (:func:`take`), as ACQUIRE_FRESH would reply; None where the
    server cannot (then ``server.plain_set`` is False from now on). A free key taken while waiters are
    in line is given back (the full RELEASE hands it to the first of them): the caller is told the key
    is queued, and parks."""
    try:
        reply = take(server, key, layout.line(key), token, wire.meta(owner_id, at=True), ms(ttl))
    except RedisError as exc:
        raise server.error(exc, key) from exc
    if reply is None:
        server.plain_set = False  # Redis 6.2: SET takes NX or GET, not both
    elif reply is JUMPED:
        jumped = Lock(server, key, token, 0, ttl, owner_id)
        try:  # again=True: the full RELEASE, which hands the key to the first waiter
            server.release(jumped, again=True)
        except LockError:  # sent once more: if the first did run, this one returns its hand-off, sent now;
            server.release(jumped, again=True)  # if both fail, the task's re-send finds the jump (ACQUIRE)
        return [0, "", -2]
    return reply


class FencedLater(Lock):
    """A lock taken by :func:`take`: its fencing token is drawn by FENCE the first time it is read
    (one round trip then; most tasks never read it), and raises :class:`LockLost` if the lock is
    no longer held by then (a token drawn after the loss would not be sound)."""

    _fence = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        self.taken_at = time.time()
        """When it was taken, by this host's clock (``celery inspect locks`` shows how long it is held)."""

    @property
    def fencing_token(self) -> int:
        if not self._fence:
            if self.released or self.lost_reason is not None:  # too late to draw one that would be sound
                raise LockLost(self.key, self.lost_reason or "released before its fencing token was read")
            fence = int(self.server.run(FENCE, (self.key,), (self.prefix,)))  # type: ignore[attr-defined]
            if not fence:
                self.mark_lost("no longer held when its fencing token was first read")
                raise LockLost(self.key, self.lost_reason or "no longer held")
            self._fence = fence
        return self._fence

    @fencing_token.setter
    def fencing_token(self, value: int) -> None:
        self._fence = value

    def known_fence(self) -> int | None:
        return self._fence or None

    def __repr__(self) -> str:  # (the dataclass's would read fencing_token: a Redis write, or LockLost)
        return (f"FencedLater(key={self.key!r}, fencing_token={self.known_fence()!r} (drawn when first read), "
                f"ttl={self.ttl!r}, owner_id={self.owner_id!r}, released={self.released!r}, "
                f"lost_reason={self.lost_reason!r})")

# Safe to send twice as they are (engine/kept.py): ACQUIRE_FRESH finds its own token and answers its
# fence; FENCE draws the fence once and then reads it. RELEASE_FRESH is never sent twice by the
# client: a release that lost its reply tries again as a full RELEASE that knows its first try.
ACQUIRE_FRESH = as_is(ACQUIRE_FRESH)
FENCE = as_is(FENCE)
