"""The hot path's own round trip (engine/exchange.py): the parser as a pure function, then the reads
against a private redis-server, over RESP2 and RESP3, with late replies, a frozen server and an
error reply."""

from __future__ import annotations

import signal
import socket

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError

from celery_singleton_lock.engine import exchange
from celery_singleton_lock.engine.lock import Holder, Lock, Release
from celery_singleton_lock.engine.server import LockServer
from celery_singleton_lock.exceptions import LockBackendRefused, LockBackendUnavailable
from celery_singleton_lock.testing.servers import RedisServer, wait_until

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("data, expected", [
    (b":42\r\n", 42),
    (b"$-1\r\n", None),
    (b"_\r\n", None),
    (b"$5\r\nhe\r\no\r\n", b"he\r\no"),  # a bulk string holds CRLF
    (b"+OK\r\n", b"OK"),
    (b"*3\r\n:1\r\n$1\r\nx\r\n*1\r\n:-2\r\n", [1, b"x", [-2]]),
    (b"*-1\r\n", None),
    (b"#t\r\n", True),
    (b",1.5\r\n", 1.5),
    (b"(12345678901234567890\r\n", 12345678901234567890),
    (b"%1\r\n$1\r\na\r\n:1\r\n", {b"a": 1}),
    (b"~2\r\n:1\r\n:2\r\n", [1, 2]),
    (b"=8\r\ntxt:abcd\r\n", b"abcd"),
])
def test_one_reply_of_each_shape(data, expected):
    assert exchange._parse_all(data, 1) == ([expected], [], len(data))


def test_errors_are_redis_pys_classes_and_pushes_are_dropped():
    replies, pushes, _ = exchange._parse_all(
        b">2\r\n$7\r\nmessage\r\n:1\r\n-NOSCRIPT No matching script\r\n:0\r\n>1\r\n$3\r\nbye\r\n", 2)
    assert isinstance(replies[0], NoScriptError) and replies[1] == 0
    assert pushes == [[b"message", 1], [b"bye"]]  # (handed to redis-py's push handlers)
    replies, _, _ = exchange._parse_all(b"!20\r\nERR something failed\r\n", 1)
    assert type(replies[0]) is ResponseError and "something failed" in str(replies[0])


@pytest.mark.parametrize("cut", [b":4", b"$5\r\nhe", b"*2\r\n:1\r\n", b"%1\r\n$1\r\na\r\n"])
def test_a_reply_cut_short_asks_for_more(cut):
    with pytest.raises(exchange._More):
        exchange._parse_all(cut, 1)


@pytest.fixture(scope="module")
def redis():
    with RedisServer() as server:
        yield server


@pytest.mark.parametrize("protocol", [2, 3])
def test_the_lock_over_resp2_and_resp3(redis, protocol):
    """The same answers whichever protocol the user's client speaks (redis-py 8 speaks RESP3 unless told)."""
    server = LockServer.from_url(redis.url(2), protocol=protocol)
    lock = server.acquire(f"p{protocol}", 5, owner_id="first")
    assert isinstance(lock, Lock) and server._held_conn().protocol in (protocol, str(protocol))
    seen = server.acquire(f"p{protocol}", 5, owner_id="second")
    assert isinstance(seen, Holder) and seen.owner_id == "first"
    assert lock.fencing_token > 0 and server.holder(f"p{protocol}").fencing_token == lock.fencing_token
    assert server.release(lock).status is Release.DELETED and server.holder(f"p{protocol}") is None
    server.close()


def test_replies_later_than_the_spin_are_read_and_the_connection_stops_spinning(redis, monkeypatch):
    """A reply that comes after the spin (here: a script that runs ~20 ms) is read by the blocking
    read; a connection whose replies keep coming late stops spinning for a while (a remote Redis).
    (Which reads miss the spin is made certain: a process preempted longer than the script during its
    spin finds the reply there when it resumes, a hit, on a loaded machine.)"""
    server = LockServer.from_url(redis.url(2))
    # (on Redis 6.2 the first release also learns that its SET takes no NX GET)
    assert server.release(server.acquire("warm", 5)).status is Release.DELETED
    slow = "local n = 0 for i = 1, 3000000 do n = n + i end return n"
    assert server.run(slow, ("x",), ()) == sum(range(1, 3_000_001))  # read after the spin, or in it
    conn = server._held_conn()
    conn._csl_misses = conn._csl_rest = 0  # (the calls above may have missed too, on a loaded machine)
    monkeypatch.setattr(exchange, "_spin", lambda fd: None)  # every spin misses from here
    for _ in range(exchange.REST_AFTER):
        assert server.run(slow, ("x",), ()) == sum(range(1, 3_000_001))
    monkeypatch.undo()
    assert conn._csl_rest == exchange.REST_FOR
    lock = server.acquire("late", 5)
    assert isinstance(lock, Lock) and conn._csl_rest == exchange.REST_FOR - 1  # read without a spin
    assert server.release(lock).status is Release.DELETED
    server.close()


@pytest.mark.parametrize("reply, raised", [
    ("ERR boom", LockBackendRefused),  # a script's error: kept in step, raised as a refusal
    ("LOADING Redis is loading the dataset in memory", LockBackendUnavailable),
])
def test_an_error_reply_is_raised_and_the_next_call_works(redis, reply, raised):
    """A script's error reply is raised, the connection kept in step. -LOADING (a Redis still loading
    its data after a restart) is a connection error in redis-py: raised, not returned as the reply;
    the connection is dropped and the call sent once more, then reported as unavailable."""
    server = LockServer.from_url(redis.url(2))
    with pytest.raises(raised, match=reply.split()[-1]):
        server.run(f"return redis.error_reply('{reply}')", ("x",), ())
    lock = server.acquire("after-error", 5)
    assert isinstance(lock, Lock) and server.release(lock).status is Release.DELETED
    server.close()


