"""One round trip on a held connection: the bytes :mod:`.wire` packed, written to the socket, and the
replies read straight off it, without redis-py's per-call layers.

Why, measured on a 2-core VM against a loopback Redis: a ping costs about 30 µs when the reply is
waited for by trying the socket again and again, and about 100 µs when the thread sleeps in the
kernel until it comes. Most of the difference is the wake-up, not the network. redis-py also polls
the socket before every send and every read of a connection with a timeout, and parses a reply in
pure Python through a buffer, a parser and the connection's error handling (hiredis is not required).
A task's lock is two round trips, so that is the bulk of its cost.

So :func:`read` first spins: it tries the socket without blocking, yielding the core between tries
(another process, Redis itself perhaps, may need it), for up to :data:`SPIN_NS`; only then does it
sleep until the reply or the connection's timeout. A connection whose replies keep coming later than
that (a remote Redis) stops spinning for a while (:data:`REST_AFTER`), so a spin never costs more
than it saves for long. Our replies are small and of few shapes, parsed here (RESP2 and RESP3).

Only the replies asked for are read, so the connection's own buffer stays empty and redis-py can go
on using it; a RESP3 push nobody asked for is dropped. Errors come out as redis-py's would: a
``-NOSCRIPT`` reply as its ``NoScriptError`` (kept in its place for the caller), a timeout as its
``TimeoutError``, a broken or closed socket as its ``ConnectionError`` after a disconnect, and a
demoted Sentinel master's ``-READONLY`` as a ``ConnectionError`` after a disconnect, so that the next
connect asks the Sentinels again. An SSL connection, or one not yet open, goes through redis-py.
"""

from __future__ import annotations

import inspect
import logging
import os
import socket
import time
from typing import Any, TypeGuard

from redis._parsers.base import BaseParser
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

logger = logging.getLogger("celery_singleton_lock")

SPIN_NS = 150_000
"""How long a read tries the socket without sleeping (ns): a few loopback round trips."""

REST_AFTER = 3
"""Replies in a row that came after the spin: the connection then sleeps at once for :data:`REST_FOR` reads."""

REST_FOR = 64


def checkout(pool: Any) -> Any:
    """A connection taken from ``pool`` for a thread to keep. redis-py 5.3 and newer take no argument
    (and warn at one); 5.0 - 5.2 require a command name, which only picks a node in a cluster."""
    try:
        return pool.get_connection()
    except TypeError:
        return pool.get_connection("_")


def send(conn: Any, data: bytes) -> None:
    """Write ``data`` on ``conn`` (connecting it first if it is not open). Anything that stops the
    write half-way drops the connection: half a command must not prefix the next one."""
    sock = getattr(conn, "_sock", None)
    if sock is None and hasattr(conn, "_sock"):
        conn.connect()  # (itself: send_packed_command's own connect skips a Sentinel's master lookup)
        sock = conn._sock
    if not _plain(sock):  # SSL, no timeout, a wrapper (client-side caching), a green socket: redis-py's way
        conn.send_packed_command([data], check_health=False)
        return
    try:
        try:
            sent = os.write(sock.fileno(), data)  # (no poll first: a small write goes into the socket's buffer)
        except BlockingIOError:
            sent = 0
        if sent < len(data):
            sock.sendall(data[sent:])
    except BaseException as exc:
        error = _dropped(conn, exc, "writing to")
        if error is exc:
            raise
        raise error from None


