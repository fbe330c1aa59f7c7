"""Send one script to several Redis servers at once, without a thread per server: :class:`MemberPipe`.

A quorum operation goes to every member and is decided once a majority answered. With a thread
per member, each operation paid a hand-off to every thread and back, and cost several times a
single server. Here each member has ONE connection per process, shared by every thread and used
in pipelined mode: a command is written to every member's socket, then the replies are read as
they arrive (``select``), so an operation costs about one round trip of wall time however many
members there are.

Replies come back in the order the commands were sent. So a member that is stopped or slow keeps
its unanswered commands in order: a release written behind an acquire runs after it, never
before. A member whose oldest unanswered command is older than :data:`STUCK_AFTER` is skipped by
operations that can do without its vote, but not by those that must reach it (``force``: the
release of an acquire it may still run). A connection that breaks fails every command still
waiting on it; the next command connects again (not before :data:`RECONNECT_AFTER`).
"""

from __future__ import annotations

import hashlib
import os
import select
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from redis.exceptions import NoScriptError, RedisError, ResponseError

from ..engine import wire
from ..engine.server import LockServer
from ..exceptions import LockBackendUnavailable

STUCK_AFTER = 0.1
"""Seconds a member may take over a command before the next optional ones skip it (a stopped member)."""
RECONNECT_AFTER = 0.2
"""Seconds a member whose connection could not be made is left alone before the next try (doubling
after each failure, up to RECONNECT_MAX)."""
RECONNECT_MAX = 5.0
CONNECT_TIMEOUT = 0.25
"""At most this long to connect to a member (a host that drops packets must not hold every operation)."""
READ_TIMEOUT = 0.05
"""A reply begun but not finished within this is a broken connection (it is dropped, not waited on)."""
STALE_AFTER = 120.0
"""A member silent this long on its oldest command (a host gone without a word) gets a new connection."""
POLL = 0.002
"""Longest sleep in :func:`gather` between looks: another thread may read our reply off the socket."""

_pipes: weakref.WeakSet[MemberPipe] = weakref.WeakSet()


def _after_fork() -> None:
    """A forked child: the parent's sockets, answers and locks are not its own (a lock held by another
    thread of the parent at the fork would never be released here)."""
    for pipe in list(_pipes):
        pipe._reset()


os.register_at_fork(after_in_child=_after_fork)

PENDING: Any = object()
"""A member asked and not answered yet (in :func:`gather`'s results)."""
SKIPPED = LockBackendUnavailable("(quorum member)", "still busy with an earlier operation: skipped")
"""A member not asked: busy (see STUCK_AFTER), or not among those the operation goes to."""


class NotSent(LockBackendUnavailable):
    """The command never left this process (no connection to the member): it cannot run there later."""


class Call:
    """What one operation sent to one member: ``parts`` commands, answered in order."""

    __slots__ = ("sent", "parts", "replies", "reply", "done", "handshake")

    def __init__(self, sent: float, parts: int = 1, *, handshake: bool = False) -> None:
        self.sent = sent
        self.parts = parts
        self.handshake = handshake  # AUTH, SELECT, SCRIPT LOAD: an error reply breaks the connection
        self.replies: list[Any] = []
        self.reply: Any = None  # the one reply, or the list of replies (parts > 1), or an error
        self.done = False

    def finish(self, reply: Any) -> None:
        self.reply, self.done = reply, True


