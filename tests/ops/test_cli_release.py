"""``celery -A proj locks release``, run as the real command line (``python -m celery -A
apps.worker_app locks ...``) against a real redis-server and real ``celery worker`` subprocesses:

3. release: asks first (no: nothing happens), logs who did it; the holder learns at its next
   renewal that its lock is gone (.lost, then .ensure() raises LockLost: the task FAILS).
4. release with a waiter in line: the key is handed to it, the command line publishes it, it runs.
"""

from __future__ import annotations

import json
import socket
import uuid

import pytest
from _cli_support import ENV, WAIT, celery_cli, lock_client

from celery_singleton_lock import LockLost
from celery_singleton_lock.testing.servers import wait_until

pytestmark = pytest.mark.usefixtures("collect_results")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_force_release_is_found_by_the_holder(worker_processes, worker_app, lock_backend):
    on = {"CSL_LOCK_URL": lock_backend.url} if lock_backend.name == "etcd" else {}
    w = worker_processes("prefork", concurrency=1, env={**ENV, **on}).wait_ready()
    arg = f"lost-{uuid.uuid4().hex[:6]}"
    key = worker_app.hold_until_lost.lock_key_for([arg])
    result = worker_app.hold_until_lost.delay(arg)
    lock = lock_backend.store if on else lock_client(worker_app)
    wait_until(lambda: lock.exists(key), WAIT, 0.05, "the holder's lock")

    # asked first: "no" releases nothing
    out = celery_cli("locks", "release", key, input="n\n", env=on)
    assert out.returncode == 1 and "not released" in out.stdout, (out.stdout, out.stderr)
    assert f"held by task {result.id}" in out.stdout
    assert lock.exists(key)

    out = celery_cli("locks", "release", key, input="y\n", env=on)
    assert out.returncode == 0, (out.stdout, out.stderr)
    assert "force-released by user " in out.stdout and f"on host {socket.gethostname()} (pid " in out.stdout
    assert f"it was held by task {result.id}" in out.stdout
    assert "force-released by" in out.stderr, "the WARNING line on logger celery_singleton_lock"
    assert not lock.exists(key)

    # the holder learns it at its next renewal: .lost, then ensure() raises LockLost
    assert result.get(timeout=WAIT, propagate=False) is not None
    assert result.state == "FAILURE" and isinstance(result.result, LockLost), result.result
    events = [json.loads(e) for e in worker_app.journal.lrange(f"journaled:{arg}", 0, -1)]
    assert [e["event"] for e in events] == ["start", "lost"]
    assert "no longer the owner" in events[1]["reason"]
    wait_until(lambda: f"lock {key} held by {result.id} was LOST" in w.log(), WAIT, 0.1, "the ERROR line")

    out = celery_cli("locks", "release", key, "--yes", env=on)
    assert out.returncode == 1 and "no lock" in out.stdout


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_force_release_hands_the_key_to_the_waiter(worker_processes, worker_app):
    w = worker_processes("prefork", concurrency=2, env=ENV).wait_ready()
    arg = f"line-{uuid.uuid4().hex[:6]}"
    key = worker_app.in_line.lock_key_for([arg])
    holder = worker_app.in_line.delay(arg, gate=True)
    lock = lock_client(worker_app)
    wait_until(lambda: lock.exists(key), WAIT, 0.05, "the holder's lock")
    waiter = worker_app.in_line.delay(arg, tag="w")
    wait_until(lambda: lock.llen(key + ":q") == 1, WAIT, 0.05, "the duplicate to park")
    try:
        out = celery_cli("locks", "release", key, "--yes")
        assert out.returncode == 0, (out.stdout, out.stderr)
        assert f"the key was handed to waiting task {waiter.id}" in out.stdout
        # published by the command line: the waiter runs while the old holder still sits behind its gate
        assert waiter.get(timeout=WAIT)["tag"] == "w"
        starts = [json.loads(e) for e in worker_app.journal.lrange(f"journaled:{arg}", 0, -1)]
        started = [e for e in starts if e["id"] == waiter.id and e["event"] == "start"]
        assert started and started[0]["entry"], "it ran as the waiter handed the key"
        # the old holder finds out at its next renewal (then its body reads .lost True)
        wait_until(lambda: f"lock {key} held by {holder.id} was LOST" in w.log(), WAIT, 0.1, "the ERROR line")
    finally:
        worker_app.journal.set(f"gate:{arg}", 1)
    assert holder.get(timeout=WAIT)["lost"] is True
