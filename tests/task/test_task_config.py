"""Configuration: options checked when the task binds to its app; option > setting > default;
the lock URL's fallbacks and its one log line; golden keys at the task level.

No worker here, and never a connection to 127.0.0.1:6379: lock URLs are only compared as
strings (building a LockServer does not connect), and no Redis configured is an error.
"""

from __future__ import annotations

import logging
import uuid

import pytest
from _apps import make_app
from celery import Celery

from celery_singleton_lock import LockedTask
from celery_singleton_lock.delivery import config as cfg
from celery_singleton_lock.testing.servers import free_port

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("collect_results")]


def bare_app(**conf) -> Celery:
    """An app that is never connected to anything."""
    app = Celery(f"cfg{uuid.uuid4().hex[:8]}", set_as_current=False)
    app.conf.update(**conf)
    return app


# -- options fail at bind time ------------------------------------------------------------------

BAD_OPTIONS = [
    ({"on_duplicate": "sometimes"}, "on_duplicate"),
    ({"on_duplicate": "Skip"}, "on_duplicate"),
    ({"lock_ttl": 0}, "lock_ttl"),
    ({"lock_ttl": -5}, "lock_ttl"),
    ({"lock_ttl": "10"}, "lock_ttl"),
    ({"lock_ttl": True}, "lock_ttl"),
    ({"lock_ttl": float("nan")}, "lock_ttl"),
    ({"lock_key": ["sku", "nope"]}, "lock_key"),
    ({"lock_key": "sku"}, "lock_key"),
    ({"lock_max_retries": -1}, "lock_max_retries"),
    ({"lock_retry_backoff": 0}, "lock_retry_backoff"),
    ({"lock_prefix": ""}, "lock_prefix"),
    ({"on_duplicate": "merge"}, "on_duplicate"),
    ({"lock_cooldown": -1}, "lock_cooldown"),
    ({"lock_cooldown": "5"}, "lock_cooldown"),
    ({"lock_cooldown_on_failure": "yes"}, "lock_cooldown_on_failure"),
    ({"lock_publish": "always"}, "lock_publish"),
    ({"lock_publish": True}, "lock_publish"),
    ({"lock_publish_ttl": 0}, "lock_publish_ttl"),
]


@pytest.mark.parametrize("options, option", BAD_OPTIONS, ids=[f"{o}" for o, _ in BAD_OPTIONS])
def test_bad_option_fails_at_finalize_naming_task_and_option(options, option):
    app = bare_app()
    name = f"cfg.bad.{uuid.uuid4().hex[:6]}"

    @app.task(base=LockedTask, shared=False, name=name, **options)
    def deduct(sku, qty=1):
        return qty

    # Celery binds lazily: the decorator hands back a proxy, and nothing is checked yet ...
    # ... until the app is finalized (or the proxy first used): then it fails
    with pytest.raises(ValueError) as info:
        app.finalize()
    message = str(info.value)
    assert name in message and option in message, message
    # and it keeps failing (the bad task was never registered half-way)
    with pytest.raises(ValueError, match=option):
        deduct.name  # noqa: B018 - evaluating the proxy binds the task
    assert name not in app.tasks


def test_bad_option_fails_when_the_proxy_is_first_used():
    app = bare_app()

    @app.task(base=LockedTask, shared=False, name="cfg.proxy", lock_key=["missing"])
    def f(a):
        return a

    with pytest.raises(ValueError, match=r"task 'cfg.proxy': lock_key names 'missing'.*parameters: a"):
        f.delay  # noqa: B018


def test_bad_option_fails_at_decoration_on_a_finalized_app():
    app = bare_app()
    app.finalize()
    with pytest.raises(ValueError, match=r"task 'cfg.now'.*on_duplicate"):
        @app.task(base=LockedTask, shared=False, name="cfg.now", on_duplicate="maybe")
        def f(a):
            return a


