"""pytest plugin that tools/celery_integration.py loads (``-p csl_integ_plugin``) into Celery's integration suite.

It is imported before the suite's conftest, so before ``t/integration/tasks.py`` defines
a single task. In "lock" mode it makes every task of every Celery app in the test
process a :class:`~celery_singleton_lock.LockedTask`:

* ``Celery.task_cls`` (the class default every app reads, the session app the worker
  runs and the per-test apps alike) becomes LockedTask, so every ``@shared_task``,
  every ``@app.task`` and Celery's built-in tasks (celery.chord, celery.group, ...)
  are LockedTask subclasses;
* ``celery.Task`` becomes LockedTask, so the two classes the suite bases on
  ``from celery import Task`` (``ClassBasedAutoRetryTask``, ``StampedTaskOnReplace``)
  are LockedTask subclasses too;
* every app gets ``singleton_lock_url`` (the private server's lock db) and
  ``singleton_lock_on_duplicate`` (the policy) as configuration defaults, so no app
  ever falls back to the machine's Redis on localhost:6379.

The suite's worker is Celery's in-process test worker (``celery_session_worker``: a
thread running a prefork pool whose child is forked from this process), so it runs
the same app, classes and configuration.

"plain" mode changes nothing: the baseline. Both modes record, without changing any
behaviour:

* the session app's task registry when the test worker has started (how many tasks,
  how many are LockedTask); in lock mode a test fails at once if one is not;
* every execution (``task_prerun``) as locked or plain, by task name, and every
  ``lock_acquired`` and ``duplicate_skipped``, counted in the private server's db 3,
  so the report shows that the worker really ran LockedTasks and which tasks met a
  duplicate;
* every test's final outcome and failure text, as JSON, for the comparison.

Configured by environment variables that the driver sets (``CSL_INTEG_*``).
"""

from __future__ import annotations

import functools
import json
import os
import threading
from typing import Any

import celery
import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import test_worker_started
from celery.signals import task_prerun

from celery_singleton_lock import LockedTask, duplicate_skipped, lock_acquired

MODE = os.environ.get("CSL_INTEG_MODE", "plain")
LOCK_URL = os.environ.get("CSL_INTEG_LOCK_URL", "")
POLICY = os.environ.get("CSL_INTEG_POLICY", "retry")
STATS_URL = os.environ.get("CSL_INTEG_STATS_URL", "")
OUT = os.environ.get("CSL_INTEG_OUT", "")

if MODE not in ("lock", "plain"):
    raise RuntimeError(f"CSL_INTEG_MODE must be 'lock' or 'plain', got {MODE!r}")
if MODE == "lock" and not LOCK_URL.startswith("redis://"):
    # never let LockedTask fall back to redis://localhost:6379 (the machine's Redis)
    raise RuntimeError(f"CSL_INTEG_LOCK_URL must be the private server's redis:// URL, got {LOCK_URL!r}")


# -- lock mode: every task a LockedTask ------------------------------------------------

