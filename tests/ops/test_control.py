"""``celery inspect locks``: each worker answers with the locks its processes hold and its watchdogs' figures.

Against a real redis-server and real ``celery worker`` subprocesses:

1. prefork: the locks live in the children; the main process answers from the children's
   snapshot files (key, task id, child pid, held for, confirmed ago, fencing token as in Redis),
   renewals show, released locks leave the answer, the directory is removed at shutdown;
   the ``celery inspect locks`` command line knows the command too.
2. threads: the main process answers from its own watchdog.
3. solo: the command is registered and answers (between tasks: a solo worker answers no remote
   control while a task runs, Celery's own limit), with the figures of the watchdog that renewed.
4. The snapshot writer itself (in this process, against a real Redis), and the private directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import pytest
import redis
from _task_support import ROOT

from celery_singleton_lock import held
from celery_singleton_lock.ops.control import inspect_locks
from celery_singleton_lock.ops.snapshots import SnapshotWriter, _make_private_dir, snapshot_dir
from celery_singleton_lock.testing.servers import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120), pytest.mark.usefixtures("collect_results")]

LOCK_TTL = 3.0  # renewed every second: renewals show within a test
ENV = {"CSL_LOCK_TTL": str(LOCK_TTL)}
WAIT = 30.0


def _fence_in_redis(worker_app, key: str, backend=None) -> int:
    """The fencing token in the lock's value, as Redis holds it (on etcd: the key's create revision)."""
    if backend is not None and backend.name == "etcd":
        holder = backend.store.server.holder(key)
        assert holder is not None, f"lock {key} is not held in etcd"
        return holder.fencing_token
    client = redis.Redis.from_url(worker_app.app.conf.singleton_lock_url)
    try:
        raw = client.get(key)
    finally:
        client.close()
    assert raw is not None, f"lock {key} is not held in Redis"
    return int(raw.split(b" ")[1]) or None  # (0: a fresh task's token, not drawn until first read)


def _find(app, want: dict[str, str], timeout: float = WAIT) -> tuple[str, dict]:
    """Poll ``inspect locks`` until one worker's reply lists every key -> task id of ``want``."""
    def found():
        for node, reply in inspect_locks(app, timeout=1.0).items():
            held_now = {lock["key"]: lock["task_id"] for lock in reply["locks"]}
            if all(held_now.get(key) == task_id for key, task_id in want.items()):
                return node, reply
        return None
    return wait_until(found, timeout, 0.2, f"inspect locks to show {want}")


def _start_gated(worker_app, *tags: str) -> dict[str, tuple[str, str, object]]:
    """A gated_skip per tag, each holding its own key until its gate opens: tag -> (key arg, lock key, result)."""
    out = {}
    for tag in tags:
        arg = f"{tag}-{uuid.uuid4().hex[:6]}"
        result = worker_app.gated_skip.delay(arg, tag=tag, gate=True)
        out[tag] = (arg, worker_app.gated_skip.lock_key_for([arg]), result)
    return out


def _open_gates(worker_app, started) -> None:
    for arg, _key, _result in started.values():
        worker_app.journal.set(f"gate:{arg}", 1)
    for _arg, _key, result in started.values():
        assert result.get(timeout=WAIT)["tag"]


def test_prefork_answers_from_its_children(worker_processes, worker_app, lock_backend):
    on = {"CSL_LOCK_URL": lock_backend.url} if lock_backend.name == "etcd" else {}
    w = worker_processes("prefork", concurrency=2, env={**ENV, **on}).wait_ready()
    started = _start_gated(worker_app, "a", "b")
    want = {key: result.id for _arg, key, result in started.values()}
    node, reply = _find(worker_app.app, want)

    assert reply["pool"] == "prefork" and reply["pid"] == w.pid
    assert reply["errors"] == []
    children = set(w.children())
    locks = {lock["key"]: lock for lock in reply["locks"]}
    assert {locks[key]["pid"] for key in want} <= children
    assert len({locks[key]["pid"] for key in want}) == 2, "two locks, one per child"
    for key, lock in locks.items():
        assert lock["fencing_token"] == _fence_in_redis(worker_app, key, lock_backend)
        assert 0 <= lock["held_for"] < WAIT  # (by the holder's host clock: etcd's too, whose token is no clock)
        assert 0 <= lock["confirmed_ago"] < LOCK_TTL
        assert lock["ttl"] == LOCK_TTL
    assert {p["pid"] for p in reply["processes"]} == children  # the main process holds nothing
    assert all(p["tracked"] == 1 for p in reply["processes"])

    # renewals show: a child's snapshot catches up with its watchdog's rounds
    def renewed():
        reply = inspect_locks(worker_app.app, timeout=1.0).get(node)
        return reply and all(p["rounds"] >= 1 and p["last_round_ms"] > 0 for p in reply["processes"]) and reply
    reply = wait_until(renewed, WAIT, 0.2, "the children's renewal rounds to show")
    assert all(lock["confirmed_ago"] < LOCK_TTL for lock in reply["locks"])
    assert all(p["failed_rounds"] == 0 and p["losses"] == 0 for p in reply["processes"])

    directory = snapshot_dir(w.pid)
    assert {path.name for path in directory.glob("*.json")} <= {f"{pid}.json" for pid in children}

    # the command line: Celery's `inspect` knows the command (registered on import in the client too)
    out = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "apps.worker_app", "inspect", "locks", "--json", "--timeout", "5"],
        cwd=ROOT / "tests", env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT)])),
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stderr
    replies = json.loads(out.stdout)
    assert set(want) <= {lock["key"] for lock in replies[node]["locks"]}

    _open_gates(worker_app, started)
    wait_until(lambda: inspect_locks(worker_app.app, timeout=1.0).get(node, {}).get("locks") == [], WAIT, 0.2,
               "the released locks to leave the answer")
    w.stop()
    assert not directory.exists(), "the worker removes its snapshot directory at shutdown"


