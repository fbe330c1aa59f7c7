"""``celery -A proj locks ...``: list, show, key, release, run as the real command line.

Pure parts (key parsing, durations) get plain unit tests. The commands run as subprocesses
(``python -m celery -A apps.worker_app locks ...``, through the ``celery.commands`` entry point)
against a real redis-server and real ``celery worker`` subprocesses:

1. list (text, JSON, --task), show (holder, raw value, the line with its waiter), key (the task's
   own lock_key_for, and who holds it) while tasks hold locks and one waits in line.
2. list walks the keyspace with SCAN in batches, never KEYS, and leaves out every key that is
   not a lock (the line, waiters, done records, wake-up lists, the index).
3. release: asks first (no: nothing happens), logs who did it; the holder learns at its next
   renewal that its lock is gone (.lost, then .ensure() raises LockLost: the task FAILS).
4. release with a waiter in line: the key is handed to it, the command line publishes it, it runs.
5. Exit statuses: 0 done, 1 no such lock, 2 a bad key / task / argument / URL / unreachable Redis,
   with a one-line error.
"""

from __future__ import annotations

import json
import os
import socket
import uuid

import pytest
import redis
from _apps import celery_cli as run_celery_cli
from _apps import make_app
from _task_support import locked
from celery.bin.base import CLIContext
from click.testing import CliRunner

from celery_singleton_lock import LockLost
from celery_singleton_lock.engine import line as lines
from celery_singleton_lock.ops.cli import duration, glob_escape, locks, parse_key
from celery_singleton_lock.testing.servers import Monitor, free_port, wait_until

pytestmark = pytest.mark.usefixtures("collect_results")

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
    for companion in (":p", ":b:0123", ":m:owner", ":mm:owner", ":mo:task", ":r:0123abcd"):  # every key beside one
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

        # show: holder, raw value, the line in order with its state, the done records
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

        # key: the task's own lock_key_for, and who holds it
        out = celery_cli("locks", "key", HOLD, "--args", json.dumps([arg]))
        assert out.returncode == 0, out.stderr
        first, second = out.stdout.splitlines()
        assert first == key and f"held by task {holder.id}" in second and "1 waiting" in second
        out = celery_cli("locks", "key", HOLD, "--kwargs", json.dumps({"key": arg, "tag": "x"}), "--json")
        answer = json.loads(out.stdout)
        assert answer["key"] == key and answer["held"] is True and answer["holder"]["task_id"] == holder.id
        out = celery_cli("locks", "key", HOLD, "--args", json.dumps(["free-" + arg]))
        assert out.stdout.splitlines() == [worker_app.in_line.lock_key_for(["free-" + arg]), "free: nobody holds it"]
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


def test_the_majority_verdict_counts_members_by_token():
    """A pure function shared by the quorum's acquire and ``celery locks`` on a quorum."""
    from celery_singleton_lock.ops.nodes import verdict
    from celery_singleton_lock.topologies.quorum import most_held

    assert most_held([None, RuntimeError("down")]) == (-1, 0)
    assert most_held([b"a 1 {}", b"b 2 {}", b"a 1 {}", None]) == (0, 2)
    seen = {"m1": b"b 2 {}", "m2": None, "m3": b"b 2 {}", "m4": RuntimeError("down"), "m5": b"a 1 {}"}
    assert verdict(seen, 3) == (b"b 2 {}", 2)  # held on 2 of 5: a minority, not held
    assert verdict({"m1": None, "m2": None}, 2) == (None, 0)