def _install_locked_tasks() -> None:
    Celery.task_cls = "celery_singleton_lock.delivery.task:LockedTask"
    celery.Task = LockedTask  # ``from celery import Task`` in the suite's tasks.py
    original_init = Celery.__init__

    @functools.wraps(original_init)
    def __init__(self: Celery, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        # defaults: below anything the suite or a test configures, and no test sets these
        self.add_defaults({"singleton_lock_url": LOCK_URL, "singleton_lock_on_duplicate": POLICY})

    Celery.__init__ = __init__


if MODE == "lock":
    _install_locked_tasks()


# -- what ran: counted on the private server (db 3), from the worker's pool child too ---------

_client: redis.Redis | None = None
_client_pid = 0


def _stats() -> redis.Redis | None:
    global _client, _client_pid
    if not STATS_URL:
        return None
    if _client is None or _client_pid != os.getpid():
        _client = redis.Redis.from_url(STATS_URL, socket_timeout=5, socket_connect_timeout=5)
        _client_pid = os.getpid()
    return _client


def _count(key: str, field: str) -> None:
    try:
        client = _stats()
        if client is not None:
            client.hincrby(f"csl_integ:{key}", field, 1)
    except Exception:  # the counters must never change what the suite sees
        pass


@task_prerun.connect(weak=False)
def _on_prerun(sender: Any = None, task: Any = None, **_: Any) -> None:
    task = task or sender
    _count("locked" if isinstance(task, LockedTask) else "plain", getattr(task, "name", "?"))


@lock_acquired.connect(weak=False)
def _on_acquired(sender: Any = None, **_: Any) -> None:
    _count("acquired", getattr(sender, "name", "?"))


@duplicate_skipped.connect(weak=False)
def _on_duplicate(sender: Any = None, policy: str = "?", **_: Any) -> None:
    _count("duplicates", f"{getattr(sender, 'name', '?')} ({policy})")


# -- the worker's app: are its tasks LockedTask? ------------------------------------------------

_registry: dict[str, Any] = {}
_registry_lock = threading.Lock()


@test_worker_started.connect(weak=False)
def _on_worker_started(sender: Any = None, worker: Any = None, **_: Any) -> None:
    """Sent by celery.contrib.testing once the suite's worker consumes: its app's registry is final."""
    app = sender if sender is not None else worker.app
    tasks = dict(app.tasks)
    plain = sorted(name for name, task in tasks.items() if not isinstance(task, LockedTask))
    with _registry_lock:
        _registry.update(
            app=repr(app), pool=str(getattr(worker, "pool_cls", "?")), concurrency=getattr(worker, "concurrency", None),
            tasks=len(tasks), locked=len(tasks) - len(plain), not_locked=plain,
        )


@pytest.fixture(autouse=True)
def _csl_integ_tasks_are_locked() -> None:
    """In lock mode, a test fails at once if the worker's app holds a task that is not a LockedTask."""
    if MODE == "lock":
        with _registry_lock:
            plain = list(_registry.get("not_locked", ()))
        if plain:
            pytest.fail(f"csl_integ: the worker's app has tasks that are not LockedTask: {plain}")


# -- shards: this process runs its share of the selected tests -------------------------------

SHARD = os.environ.get("CSL_INTEG_SHARD", "")
"""``i/n``: run the i-th of n shares (0-based), each in its own pytest process and redis-server."""
WEIGHTS = os.environ.get("CSL_INTEG_WEIGHTS", "")
"""A JSON file {node id: seconds} from an earlier run, to balance the shares."""


@pytest.hookimpl(trylast=True)  # after -k / -m have deselected theirs
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not SHARD:
        return
    index, count = (int(x) for x in SHARD.split("/"))
    weights: dict[str, float] = {}
    if WEIGHTS and os.path.exists(WEIGHTS):
        with open(WEIGHTS) as f:
            weights = json.load(f)
    from celery_integration import shard_of  # the driver's module (stdlib only), beside this file

    owner = shard_of([item.nodeid for item in items], count, weights)
    keep = [item for item, share in zip(items, owner, strict=True) if share == index]
    drop = [item for item, share in zip(items, owner, strict=True) if share != index]
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep


# -- outcomes ------------------------------------------------------------------------------------

_reports: dict[str, dict[str, Any]] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    entry = _reports.setdefault(report.nodeid, {"outcome": "passed", "duration": 0.0, "reruns": 0})
    subtest = type(report).__name__ == "SubtestReport"  # its time is inside its test's call already
    if subtest and not report.failed:
        return
    if not subtest:
        entry["duration"] += report.duration
    if report.outcome == "rerun":  # pytest-rerunfailures: a failed try that will be run again
        entry["reruns"] += 1
        entry.pop("message", None)
        entry["outcome"] = "passed"
        return
    if hasattr(report, "wasxfail"):
        entry["outcome"] = "xfailed" if report.skipped else "xpassed"
        return
    if report.failed:
        entry["outcome"] = "failed" if report.when == "call" else "error"
        crash = getattr(report.longrepr, "reprcrash", None)
        entry["message"] = crash.message if crash is not None else str(report.longrepr)[-2000:]
        entry["when"] = report.when
        entry["longrepr"] = report.longreprtext[-12000:]
    elif report.skipped and entry["outcome"] == "passed":
        entry["outcome"] = "skipped"
        longrepr = report.longrepr
        entry["message"] = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)


def _stats_snapshot() -> dict[str, dict[str, int]]:
    try:
        client = _stats()
        if client is None:
            return {}
        return {
            key: {k.decode(): int(v) for k, v in client.hgetall(f"csl_integ:{key}").items()}
            for key in ("locked", "plain", "acquired", "duplicates")
        }
    except Exception as exc:
        return {"error": {repr(exc): 1}}


def _write(finished: bool, exitstatus: int | None = None) -> None:
    """results.json: after every test (a run ended from outside still leaves what it did), and at the end."""
    if not OUT:
        return
    with _registry_lock:
        registry = dict(_registry)
    data = {
        "mode": MODE, "policy": POLICY if MODE == "lock" else None, "finished": finished,
        "exitstatus": exitstatus, "registry": registry, "tests": _reports,
        "executions": _stats_snapshot() if finished else {},
    }
    path = os.path.join(OUT, "results.json")
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(path + ".tmp", path)


def pytest_runtest_logfinish(nodeid: str, location: Any) -> None:
    _write(finished=False)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _write(finished=True, exitstatus=int(exitstatus))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    with _registry_lock:
        registry = dict(_registry)
    stats = _stats_snapshot()
    say = terminalreporter.write_line
    say(f"csl_integ: mode={MODE}" + (f" policy={POLICY} lock_url={LOCK_URL}" if MODE == "lock" else ""))
    if registry:
        say(
            f"csl_integ: worker app {registry['app']} (pool {registry['pool']}, concurrency "
            f"{registry['concurrency']}): {registry['tasks']} tasks, {registry['locked']} LockedTask, "
            f"not LockedTask: {registry['not_locked'] or 'none'}"
        )
    else:
        say("csl_integ: the suite's worker did not start in this run")
    locked, plain = stats.get("locked", {}), stats.get("plain", {})
    say(
        f"csl_integ: executions: {sum(locked.values())} as LockedTask, {sum(plain.values())} as plain Task; "
        f"locks acquired {sum(stats.get('acquired', {}).values())}; "
        f"duplicates met {sum(stats.get('duplicates', {}).values())}"
    )
    if MODE == "lock" and plain:
        say(f"csl_integ: plain executions by task: {plain}")
    for name, n in sorted(stats.get("duplicates", {}).items(), key=lambda kv: -kv[1]):
        say(f"csl_integ:   duplicate {name}: {n}")
