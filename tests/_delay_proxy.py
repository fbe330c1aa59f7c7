"""A TCP proxy in front of a Redis broker that delays deliveries: a slow broker, as consumers see it.

On a connection that sends BRPOP (kombu's Redis transport fetches messages that way, on a
connection of its own), every byte the server sends back reaches the client ``delay`` seconds
later, in order; every other connection, and what clients send, goes through at once. Put it
between a worker's consuming connection (``broker_read_url``) and the broker Redis: each
delivered message then arrives ``delay`` seconds late, whatever the depth of the queue, while
acks and the rest stay fast. Stopped by ``close()`` (its own threads and sockets only).
"""

from __future__ import annotations

import heapq
import itertools
import socket
import threading
import time

from _fault_proxy import _close


class DelayProxy:
    def __init__(self, target_port: int, delay: float, host: str = "127.0.0.1") -> None:
        self.target = (host, target_port)
        self.delay = delay
        self._listener = socket.create_server((host, 0))
        self.port = self._listener.getsockname()[1]
        self._closing = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True, name="delay-proxy-accept").start()

    def url(self, db: int = 0) -> str:
        return f"redis://{self.target[0]}:{self.port}/{db}"

    def _accept(self) -> None:
        while not self._closing.is_set():
            try:
                client, _ = self._listener.accept()
                server = socket.create_connection(self.target)
            except OSError:
                return
            with self._lock:
                self._sockets += [client, server]
            fetching = threading.Event()  # this connection sent BRPOP: delay what comes back
            threading.Thread(target=self._pipe, args=(client, server, None, fetching), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, fetching, None), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, delayed: threading.Event | None,
              watch: threading.Event | None) -> None:
        """Copy src to dst; once ``delayed`` is set, each chunk leaves ``delay`` s after it came (a
        writer thread keeps the order). Sets ``watch`` when src sends a BRPOP."""
        due: list[tuple[float, int, bytes]] = []
        cond = threading.Condition()
        seq = itertools.count()
        done = threading.Event()

        def writer() -> None:
            while True:
                with cond:
                    while not due and not done.is_set():
                        cond.wait(0.5)
                    if not due and done.is_set():
                        break
                    at, _, data = due[0]
                    left = at - time.monotonic()
                    if left > 0:
                        cond.wait(left)
                        continue
                    heapq.heappop(due)
                try:
                    dst.sendall(data)
                except OSError:
                    break
            _close(dst)

        threading.Thread(target=writer, daemon=True).start()
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            if watch is not None and b"BRPOP" in data.upper():
                watch.set()
            delay = self.delay if delayed is not None and delayed.is_set() else 0.0
            with cond:
                if not data:
                    done.set()
                    cond.notify_all()
                    return
                heapq.heappush(due, (time.monotonic() + delay, next(seq), data))
                cond.notify_all()

    def close(self) -> None:
        self._closing.set()
        _close(self._listener)
        with self._lock:
            for s in self._sockets:
                _close(s)
