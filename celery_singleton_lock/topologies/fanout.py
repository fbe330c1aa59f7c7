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
"""Seconds a member whose connection could not be made is left alone before the next try."""
POLL = 0.002
"""Longest sleep in :func:`gather` between looks: another thread may read our reply off the socket."""

PENDING: Any = object()
"""A member asked and not answered yet (in :func:`gather`'s results)."""
SKIPPED = LockBackendUnavailable("(quorum member)", "still busy with an earlier operation: skipped")
"""A member not asked: busy (see STUCK_AFTER), or not among those the operation goes to."""


class Call:
    """What one operation sent to one member: ``parts`` commands, answered in order."""

    __slots__ = ("sent", "parts", "replies", "reply", "done")

    def __init__(self, sent: float, parts: int = 1) -> None:
        self.sent = sent
        self.parts = parts
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
        self._lock = threading.Lock()
        self._conn: Any = None
        self._pid = os.getpid()
        self._calls: deque[Call] = deque()  # sent, not yet answered, oldest first
        self._retry_at = 0.0

    # -- sending ----------------------------------------------------------------

    def send(self, script: str, commands: Sequence[tuple[Sequence[str], Sequence[Any]]], *,
             force: bool = False) -> Call | None:
        """Write ``script`` once per (keys, args) in ``commands``, in one write; None when skipped.

        A member that could not take it gets a Call that is already done with the error."""
        with self._lock:
            now = time.monotonic()
            self._pump()
            if self._calls and now - self._calls[0].sent > STUCK_AFTER and not force:
                return None
            call = Call(now, len(commands))
            try:
                conn = self._connection(now)
                sha = self._shas[script]
                conn.send_packed_command([b"".join(wire.pack(sha, k, a) for k, a in commands)], check_health=False)
            except (RedisError, OSError, LockBackendUnavailable) as exc:
                self._fail_all(exc)
                unavailable = exc if isinstance(exc, LockBackendUnavailable) else None
                call.finish(unavailable or LockBackendUnavailable(self.url, str(exc) or type(exc).__name__))
                return call
            self._calls.append(call)
            return call

    def _connection(self, now: float) -> Any:
        """The connection (made now if needed, with every script loaded ahead of the first command)."""
        if self._pid != os.getpid():  # a forked child: the parent's socket and answers are not ours
            self._pid, self._conn, self._calls = os.getpid(), None, deque()
        if self._conn is not None:
            return self._conn
        if now < self._retry_at:
            raise LockBackendUnavailable(self.url, "could not connect a moment ago")
        conn = self.server.client.connection_pool.make_connection()
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
            self._retry_at = now + RECONNECT_AFTER
            conn.disconnect()
            raise
        self._conn = conn
        for _ in range(len(hello) + len(self._shas)):
            self._calls.append(Call(now))  # their answers (OK, the SHAs) are read and dropped like any other
        return conn

    # -- reading ----------------------------------------------------------------

    def pump(self) -> None:
        """Read every answer already here, without waiting."""
        with self._lock:
            self._pump()

    def _pump(self) -> None:
        conn = self._conn
        if conn is None or self._pid != os.getpid():
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
                    reply = conn.read_response(disconnect_on_error=False)
                except NoScriptError as exc:  # a SCRIPT FLUSH: fail what waits, load them again on a new connection
                    self._fail_all(exc)
                    return
                except ResponseError as exc:
                    reply = exc
            except (RedisError, OSError) as exc:
                self._fail_all(exc)
                return
            call = self._calls[0]
            call.replies.append(reply)
            if len(call.replies) == call.parts:
                self._calls.popleft()
                call.finish(call.replies[0] if call.parts == 1 else call.replies)

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
        sock = getattr(self._conn, "_sock", None)
        return sock.fileno() if sock is not None else None

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
                poller.register(fd, select.POLLIN)
        try:
            poller.poll(max(1, int(min(left, POLL) * 1000)))
        except OSError:  # a socket closed by another thread meanwhile: look again
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
