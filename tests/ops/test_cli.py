"""``celery -A proj locks ...``: list, show, key, release, run as the real command line.

Pure parts (key parsing, durations, the majority verdict) get plain unit tests. The commands run as
subprocesses (``python -m celery -A apps.worker_app locks ...``, through the ``celery.commands``
entry point) against a real redis-server and real ``celery worker`` subprocesses:

1. list (text, JSON, --task), show (holder, raw value, the line with its waiter), key (the task's
   own lock_key_for, and who holds it) while tasks hold locks and one waits in line.
2. list walks the keyspace with SCAN in batches, never KEYS, and leaves out every key that is
   not a lock (the line, waiters, done records, wake-up lists, the index).

3. and 4. (release) are in test_cli_release.py, 5. (exit statuses) in test_cli_exit_statuses.py.
"""

from __future__ import annotations

import json
import os
import socket
import uuid

import pytest
import redis
from _apps import make_app
from _cli_support import ENV, HOLD, LOCK_TTL, WAIT, celery_cli, lock_client
from _task_support import locked
from celery.bin.base import CLIContext
from click.testing import CliRunner

from celery_singleton_lock.ops.cli import duration, glob_escape, locks, parse_key
from celery_singleton_lock.testing.servers import Monitor, wait_until

pytestmark = pytest.mark.usefixtures("collect_results")


# -- pure functions ------------------------------------------------------------------------


def test_parse_key():
    prefixes = ("singleton_lock", "singleton_lock:x", "other")
    assert parse_key("singleton_lock:apps.t:{" + "a" * 32 + "}", prefixes) == "apps.t"
    assert parse_key("other:t:{abc}", prefixes) == "t"
    assert parse_key("singleton_lock:x:t:{abc}", prefixes) == "t", "the longest prefix wins"
    with pytest.raises(ValueError, match="the lock is 'singleton_lock:t:{abc}'"):
        parse_key("singleton_lock:t:{abc}:q", prefixes)
    with pytest.raises(ValueError, match="the lock is 'singleton_lock:t:{abc}'"):
        parse_key("singleton_lock:t:{abc}:wake:0123", prefixes)
    for companion in (":p", ":b:0123", ":m:owner", ":mo:task", ":r:0123abcd"):  # every key beside one
        with pytest.raises(ValueError, match="the lock is 'singleton_lock:t:{abc}'"):
            parse_key("singleton_lock:t:{abc}" + companion, prefixes)
    with pytest.raises(ValueError, match="hash tag"):
        parse_key("singleton_lock:{waiting}", prefixes)
    with pytest.raises(ValueError, match="hash tag"):
        parse_key("singleton_lock:t:abc", prefixes)
    with pytest.raises(ValueError, match="does not start with a lock prefix"):
        parse_key("elsewhere:t:{abc}", prefixes)


def test_glob_escape_and_duration():
    assert glob_escape("a*b?[c]\\") == "a\\*b\\?\\[c\\]\\\\"
    assert [duration(x) for x in (None, 850, 4200, 184_000, 7_260_000, 273_600_000)] == [
        "-", "850ms", "4.2s", "3m04s", "2h01m", "3d04h",
    ]


# -- against a real Redis and workers ----------------------------------------------------------


@pytest.mark.timeout(60)
def test_every_prefix_of_the_app_is_looked_at(redis_server, caplog, lock_backend):
    """The app's prefix and each task's own lock_prefix (click's CliRunner on the group, in-process)."""
    app = make_app(redis_server, singleton_lock_prefix=f"app{uuid.uuid4().hex[:6]}",
                   singleton_lock_url=lock_backend.url)

    @locked(app, name="t.default")
    def default(self, n):
        return n

    @locked(app, name="t.jobs", lock_prefix=f"jobs{uuid.uuid4().hex[:6]}")
    def jobs(self, n):
        return n

    held_locks = {}
    for task in (default, jobs):
        key = task.lock_key_for([1])
        held_locks[key] = task.lock_server().acquire(key, 30, owner_id=f"owner-{task.name}")
    assert {key.split(":")[0] for key in held_locks} == {
        app.conf.singleton_lock_prefix, jobs.lock_settings().prefix,
    }
    runner = CliRunner()
    obj = CLIContext(app=app, no_color=True, workdir=None)
    out = runner.invoke(locks, ["list", "--json"], obj=obj)
    assert out.exit_code == 0, out.output
    rows = {row["key"]: row for row in json.loads(out.output)}
    assert set(rows) == set(held_locks)
    assert {row["task"] for row in rows.values()} == {"t.default", "t.jobs"}
    assert rows[jobs.lock_key_for([1])]["task_id"] == "owner-t.jobs"

    jobs_key = jobs.lock_key_for([1])
    out = runner.invoke(locks, ["show", jobs_key], obj=obj)
    assert out.exit_code == 0 and "held by task owner-t.jobs" in out.output
    with caplog.at_level("WARNING", logger="celery_singleton_lock"):
        out = runner.invoke(locks, ["release", jobs_key, "--yes"], obj=obj)
    assert out.exit_code == 0, out.output
    (record,) = [r for r in caplog.records if "force-released by user" in r.getMessage()]
    assert record.levelname == "WARNING" and jobs_key in record.getMessage()
    assert f"(pid {os.getpid()})" in record.getMessage()
    assert jobs.lock_server().holder(jobs_key) is None
    assert default.lock_server().holder(default.lock_key_for([1])) is not None
    for lock in held_locks.values():
        lock.release()



