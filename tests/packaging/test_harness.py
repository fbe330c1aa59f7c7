"""The test harness itself: private redis-servers we start, pause and stop by PID, and the MONITOR reader."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_singleton_lock.testing import servers as testing
from celery_singleton_lock.testing.servers import Monitor, RedisServer, free_port, wait_until

pytestmark = pytest.mark.timeout(60)


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _refused(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_free_port_is_a_private_loopback_port():
    port = free_port()
    assert port != 6379 and 1024 < port < 65536
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # it really is free


def test_find_redis_server_honours_the_environment(monkeypatch):
    monkeypatch.setenv("REDIS_SERVER", "/opt/some/redis-server")
    assert testing.find_redis_server() == "/opt/some/redis-server"
    monkeypatch.delenv("REDIS_SERVER")
    assert os.access(testing.find_redis_server(), os.X_OK)


def test_fixture_servers_are_ours(redis_server, any_redis):
    for server in (redis_server, any_redis):
        assert server.port != 6379
        assert server.url(2) == f"redis://127.0.0.1:{server.port}/2"
        assert _parent_of(server.pid) == os.getpid()  # started by this process, so stoppable by PID
        with server.client() as c:
            assert c.ping()
            assert c.config_get("save")["save"] == "" and c.config_get("appendonly")["appendonly"] == "no"
        assert server.version() >= (6, 2)


def test_start_restart_stop_by_pid():
    server = RedisServer()
    assert server.port != 6379
    with server:
        first = server.pid
        assert _alive(first)
        with server.client(3) as c:
            c.set("k", "v")
            assert c.get("k") == b"v"
        server.restart()
        assert server.pid != first and not _alive(first)
        with server.client(3) as c:
            assert c.get("k") is None  # same port, no persistence: empty
            assert c.ping()
        second = server.pid
        server.stop()
        assert server.pid is None and not _alive(second)
        assert _refused(server.port)
        server.stop()  # idempotent
    assert not Path(server.dir).exists()


def test_pause_and_resume(fresh_redis):
    with fresh_redis.client(socket_timeout=0.3, retry=Retry(NoBackoff(), 0)) as c:
        c.set("k", "v")
        fresh_redis.pause()
        try:
            with pytest.raises(redis.TimeoutError):
                c.get("k")
            assert _alive(fresh_redis.pid)
            assert Path(f"/proc/{fresh_redis.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
        finally:
            fresh_redis.resume()
    with fresh_redis.client(socket_timeout=5) as c:
        assert c.get("k") == b"v"  # same process, data kept


def test_stop_while_paused():
    with RedisServer() as server:
        pid = server.pid
        server.pause()
        server.stop()
        assert not _alive(pid)


def test_commandstats(fresh_redis):
    before = fresh_redis.commandstats()
    with fresh_redis.client() as c:
        for i in range(7):
            c.set(f"k{i}", i)
        c.get("k1")
    after = fresh_redis.commandstats()
    assert after["set"] - before.get("set", 0) == 7
    assert after["get"] - before.get("get", 0) == 1


def test_wait_until():
    box = []
    assert wait_until(lambda: box.append(1) or len(box) >= 3 and "done", 5, 0.0) == "done"
    with pytest.raises(TimeoutError, match="the impossible"):
        wait_until(lambda: False, 0.1, 0.01, "the impossible")


def test_monitor_sees_client_commands_but_not_script_internals(any_redis):
    with any_redis.client(3) as c, Monitor(any_redis) as mon:
        c.set("k", "v")
        c.get("k")
        c.eval("return redis.call('GET', KEYS[1])", 1, "k")
        mon.sync()
        cmds = mon.commands()
    assert cmds == [["SET", "k", "v"], ["GET", "k"], ["EVAL", "return redis.call('GET', KEYS[1])", "1", "k"]]


def test_monitor_db_filter_and_clear(fresh_redis):
    with fresh_redis.client(3) as c3, fresh_redis.client(4) as c4, Monitor(fresh_redis, db=4) as mon:
        c3.set("a", "1")
        c4.set("b", "2")
        mon.sync()
        assert mon.commands() == [["SET", "b", "2"]]
        assert mon.commands(db=3) == [["SET", "a", "1"]]
        mon.clear()
        assert mon.commands() == []
        c4.delete("b")
        mon.sync()
        assert mon.commands() == [["DEL", "b"]]


def test_monitor_keeps_each_argument_whole(fresh_redis):
    """Arguments with spaces, quotes, backslashes, newlines, UTF-8 and raw bytes come back as sent."""
    tricky = ["a b", 'say "hi"', "it's", "back\\slash", "two\nlines\ttab", "Grüße 世界", "{\"owner\":null}", ""]
    with fresh_redis.client(3) as c, Monitor(fresh_redis) as mon:
        c.execute_command("ECHO", "not recorded")
        c.rpush("list", *tricky)
        c.set("bin", b"\x00\xff\x7f")
        mon.sync()
        cmds = mon.commands()
    assert cmds[0] == ["RPUSH", "list", *tricky]
    assert cmds[1][:2] == ["SET", "bin"] and cmds[1][2].startswith("\x00")
    assert len(cmds) == 2