def read(conn: Any, n: int = 1) -> list[Any]:
    """The next ``n`` replies on ``conn``, in order; an error reply is kept in its place as its
    :class:`ResponseError` (the caller raises or keeps it), except those redis-py raises as connection
    errors (LOADING, NOAUTH, ...): raised, the connection dropped. Strings come back as bytes.

    Anything that stops the read half-way (a timeout, a broken socket, a soft time limit raised
    in the middle) drops the connection: the rest of the reply must not be read as the next one's."""
    sock = getattr(conn, "_sock", None)
    if not _plain(sock):
        return [_through_redis_py(conn) for _ in range(n)]
    try:
        replies, pushes = _read(conn, sock, n)
    except BaseException as exc:
        error = _dropped(conn, exc, "reading from")
        if error is exc:
            raise
        raise error from None
    for push in pushes:
        _hand_on(conn, push)
    for reply in replies:
        if isinstance(reply, RedisConnectionError):  # LOADING, NOAUTH, ...: as redis-py raises them
            conn.disconnect()
            raise reply
    if any(isinstance(reply, ReadOnlyError) for reply in replies) and \
            getattr(getattr(conn, "connection_pool", None), "is_master", False):
        conn.disconnect()  # as redis-py's Sentinel connection does: a demoted master; ask the Sentinels again
        raise RedisConnectionError("The previous master is now a replica")
    return replies


def _dropped(conn: Any, exc: BaseException, doing: str) -> BaseException:
    """Drop a connection a write or a read stopped on half-way (the rest must not be taken for the next
    call's), and say what to raise: redis-py's error for a timeout, a broken socket or bytes that are
    not RESP; anything else (an interrupt such as a soft time limit) as it is."""
    conn.disconnect()
    if isinstance(exc, TimeoutError):
        return RedisTimeoutError(f"Timeout {doing} {_where(conn)}")
    if isinstance(exc, OSError):
        return RedisConnectionError(f"Error {doing} {_where(conn)}: {exc}")
    if isinstance(exc, ValueError):  # (a length or a number that is not one)
        return RedisConnectionError(f"Bytes that are not RESP {doing} {_where(conn)}: {exc}")
    return exc


def spin(on: bool) -> None:
    """Whether this process's reads spin first (``singleton_lock_spin``, set as each worker process starts)."""
    global SPIN_NS
    SPIN_NS = 150_000 if on else 0


def _read(conn: Any, sock: socket.socket, n: int) -> tuple[list[Any], list[Any]]:
    """Spin (unless spinning is off, or this connection rests), then sleep until ``n`` whole replies are in."""
    data = _spun(conn, sock) if SPIN_NS else None
    data = data or b""
    while True:
        if data:
            try:
                replies, pushes, end = _parse_all(data, n)
                break
            except _More:
                pass
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionResetError("closed by the server")
        data += chunk
    if end != len(data):  # more than the replies asked for: out of step with the server
        raise ConnectionResetError(f"{len(data) - end} bytes past the {n} replies asked for")
    return replies, pushes


def _spun(conn: Any, sock: socket.socket) -> bytes | None:
    """What a spin on ``conn`` read (None: nothing came, or the connection rests from spinning)."""
    rest = getattr(conn, "_csl_rest", 0)
    if rest > 0:
        conn._csl_rest = rest - 1
        return None
    data = _spin(sock.fileno())
    if data is None:  # the spin missed: count it
        conn._csl_misses = misses = getattr(conn, "_csl_misses", 0) + 1
        if misses >= REST_AFTER:
            conn._csl_rest, conn._csl_misses = REST_FOR, 0
    else:
        conn._csl_misses = 0
    return data


def _plain(sock: Any) -> TypeGuard[socket.socket]:
    """A plain (not SSL, not green) socket with a timeout: its fd is non-blocking, so it can be spun on."""
    return type(sock) is socket.socket and _REAL_SOCKET and bool(sock.gettimeout())


_REAL_SOCKET = socket.socket.__module__ == "socket"  # (gevent or eventlet patched it: a spin would stall the hub)


def _hand_on(conn: Any, push: list[Any]) -> None:
    """A push frame (RESP3: a maintenance notice, an invalidation) to redis-py's handlers, as its own
    parser would have passed it. The parser's ``handle_push_response`` takes the frame alone on
    redis-py 5.0, two more arguments on 5.1 - 6.1, and keywords from 6.2 on
    (tests/engine/test_exchange.py runs it on each in the support matrix)."""
    handle = getattr(getattr(conn, "_parser", None), "handle_push_response", None)
    if handle is None:
        return
    try:
        if _takes_decoding(handle):
            handle(list(push), disable_decoding=False, push_request=False)
        else:
            handle(list(push))
    except Exception:  # (a handler's failure is not the lock's)
        logger.warning("a push frame from %s was not handled", _where(conn), exc_info=True)


