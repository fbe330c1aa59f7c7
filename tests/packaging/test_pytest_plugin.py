"""The pytest plugin, as a user's test suite sees it.

Each sample project below is written by pytester and run in a pytest subprocess,
where the plugin is loaded through its ``pytest11`` entry point only (nothing
here registers it). The main sample is the complete example of
docs/how-to/testing.md, taken from that file, so the documented example is what
runs; beside it, a module with a test that MUST fail (the helper catches a task
that was not a duplicate) and the helper's other failure messages, and a module
about the server: private, emptied per test, stopped by PID at the end.
``celery_singleton_lock.pytest_plugin.LockEvents`` itself is also tested in this
process with signals sent by hand (the helper's logic, not lock behaviour).
"""

from __future__ import annotations

import re
import textwrap
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from celery_singleton_lock.pytest_plugin import LockEvents
from celery_singleton_lock.signals import duplicate_skipped, lock_acquired, lock_released
from celery_singleton_lock.testing.servers import wait_until

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "how-to" / "testing.md"

# the sample run: -p no:celery leaves out pytest-celery's plugin, so the documented
# `pytest_plugins = ("celery.contrib.pytest",)` is what brings celery's fixtures, as for a
# user without pytest-celery; --timeout is pytest-timeout's, per sample test
SAMPLE_ARGS = ("-p", "no:celery", "-p", "no:cacheprovider", "--timeout=90", "-rA")


def doc_files() -> dict[str, str]:
    """The files of the documented example: python blocks whose first line is ``# <name>.py``."""
    files: dict[str, str] = {}
    for block in re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S):
        named = re.match(r"# (\w+\.py)\n", block)
        if named:
            files[named.group(1)] = block
    return files


CATCHES = '''
"""The helper can fail: a task that was not a duplicate, a wrong holder, a wrong policy."""
import threading

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_singleton_lock import LockedTask

app = Celery("catches", set_as_current=False)
app.conf.task_default_queue = "catches"
release = threading.Event()


@app.task(base=LockedTask, bind=True, shared=False, lock_key=["n"])
def hold(self, n, tag=None):
    if not release.wait(30):
        raise TimeoutError("the test never released the holder")
    return n


@pytest.fixture
def worker(singleton_lock_app):
    singleton_lock_app(app)
    release.clear()
    with start_worker(app, pool="threads", concurrency=4, perform_ping_check=False):
        try:
            yield
        finally:
            release.set()


def test_must_fail_not_a_duplicate(worker, singleton_lock_events):
    a = hold.delay(1)
    singleton_lock_events.assert_acquired(a)
    b = hold.delay(2)  # another key: it runs beside a, it is no duplicate
    try:
        singleton_lock_events.assert_duplicate(b, of=a)
    finally:
        release.set()


def test_wrong_holder_policy_and_missing_events_are_caught(worker, singleton_lock_events):
    events = singleton_lock_events
    a, other = hold.delay(1), hold.delay(2)
    events.assert_acquired(a)
    events.assert_acquired(other)
    dup = hold.delay(1, tag="dup")  # lock_key=["n"]: the same key as a
    assert events.assert_duplicate(dup, of=a, policy="skip").holder_task_id == a.id
    with pytest.raises(AssertionError, match=f"duplicate of {a.id}, not of {other.id}"):
        events.assert_duplicate(dup, of=other)
    with pytest.raises(AssertionError, match="with policy 'skip', not 'retry'"):
        events.assert_duplicate(dup, of=a, policy="retry")
    with pytest.raises(AssertionError, match="no-such-task was not skipped as a duplicate .* within 0.3s"):
        events.assert_duplicate("no-such-task", of=a, timeout=0.3)
    with pytest.raises(AssertionError, match="timed out after 0.3s waiting for 1 event"):
        events.wait_for("lock_lost", timeout=0.3)
    with pytest.raises(ValueError, match="unknown signal 'duplicate'"):
        events.of("duplicate")
    with pytest.raises(TypeError, match="got 7"):
        events.assert_duplicate(7, of=a)

    events.clear()  # forget that a took its lock: a later duplicate's holder is then unproven
    late = hold.delay(1, tag="late")
    with pytest.raises(AssertionError, match=f"{a.id} was not seen taking that lock within 0.3s"):
        events.assert_duplicate(late, of=a, timeout=0.3)

    release.set()
    assert (a.get(timeout=10), other.get(timeout=10)) == (1, 2)
'''