def test_threads_answers_from_its_main_process(worker_processes, worker_app):
    w = worker_processes("threads", concurrency=2, env=ENV).wait_ready()
    started = _start_gated(worker_app, "a", "b")
    want = {key: result.id for _arg, key, result in started.values()}
    _node, reply = _find(worker_app.app, want)

    assert reply["pool"] == "threads" and reply["pid"] == w.pid
    assert [p["pid"] for p in reply["processes"]] == [w.pid]
    assert reply["processes"][0]["tracked"] == 2 and reply["processes"][0]["alive"]
    for lock in reply["locks"]:
        assert lock["pid"] == w.pid
        assert lock["fencing_token"] == _fence_in_redis(worker_app, lock["key"])
        assert 0 <= lock["confirmed_ago"] < LOCK_TTL
    _open_gates(worker_app, started)


def test_solo_answers_between_tasks(worker_processes, worker_app):
    w = worker_processes("solo", concurrency=1, env=ENV).wait_ready()
    # a task that holds its lock through a few renewals; a solo worker answers no remote control
    # while it runs (Celery's own limit: `celery inspect ping` is not answered either)
    result = worker_app.hold.delay(f"solo-{uuid.uuid4().hex[:6]}", LOCK_TTL * 0.9)
    assert result.get(timeout=WAIT)["lost"] is False

    replies = wait_until(lambda: inspect_locks(worker_app.app, timeout=2.0), WAIT, 0.2, "the solo worker's answer")
    (reply,) = replies.values()
    assert reply["pool"] == "solo" and reply["pid"] == w.pid
    assert reply["locks"] == []
    (proc,) = reply["processes"]
    assert proc["pid"] == w.pid and proc["tracked"] == 0
    assert proc["rounds"] >= 1 and proc["failed_rounds"] == 0, "its watchdog renewed the task's lock"


def test_snapshot_writer_follows_the_locks(redis_server, tmp_path):
    """The prefork child's writer, in this process: a file that follows the locks it holds."""
    directory = tmp_path / "snapshots" / "1"
    writer = SnapshotWriter(directory).start()
    name = f"writer-{uuid.uuid4().hex[:6]}"
    try:
        with held(redis_server.url(2), name, ttl=LOCK_TTL, owner_id="owner-1") as lock:
            writer.poke()
            snap = wait_until(
                lambda: writer.path.exists() and json.loads(writer.path.read_text())["locks"] and
                json.loads(writer.path.read_text()), 10, 0.02, "the snapshot file",
            )
            (entry,) = snap["locks"]
            assert entry["key"] == lock.key and entry["task_id"] == "owner-1"
            assert entry["fencing_token"] == lock.fencing_token > 0  # known from the acquire on
            assert entry["taken_at"] and time.time() - 5 < entry["taken_at"] <= time.time()
            assert "token" not in entry and lock.token not in writer.path.read_text(), "no secret in the file"
            assert snap["written_at"] - 5 < entry["confirmed_at"] <= snap["written_at"] < entry["deadline_at"]
        writer.poke()
        empty = wait_until(lambda: (s := json.loads(writer.path.read_text()))["locks"] == [] and s, 10, 0.02,
                           "the lock to leave the file")
        time.sleep(1.5)  # idle: nothing changes, so nothing is written (written_at would change)
        assert json.loads(writer.path.read_text()) == empty
    finally:
        writer.stop()
    assert not writer.path.exists()


def test_private_dir_refuses_a_parent_open_to_others(tmp_path):
    parent = tmp_path / "shared"
    parent.mkdir()
    parent.chmod(0o777)
    with pytest.raises(OSError, match="open to others"):
        _make_private_dir(parent / "123")
    mine = tmp_path / "mine" / "123"
    _make_private_dir(mine)
    assert mine.is_dir() and (mine.parent.stat().st_mode & 0o077) == 0
