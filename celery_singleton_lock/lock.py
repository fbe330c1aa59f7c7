"""Exclusion: the Redis scripts and the lock handle.

This module knows redis-py and nothing of Celery, so it can be used (and
tested, and benchmarked) on its own.

Layout in Redis, for a lock named ``N`` (``N`` always carries a cluster hash
tag, so both keys live in one hash slot and every script stays cluster-safe):

``N``
    the lock itself: ``"<token> <json metadata>"`` with a PX expiry. The
    token is 128 random bits in hex; the metadata (owner id, host, pid,
    acquired-at) is there for operators reading the key.
``N:state``
    a small hash beside it: ``fence`` (the last fencing token handed out) and
    ``done`` (the owner id of the last holder that finished for good). It
    expires on its own (``state_ttl``), so no key lives forever.

Every operation is ONE round trip: one EVALSHA, or one pipeline for a batch.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from .exceptions import LockBackendUnavailable, LockError, LockLost

# --------------------------------------------------------------------------
# The scripts. Each one is short and says its KEYS/ARGV layout at the top.
# Ownership is checked by comparing the value's prefix "<token> " with ARGV[1].
# --------------------------------------------------------------------------

ACQUIRE = """
-- KEYS[1] lock key, KEYS[2] its state hash (same slot)
-- ARGV[1] "<token> " prefix, ARGV[2] full value, ARGV[3] ttl ms,
-- ARGV[4] state ttl ms, ARGV[5] owner id ('' for none)
-- Returns {1, fence} taken, {0, value, pttl} held by another,
-- {2, 0} this owner already finished for good (a redelivery to drop).
local held = redis.call('GET', KEYS[1])
if held then
  if string.sub(held, 1, #ARGV[1]) ~= ARGV[1] then
    return {0, held, redis.call('PTTL', KEYS[1])}
  end
  -- our own token: a re-acquire after a lost reply. Refresh the ttls and hand
  -- back the same fence; if the state hash expired meanwhile, fall through
  -- and hand out a new one (never 0).
  local fence = redis.call('HGET', KEYS[2], 'fence')
  if fence then
    redis.call('PEXPIRE', KEYS[1], ARGV[3])
    redis.call('PEXPIRE', KEYS[2], ARGV[4])
    return {1, tonumber(fence)}
  end
end
local state = redis.call('HMGET', KEYS[2], 'fence', 'done')  -- missing fields are false
if ARGV[5] ~= '' and state[2] == ARGV[5] then
  return {2, 0}
end
-- fencing token: above the last one, and never below the server clock in
-- microseconds, so it keeps rising even after the state hash expired.
local t = redis.call('TIME')
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local last = tonumber(state[1] or '0')
local fence = math.max(last + 1, now_us)
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
redis.call('HSET', KEYS[2], 'fence', string.format('%.0f', fence))
redis.call('PEXPIRE', KEYS[2], ARGV[4])
return {1, fence}
"""

RELEASE = """
-- KEYS[1] lock key, KEYS[2] its state hash
-- ARGV[1] "<token> " prefix, ARGV[2] owner id to remember as done ('' for none),
-- ARGV[3] state ttl ms
-- Deletes the lock only while this token holds it. Returns 1 deleted, 0 not ours.
local held = redis.call('GET', KEYS[1])
if not held or string.sub(held, 1, #ARGV[1]) ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[1])
if ARGV[2] ~= '' then
  redis.call('HSET', KEYS[2], 'done', ARGV[2])
  -- the hash may have expired while the lock was held: never leave it immortal
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
end
return 1
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

DEFAULT_STATE_TTL = 24 * 3600.0
"""Seconds the state hash (fence counter, last finished owner) outlives its last use."""

TOKEN_BYTES = 16  # 128 bits
MAX_TTL = 10 * 365 * 24 * 3600.0  # ten years: beyond that Redis may refuse the expiry


def redact_url(url: str) -> str:
    """The URL with its password replaced by ``***``, for logs and errors."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if ":" in host:  # IPv6: keep its brackets
        host = f"[{host}]"
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def check_ttl(ttl: Any, what: str = "ttl") -> float:
    """Return ``ttl`` as seconds, or raise ValueError naming the bad value."""
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)):
        raise ValueError(f"{what} must be a number of seconds > 0, got {ttl!r}")
    if not 0 < ttl <= MAX_TTL:
        raise ValueError(f"{what} must be a number of seconds > 0 and <= {MAX_TTL:g}, got {ttl!r}")
    return float(ttl)


def slot_safe(name: str) -> str:
    """``name`` with a cluster hash tag, so ``name`` and ``name:state`` share a slot."""
    start = name.find("{")
    if start != -1:
        end = name.find("}", start + 1)
        if end > start + 1:
            return name
    tagged = "{" + name + "}"
    if tagged.startswith("{}"):
        raise ValueError(f"lock name {name!r} cannot carry a cluster hash tag")
    return tagged


@dataclass(frozen=True)
class Holder:
    """Who holds a lock that we did not get."""

    key: str
    owner_id: str | None
    host: str | None
    pid: int | None
    ttl_ms: int
    raw: str

    @classmethod
    def parse(cls, key: str, value: str | bytes, ttl_ms: int) -> Holder:
        text = value.decode() if isinstance(value, bytes) else value
        meta: dict[str, Any] = {}
        _, _, rest = text.partition(" ")
        try:
            meta = json.loads(rest) if rest else {}
        except ValueError:  # someone else's value format; show it raw
            meta = {}
        return cls(key, meta.get("owner"), meta.get("host"), meta.get("pid"), int(ttl_ms), text)


@dataclass(eq=False)
class Lock:
    """One held lock: the handle an execution keeps while it runs.

    ``lost`` turns True when the watchdog learns the lock is gone (or could not
    confirm it in time). Code about to do something that must be exclusive
    calls :meth:`ensure` first, and hands :attr:`fencing_token` to any store
    that can reject writes from an older holder.
    """

    server: LockServer
    key: str
    token: str
    fencing_token: int
    ttl: float
    owner_id: str | None = None
    confirmed_at: float = 0.0
    """``time.monotonic()`` when the last confirmed acquire/renewal was SENT."""
    lost: bool = False
    lost_reason: str | None = None
    released: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def prefix(self) -> str:
        return self.token + " "

    def ensure(self) -> None:
        """Raise :class:`LockLost` if this lock is gone, or may be.

        Besides what the watchdog reported, this checks the clock: a lock not
        confirmed for a whole TTL may have expired in Redis even if nobody has
        said so yet (a watchdog starved by a CPU-bound greenlet, a lock that
        was never tracked).
        """
        if not self.lost and time.monotonic() >= self.confirmed_at + self.ttl:
            self.mark_lost(f"not confirmed for its whole ttl of {self.ttl:g}s")
        if self.lost:
            raise LockLost(self.key, self.lost_reason or "unknown")

    def mark_lost(self, reason: str) -> bool:
        """Record the loss; True the first time only."""
        if self.lost:
            return False
        self.lost, self.lost_reason = True, reason
        return True

    def release(self, *, finished: bool = False) -> bool:
        return self.server.release(self, finished=finished)

    def renew(self) -> bool:
        return self.server.renew(self)


class LockServer:
    """The lock operations against one Redis server.

    Create one per URL and process and share it: it holds a connection pool
    and the scripts' SHAs. ``with_timeout`` gives a twin with its own pool
    and short socket timeouts, which is what the watchdog uses.
    """

    def __init__(self, client: redis.Redis, *, state_ttl: float = DEFAULT_STATE_TTL) -> None:
        self.client = client
        self.state_ttl = check_ttl(state_ttl, "state_ttl")
        kwargs = client.connection_pool.connection_kwargs
        if "path" in kwargs:
            self.url = f"unix://{kwargs['path']}?db={kwargs.get('db', 0)}"
        else:
            self.url = f"redis://{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}/{kwargs.get('db', 0)}"
        self._shas: dict[str, str] = {}

    @classmethod
    def from_url(cls, url: str, *, state_ttl: float = DEFAULT_STATE_TTL, **client_options: Any) -> LockServer:
        client_options.setdefault("socket_connect_timeout", 5.0)
        client_options.setdefault("socket_timeout", 10.0)
        server = cls(redis.Redis.from_url(url, **client_options), state_ttl=state_ttl)
        server.url = redact_url(url)
        return server

    def close(self) -> None:
        """Close this server's connections (they reopen on the next operation)."""
        self.client.close()
        self.client.connection_pool.disconnect()

    def with_timeout(self, seconds: float) -> LockServer:
        """A twin on its own connection pool whose commands time out after ``seconds``."""
        pool = self.client.connection_pool
        kwargs = dict(pool.connection_kwargs)
        # no client-side retries either: the watchdog retries on its next tick
        kwargs.update(socket_timeout=seconds, socket_connect_timeout=seconds, retry=Retry(NoBackoff(), 0))
        twin = LockServer(
            redis.Redis(connection_pool=redis.ConnectionPool(connection_class=pool.connection_class, **kwargs)),
            state_ttl=self.state_ttl,
        )
        twin.url = self.url
        twin._shas = self._shas  # same server, same scripts
        return twin

    # -- script plumbing -------------------------------------------------

    def _sha(self, script: str) -> str:
        sha = self._shas.get(script)
        if sha is None:
            sha = self._shas[script] = self.client.script_load(script)
        return sha

    def _run(self, script: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """EVALSHA, loading the script once and again after NOSCRIPT (restart, SCRIPT FLUSH)."""
        try:
            try:
                return self.client.evalsha(self._sha(script), len(keys), *keys, *args)
            except NoScriptError:
                self._shas.pop(script, None)
                return self.client.evalsha(self._sha(script), len(keys), *keys, *args)
        except (RedisConnectionError, RedisTimeoutError) as exc:
            raise LockBackendUnavailable(self.url, str(exc) or type(exc).__name__) from exc
        except RedisError as exc:  # e.g. WRONGTYPE: the key holds something that is not our lock
            raise LockError(f"Redis at {self.url} refused the lock operation on {keys[0]!r}: {exc}") from exc

    # -- operations ------------------------------------------------------

    def acquire(
        self,
        name: str,
        ttl: float,
        *,
        owner_id: str | None = None,
        token: str | None = None,
    ) -> Lock | Holder | None:
        """Try once to take ``name``, in one round trip.

        Returns the :class:`Lock` when taken, the :class:`Holder` when another
        token holds it, or ``None`` when ``owner_id`` already finished under
        this name (see ``release(finished=True)``).

        Passing the ``token`` of an earlier attempt makes a retry after a lost
        reply safe: if that attempt did take the lock, this one gets it back.
        """
        ttl = check_ttl(ttl)
        key = slot_safe(name)
        token = token or secrets.token_hex(TOKEN_BYTES)
        meta = {
            "owner": owner_id,
            "host": _HOSTNAME,
            "pid": os.getpid(),
            "acquired_at": round(time.time(), 3),
        }
        value = f"{token} {_COMPACT_JSON.encode(meta)}"
        sent = time.monotonic()
        reply = self._run(
            ACQUIRE,
            (key, key + ":state"),
            (token + " ", value, _ms(ttl), _ms(self.state_ttl), owner_id or ""),
        )
        status = int(reply[0])
        if status == 1:
            return Lock(self, key, token, int(reply[1]), ttl, owner_id, confirmed_at=sent)
        if status == 2:
            return None
        return Holder.parse(key, reply[1], int(reply[2]))

    def release(self, lock: Lock, *, finished: bool = False) -> bool:
        """Delete the lock if ``lock`` still holds it, in one round trip.

        Idempotent. On a transport error it raises
        :class:`LockBackendUnavailable` and the handle keeps its token, so the
        caller can simply call again. ``finished=True`` remembers the owner id
        as done, so a later redelivery of the same owner is told so by acquire.
        """
        owner = (lock.owner_id or "") if finished else ""
        deleted = bool(
            self._run(RELEASE, (lock.key, lock.key + ":state"), (lock.prefix, owner, _ms(self.state_ttl)))
        )
        lock.released = True
        return deleted

    def renew(self, lock: Lock) -> bool:
        """Set the lock's TTL again; True renewed, False no longer the owner."""
        sent = time.monotonic()
        ok = self._run(RENEW_MANY, (lock.key,), (lock.prefix, _ms(lock.ttl)))[0] == 1
        if ok:
            lock.confirmed_at = sent
        return ok

    def renew_many(self, locks: Sequence[Lock], *, chunk: int = 500) -> list[bool | LockError]:
        """Renew many locks in ONE pipelined round trip (one EVALSHA per chunk).

        Returns, per lock in order: True renewed, False not the owner, or a
        :class:`LockError` for a chunk that failed. A failed chunk does not
        stop the others. Confirmed locks get ``confirmed_at`` = send time.
        """
        if not locks:
            return []
        chunks = [locks[i : i + chunk] for i in range(0, len(locks), chunk)]
        sent = time.monotonic()
        try:
            sha = self._sha(RENEW_MANY)
            replies = self._pipeline_evalsha(sha, chunks)
            if any(isinstance(r, NoScriptError) for r in replies):
                self._shas.pop(RENEW_MANY, None)
                sha = self._sha(RENEW_MANY)
                replies = self._pipeline_evalsha(sha, chunks)
        except RedisError as exc:
            err = LockBackendUnavailable(self.url, str(exc) or type(exc).__name__)
            return [err] * len(locks)
        out: list[bool | LockError] = []
        for part, reply in zip(chunks, replies, strict=False):
            if isinstance(reply, Exception):
                out.extend([LockError(f"renewal failed on {self.url}: {reply}")] * len(part))
                continue
            for lock, flag in zip(part, reply, strict=False):
                ok = int(flag) == 1
                if ok:
                    lock.confirmed_at = sent
                out.append(ok)
        return out

    def _pipeline_evalsha(self, sha: str, chunks: Iterable[Sequence[Lock]]) -> list[Any]:
        # A raw pipeline: redis-py's Script objects would add a SCRIPT EXISTS round trip.
        pipe = self.client.pipeline(transaction=False)
        for part in chunks:
            keys = [lock.key for lock in part]
            args = [lock.prefix for lock in part] + [_ms(lock.ttl) for lock in part]
            pipe.execute_command("EVALSHA", sha, len(keys), *keys, *args)
        return pipe.execute(raise_on_error=False)

    def holder(self, name: str) -> Holder | None:
        """Who holds ``name`` now (for operators and tests); None when free."""
        key = slot_safe(name)
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.get(key)
            pipe.pttl(key)
            value, pttl = pipe.execute()
        except RedisError as exc:
            raise LockBackendUnavailable(self.url, str(exc)) from exc
        return None if value is None else Holder.parse(key, value, pttl)


def _ms(seconds: float) -> int:
    return max(1, int(round(seconds * 1000)))


_HOSTNAME = socket.gethostname()
_COMPACT_JSON = json.JSONEncoder(separators=(",", ":"))  # made once: json.dumps(separators=...) makes one per call