BASICS = '''
"""The plugin itself: loaded by its entry point, a private server, an empty locks' db per test."""
import os
from pathlib import Path

import pytest
from celery import Celery

from celery_singleton_lock import LockedTask


def test_loaded_through_the_entry_point(request):
    plugin = request.config.pluginmanager.get_plugin("celery_singleton_lock")
    assert plugin is not None and plugin.__name__ == "celery_singleton_lock.pytest_plugin"


def test_the_server_is_private(singleton_lock_redis, singleton_lock_url):
    server = singleton_lock_redis
    assert server.port != 6379
    assert singleton_lock_url == f"redis://127.0.0.1:{server.port}/2"
    stat = Path(f"/proc/{server.pid}/stat").read_text()
    assert int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid()  # started by this session
    Path("redis-server.txt").write_text(f"{server.pid} {server.dir}")  # checked after the session
    with server.client(2) as locks, server.client(3) as other:
        locks.set("left-over", 1)
        other.set("not-the-locks", 1)


def test_each_test_gets_an_empty_locks_db(singleton_lock_redis, singleton_lock_url):
    with singleton_lock_redis.client(2) as locks, singleton_lock_redis.client(3) as other:
        assert locks.dbsize() == 0
        assert other.get("not-the-locks") == b"1"  # only the locks' db is flushed


def test_eager_calls_are_recorded_and_the_broker_can_stay(singleton_lock_app, singleton_lock_events,
                                                           singleton_lock_celery_config):
    app = singleton_lock_app(Celery("eager", set_as_current=False), broker=False, backend=False)
    assert app.conf.singleton_lock_url == singleton_lock_celery_config["singleton_lock_url"]
    assert app.conf.broker_url != singleton_lock_celery_config["broker_url"]
    assert app.conf.result_backend != singleton_lock_celery_config["result_backend"]

    @app.task(base=LockedTask, bind=True, shared=False)
    def double(self, x):
        return 2 * x

    assert double.apply(args=(21,)).get() == 42
    took = singleton_lock_events.wait_for("lock_acquired", task=double)[0]
    singleton_lock_events.wait_for("lock_released", task_id=took.task_id, key=took.key, state="SUCCESS")
    with pytest.raises(TypeError, match="expected a Celery app, got 'not an app'"):
        singleton_lock_app("not an app")
'''


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_documented_example_and_the_helper_in_a_users_suite(pytester: pytest.Pytester) -> None:
    files = doc_files()
    assert set(files) == {"conftest.py", "test_reports.py", "test_with_celery_fixtures.py"}, files
    pytester.makepyfile(**{name[:-3]: text for name, text in files.items()})
    pytester.makepyfile(test_catches=CATCHES, test_basics=BASICS)

    result = pytester.runpytest_subprocess(*SAMPLE_ARGS, timeout=360)

    # the documented example: 3 + 1; the helper's own failure modes: 1 must fail, 1 passes; basics: 4
    result.assert_outcomes(passed=9, failed=1)
    result.stdout.fnmatch_lines(["FAILED test_catches.py::test_must_fail_not_a_duplicate - *"])
    result.stdout.fnmatch_lines(["*AssertionError: task * was not a duplicate of *: it took lock * itself*"])
    result.stdout.fnmatch_lines(["PASSED test_with_celery_fixtures.py::test_a_duplicate_fails"])

    # the session's redis-server was stopped (by PID) and its directory removed
    pid, directory = (pytester.path / "redis-server.txt").read_text().split()
    wait_until(lambda: not Path(f"/proc/{pid}").exists(), 10, 0.05, f"redis-server {pid} to be gone")
    assert not Path(directory).exists()


