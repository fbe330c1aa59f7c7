"""The ``celery locks ...`` tests' shared helpers (tests/ops/test_cli.py, test_cli_release.py,
test_cli_exit_statuses.py): the workers' lock TTL, the command line run as the fixtures run it, its
one-line errors, and a client on the app's lock Redis."""

from __future__ import annotations

import redis
from _apps import celery_cli as run_celery_cli

LOCK_TTL = 3.0  # the workers' singleton_lock_ttl: a force release is found within a second
ENV = {"CSL_LOCK_TTL": str(LOCK_TTL)}
WAIT = 30.0
HOLD = "apps.worker_app.in_line"


def celery_cli(*args: str, env: dict[str, str] | None = None, input: str | None = None):
    """``python -m celery -A apps.worker_app <args>`` with the workers' lock TTL (ENV) as the fixtures run them."""
    return run_celery_cli(*args, env={**ENV, **(env or {})}, input=input)


def one_line_error(proc) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), proc.stderr
    return lines[0]


def lock_client(worker_app) -> redis.Redis:
    return redis.Redis.from_url(worker_app.app.conf.singleton_lock_url)