@pytest.mark.timeout(60)
def test_show_names_plain_code_waiting_as_parked_not_as_in_a_worker_slot(redis_server):
    """Plain code waiting in ``held(..., wait=...)`` keeps a mark alive as a task waiting in its worker
    slot does; ``locks show`` still names it parked plain code, not a task waiting in its worker slot."""
    import threading

    from celery_singleton_lock import held

    app = make_app(redis_server, singleton_lock_prefix=f"app{uuid.uuid4().hex[:6]}")

    @locked(app, name="t.plain")
    def plain(self, n):
        return n

    key = plain.lock_key_for([1])
    server = plain.lock_server()
    holder = server.acquire(key, 30, owner_id="holder")
    got: list = []

    def wait() -> None:
        with held(server, key, ttl=30, wait=30, owner_id="plain-waiter"):
            got.append(True)

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.client.llen(key + ":q") == 1, 20, 0.02, "the plain waiter to park")
        out = CliRunner().invoke(locks, ["show", key, "--json"], obj=CLIContext(app=app, no_color=True, workdir=None))
        assert out.exit_code == 0, out.output
        (entry,) = json.loads(out.output)["line"]
        assert entry["owner"] == "plain-waiter" and entry["kind"] == "plain code"
        assert entry["state"] == "parked", entry
    finally:
        holder.release()
        thread.join(20)
    assert got == [True]  # it was woken and took the key


def _check_list(lock: redis.Redis, w, key: str, other_key: str, holder, skipper) -> None:
    """``locks list`` (text, JSON, --task) while ``holder`` holds ``key`` with one waiter parked and
    ``skipper`` holds ``other_key``, in ``w``'s children."""
    # list, text
    out = celery_cli("locks", "list")
    assert out.returncode == 0, out.stderr
    header, *rows = out.stdout.splitlines()
    assert header.split()[:3] == ["KEY", "TASK", "HOLDER"]
    assert len(rows) == 2
    row = next(r.split() for r in rows if r.startswith(key))
    assert row[1:3] == [HOLD, holder.id] and row[-1] == "1"

    # list, JSON: one array of objects
    out = celery_cli("locks", "list", "--json")
    assert out.returncode == 0, out.stderr
    found = {item["key"]: item for item in json.loads(out.stdout)}
    assert set(found) == {key, other_key}
    item = found[key]
    assert item["task"] == HOLD and item["task_id"] == holder.id
    assert item["host"] == socket.gethostname() and item["pid"] in w.children()
    assert item["fencing_token"] == int(lock.get(key).split(b" ")[1])
    assert 0 <= item["held_ms"] < WAIT * 1000 and 0 < item["ttl_ms"] <= LOCK_TTL * 1000
    assert item["waiters"] == 1 and item["reserved"] is False
    assert found[other_key]["task_id"] == skipper.id and found[other_key]["waiters"] == 0
    # a fresh task's fencing token is drawn when an operator first reads it: the one its holder reads
    fence = found[other_key]["fencing_token"]
    assert fence and fence == int(lock.get(other_key).split(b" ")[1]), (fence, lock.get(other_key))

    out = celery_cli("locks", "list", "--task", "apps.worker_app.gated_skip", "--json")
    assert [item["key"] for item in json.loads(out.stdout)] == [other_key]


def _check_show(lock: redis.Redis, key: str, holder, waiter, arg: str) -> None:
    """``locks show``: holder, raw value, the line in order with its state, the done records."""
    out = celery_cli("locks", "show", key)
    assert out.returncode == 0, out.stderr
    assert f"held by task {holder.id}" in out.stdout
    assert f"value     {lock.get(key).decode()}" in out.stdout
    assert "1 waiting:" in out.stdout
    assert f"1. {waiter.id}  task, parked" in out.stdout and f"{HOLD}(args=" in out.stdout
    out = celery_cli("locks", "show", key, "--json")
    shown = json.loads(out.stdout)
    assert shown["held"] is True and shown["task_id"] == holder.id and shown["value"] == lock.get(key).decode()
    (entry,) = shown["line"]
    assert entry["owner"] == waiter.id and entry["kind"] == "task" and entry["state"] == "parked"
    assert entry["task"] == HOLD and entry["args"] == [arg] and entry["in_line"] is True
    assert shown["done"] == []