@pytest.mark.timeout(120)
def test_a_session_that_does_not_use_it_starts_nothing(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No fixture asked: no server, no server machinery, even with no redis-server to be had."""
    monkeypatch.setenv("REDIS_SERVER", "/nonexistent/redis-server")
    pytester.makepyfile(
        test_plain=textwrap.dedent('''
            import sys

            def test_plain(request):
                assert request.config.pluginmanager.has_plugin("celery_singleton_lock")
                assert "celery_singleton_lock.testing.servers" not in sys.modules

            def test_asks_for_the_server(singleton_lock_redis):
                pass
        ''')
    )
    result = pytester.runpytest_subprocess(*SAMPLE_ARGS, timeout=100)
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*could not start redis-server '/nonexistent/redis-server'*"])


# -- LockEvents in this process, with signals sent by hand --------------------------------------


class Sender:
    """Stands for a task: signals want a hashable sender, and the recorder reads its name."""

    def __init__(self, name: str) -> None:
        self.name = name


@pytest.mark.timeout(30)
def test_events_wait_across_threads_and_take_any_policy() -> None:
    sender = Sender("billing.sync")
    with LockEvents(timeout=10) as events:
        lock_acquired.send(sender=sender, key="k", task_id="holder", lock=object())
        # a policy name nobody knows today: the helper must not have a fixed list
        later = threading.Timer(0.2, lambda: duplicate_skipped.send(
            sender=sender, key="k", task_id="dup", holder_task_id="holder", policy="defer"))
        later.start()
        try:
            event = events.assert_duplicate("dup", of="holder", policy="defer")
        finally:
            later.join(5)
        assert (event.signal, event.key, event.task_name, event.policy) == ("duplicate_skipped", "k",
                                                                            "billing.sync", "defer")
        assert events.of(task="billing.sync", policy="defer") == [event]
        assert events.of(holder_task_id=SimpleNamespace(id="holder")) == [event]  # a result-like works too
        assert "policy=defer" in str(event) and "lock=object" in str(events.events[0])  # objects by type
    lock_released.send(sender=sender, key="k", task_id="holder", state="SUCCESS", deleted=True)
    assert [e.signal for e in events] == ["lock_acquired", "duplicate_skipped"]  # disconnected on exit


@pytest.mark.timeout(30)
def test_events_count_and_fail_with_what_was_recorded() -> None:
    sender = Sender("t")
    with LockEvents(timeout=0.2) as events:
        for n in range(3):
            lock_acquired.send(sender=sender, key=f"k{n}", task_id=f"id{n}", lock=None)
        assert len(events.wait_for("lock_acquired", count=3)) == 3
        with pytest.raises(AssertionError) as info:
            events.wait_for("lock_acquired", count=4)
        assert "timed out after 0.2s waiting for 4 event(s) with signal='lock_acquired'" in str(info.value)
        assert "#2 lock_acquired task=t key=k2 task_id=id2" in str(info.value)
        with pytest.raises(AssertionError, match="task id0 was not a duplicate of id1: it took lock k0 itself"):
            events.assert_duplicate("id0", of="id1")



@pytest.mark.timeout(30)
def test_events_of_one_app_leave_out_other_apps_tasks() -> None:
    from celery import Celery

    ours, theirs = Celery("ours", set_as_current=False), Celery("theirs", set_as_current=False)

    def noop() -> None:
        pass

    ours.task(name="t.mine", shared=False)(noop)
    theirs.task(name="t.other", shared=False)(noop)
    mine, other = ours.tasks["t.mine"], theirs.tasks["t.other"]  # the real tasks (apps finalized)
    with LockEvents(timeout=0.2, app=ours) as events, LockEvents(timeout=0.2) as every:
        lock_acquired.send(sender=other, key="k", task_id="theirs", lock=None)
        lock_acquired.send(sender=mine, key="k", task_id="mine", lock=None)
        lock_acquired.send(sender=Sender("no.app"), key="k", task_id="none", lock=None)
    assert [e.task_id for e in events] == ["mine"] and events.app is ours
    assert [e.task_id for e in every] == ["theirs", "mine", "none"]  # no app: every task's
