"""Reading what a hot-key run left: the workers' records and the lock server's MONITOR.

* :class:`RawMonitor`: MONITOR copied into a file by a process of its own, parsed after the run;
* the MONITORed scripts' SHAs and arguments, and :func:`arrival_order`: the order in which the
  waiters reached the lock (their PARK, first ACQUIRE or first SET NX);
* :class:`HotRecords`: what the hot_app workers wrote (bodies, gates, parks, publishes);
* :func:`longest_in_order` and :func:`_ms`: the figures made from them.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness import percentile

from celery_singleton_lock.engine import line_scripts, scripts
from celery_singleton_lock.testing.servers import RedisServer, _parse_monitor_line, wait_until

_COPY_MONITOR = """
import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
s.sendall(b"MONITOR\\r\\n")
with open(sys.argv[2], "wb", buffering=0) as out:
    while chunk := s.recv(1 << 20):
        out.write(chunk)
"""


class RawMonitor:
    """MONITOR, copied byte for byte into a file by a process of its own and parsed after the run.

    The drain measures throughput: the test suite's Monitor parses every line in a thread of this
    process as it comes, and that took a third of the machine's CPU from the workers (a hot-key drain
    ran 30 % slower under it). A copy costs almost nothing; Redis's own MONITOR output remains.
    """

    def __init__(self, server: RedisServer, path: Path) -> None:
        self.server, self.path = server, path
        self._proc: subprocess.Popen[bytes] | None = None
        self._offset = 0

    def __enter__(self) -> RawMonitor:
        self._proc = subprocess.Popen([sys.executable, "-c", _COPY_MONITOR, str(self.server.port), str(self.path)])

        def live() -> bool:  # a marker sent before its MONITOR began is never seen: send them until one is
            marker = self._marker()
            time.sleep(0.02)
            return self.path.exists() and marker in self.path.read_bytes()

        wait_until(live, 10, 0.0, "MONITOR to start")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.terminate()  # (by PID)
            self._proc.wait(10)

    def _marker(self) -> bytes:
        marker = f"csl-sync-{time.monotonic_ns()}"
        with self.server.client() as c:
            c.echo(marker)
        return f'"ECHO" "{marker}"'.encode()

    def sync(self) -> None:
        """Wait until every command sent before this call is in the file."""
        marker = self._marker()
        wait_until(lambda: self.path.exists() and marker in self.path.read_bytes()[self._offset:], 10, 0.01,
                   "MONITOR sync")

    def clear(self) -> None:
        """Forget what was recorded so far."""
        self.sync()
        self._offset = self.path.stat().st_size

    def commands(self) -> list[list[str]]:
        """The commands clients sent since :meth:`clear` (not those of scripts, nor the connections' set-up)."""
        skip = {"HELLO", "SELECT", "CLIENT", "ECHO", "PING", "MONITOR", "INFO"}
        out = []
        for line in self.path.read_bytes()[self._offset:].split(b"\r\n"):
            if not line.startswith(b"+") or line == b"+OK":
                continue
            _, _, client, words = _parse_monitor_line(line[1:])
            if client != "lua" and words and words[0].upper() not in skip:
                out.append(words)
        return out


PARK_SHA = hashlib.sha1(line_scripts.PARK.encode()).hexdigest()
ACQUIRE_SHA = hashlib.sha1(scripts.ACQUIRE.encode()).hexdigest()
"""ACQUIRE: a fresh delivery's sends three arguments (token, metadata, ttl; its owner is in the metadata),
any other more."""


def _argv(w: list[str]) -> list[str]:
    """A MONITORed EVALSHA's arguments (ARGV[1] first), past its keys (their count is its third word)."""
    return w[3 + int(w[2]):]


def _acquire_owner(w: list[str]) -> str | None:
    """The owner id of a MONITORed ACQUIRE (full: its 4th argument; fresh: in its metadata, the
    script's 2nd argument), else None."""
    if w[0].upper() != "EVALSHA" or w[1] != ACQUIRE_SHA:
        return None
    if len(_argv(w)) > 3:
        return _argv(w)[3]
    if len(_argv(w)) > 1:
        try:
            return json.loads(_argv(w)[1]).get("owner")
        except ValueError:
            return None
    return None


def arrival_order(variant: str, cmds: list[list[str]], ids: dict[str, int], parks: dict[str, Any],
                  sku: str) -> tuple[list[int], set[int]]:
    """A drain's waiters and the order they arrived at the lock, as Redis ran it (MONITOR's ``cmds``).

    ``ids`` maps task id -> seq; ``parks`` is HotRecords.parks. Returns the seqs of the waiters in
    arrival order (waiters only) and the set of waiters.
    """
    order: list[int] = []
    seen: set[int] = set()
    attempts: dict[int, int] = {}
    if variant in ("ours", "ours-slot"):
        # each waiter's place: its last PARK that is not a copy's re-park at the head (again: ARGV[8]).
        # A PARK that found the key free and nobody waiting (it then takes it, or parks again) held no place.
        placed: dict[int, int] = {}
        for i, w in enumerate(cmds):
            argv = _argv(w) if w[0].upper() == "EVALSHA" and w[1] == PARK_SHA else []
            if len(argv) > 7 and argv[4] in ids and argv[7] != "1":
                placed[ids[argv[4]]] = i
        order = sorted(placed, key=placed.__getitem__)
        seen = set(order)
        # ours: those that parked (its duplicate_skipped record); ours-slot: every PARK, a slot wait too
        waiters = {ids[t] for t in parks if t in ids} if variant == "ours" else seen
    elif variant == "plain":  # no lock: nobody waits
        waiters = set()
    elif variant == "backoff":
        for w in cmds:
            owner = _acquire_owner(w)
            if owner in ids:
                s = ids[owner]
                if s not in seen:
                    seen.add(s)
                    order.append(s)
        waiters = {ids[t] for t in parks if t in ids}
    else:
        name = f"hot-rlock:{sku}"
        for w in cmds:
            if w[0].upper() == "SET" and len(w) > 2 and w[1] == name and w[2].startswith("seq-"):
                s = int(w[2][4:])
                attempts[s] = attempts.get(s, 0) + 1
                if s not in seen:
                    seen.add(s)
                    order.append(s)
        waiters = {s for s, k in attempts.items() if k >= 2}
    return [s for s in order if s in waiters], waiters


class HotRecords:
    """What the hot_app workers wrote (``hot-<pid>.txt`` in each node's record directory)."""

    def __init__(self, dirs: Sequence[Path]) -> None:
        self.dirs = list(dirs)
        self._offsets: dict[Path, int] = {}
        self.bodies: dict[tuple[str, int], list[tuple[int, int, int, int]]] = {}
        """(variant, seq) -> [(start ns, end ns, pid, ns waited in acquire)]"""
        self.gave_up: dict[tuple[str, int], int] = {}
        self.gates: dict[int, int] = {}
        self.parks: dict[str, list[tuple[int, str]]] = {}
        """task id -> [(t ns, policy)]"""
        self.pubs: list[tuple[str, str, int, int, str]] = []
        """(task name, task id, t ns, pid, why)"""
        self._counts: dict[str, int] = {}

    def poll(self) -> None:
        for directory in self.dirs:
            for path in directory.glob("hot-*.txt"):
                offset = self._offsets.get(path, 0)
                with open(path, "rb") as f:
                    f.seek(offset)
                    data = f.read()
                end = data.rfind(b"\n") + 1
                self._offsets[path] = offset + end
                for line in data[:end].decode().splitlines():
                    self._parse(line.split())

    def count(self, variant: str) -> int:
        """How many body and gave-up records of ``variant`` were read so far (all its runs)."""
        return self._counts.get(variant, 0)

    def _parse(self, w: list[str]) -> None:
        kind = w[0]
        if kind == "body":
            self.bodies.setdefault((w[1], int(w[2])), []).append((int(w[3]), int(w[4]), int(w[5]), int(w[6])))
            self._counts[w[1]] = self._counts.get(w[1], 0) + 1
        elif kind == "gave-up":
            self.gave_up[(w[1], int(w[2]))] = int(w[3])
            self._counts[w[1]] = self._counts.get(w[1], 0) + 1
        elif kind == "gate":
            self.gates[int(w[1])] = int(w[2])
        elif kind == "park":
            self.parks.setdefault(w[1], []).append((int(w[2]), w[4]))
        elif kind == "pub":
            self.pubs.append((w[1], w[2], int(w[3]), int(w[4]), w[5]))


def longest_in_order(values: Sequence[int]) -> int:
    """Length of the longest increasing subsequence: how many kept their order (the rest were overtaken)."""
    tails: list[int] = []
    for v in values:
        i = bisect.bisect_left(tails, v)
        if i == len(tails):
            tails.append(v)
        else:
            tails[i] = v
    return len(tails)


def _ms(values_ns: Sequence[int]) -> dict[str, Any]:
    vals = [v / 1e6 for v in values_ns]
    if not vals:
        return {"n": 0, "p50": None, "p99": None, "max": None, "mean": None}
    return {"n": len(vals), "p50": percentile(vals, 50), "p99": percentile(vals, 99), "max": max(vals),
            "mean": sum(vals) / len(vals)}
