"""One TCP proxy in front of a Redis, with the faults the tests inject between a client and it.

- reset-after-run (``arm(pattern, count)``): the next ``count`` requests containing ``pattern``
  reach Redis, which runs them; the reply is dropped and the client's connection closed (a reply
  lost on the way back: a network reset, a proxy or sidecar restart, ``CLIENT KILL``);
- refuse (``refuse(pattern, count)``): the next ``count`` requests containing ``pattern`` never
  reach Redis; the client's connection is closed (a command that met a dead connection);
- delay (``delay(pattern, seconds, count)``): the reply of the next ``count`` requests containing
  ``pattern`` reaches the client ``seconds`` late (a Redis or a network that stalls);
- swallow (``swallowing.set()``): while set, every reply is dropped and the connection kept open (a
  reply lost to a client that waits for it until its timeout);
- blackout (``blackout(seconds)``): every open connection is closed, and new ones are refused
  (accepted and closed at once) for that many seconds;
- count (``count(pattern)``, then ``seen(pattern)``): how many requests contained ``pattern``
  since (no fault: what a client sent, counted);
- lag (``lag(pattern, seconds)``): on every connection that sends a request containing ``pattern``
  (upper case; ``b""``: every connection), each reply from then on reaches the client ``seconds``
  late, in order, without holding up the ones behind it: a slow broker as its consumers see it
  (``b"BRPOP"``: kombu fetches on a connection of its own), or a Redis further away.

Everything else goes through as it is. ``close()`` stops it (its own threads and sockets only).
"""

from __future__ import annotations

import hashlib
import queue
import socket
import threading
import time


def sha_of(script: str, keys: int = 0) -> bytes:
    """What an EVALSHA of ``script`` carries on the wire: the pattern that arms the proxy for it.
    ``keys``: only its calls with that many keys (ACQUIRE's and RELEASE's fresh path: 2; the whole script: 5)."""
    sha = hashlib.sha1(script.encode()).hexdigest().encode()
    return sha + b"\r\n$%d\r\n%d\r\n" % (len(str(keys)), keys) if keys else sha