def test_bad_option_on_a_class_based_task_fails_at_class_definition():
    with pytest.raises(ValueError, match=r"task 'cfg.cls'.*lock_ttl"):
        class Bad(LockedTask):
            name = "cfg.cls"
            lock_ttl = -1

            def run(self, a):
                return a


def test_good_options_bind_and_lock_key_may_name_kwargs():
    app = bare_app()

    @app.task(base=LockedTask, shared=False, bind=True, lock_key=["sku"], lock_ttl=2.5, on_duplicate="retry")
    def deduct(self, sku, qty=1):
        return qty

    @app.task(base=LockedTask, shared=False, name="cfg.kw", lock_key=["anything"])
    def loose(**kwargs):  # **kwargs: any name may be keyed
        return kwargs

    @app.task(base=LockedTask, shared=False, name="cfg.callable", lock_key=lambda sku, qty=1: sku)
    def by_callable(sku, qty=1):
        return qty

    app.finalize()
    assert deduct.lock_ttl == 2.5 and deduct.on_duplicate == "retry"
    assert loose.lock_key == ["anything"]


# -- resolution: option > setting > default ---------------------------------------------------


def test_option_beats_setting_beats_default():
    app = bare_app(singleton_lock_url="redis://127.0.0.1:1/2")

    @app.task(base=LockedTask, shared=False, name="cfg.defaults")
    def plain(a):
        return a

    @app.task(base=LockedTask, shared=False, name="cfg.options", lock_ttl=3, on_duplicate="raise",
              lock_prefix="mine", lock_max_retries=4, lock_retry_backoff=0.5, lock_retry_backoff_max=2)
    def opted(a):
        return a

    app.finalize()
    s = cfg.resolve(plain)
    assert (s.ttl, s.on_duplicate, s.prefix, s.max_retries, s.retry_backoff, s.retry_backoff_max) == (
        30.0, "skip", "singleton_lock", 50, 1.0, 30.0)
    assert s.url == "redis://127.0.0.1:1/2" and s.redis_options == {}
    app.conf.update(singleton_lock_ttl=7, singleton_lock_on_duplicate="retry", singleton_lock_prefix="app",
                    singleton_lock_max_retries=9, singleton_lock_retry_backoff=0.2,
                    singleton_lock_retry_backoff_max=1.5)
    s = cfg.resolve(plain)
    assert (s.ttl, s.on_duplicate, s.prefix, s.max_retries, s.retry_backoff, s.retry_backoff_max) == (
        7.0, "retry", "app", 9, 0.2, 1.5)
    s = cfg.resolve(opted)
    assert (s.ttl, s.on_duplicate, s.prefix, s.max_retries, s.retry_backoff, s.retry_backoff_max) == (
        3.0, "raise", "mine", 4, 0.5, 2.0)


def test_watchdog_settings_reach_the_watchdog_options():
    app = bare_app(singleton_lock_url="redis://127.0.0.1:1/2")

    @app.task(base=LockedTask, shared=False, name="cfg.watchdog")
    def task(a):
        return a

    app.finalize()
    assert cfg.resolve(task).watchdog_options == {}  # the watchdog's own defaults
    app.conf.update(singleton_lock_watchdog_tick=0.05, singleton_lock_watchdog_chunk=100,
                    singleton_lock_watchdog_socket_timeout=0.1)
    options = cfg.resolve(task).watchdog_options
    assert options == {"tick": 0.05, "chunk": 100, "socket_timeout": 0.1}
    from celery_singleton_lock.watchdog.renewer import Watchdog

    wd = Watchdog(**options)  # the same options a process's watchdog is made with
    assert (wd.tick, wd.chunk, wd.socket_timeout) == (0.05, 100, 0.1)
    with pytest.raises(ValueError, match="tick"):
        Watchdog(tick=0)


