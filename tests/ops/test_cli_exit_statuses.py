"""``celery -A proj locks ...``'s exit statuses, run as the real command line against a real
redis-server (and etcd): 0 done, 1 no such lock, 2 a bad key / task / argument / URL / unreachable
Redis, with a one-line error."""

from __future__ import annotations

import json
import os

import pytest
from _cli_support import HOLD, celery_cli, one_line_error

from celery_singleton_lock.engine import line as lines
from celery_singleton_lock.testing.servers import free_port

pytestmark = pytest.mark.usefixtures("collect_results")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_exit_statuses(worker_app):
    missing = worker_app.in_line.lock_key_for(["nobody"])
    out = celery_cli("locks", "release", missing, "--yes")
    assert out.returncode == 1 and out.stdout.startswith("no lock"), (out.stdout, out.stderr)
    out = celery_cli("locks", "show", missing)
    assert out.returncode == 1 and "free: nobody holds it" in out.stdout

    assert "does not start with a lock prefix ('singleton_lock')" in one_line_error(
        celery_cli("locks", "release", "other:t:{abc}", "--yes"))
    assert f"the lock is '{missing}'" in one_line_error(celery_cli("locks", "release", missing + ":q", "--yes"))
    assert "hash tag" in one_line_error(celery_cli("locks", "show", "singleton_lock:{waiting}"))

    assert "no task named 'apps.worker_app.nope'" in one_line_error(celery_cli("locks", "key", "apps.worker_app.nope"))
    assert "is not a LockedTask" in one_line_error(celery_cli("locks", "key", "apps.worker_app.plain_append"))
    assert "--args must be JSON" in one_line_error(celery_cli("locks", "key", HOLD, "--args", "[oops"))
    assert "--args must be a JSON array" in one_line_error(celery_cli("locks", "key", HOLD, "--args", '{"a": 1}'))
    assert "missing a required argument: 'key'" in one_line_error(celery_cli("locks", "key", HOLD))

    bad = one_line_error(celery_cli("locks", "list", env={"CSL_LOCK_URL": "sentinel://127.0.0.1:26379"}))
    assert "master_name" in bad and "sentinel://" in bad  # a Sentinel URL needs its master's name
    port = free_port()
    down = one_line_error(celery_cli("locks", "list", env={"CSL_LOCK_URL": f"redis://127.0.0.1:{port}/2"}))
    assert f"cannot reach the lock's Redis at redis://127.0.0.1:{port}/2" in down
    down = one_line_error(celery_cli("locks", "release", missing, "--yes",
                                     env={"CSL_LOCK_URL": f"redis://127.0.0.1:{port}/2"}))
    assert "cannot reach" in down


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.long
def test_exit_statuses_on_etcd(worker_app, etcd_server):
    """The same exit statuses on etcd: 1 for no such lock, 2 (one line, no password) for a bad key or
    an etcd that does not answer; list and show of a held lock answer 0."""
    on = {"CSL_LOCK_URL": etcd_server.url()}
    missing = worker_app.in_line.lock_key_for(["nobody"])
    out = celery_cli("locks", "release", missing, "--yes", env=on)
    assert out.returncode == 1 and out.stdout.startswith("no lock"), (out.stdout, out.stderr)
    out = celery_cli("locks", "show", missing, env=on)
    assert out.returncode == 1 and "free: nobody holds it" in out.stdout
    assert f"the lock is '{missing}'" in one_line_error(celery_cli("locks", "release", missing + ":q", "--yes", env=on))
    from celery_singleton_lock.topologies.etcd import EtcdLockServer

    held = EtcdLockServer.from_url(etcd_server.url()).acquire(missing, 30, owner_id="someone")
    try:
        out = celery_cli("locks", "show", missing, env=on)
        assert out.returncode == 0 and "held by task someone" in out.stdout, (out.stdout, out.stderr)
        out = celery_cli("locks", "key", HOLD, "--args", json.dumps(["nobody"]), "--json", env=on)
        answer = json.loads(out.stdout)
        assert answer["held"] is True and answer["holder"]["fencing_token"] == held.fencing_token
        rows = json.loads(celery_cli("locks", "list", "--json", env=on).stdout)
        row = next(r for r in rows if r["key"] == missing)
        assert row["task_id"] == "someone" and 0 < row["ttl_ms"] <= 30_000 and row["pid"] == os.getpid()
        assert row["waiters"] == 0
        # a task parked behind it: line, show, list and drop see it
        message = b"application/json\nutf-8\n" + json.dumps({"task": "t.waits", "args": [1], "kwargs": {},
                                                               "options": {"headers": {}}}).encode()
        assert lines.park(held.server, missing, "e-waiter", kind="t", wait=60, ttl=30, owner_id="waiter-1",
                          message=message).place == 1
        out = celery_cli("locks", "line", missing, "--json", env=on)
        assert out.returncode == 0 and [r["task_id"] for r in json.loads(out.stdout)] == ["waiter-1"], out.stderr
        out = celery_cli("locks", "show", missing, env=on)
        assert "line      1 waiting: waiter-1" in out.stdout, (out.stdout, out.stderr)
        rows = json.loads(celery_cli("locks", "list", "--json", env=on).stdout)
        assert next(r for r in rows if r["key"] == missing)["waiters"] == 1
        out = celery_cli("locks", "drop", missing, "waiter-1", "--yes", env=on)
        assert out.returncode == 0 and "dropped from the line" in out.stdout, (out.stdout, out.stderr)
        assert lines.line(held.server, missing) == []
        # every lock of the task: listed by the backend itself, as `list` does
        out = celery_cli("locks", "release", "--task", HOLD, "--all", env=on, input="y\n")
        assert out.returncode == 0 and f"lock {missing}: held by task someone" in out.stdout, (out.stdout, out.stderr)
        assert f"lock {missing} force-released by user " in out.stdout and " released" in out.stdout.splitlines()[-1]
        assert held.server.holder(missing) is None
    finally:
        held.release()
    out = celery_cli("locks", "line", missing, env=on)
    assert out.returncode == 1 and "nobody waits" in out.stdout, (out.stdout, out.stderr)
    out = celery_cli("locks", "drop", missing, "some-task", "--yes", env=on)
    assert out.returncode == 1 and "nothing dropped" in out.stdout, (out.stdout, out.stderr)
    port = free_port()
    down = one_line_error(celery_cli("locks", "list", env={"CSL_LOCK_URL": f"etcd://u:pw@127.0.0.1:{port}?timeout=1"}))
    assert "no etcd endpoint answered" in down and "pw" not in down.replace("***", "")