class FaultProxy:
    def __init__(self, target_port: int, host: str = "127.0.0.1") -> None:
        self.target = (host, target_port)
        self._listener = socket.create_server((host, 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._armed: dict[bytes, int] = {}
        self._refused: dict[bytes, int] = {}
        self._delayed: dict[bytes, tuple[int, float]] = {}
        self._dark_until = 0.0
        self._lag: tuple[bytes, float] | None = None
        self._seen: dict[bytes, int] = {}
        self.lagged = 0
        """Connections lagging (``lag``), counted."""
        self.swallowing = threading.Event()
        """Set: every reply is dropped, the connection kept open."""
        self.dropped: list[bytes] = []
        """The patterns whose reply was dropped, in order."""
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True, name="fault-proxy-accept").start()

    def url(self, db: int = 0) -> str:
        return f"redis://{self.target[0]}:{self.port}/{db}"

    def arm(self, pattern: bytes, count: int = 1) -> None:
        """Drop the reply of the next ``count`` requests that contain ``pattern`` (after Redis ran them)."""
        with self._lock:
            self._armed[pattern] = count

    def refuse(self, pattern: bytes, count: int = 1) -> None:
        """Close the connection of the next ``count`` requests that contain ``pattern``, unsent."""
        with self._lock:
            self._refused[pattern] = count

    def delay(self, pattern: bytes, seconds: float, count: int = 1) -> None:
        """Hold the reply of the next ``count`` requests that contain ``pattern`` for ``seconds``."""
        with self._lock:
            self._delayed[pattern] = (count, seconds)

    def lag(self, pattern: bytes, seconds: float) -> None:
        """Delay every reply ``seconds`` on each connection that sends ``pattern`` (see the module doc)."""
        with self._lock:
            self._lag = (pattern.upper(), seconds)

    def count(self, pattern: bytes) -> None:
        """Count the requests that contain ``pattern`` from now on (:meth:`seen`)."""
        with self._lock:
            self._seen[pattern] = 0

    def seen(self, pattern: bytes) -> int:
        with self._lock:
            return self._seen[pattern]

    def left(self, pattern: bytes) -> int:
        with self._lock:
            return self._armed.get(pattern, 0) + self._refused.get(pattern, 0) + self._delayed.get(pattern, (0, 0))[0]

    def blackout(self, seconds: float) -> None:
        """Close every connection now, and refuse new ones for ``seconds``."""
        with self._lock:
            self._dark_until = time.monotonic() + seconds
            sockets, self._sockets = self._sockets, []
        for s in sockets:
            _close(s)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                dark = time.monotonic() < self._dark_until
            if dark:
                _close(client)
                continue
            try:
                server = socket.create_connection(self.target)
            except OSError:
                _close(client)
                continue
            with self._lock:
                self._sockets += [client, server]
            lose = threading.Event()  # set: the next reply on this connection is lost, and it closes
            late: list[float] = []  # the seconds the next reply on this connection is held
            lagging: list[float] = []  # set once: every reply on this connection is that many seconds late
            threading.Thread(target=self._up, args=(client, server, lose, late, lagging), daemon=True).start()
            threading.Thread(target=self._down, args=(server, client, lose, late, lagging), daemon=True).start()

    def _up(self, src: socket.socket, dst: socket.socket, lose: threading.Event, late: list[float],
            lagging: list[float]) -> None:
        while True:
            try:
                data = src.recv(65536)
                if not data:
                    break
                with self._lock:
                    for pattern in self._seen:
                        self._seen[pattern] += pattern in data
                    if self._lag is not None and not lagging and self._lag[0] in data.upper():
                        lagging.append(self._lag[1])
                        self.lagged += 1
                    refused = next((p for p, n in self._refused.items() if n > 0 and p in data), None)
                    if refused is not None:
                        self._refused[refused] -= 1
                        break
                    for pattern, (count, seconds) in self._delayed.items():
                        if count > 0 and pattern in data:
                            self._delayed[pattern] = (count - 1, seconds)
                            late.append(seconds)
                            break
                    for pattern, count in self._armed.items():
                        if count > 0 and pattern in data:
                            self._armed[pattern] = count - 1
                            self.dropped.append(pattern)
                            lose.set()
                            break
                dst.sendall(data)
            except OSError:
                break
        _close(src)
        _close(dst)

    def _down(self, src: socket.socket, dst: socket.socket, lose: threading.Event, late: list[float],
              lagging: list[float]) -> None:
        later: _Later | None = None
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            if not data or lose.is_set():
                break
            if late:
                time.sleep(late.pop(0))  # (the fault itself: this reply arrives that much later)
            if self.swallowing.is_set():
                continue
            if lagging:
                later = later or _Later(dst, lagging[0])
                later.put(data)
                continue
            try:
                dst.sendall(data)
            except OSError:
                break
        _close(src)
        if later is not None:
            later.close()  # (it closes dst once what it holds is sent)
        else:
            _close(dst)

    def close(self) -> None:
        _close(self._listener)
        with self._lock:
            for s in self._sockets:
                _close(s)


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)  # (close alone waits for a thread blocked in recv on it)
    except OSError:
        pass
    try:
        s.close()
    except OSError:
        pass


class _Later:
    """Sends what it is given to ``dst``, each ``seconds`` after it came, in order (one thread)."""

    def __init__(self, dst: socket.socket, seconds: float) -> None:
        self.dst, self.seconds = dst, seconds
        self._queue: queue.Queue[tuple[float, bytes] | None] = queue.Queue()
        threading.Thread(target=self._run, daemon=True, name="fault-proxy-later").start()

    def put(self, data: bytes) -> None:
        self._queue.put((time.monotonic() + self.seconds, data))

    def close(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            due, data = item
            if (wait := due - time.monotonic()) > 0:
                time.sleep(wait)
            try:
                self.dst.sendall(data)
            except OSError:
                break
        _close(self.dst)
