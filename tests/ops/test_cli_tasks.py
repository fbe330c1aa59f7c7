"""``celery locks`` and task names: no app given, ``--task`` resolved or refused with close matches,
and ``release --task NAME --all`` (every lock of one task).

Against a real redis-server: locks are taken through each task's own server (as a worker would), the
commands run in-process through click's CliRunner on the group, with the app Celery's CLI would pass;
the "no -A" case runs ``python -m celery locks list`` as a subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import redis
from _apps import make_app
from _task_support import ROOT, locked
from celery.bin.base import CLIContext
from click.testing import CliRunner

from celery_singleton_lock.ops.cli import locks

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def shop(redis_server):
    """An app with three LockedTasks (two end in ``deduct``'s neighbours) and one plain task."""
    app = make_app(redis_server)

    @locked(app, name="shop.orders.deduct", lock_key=["sku"])
    def deduct(self, sku, qty):
        return qty

    @locked(app, name="shop.orders.restock", lock_key=["sku"])
    def restock(self, sku, qty):
        return qty

    @locked(app, name="shop.billing.charge")
    def charge(self, order):
        return order

    @app.task(name="shop.plain", shared=False)
    def plain():
        return None

    return app, deduct, restock


def invoke(app, *args: str, input: str | None = None):
    return CliRunner().invoke(locks, list(args), obj=CLIContext(app=app, no_color=True, workdir=None), input=input)


def hold(task, *args):
    key = task.lock_key_for(list(args))
    task.lock_server().acquire(key, 30, owner_id=f"owner-{task.name}-{args[0]}")
    return key


def test_no_app_says_to_pass_one(tmp_path):
    """Celery's default app (no -A) has no broker: the error names -A, not the broker."""
    env = {k: v for k, v in os.environ.items() if k not in ("CELERY_APP", "CELERY_CONFIG_MODULE")}
    proc = subprocess.run([sys.executable, "-m", "celery", "locks", "list"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "no app given" in proc.stderr and "celery -A proj locks list" in proc.stderr, proc.stderr
    assert "CELERY_APP" in proc.stderr and "broker" not in proc.stderr.lower()
    assert ROOT.is_dir()  # the package under test is the checkout's (installed editable)


def test_a_short_task_name_is_resolved(shop):
    app, deduct, restock = shop
    key = hold(deduct, "sku-1", 1)
    hold(restock, "sku-1", 1)
    out = invoke(app, "list", "--task", "deduct", "--json")
    assert out.exit_code == 0, out.output
    assert "(task 'deduct' is shop.orders.deduct)" in out.output  # said on stderr (mixed in by CliRunner)
    assert key in out.output and "restock" not in out.output.split("\n", 1)[1]
    out = invoke(app, "key", "deduct", "--args", '["sku-1", 1]')
    assert out.exit_code == 0 and key in out.output, out.output


def test_an_unknown_task_exits_2_with_close_matches(shop):
    app, _, _ = shop
    out = invoke(app, "list", "--task", "dedcut")
    assert out.exit_code == 2, out.output
    assert "no task named 'dedcut'" in out.output and "did you mean shop.orders.deduct?" in out.output
    out = invoke(app, "list", "--task", "shop.orders.dedcut")
    assert out.exit_code == 2 and "did you mean shop.orders.deduct, " in out.output, out.output
    out = invoke(app, "list", "--task", "stock")  # a part of a name
    assert out.exit_code == 2 and "did you mean shop.orders.restock?" in out.output, out.output
    out = invoke(app, "list", "--task", "zzz")
    assert out.exit_code == 2, out.output
    # (tasks shared by a test app imported earlier in this process may be listed too)
    assert "no task named 'zzz'" in out.output and "its LockedTasks: " in out.output, out.output
    out = invoke(app, "list", "--task", "shop.plain")
    assert out.exit_code == 2 and "is not a LockedTask" in out.output, out.output


def test_release_every_lock_of_one_task(shop):
    app, deduct, restock = shop
    client = redis.Redis.from_url(app.conf.singleton_lock_url)
    keys = [hold(deduct, f"sku-{i}", 1) for i in range(3)]
    other = hold(restock, "sku-0", 1)
    assert all(client.exists(k) for k in [*keys, other]), "the locks are held before the release"

    out = invoke(app, "release", "--task", "deduct", "--all", input="n\n")
    assert out.exit_code == 1 and "not released" in out.output, out.output
    assert "3 lock(s) of task shop.orders.deduct" in out.output
    assert all(client.exists(k) for k in keys)

    out = invoke(app, "release", "--task", "deduct", "--all", "--yes")
    assert out.exit_code == 0, out.output
    assert out.output.count("force-released by user ") == 3
    assert "3 of 3 lock(s) of task shop.orders.deduct released" in out.output
    assert not any(client.exists(k) for k in keys)
    assert client.exists(other), "another task's lock stays"

    out = invoke(app, "release", "--task", "deduct", "--all", "--yes")
    assert out.exit_code == 1 and "no locks of task shop.orders.deduct: nothing released" in out.output

    keys = [hold(deduct, f"sku-{i}", 1) for i in range(2)]
    out = invoke(app, "release", "--task", "shop.orders.deduct", "--all", input="y\n")
    assert out.exit_code == 0 and "2 of 2 lock(s)" in out.output, out.output
    assert not any(client.exists(k) for k in keys)


def test_release_arguments_are_checked(shop):
    app, deduct, _ = shop
    key = hold(deduct, "sku-9", 1)
    for args, wanted in (
        (["release"], "give the KEY of a lock"),
        (["release", "--all", "--yes"], "--task NAME --all"),
        (["release", "--task", "deduct", "--yes"], "--task NAME --all"),
        (["release", key, "--task", "deduct", "--all"], "not both"),
        (["release", "--task", "nope", "--all", "--yes"], "no task named 'nope'"),
    ):
        out = invoke(app, *args)
        assert out.exit_code == 2 and wanted in out.output, (args, out.output)
    assert redis.Redis.from_url(app.conf.singleton_lock_url).exists(key)
