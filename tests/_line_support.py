"""What the line's tests (tests/line/) share about the nodes that run apps/worker_app.py (not a test module):
the journal their bodies write, :class:`Nodes`, and :func:`worker_nodes`, which starts them.

The journal is db 3 of the session's Redis: each body journals its start and its end
(``journaled:<k>``), and with CSL_JOURNAL_HANDOFF the workers journal what they publish
(``handoff:publishes``) and where they park (``handoff:parks``). A gated body ends once the test
sets ``gate:<k>`` (:func:`open_gate`). tests/line/conftest.py's ``lock_nodes`` gives the nodes their
lock backend.
"""

from __future__ import annotations

import contextlib
import gc
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _task_support import TIMEOUT, start_worker_process

from celery_singleton_lock.engine import line as lines
from celery_singleton_lock.testing.servers import RedisServer, WorkerProcess, wait_until


class Nodes:
    """Worker nodes and what a test reads of them: ``wa`` (the app, client side), ``locks`` (the lock
    store), ``backend`` ("redis" or "etcd"), ``server`` (a lock server on it), and the workers and
    queues the module's fixture starts."""

    wa: Any
    locks: Any
    backend: str
    server: Any
    url: str
    queue: str

    def gated_holder(self, prefix: str, queue: str | None = None) -> tuple[str, str, Any]:
        """A new key (``<prefix>-...``), its lock key, and a call of ``in_line`` sent to ``queue`` (the
        nodes' own by default) that holds the key until the test opens its gate (:func:`open_gate`)."""
        k = f"{prefix}-{uuid.uuid4().hex[:8]}"
        key = self.wa.in_line.lock_key_for((k,), {})
        return k, key, self.wa.in_line.apply_async((k, 0.0, "holder", True), queue=queue or self.queue)

    def line_len(self, key: str) -> int:
        """How many wait in ``key``'s line."""
        return self.locks.llen(key + ":q") if self.backend == "redis" else len(lines.line(self.server, key))

    def pttl(self, key: str) -> int:
        """The ms the lock of ``key`` lives unless renewed (on etcd, its lease's, in whole seconds)."""
        if self.backend == "redis":
            return int(self.locks.pttl(key))
        _, lease = self.server.holder_and_lease(key)
        return int(self.server.transport.call("/lease/timetolive", {"ID": str(lease)})["TTL"]) * 1000

    def nothing_left(self, key: str) -> None:
        def empty() -> bool:
            if self.backend == "redis":
                return not self.locks.exists(key, key + ":q", key + ":w")
            return self.server.holder(key) is None and not lines.line(self.server, key)
        wait_until(empty, TIMEOUT, 0.05, f"{key} to be left empty")


@contextlib.contextmanager
def worker_nodes(redis_server: RedisServer, logdir: Path,
                 specs: dict[str, tuple[str, int, dict[str, str]]]) -> Iterator[dict[str, WorkerProcess]]:
    """Prefork workers of apps/worker_app.py, one per ``specs`` entry (its log's name: the queue it
    consumes, its children, its environment), started together so that their start-ups overlap, and
    ready; by name. After: stopped by PID, and the garbage collected while the servers still run."""
    started: dict[str, WorkerProcess] = {}
    try:
        for name, (queue, concurrency, env) in specs.items():
            started[name] = start_worker_process(redis_server, logdir, concurrency=concurrency, env=env,
                                                 extra=("-Q", queue), name=name)
        for w in started.values():
            w.wait_ready(90)
        yield started
    finally:
        for w in started.values():
            w.stop()
        gc.collect()


# -- the journal the workers write (Redis db 3) ---------------------------------------------------


def events(wa, k: str) -> list[dict]:
    return [json.loads(raw) for raw in wa.journal.lrange(f"journaled:{k}", 0, -1)]


def starts(wa, k: str) -> list[dict]:
    return [e for e in events(wa, k) if e["event"] == "start"]


def wait_starts(wa, k: str, count: int, timeout: float = TIMEOUT) -> list[dict]:
    return wait_until(lambda: len(starts(wa, k)) >= count and starts(wa, k), timeout, 0.02,
                      f"{count} start(s) of {k}")


def publishes(wa, task_id: str) -> list[dict]:
    """What the workers published for ``task_id`` (the tests' own sends are not journaled)."""
    return [p for p in map(json.loads, wa.journal.lrange("handoff:publishes", 0, -1)) if p["id"] == task_id]


def parks(wa, task_id: str) -> list[dict]:
    return [p for p in map(json.loads, wa.journal.lrange("handoff:parks", 0, -1)) if p["id"] == task_id]


def open_gate(wa, k: str) -> None:
    wa.journal.set(f"gate:{k}", 1)