class MemberPipe:
    """One member's pipelined connection, shared by every thread of this process (see the module doc)."""

    def __init__(self, server: LockServer, scripts: Sequence[str]) -> None:
        self.server = server
        self.url = server.url
        self._shas = {s: hashlib.sha1(s.encode()).hexdigest() for s in scripts}  # noqa: S324 (Redis's own SHA1)
        self._reset()
        _pipes.add(self)

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._conn: Any = None
        self._calls: deque[Call] = deque()  # sent, not yet answered, oldest first
        self._retry_at = 0.0
        self._backoff = RECONNECT_AFTER

    # -- sending ----------------------------------------------------------------

    def send(self, script: str, commands: Sequence[tuple[Sequence[str], Sequence[Any]]], *,
             force: bool = False) -> Call | None:
        """Write ``script`` once per (keys, args) in ``commands``, in one write; None when skipped.

        A member that could not take it gets a Call that is already done with the error."""
        with self._lock:
            now = time.monotonic()
            self._pump()
            if self._calls and now - self._calls[0].sent > STALE_AFTER:
                self._fail_all(ConnectionError(f"no answer for {STALE_AFTER:g}s"))
            if self._calls and now - self._calls[0].sent > STUCK_AFTER and not force:
                return None
            call = Call(now, len(commands))
            try:
                conn = self._connection(now)
            except (RedisError, OSError, LockBackendUnavailable) as exc:
                call.finish(NotSent(self.url, str(exc) or type(exc).__name__))
                return call
            try:
                sha = self._shas[script]
                conn.send_packed_command([b"".join(wire.pack(sha, k, a) for k, a in commands)], check_health=False)
            except (RedisError, OSError) as exc:
                self._fail_all(exc)
                call.finish(LockBackendUnavailable(self.url, str(exc) or type(exc).__name__))
                return call
            self._calls.append(call)
            return call

    def _connection(self, now: float) -> Any:
        """The connection (made now if needed, with every script loaded ahead of the first command)."""
        if self._conn is not None:
            return self._conn
        if now < self._retry_at:
            raise LockBackendUnavailable(self.url, "could not connect a moment ago")
        pool = self.server.client.connection_pool  # a connection of our own, not one of the pool's slots
        kwargs = dict(pool.connection_kwargs)
        kwargs["socket_connect_timeout"] = min(kwargs.get("socket_connect_timeout") or CONNECT_TIMEOUT,
                                               CONNECT_TIMEOUT)
        conn = pool.connection_class(**kwargs)
        # The handshake (AUTH, SELECT) is pipelined ahead of the scripts rather than waited for at
        # connect: a stopped member accepts the TCP connection but answers nothing, and this thread
        # must not wait on it. So connect() gets nothing to send (no CLIENT SETINFO either).
        hello = _handshake(conn)
        try:
            conn.connect()
            # SCRIPT LOAD before anything else on this connection: an EVALSHA written behind it finds the
            # script even on a server that just restarted empty (a restart always breaks the connection)
            conn.send_packed_command([b"".join(hello + [_pack("SCRIPT", "LOAD", s) for s in self._shas])],
                                     check_health=False)
        except (RedisError, OSError):
            self._retry_at = now + self._backoff
            self._backoff = min(self._backoff * 2, RECONNECT_MAX)
            conn.disconnect()
            raise
        self._conn = conn
        self._backoff = RECONNECT_AFTER
        for _ in range(len(hello) + len(self._shas)):
            self._calls.append(Call(now, handshake=True))  # their answers (OK, the SHAs) are read and dropped
        return conn

    # -- reading ----------------------------------------------------------------

    def pump(self) -> None:
        """Read every answer already here, without waiting."""
        with self._lock:
            self._pump()

    def _pump(self) -> None:
        conn = self._conn
        if conn is None:
            return
        if not self._calls:  # nothing expected: something to read means the server closed it (a restart)
            try:
                if conn.can_read(0):
                    self._fail_all(ConnectionError("closed by the server"))
            except (RedisError, OSError) as exc:
                self._fail_all(exc)
            return
        while self._calls:
            try:
                if not conn.can_read(0):
                    return
                try:
                    reply = self._read_one(conn)
                except NoScriptError as exc:  # a SCRIPT FLUSH: fail what waits, load them again on a new connection
                    self._fail_all(exc)
                    return
                except ResponseError as exc:
                    if self._calls[0].handshake:  # a wrong password, a database that does not exist
                        self._retry_at = time.monotonic() + self._backoff
                        self._fail_all(exc)
                        return
                    reply = exc
            except (RedisError, OSError) as exc:
                self._fail_all(exc)
                return
            call = self._calls[0]
            call.replies.append(reply)
            if len(call.replies) == call.parts:
                self._calls.popleft()
                call.finish(call.replies[0] if call.parts == 1 else call.replies)

    @staticmethod
    def _read_one(conn: Any) -> Any:
        """One reply, already arriving (can_read said so): a reply begun but not finished within
        READ_TIMEOUT raises (the connection is then dropped), so a member frozen in the middle of a
        reply cannot hold the other members' operations, which wait on this pipe's lock."""
        sock = conn._sock
        sock.settimeout(READ_TIMEOUT)
        try:
            return conn.read_response(disconnect_on_error=False)
        finally:
            if conn._sock is sock:
                sock.settimeout(conn.socket_timeout)

    def _fail_all(self, exc: BaseException) -> None:
        """The connection broke: every command still waiting on it failed; the next send connects anew."""
        error = LockBackendUnavailable(self.url, str(exc) or type(exc).__name__)
        for call in self._calls:
            call.finish(error)
        self._calls.clear()
        if self._conn is not None:
            self._conn.disconnect()
            self._conn = None

    def fileno(self) -> int | None:
        """The socket's descriptor, None when there is none (read without the lock: may be stale)."""
        sock = getattr(self._conn, "_sock", None)
        fd = sock.fileno() if sock is not None else -1
        return fd if fd >= 0 else None

    def close(self) -> None:
        with self._lock:
            self._fail_all(ConnectionError("closed"))


