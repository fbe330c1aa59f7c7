"""Options and settings that are not ours are refused (a task option) or reported (an app setting).

A typo such as ``lock_tll=5``, or celery-singleton's ``unique_on=[...]`` copied across, used to
be accepted in silence: the task ran on the defaults, with every argument in its key.
"""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path

import pytest
from _task_support import start_worker_process
from celery import Celery

from celery_singleton_lock import LockedTask
from celery_singleton_lock.delivery.config import SETTINGS
from celery_singleton_lock.delivery.options import unknown_settings

pytestmark = pytest.mark.timeout(60)

PACKAGE = Path(__file__).resolve().parents[2] / "celery_singleton_lock"


def define(base: type = LockedTask, **options) -> None:
    app = Celery(f"opt{uuid.uuid4().hex[:8]}", set_as_current=False)

    @app.task(base=base, shared=False, name=f"opt.t.{uuid.uuid4().hex[:6]}", **options)
    def deduct(sku, qty=1):
        return qty

    app.finalize()


TYPOS = [
    ({"lock_tll": 5}, "lock_tll=5", "did you mean lock_ttl?"),
    ({"lock_keys": ["sku"]}, "lock_keys=['sku']", "did you mean lock_key?"),
    ({"on_duplicates": "retry"}, "on_duplicates='retry'", "did you mean on_duplicate?"),
    ({"lock_max_waits": 5}, "lock_max_waits=5", "did you mean lock_max_wait?"),
]


@pytest.mark.parametrize("options, shown, hint", TYPOS, ids=[t[1] for t in TYPOS])
def test_a_typo_of_our_option_fails_at_definition_naming_the_closest(options, shown, hint):
    with pytest.raises(ValueError) as info:
        define(**options)
    message = str(info.value)
    assert shown in message and hint in message and "not an option of celery-singleton-lock" in message, message


PEERS = [
    ({"unique_on": ["sku"]}, "lock_key"),
    ({"once": {"graceful": True}}, "lock_publish='join'"),  # as the migration guide maps it
    ({"raise_on_duplicate": True}, "on_duplicate='raise'"),
    ({"lock_expiry": 5}, "lock_ttl"),
    ({"heimdall": {"unique": True}}, "lock_publish='raise'"),
]


@pytest.mark.parametrize("options, ours", PEERS, ids=[next(iter(p[0])) for p in PEERS])
def test_another_librarys_option_fails_naming_ours_and_the_migration_guide(options, ours):
    with pytest.raises(ValueError) as info:
        define(**options)
    message = str(info.value)
    assert next(iter(options)) in message and ours in message, message
    assert "https://celery-singleton-lock.github.io/celery-singleton-lock/migration/" in message, message


def test_the_users_own_methods_and_our_options_are_fine():
    class Base(LockedTask):
        abstract = True

        def lock_audit(self) -> str:  # the user's own method, not an option
            return "ok"

        @property
        def lock_owner_name(self) -> str:
            return "me"

    define(lock_key=["sku"], lock_ttl=5, on_duplicate="retry", lock_max_wait=10, base=Base)


def test_unknown_settings_are_named_with_the_closest_known_one():
    lines = unknown_settings(["singleton_lock_tll", "SINGLETON_LOCK_EXPIRY", "singleton_lock_ttl", "broker_url",
                              "celery_singleton_lock_on_duplicat"])
    assert any("singleton_lock_tll" in x and "did you mean singleton_lock_ttl?" in x for x in lines), lines
    assert any("singleton_lock_expiry" in x for x in lines), lines
    assert any("celery_singleton_lock_on_duplicat" in x and "singleton_lock_on_duplicate?" in x for x in lines)
    assert len(lines) == 3, lines


def test_every_setting_the_code_reads_is_a_known_setting():
    read = set()
    for path in PACKAGE.rglob("*.py"):
        read |= set(re.findall(r"""conf(?:\.get\(|\[)["'](singleton_lock_[a-z_]+)["']""", path.read_text()))
    assert read, "the code reads settings through conf.get(...) or conf[...]"
    assert read <= SETTINGS, f"read but not in config.SETTINGS: {sorted(read - SETTINGS)}"


@pytest.mark.slow
def test_a_worker_logs_an_unknown_setting_at_start(redis_server, tmp_path):
    conf = {"singleton_lock_expiry": 600, "singleton_lock_tll": 5}
    worker = start_worker_process(redis_server, tmp_path, concurrency=1, env={"CSL_EXTRA_CONF": json.dumps(conf)})
    try:
        worker.wait_ready(90)
    finally:
        worker.stop()
    log = worker.log()
    assert "unknown setting singleton_lock_expiry: ignored" in log, log[-2000:]
    assert "unknown setting singleton_lock_tll: ignored; did you mean singleton_lock_ttl?" in log, log[-2000:]


def test_a_lock_ttl_taken_for_the_longest_run_is_warned_about_with_the_reason(caplog):
    """``lock_ttl=3600`` (celery-once's timeout copied across): a warning when the task is made, naming
    the value and why; a TTL of a minute is not warned about."""
    import logging

    from celery import Celery

    from celery_singleton_lock import LockedTask

    app = Celery("long_ttl", set_as_current=False)
    with caplog.at_level(logging.WARNING, logger="celery_singleton_lock"):
        @app.task(base=LockedTask, shared=False, lock_ttl=3600)
        def hourly(x):
            return x

        @app.task(base=LockedTask, shared=False, lock_ttl=60)
        def minutely(x):
            return x

        app.finalize()
    warned = [r.getMessage() for r in caplog.records if "lock_ttl" in r.getMessage()]
    assert len(warned) == 1 and "3600s" in warned[0] and "without renewal" in warned[0], warned
    assert "hourly" in warned[0]