@pytest.mark.parametrize("setting, value", [
    ("singleton_lock_on_duplicate", "never"),
    ("singleton_lock_ttl", 0),
    ("singleton_lock_ttl", "30"),
    ("singleton_lock_max_retries", 1.5),
    ("singleton_lock_url", "amqp://guest@localhost//"),
    ("singleton_lock_cooldown", -2),
    ("singleton_lock_publish", "yes"),
    ("singleton_lock_publish_ttl", -1),
])
def test_bad_setting_names_the_setting(setting, value):
    app = bare_app(**{setting: value})

    @app.task(base=LockedTask, shared=False, name="cfg.setting")
    def f(a):
        return a

    app.finalize()
    with pytest.raises(ValueError, match=setting):
        cfg.resolve(f)


def test_bad_setting_fails_the_execution_not_the_worker(redis_server):
    app = make_app(redis_server, singleton_lock_on_duplicate="never")

    @app.task(base=LockedTask, shared=False, name="cfg.exec")
    def f(a):
        return a

    result = f.apply((1,))
    assert result.state == "FAILURE"
    assert "singleton_lock_on_duplicate" in str(result.result)


# -- the lock URL -------------------------------------------------------------------------------


@pytest.mark.parametrize("conf, expected", [
    ({"singleton_lock_url": "redis://locks:6380/2", "result_backend": "redis://rb/1", "broker_url": "redis://b/0"},
     "redis://locks:6380/2"),
    ({"result_backend": "redis://rb:6390/1", "broker_url": "redis://b:6391/0"}, "redis://rb:6390/1"),
    ({"result_backend": "rediss://rb:6390/1", "broker_url": "redis://b:6391/0"}, "rediss://rb:6390/1"),
    ({"result_backend": "rpc://", "broker_url": "redis://b:6391/0"}, "redis://b:6391/0"),
    ({"result_backend": "db+sqlite:///r.db", "broker_url": "redis://:pw@b:6391/3"}, "redis://:pw@b:6391/3"),
    ({"broker_url": "redis://b:6391/0"}, "redis://b:6391/0"),
])
def test_lock_url_fallbacks(conf, expected):
    app = bare_app(**conf)
    assert cfg.lock_url(app.conf) == expected


@pytest.mark.parametrize("conf", [
    {"result_backend": "rpc://", "broker_url": "amqp://guest:guest@rabbit//"},
    {},
])
def test_lock_url_without_any_redis_is_an_error_not_localhost(conf):
    """A per-host localhost Redis would exclude nothing across hosts (more in test_urls.py)."""
    with pytest.raises(ValueError, match="set singleton_lock_url"):
        cfg.lock_url(bare_app(**conf).conf)


def test_lock_url_is_logged_once_per_process_without_password(caplog):
    caplog.set_level(logging.INFO, logger="celery_singleton_lock")
    secret = f"s3cret{uuid.uuid4().hex[:6]}"
    url = f"redis://user:{secret}@127.0.0.1:{free_port()}/5"  # nothing listens; nothing connects
    app = bare_app(singleton_lock_url=url)

    @app.task(base=LockedTask, shared=False, name="cfg.url")
    def f(a):
        return a

    @app.task(base=LockedTask, shared=False, name="cfg.url2")
    def g(a):
        return a

    app.finalize()
    first = cfg.server_for(f.lock_settings())
    assert cfg.server_for(f.lock_settings()) is first
    assert cfg.server_for(g.lock_settings()) is first  # one server (and one line) per URL and process
    lines = [r.getMessage() for r in caplog.records if "locks live at" in r.getMessage()]
    assert len(lines) == 1, lines
    assert secret not in lines[0] and "user:***@127.0.0.1" in lines[0]
    assert all(secret not in r.getMessage() for r in caplog.records)
    assert secret not in first.url


# -- golden keys at the task level ------------------------------------------------------------


