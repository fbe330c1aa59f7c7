"""One script call in one round trip on one Redis: :class:`ScriptClient`, the plumbing under
:class:`~celery_singleton_lock.engine.server.LockServer`.

redis-py's generic command path (pool checkout, packing, response callbacks) costs about as much
as the round trip itself, and the lock's hot path is two commands per task; so a script call here
is an EVALSHA packed by hand (:mod:`.wire`) and sent on a connection the calling thread keeps, with
``WAIT`` for replicas in the same write when asked, and the script loaded again after NOSCRIPT
(a restart, a SCRIPT FLUSH, a failover). The batched renewal sends one pipeline of them.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import threading
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError, ResponseError

from ..exceptions import LockError
from . import exchange, kept, layout, refusals, scripts, wire
from .lock import ms

if TYPE_CHECKING:
    from .lock import Lock

DEFAULT_REPLICA_TIMEOUT = 1.0
"""Seconds an acquire waits for ``min_replicas`` replicas to acknowledge it (Redis WAIT)."""


def _out_of_step(conn: Any) -> None:
    """Drop a held connection a read was cut short on (a timeout, a soft time limit, any interrupt).
    Its replies may still be on the way, and the next command on it would read them as its own: a
    stale "nil" from someone else's SET NX would read as "taken". redis-py's Sentinel connection does
    not disconnect on such errors by itself (``disconnect_on_error=False``)."""
    conn.disconnect()


class Unreplicated(Exception):
    """A script ran, but fewer replicas than ``min_replicas`` acknowledged its writes in time (internal)."""

    def __init__(self, reply: Any, acked: int) -> None:
        super().__init__(f"{acked} replica(s) acknowledged")
        self.reply = reply
        self.acked = acked



class ScriptClient:
    """Scripts on one Redis, one round trip each (see the module doc); ``min_replicas`` > 0 adds a
    ``WAIT`` for that many replicas to the same write, waiting up to ``replica_timeout`` seconds."""

    def __init__(self, client: redis.Redis, *, url: str | None = None, min_replicas: int = 0,
                 replica_timeout: float = DEFAULT_REPLICA_TIMEOUT) -> None:
        self.client = client
        self.url = url or _describe(client)
        self._shas: dict[str, str] = {}
        self._held = threading.local()  # each thread's own connection, taken from the pool and kept
        self.min_replicas = min_replicas
        self.replica_timeout = replica_timeout

    def _sha(self, script: str) -> str:
        """The script's SHA1, computed here: a process's first EVALSHA of a script another process
        loaded already costs no SCRIPT LOAD (a NOSCRIPT reply loads it where it was sent: run)."""
        sha = self._shas.get(script)
        if sha is None:
            sha = self._shas[script] = hashlib.sha1(script.encode()).hexdigest()  # noqa: S324 (Redis's own SHA1)
        return sha

    def run(self, script: str, keys: Sequence[str], args: Sequence[Any], *, replicated: bool = False,
            request_id: str = "", fresh: bool = False, once: bool = False) -> Any:
        """EVALSHA, loading the script once and again after NOSCRIPT (restart, SCRIPT FLUSH, failover).

        ``replicated``: with ``min_replicas``, also WAIT for the replicas in the
        same round trip; :class:`Unreplicated` (carrying the script's reply) if
        too few acknowledged in time.

        A broken connection is replaced and the call sent once more only where that is safe
        (:func:`.kept.may_resend`): a kept script carries a request id (one more key) whose kept
        reply answers the second send as the first; any other is never sent twice. ``request_id``: the
        caller's, to send a kept call again itself later (within ``kept.KEEP_MS``) and read its first answer.
        ``fresh``: a call the script's fresh path answers whole, ahead of the kept reply (see fresh.py): no
        request id. ``once``: never sent twice (a fresh release).
        """
        wait = replicated and self.min_replicas > 0
        resend = not once and kept.may_resend(script)
        if script in kept.KEPT and not fresh:
            keys = (*keys, layout.reply(keys[0], request_id or secrets.token_hex(8)))
        try:
            try:
                return self._call(self._sha(script), keys, args, wait, resend)
            except NoScriptError:  # loaded where the EVALSHA goes: after a failover the pool's connection
                # and this thread's may be on different servers for a moment
                return self._call(self._load_here(script), keys, args, wait, resend)
        except RedisError as exc:
            raise self.error(exc, keys[0]) from exc

    def _load_here(self, script: str) -> str:
        """SCRIPT LOAD on this thread's own connection (the one the next EVALSHA goes to)."""
        conn = self._held_conn()
        try:
            conn.send_command("SCRIPT", "LOAD", script)
            reply = conn.read_response()
        except ResponseError:
            raise
        except BaseException:
            _out_of_step(conn)
            raise
        sha = self._shas[script] = reply.decode() if isinstance(reply, bytes) else str(reply)
        return sha

    def _packed(self, sha: str, keys: Sequence[str], args: Sequence[Any], wait: bool) -> bytes:
        data = wire.pack(sha, keys, args)
        return data + wire.pack_wait(self.min_replicas, ms(self.replica_timeout)) if wait else data

    def _read(self, conn: Any, wait: bool) -> Any:
        """The script's reply (and, with ``wait``, the WAIT's: both are always read off the wire)."""
        return self._replied(*exchange.read(conn, 2 if wait else 1))

    def _replied(self, *replies: Any) -> Any:
        """The script's reply out of the replies read (an error among them raised; after a WAIT's,
        :class:`Unreplicated` if too few replicas acknowledged)."""
        for reply in replies:
            if isinstance(reply, Exception):  # an error reply (NOSCRIPT, a script's error, READONLY, ...)
                raise reply
        if len(replies) > 1:
            acked = int(replies[-1])
            if acked < self.min_replicas:
                raise Unreplicated(replies[-2], acked)
        return replies[-2] if len(replies) > 1 else replies[0]

    def _call(self, sha: str, keys: Sequence[str], args: Sequence[Any], wait: bool = False,
              resend: bool = True) -> Any:
        """One EVALSHA, packed here and sent on this thread's own connection.

        redis-py's generic command path (pool checkout, packing, response
        callbacks) costs about as much as the round trip itself; the lock's hot
        path is two commands per task, so it takes the short way: a connection
        this thread keeps (a forked child takes a new one), the command packed in
        one join. A connection found broken is replaced and, with ``resend``, the
        command sent once more: the caller (:meth:`run`) says whether a second send
        is safe if the first did run. A timeout is not retried: the caller decides.

        Under Sentinel the connection asks the Sentinels for the master whenever
        it (re)connects, and a READONLY reply (a demoted master) disconnects it:
        the second send goes to the new master. With ``wait`` a ``WAIT`` follows
        the script in the same write, and both replies are read.
        """
        data = self._packed(sha, keys, args, wait)
        conn = self._held_conn()
        for attempt in (1, 2):
            try:
                exchange.send(conn, data)
                return self._read(conn, wait)
            except (ResponseError, Unreplicated):
                raise  # every reply was read: the connection is still in step
            except RedisConnectionError:
                conn.disconnect()
                if attempt == 2 or not resend:
                    raise
                conn.connect()  # not left to send_packed_command: that one skips Sentinel's master lookup
            except BaseException:
                _out_of_step(conn)
                raise
        raise AssertionError("unreachable")

    def error(self, exc: Exception, key: str) -> LockError:
        """Our error for a redis-py one: transient (try again) or a refusal (fix something)."""
        return refusals.classify(exc, self.url, key)

    def _renew_replies(self, chunks: Sequence[Sequence[Lock]]) -> list[Any]:
        """RENEW_MANY over ``chunks`` in one pipelined round trip, sent once more after reloading the
        script if Redis lost it (restart, SCRIPT FLUSH, failover): what every batched renewal uses."""
        replies = self._pipeline_evalsha(self._sha(scripts.RENEW_MANY), chunks)
        if any(isinstance(r, NoScriptError) for r in replies):
            replies = self._pipeline_evalsha(self._load_here(scripts.RENEW_MANY), chunks)
        return replies

    def _pipeline_evalsha(self, sha: str, chunks: Iterable[Sequence[Lock]]) -> list[Any]:
        """The batched renewal: every chunk's EVALSHA packed here and sent in one write on this
        thread's held connection, then each reply read (an error reply is kept, not raised).
        redis-py's pipeline packs a 1,000-argument command in pure Python, at several times the cost."""
        parts = [wire.pack_renewals(sha, part) for part in chunks]
        if self.min_replicas > 0:
            parts.append(wire.pack_wait(self.min_replicas, ms(self.replica_timeout)))
        conn = self._held_conn()
        data = b"".join(parts)
        for attempt in (1, 2):  # a connection found broken (a restart, a failover) is replaced once
            try:
                conn.send_packed_command([data], check_health=False)
                replies: list[Any] = []
                for _ in parts:
                    try:
                        replies.append(conn.read_response())
                    except ResponseError as exc:
                        replies.append(exc)
                return replies
            except RedisConnectionError:
                conn.disconnect()
                if attempt == 2:
                    raise
                conn.connect()
            except RedisError:
                conn.disconnect()  # the next round connects anew
                raise
        raise AssertionError("unreachable")

    def _held_conn(self) -> Any:
        """This thread's own connection, taken from the pool and kept (a forked child takes a new one)."""
        held = self._held
        conn = getattr(held, "conn", None)
        if conn is None or conn.pid != os.getpid():
            conn = held.conn = exchange.checkout(self.client.connection_pool)
        return conn

    def _unreplicated_reason(self, acked: int) -> str:
        return (
            f"renewal acknowledged by {acked} of the {self.min_replicas} replica(s) required "
            f"(singleton_lock_min_replicas) within {self.replica_timeout:g}s"
        )


def _describe(client: redis.Redis) -> str:
    kwargs = client.connection_pool.connection_kwargs
    if "path" in kwargs:
        return f"unix://{kwargs['path']}?db={kwargs.get('db', 0)}"
    return f"redis://{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}/{kwargs.get('db', 0)}"