def gather(pipes: Sequence[MemberPipe], calls: Sequence[Call | None], decided: Callable[[list[Any]], bool],
           deadline: float) -> list[Any]:
    """The members' answers as they come, in member order: until ``decided(answers so far)``, all
    answered, or ``deadline`` (``time.monotonic()``). ``PENDING`` for a member asked and not answered,
    ``SKIPPED`` for one not asked. What is not read here is read by the member's next operation."""
    results: list[Any] = [SKIPPED if c is None else PENDING for c in calls]
    while True:
        waiting = []
        for i, call in enumerate(calls):
            if call is None or results[i] is not PENDING:
                continue
            if not call.done:
                pipes[i].pump()
            if call.done:
                results[i] = call.reply
            else:
                waiting.append(i)
        if not waiting or decided(results):
            return results
        left = deadline - time.monotonic()
        if left <= 0:
            return results
        poller = select.poll()  # not select.select: no limit on the descriptor's number
        for fd in (pipes[i].fileno() for i in waiting):
            if fd is not None:
                try:
                    poller.register(fd, select.POLLIN)
                except (OSError, ValueError):  # closed meanwhile
                    pass
        try:
            poller.poll(max(1, int(min(left, POLL) * 1000)))
        except (OSError, ValueError):  # a socket closed by another thread meanwhile: look again
            pass


def _pack(*words: str) -> bytes:
    """One command in RESP."""
    parts = [b"*%d\r\n" % len(words)]
    for word in words:
        data = word.encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


def _handshake(conn: Any) -> list[bytes]:
    """Take AUTH and SELECT off ``conn``'s connect (and HELLO, CLIENT SETINFO, CLIENT SETNAME), and return them
    packed, to be written ahead of the first commands instead."""
    out = []
    provider = getattr(conn, "credential_provider", None)
    if provider is not None or getattr(conn, "password", None):
        creds = provider.get_credentials() if provider is not None else (conn.username, conn.password)
        out.append(_pack("AUTH", *[c for c in creds if c]))
    if getattr(conn, "db", 0):
        out.append(_pack("SELECT", str(conn.db)))
    for attr in ("credential_provider", "username", "password", "client_name", "driver_info", "lib_name",
                 "lib_version"):
        if hasattr(conn, attr):
            setattr(conn, attr, None)
    conn.db = 0
    conn.protocol = 2  # no HELLO either (redis-py 8 speaks RESP3 by default): RESP2 replies read the same
    return out
