"""One worker cluster for the tests that run real ``celery worker`` processes against an app in
tests/apps: its servers, the app imported with their URLs, and the worker processes.

Broker (db 0), results (db 1) and the app's journal (db 3) live on one private redis-server. With
``lock_proxy``, the locks live on a second one, reached through a :class:`FaultProxy` (so the lock
Redis can be faulted, or restarted empty, without touching the broker): ``CSL_LOCK_URL`` names the
proxy's address, db 2. The app reads ``CSL_REDIS_URL_BASE`` (and ``CSL_LOCK_URL``) at import.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from _fault_proxy import FaultProxy

from celery_singleton_lock.testing.servers import RedisServer, WorkerProcess, wait_until

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def import_app(name: str) -> ModuleType:
    """tests/apps/<name>.py, (re)imported so that it reads the URLs set for this cluster."""
    sys.path.insert(0, str(TESTS))
    try:
        full = f"apps.{name}"
        return importlib.reload(sys.modules[full]) if full in sys.modules else importlib.import_module(full)
    finally:
        sys.path.remove(str(TESTS))


@contextlib.contextmanager
def worker_cluster(app: str, logs: Path, *, nodes: int = 2, concurrency: int = 2,
                   lock_proxy: bool = False) -> Iterator[ModuleType]:
    """``nodes`` prefork workers of tests/apps/<app>.py, ready; yields the app module, with ``server``
    (broker, results, journal), ``base`` (its URL), ``workers``, and with ``lock_proxy`` also ``locks``
    (the lock Redis) and ``proxy`` (the FaultProxy in front of it). Everything stops by PID after."""
    with RedisServer() as server, contextlib.ExitStack() as stack:
        base = f"redis://127.0.0.1:{server.port}"
        # CSL_WORKER_HOOKS: the apps' fault hooks (they patch the package) go in the workers only
        env = {"CSL_REDIS_URL_BASE": base, "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)]),
               "CSL_WORKER_HOOKS": "1"}
        locks = proxy = None
        if lock_proxy:
            locks = stack.enter_context(RedisServer())
            proxy = FaultProxy(locks.port)
            stack.callback(proxy.close)
            env["CSL_LOCK_URL"] = proxy.url(2)
        saved = {k: os.environ.get(k) for k in ("CSL_REDIS_URL_BASE", "CSL_LOCK_URL")}
        os.environ.update({k: v for k, v in env.items() if k not in ("PYTHONPATH", "CSL_WORKER_HOOKS")})
        stack.callback(_restore, saved)
        module = import_app(app)
        workers = [WorkerProcess(f"apps.{app}", concurrency=concurrency, cwd=TESTS,
                                 logfile=str(logs / f"w{i}.log"), env=env).start() for i in range(nodes)]
        try:
            for w in workers:
                w.wait_ready(60)
            module.server, module.base, module.workers = server, base, workers
            module.locks, module.proxy = locks, proxy
            yield module
        finally:
            for w in workers:
                w.stop()


def _restore(saved: dict[str, str | None]) -> None:
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


# -- what the apps' bodies journal (apps/_slot_journal.py: db 3 of the cluster's server) ----------


def new_key() -> str:
    """A key no other test uses."""
    return uuid.uuid4().hex[:12]


def runs(env: ModuleType, key: str) -> list[dict]:
    """The bodies of ``key`` that ran to their end, in order."""
    return [json.loads(r) for r in env.journal.lrange(f"runs:{key}", 0, -1)]


def starts(env: ModuleType, key: str) -> list[dict]:
    """The bodies of ``key`` that started, in order."""
    return [json.loads(r) for r in env.journal.lrange(f"started:{key}", 0, -1)]


def started(env: ModuleType, key: str, count: int = 1, timeout: float = 40) -> list[dict]:
    """Wait until ``count`` bodies of ``key`` started; they."""
    return wait_until(lambda: len(starts(env, key)) >= count and starts(env, key), timeout,
                      what=f"{count} run(s) of {key} to start")


def state_of(result: Any) -> str:
    """The stored state of ``result``, read from the backend now (not cached)."""
    return str(result.backend.get_task_meta(result.id, cache=False)["status"])