class Interrupted(Exception):
    """What a Celery soft time limit is: an exception raised in the middle of whatever runs."""


@pytest.mark.parametrize("cut_by", ["timeout", "interrupt"])
def test_a_read_cut_short_drops_the_connection(cut_by):
    """The reply arrives after the read stopped: on the socket timeout (the server frozen past it), or
    on an exception raised in the middle of the wait (what a Celery soft time limit is). The connection
    is dropped, so the next call cannot read that reply as its own: the acquire of a key held by
    someone else then says so."""
    with RedisServer() as redis:
        mine = LockServer.from_url(redis.url(2), socket_timeout=0.2 if cut_by == "timeout" else 10)
        other = LockServer.from_url(redis.url(2))
        theirs = other.acquire("theirs", 30)
        assert isinstance(theirs, Lock) and isinstance(mine.acquire("warm", 30), Lock)

        def interrupt(*_):
            raise Interrupted

        old = signal.signal(signal.SIGALRM, interrupt)
        redis.pause()
        try:
            if cut_by == "interrupt":
                signal.setitimer(signal.ITIMER_REAL, 0.2)
            with pytest.raises(Interrupted if cut_by == "interrupt" else LockBackendUnavailable):
                mine.acquire("cut", 30)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
            redis.resume()
        with redis.client(2) as c:
            wait_until(lambda: c.exists("{cut}"), 5, 0.02, "the cut-short acquire to run")
        assert isinstance(mine.acquire("theirs", 30), Holder)
        mine.close()
        other.close()


def test_a_closed_connection_is_a_connection_error_and_the_next_call_reconnects(redis):
    server = LockServer.from_url(redis.url(2))
    conn = server._held_conn()
    assert isinstance(server.acquire("c1", 5), Lock)
    with redis.client(2) as c:
        c.client_kill_filter(_id=_client_id(c, conn))
        wait_until(lambda: conn._sock.recv(16, socket.MSG_PEEK) == b"", 5, 0.01, "the server to close it")
    with pytest.raises(RedisConnectionError):
        exchange.read(conn, 1)  # a closed socket says so, and is dropped
    assert conn._sock is None
    lock = server.acquire("c2", 5)  # the next call connects again
    assert isinstance(lock, Lock) and server.release(lock).status is Release.DELETED
    server.close()


def _client_id(c, conn) -> int:
    port = conn._sock.getsockname()[1]
    return next(cl["id"] for cl in c.client_list() if cl["addr"].endswith(f":{port}"))


def _plain(words) -> bytes:
    """A plain command in RESP (the package sends scripts only; these tests send plain commands)."""
    return (f"*{len(words)}\r\n" + "".join(f"${len(w)}\r\n{w}\r\n" for w in words)).encode()


def test_send_writes_what_it_is_given(redis):
    server = LockServer.from_url(redis.url(2))
    conn = server._held_conn()
    exchange.send(conn, _plain(("SET", "w", "v")) + _plain(("GET", "w")))
    assert exchange.read(conn, 2) == [b"OK", b"v"]
    server.close()


def test_the_private_names_of_redis_py_it_reads_are_there_and_a_push_reaches_its_handler(redis):
    """The exchange reads redis-py's private ``Connection._sock``, ``_parser.handle_push_response`` and
    ``redis._parsers.base.BaseParser``. The support matrix runs this on every redis-py we declare: it
    fails the day one of them changes. A RESP3 invalidation push read by the exchange reaches the
    handler the user's client set, whatever the handler's signature in that redis-py."""
    server = LockServer.from_url(redis.url(2), protocol=3)
    conn = server._held_conn()
    exchange.send(conn, _plain(["PING"]))
    assert exchange.read(conn) == [b"PONG"]
    assert type(conn._sock) is socket.socket, "redis-py's Connection._sock is not the plain socket any more"
    assert callable(conn._parser.handle_push_response)
    got: list[list[bytes]] = []
    setter = getattr(conn._parser, "set_invalidation_push_handler", None)
    if setter is not None:  # (redis-py 5.0's parser only logs pushes)
        setter(got.append)
    exchange.send(conn, _plain(["CLIENT", "TRACKING", "ON"]) + _plain(["GET", "tracked"]))
    assert exchange.read(conn, 2) == [b"OK", None]
    redis.client(2).set("tracked", "changed")  # -> an invalidation push on the tracking connection
    for _ in range(20):  # (the push comes after the SET's reply: it may need a later read)
        exchange.send(conn, _plain(["PING"]))
        assert exchange.read(conn) == [b"PONG"]
        if got or setter is None:
            break
    if setter is not None:
        assert got and got[0][0] == b"invalidate", got
    server.close()


def test_spin_off_reads_by_sleeping_at_once_and_the_setting_turns_it_off(redis):
    """``singleton_lock_spin=False``: each worker process (set as it starts) reads replies without
    spinning first; the lock works the same."""
    from celery import Celery

    from celery_singleton_lock.worker import workers

    app = Celery("spin_off", set_as_current=False)
    app.conf.singleton_lock_spin = False
    try:
        workers.watch_app(app)
        assert exchange.SPIN_NS == 0
        server = LockServer.from_url(redis.url(2))
        lock = server.acquire("no-spin", 5)
        assert isinstance(lock, Lock) and server.release(lock).status is Release.DELETED
        conn = server._held_conn()
        assert getattr(conn, "_csl_misses", 0) == 0 and getattr(conn, "_csl_rest", 0) == 0  # never spun
        server.close()
    finally:
        exchange.spin(True)
    assert exchange.SPIN_NS == 150_000