def _check_key(worker_app, key: str, holder, arg: str) -> None:
    """``locks key``: the task's own lock_key_for, and who holds it."""
    out = celery_cli("locks", "key", HOLD, "--args", json.dumps([arg]))
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.splitlines()
    assert first == key and f"held by task {holder.id}" in second and "1 waiting" in second
    out = celery_cli("locks", "key", HOLD, "--kwargs", json.dumps({"key": arg, "tag": "x"}), "--json")
    answer = json.loads(out.stdout)
    assert answer["key"] == key and answer["held"] is True and answer["holder"]["task_id"] == holder.id
    out = celery_cli("locks", "key", HOLD, "--args", json.dumps(["free-" + arg]))
    assert out.stdout.splitlines() == [worker_app.in_line.lock_key_for(["free-" + arg]), "free: nobody holds it"]


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_list_show_key_while_tasks_hold_locks(worker_processes, worker_app):
    w = worker_processes("prefork", concurrency=3, env=ENV).wait_ready()
    arg, other = f"k-{uuid.uuid4().hex[:6]}", f"o-{uuid.uuid4().hex[:6]}"
    key = worker_app.in_line.lock_key_for([arg])
    other_key = worker_app.gated_skip.lock_key_for([other])
    holder = worker_app.in_line.delay(arg, gate=True)
    skipper = worker_app.gated_skip.delay(other, gate=True)
    lock = lock_client(worker_app)
    wait_until(lambda: lock.exists(key) and lock.exists(other_key), WAIT, 0.05, "both locks")
    waiter = worker_app.in_line.delay(arg, tag="w")
    wait_until(lambda: lock.llen(key + ":q") == 1, WAIT, 0.05, "the duplicate to park")
    try:
        _check_list(lock, w, key, other_key, holder, skipper)
        _check_show(lock, key, holder, waiter, arg)
        _check_key(worker_app, key, holder, arg)
    finally:
        worker_app.journal.set(f"gate:{arg}", 1)
        worker_app.journal.set(f"gate:{other}", 1)
    assert holder.get(timeout=WAIT)["lost"] is False
    assert waiter.get(timeout=WAIT)["tag"] == "w"
    assert skipper.get(timeout=WAIT)

    out = celery_cli("locks", "list")
    assert out.returncode == 0 and out.stdout.startswith("no locks held"), out.stdout
    assert json.loads(celery_cli("locks", "list", "--json").stdout) == []


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_list_scans_in_batches_and_skips_what_is_not_a_lock(redis_server, worker_app):
    client = redis_server.client(2)
    pipe = client.pipeline()
    for i in range(1200):
        key = worker_app.hold.lock_key_for([f"bulk-{i}", 1])
        meta = json.dumps({"owner": f"id-{i}", "host": "h", "pid": i})
        pipe.set(key, f"tok{i} 1700000000000000 {meta}", px=60_000)
    first = worker_app.hold.lock_key_for(["bulk-0", 1])
    pipe.rpush(first + ":q", "e1")
    # a deadline far ahead: a sweeper thread left in this process by an earlier test watches the
    # same index, and would time out a waiter whose deadline has passed (seen as a flake)
    pipe.hset(first + ":w", "e1", "tp\n9999999999999\n1000\nowner\n")
    pipe.zadd(first + ":d", {"someone": 1})
    pipe.rpush(first + ":wake:e1", "1")
    pipe.zadd("singleton_lock:{waiting}", {first: 1})
    pipe.set("unrelated:key:{x}", "1")
    pipe.execute()

    with Monitor(redis_server, db=2) as mon:
        out = celery_cli("locks", "list", "--json", "--count", "100")
        mon.sync()
        commands = mon.commands()
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert len(rows) == 1200 and len({r["key"] for r in rows}) == 1200
    assert {r["task"] for r in rows} == {"apps.worker_app.hold"}
    assert next(r for r in rows if r["key"] == first)["waiters"] == 1
    names = [c[0].upper() for c in commands]
    assert "KEYS" not in names
    scans = [c for c in commands if c[0].upper() == "SCAN"]
    assert len(scans) > 5 and all(c[c.index("COUNT") + 1] == "100" for c in scans)
    assert names.count("GET") == 1200


def test_the_majority_verdict_counts_members_by_token():
    """A pure function shared by the quorum's acquire and ``celery locks`` on a quorum."""
    from celery_singleton_lock.ops.nodes import verdict
    from celery_singleton_lock.topologies.quorum import most_held

    assert most_held([None, RuntimeError("down")]) == (-1, 0)
    assert most_held([b"a 1 {}", b"b 2 {}", b"a 1 {}", None]) == (0, 2)
    seen = {"m1": b"b 2 {}", "m2": None, "m3": b"b 2 {}", "m4": RuntimeError("down"), "m5": b"a 1 {}"}
    assert verdict(seen, 3) == (b"b 2 {}", 2)  # held on 2 of 5: a minority, not held
    assert verdict({"m1": None, "m2": None}, 2) == (None, 0)