@pytest.fixture
def golden_app():
    app = bare_app(singleton_lock_url="redis://127.0.0.1:1/2")  # never connected: keys need settings, not Redis

    @app.task(base=LockedTask, shared=False, bind=True, name="golden.deduct")
    def deduct(self, sku, qty=1, note=None):
        return qty

    @app.task(base=LockedTask, shared=False, name="golden.deduct_unbound")
    def deduct_unbound(sku, qty=1, note=None):
        return qty

    @app.task(base=LockedTask, shared=False, bind=True, name="golden.by_sku", lock_key=["sku"])
    def by_sku(self, sku, qty=1):
        return qty

    @app.task(base=LockedTask, shared=False, name="golden.by_callable", lock_key=lambda sku, qty=1: f"sku={sku}")
    def by_callable(sku, qty=1):
        return qty

    @app.task(base=LockedTask, shared=False, name="golden.prefixed", lock_prefix="shop")
    def prefixed(sku):
        return sku

    app.finalize()
    return app


# Computed by hand from the documented scheme (keys.py): sha256("<task name>\n" + compact JSON of
# the sorted, type-tagged arguments)[:32], e.g. for deduct("A-1"):
#   golden.deduct\n[["note",null],["qty",["int","1"]],["sku","A-1"]]
GOLDEN_DEDUCT_1 = "singleton_lock:golden.deduct:{1951b7216df4433d8001e4eb3bc962bf}"


def test_golden_keys(golden_app):
    tasks = golden_app.tasks
    deduct = tasks["golden.deduct"]
    # bound with defaults applied: f(1), f(sku=1), f(1, qty=<default>) are one call
    assert deduct.lock_key_for(("A-1",), {}) == GOLDEN_DEDUCT_1
    assert deduct.lock_key_for((), {"sku": "A-1"}) == GOLDEN_DEDUCT_1
    assert deduct.lock_key_for(("A-1", 1), {"note": None}) == GOLDEN_DEDUCT_1
    assert deduct.lock_key_for(("A-1", 2), {}) == "singleton_lock:golden.deduct:{0f20aa969b54c2cbf23378d3d3500ce0}"
    assert deduct.lock_key_for(("A-1",), {"note": ["x", 1]}) == deduct.lock_key_for(("A-1",), {"note": ("x", 1)})
    # bind=True or not: self is no argument; only the name differs
    assert tasks["golden.deduct_unbound"].lock_key_for(("A-1",), {}) == (
        "singleton_lock:golden.deduct_unbound:{a66fdc6c11d560786cad43093e22938a}")
    by_sku = tasks["golden.by_sku"]
    assert by_sku.lock_key_for(("A-1", 5), {}) == by_sku.lock_key_for((), {"sku": "A-1", "qty": 9}) == (
        "singleton_lock:golden.by_sku:{0b7722a3c143a27314c3eda055a216be}")
    assert tasks["golden.by_callable"].lock_key_for(("A-1",), {"qty": 3}) == (
        "singleton_lock:golden.by_callable:{7358bf34b2993f4913c254e469dc280c}")
    assert tasks["golden.prefixed"].lock_key_for(("A-1",), {}) == (
        "shop:golden.prefixed:{8efa51cce7c3ff583eb6d551dfa6cb54}")


def test_callable_lock_key_is_used_by_the_execution(redis_server):
    """The callable gets the task's arguments (never the task itself) and picks the key."""
    app = make_app(redis_server)
    seen = []

    def key_of(sku, qty=1):
        seen.append((sku, qty))
        return f"sku={sku}"

    @app.task(base=LockedTask, shared=False, bind=True, name=f"cfg.callable.{uuid.uuid4().hex[:6]}", lock_key=key_of)
    def deduct(self, sku, qty=1):
        return self.lock.key

    assert deduct.lock_key is key_of
    key = deduct.lock_key_for(("A-1",), {"qty": 3})
    assert key == deduct.lock_key_for(("A-1", 99), {})  # qty is not part of this key
    assert deduct.apply(("A-1",), {"qty": 3}).get() == key
    assert seen[-1] == ("A-1", 3)
    assert redis_server.client(2).exists(key) == 0