def _takes_decoding(handle: Any) -> bool:
    """Whether redis-py's ``handle_push_response`` takes ``disable_decoding`` (by name or ``**kwargs``)."""
    params = inspect.signature(handle).parameters.values()
    return any(p.name == "disable_decoding" or p.kind is p.VAR_KEYWORD for p in params)


def _spin(fd: int) -> bytes | None:
    """What the socket has within :data:`SPIN_NS`, tried without sleeping; None if nothing came.
    (``os.read``: the fd of a socket with a timeout is non-blocking, and Python's ``recv`` would
    poll first.)"""
    deadline = time.perf_counter_ns() + SPIN_NS
    while True:
        try:
            return os.read(fd, 65536) or None  # (b"": closed; the blocking read after says so)
        except BlockingIOError:
            if time.perf_counter_ns() > deadline:
                return None
            os.sched_yield()


def _where(conn: Any) -> str:
    path = getattr(conn, "path", None)
    return str(path) if path else f"{getattr(conn, 'host', '?')}:{getattr(conn, 'port', '?')}"


def _through_redis_py(conn: Any) -> Any:
    try:
        return conn.read_response()
    except ResponseError as exc:
        return exc


class _More(Exception):
    """The bytes so far end inside a reply: read more."""


class _Push(list):  # type: ignore[type-arg]
    """A RESP3 push frame (a notice nobody asked for)."""


def _parse_all(data: bytes, n: int) -> tuple[list[Any], list[Any], int]:
    """``n`` replies from the start of ``data``, the push frames among them apart, and where they end."""
    replies: list[Any] = []
    pushes: list[Any] = []
    pos = 0
    while len(replies) < n or (pos < len(data) and data[pos] == 62):  # (a push after the replies)
        reply, pos = _parse(data, pos)
        (pushes if isinstance(reply, _Push) else replies).append(reply)
    return replies, pushes, pos


def _parse(data: bytes, pos: int) -> tuple[Any, int]:
    """One reply (RESP2 or RESP3) at ``pos``: (the reply, where the next begins); :class:`_More` if it is cut."""
    end = data.find(b"\r\n", pos)
    if end < 0:
        raise _More
    kind, line, pos = data[pos], data[pos + 1 : end], end + 2
    if kind == 58:  # ':' an integer
        return int(line), pos
    if kind in (36, 61, 33):  # '$' a bulk string (-1: nil); '=' verbatim text; '!' a long error
        size = int(line)
        if size < 0:
            return None, pos
        if len(data) < pos + size + 2:
            raise _More
        text = data[pos : pos + size]
        if kind == 33:
            return BaseParser.parse_error(text.decode(errors="replace")), pos + size + 2
        return (text[4:] if kind == 61 else text), pos + size + 2
    if kind in (42, 126, 62, 37):  # '*' an array (-1: nil), '~' a set, '>' a push, '%' a map (pairs)
        size = int(line)
        if size < 0:
            return None, pos
        items: list[Any] = _Push() if kind == 62 else []
        for _ in range(size * 2 if kind == 37 else size):
            item, pos = _parse(data, pos)
            items.append(item)
        return (dict(zip(items[::2], items[1::2], strict=True)) if kind == 37 else items), pos
    if kind == 43:  # '+' a status, as redis-py gives it
        return line, pos
    if kind == 45:  # '-' an error, as redis-py's class for it (NOSCRIPT, READONLY, ...)
        return BaseParser.parse_error(line.decode(errors="replace")), pos
    if kind == 95:  # '_' RESP3's nil
        return None, pos
    if kind == 35:  # '#' a boolean
        return line == b"t", pos
    if kind in (44, 40):  # ',' a double, '(' a big number
        return (float(line) if kind == 44 else int(line)), pos
    raise RedisConnectionError(f"unexpected reply type {chr(kind)!r} from the lock Redis")
