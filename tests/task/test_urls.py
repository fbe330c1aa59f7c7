"""The lock URL: where it comes from, how Celery's spellings reach redis-py, and what logs show of it.

One section each:

1. no Redis configured is an error, never a silent per-host ``redis://localhost:6379/0``;
2. a Celery-valid ``rediss://...?ssl_cert_reqs=CERT_REQUIRED`` reaches redis-py as ``required``;
3. passwords in the query string (and each part of a ``;``-separated Sentinel list) are masked.

The eviction-policy check is in test_urls_eviction.py, Sentinel and Cluster URLs in
test_urls_topologies.py.

Nothing here connects to 127.0.0.1:6379: URLs are compared as strings, turned into clients
without connecting (``connection_kwargs``, ``make_connection()``), or point at private servers.
"""

from __future__ import annotations

import ssl

import pytest
import redis
from _urls_support import (
    SECRET,
    _no_celery_env,  # noqa: F401 (autouse: no CELERY_* from a developer's shell)
    bare_app,
    kwargs_of,
)

from celery_singleton_lock import LockedTask
from celery_singleton_lock.delivery import config
from celery_singleton_lock.engine.addresses import redact_url
from celery_singleton_lock.engine.server import LockServer
from celery_singleton_lock.testing.servers import free_port
from celery_singleton_lock.topologies import urls as cfg

pytestmark = pytest.mark.timeout(60)


# -- 1. the fallback: a Redis result backend, then a Redis broker, else an error ------------------


@pytest.mark.parametrize("conf, expected", [
    ({"result_backend": "redis://rb:6390/1", "broker_url": "redis://b:6391/0"}, "redis://rb:6390/1"),
    ({"result_backend": "rpc://", "broker_url": "redis://b:6391/0"}, "redis://b:6391/0"),
    ({"result_backend": "sentinel://s1:26379;sentinel://s2:26379", "broker_url": "redis://b:6391/0"},
     "sentinel://s1:26379/0;sentinel://s2:26379/0"),
    ({"result_backend": "rpc://", "broker_url": ["sentinel://:pw@s1:26379/3", "sentinel://s2:26379/3"]},
     "sentinel://:pw@s1:26379/3;sentinel://s2:26379/3"),
    ({"result_backend": "db+sqlite:///r.db", "broker_url": "rediss://:pw@b:6391/3"}, "rediss://:pw@b:6391/3"),
    ({"broker_url": "amqp://guest@rabbit//", "result_backend": "redis+socket:///run/redis.sock?virtual_host=4"},
     "unix:///run/redis.sock?db=4"),
])
def test_fallback_order(conf, expected):
    assert cfg.lock_url(bare_app(**conf).conf) == expected


@pytest.mark.parametrize("conf, shown", [
    ({"result_backend": "rpc://", "broker_url": f"amqp://guest:{SECRET}@rabbit:5672//"},
     ["'rpc://'", "'amqp://guest:***@rabbit:5672//'"]),
    ({}, ["result_backend", "broker_url", "unset"]),
    ({"result_backend": f"sentinel://:{SECRET}@s1:26379;redis://:{SECRET}@s2:6379/0",
      "broker_url": "amqp://rabbit//"}, ["sentinel://:***@s1:26379", "redis://:***@s2:6379/0", "Sentinel"]),
    ({"broker_url": f"redis://:{SECRET}@b1:6379/0;redis://:{SECRET}@b2:6379/0"}, ["several", "b1", "b2"]),
    ({"broker_url": [f"redis://:{SECRET}@b1:6379/0", "redis://b2:6379/0"]}, ["several", "b1", "b2"]),
], ids=["amqp-rpc", "nothing", "sentinel-mixed", "failover-string", "failover-list"])
def test_no_usable_redis_is_an_error_naming_what_to_set(conf, shown):
    """No localhost default: each host would lock on its own Redis, and nothing would be exclusive."""
    with pytest.raises(ValueError) as info:
        cfg.lock_url(bare_app(**conf).conf)
    message = str(info.value)
    assert "singleton_lock_url" in message and "localhost" not in message.split("There is no")[0], message
    for text in shown:
        assert text in message, (text, message)
    assert SECRET not in message


def test_a_task_without_a_usable_redis_fails_resolving_its_settings():
    app = bare_app(broker_url="amqp://guest:guest@rabbit//", result_backend="rpc://")

    @app.task(base=LockedTask, shared=False, name="urls.no_redis")
    def f(a):
        return a

    app.finalize()
    with pytest.raises(ValueError, match="singleton_lock_url"):
        config.resolve(f)


def test_the_environment_urls_celery_reads_count(monkeypatch):
    """Celery takes CELERY_RESULT_BACKEND / CELERY_BROKER_URL over app.conf: so do the locks."""
    app = bare_app(broker_url="amqp://rabbit//", result_backend="rpc://")
    monkeypatch.setenv("CELERY_RESULT_BACKEND", "redis://env-rb:6390/4")
    assert cfg.lock_url(app.conf) == "redis://env-rb:6390/4"
    monkeypatch.delenv("CELERY_RESULT_BACKEND")
    monkeypatch.setenv("CELERY_BROKER_URL", "redis://env-b:6391/5")
    assert cfg.lock_url(app.conf) == "redis://env-b:6391/5"


@pytest.mark.parametrize("url, ok", [
    ("redis://h:6379/0", True),
    ("rediss://h:6380/0", True),
    ("unix:///tmp/redis.sock", True),
    ("redis+socket:///tmp/redis.sock", True),
    ("sentinel://h:26379", True),
    ("sentinel://h1:26379;sentinel://h2:26379", True),
    (["sentinel://h1:26379", "sentinel://h2:26379"], True),
    ("sentinel://h1:26379;redis://h2:6379/0", False),
    ("redis+cluster://h1:7000,h2:7001", True),
    ("rediss+cluster://h1:7000", True),
    ("redis+cluster://h1:7000;redis+cluster://h2:7000", False),
    ("redis-sentinel://h:26379", False),
    ("redis://a:6379/0;redis://b:6379/0", False),
    ("amqp://guest@h//", False),
    ("rpc://", False),
    ("redis", False),
    ("redis:/h", False),
    ("socket:///tmp/redis.sock", False),
    ("", False),
    (None, False),
    (6379, False),
])
def test_is_redis_is_explicit_about_schemes(url, ok):
    assert cfg._is_redis(url) is ok


@pytest.mark.parametrize("url", ["sentinel://h:26379;redis://a/0", "amqp://guest@h//", "redis://a/0;redis://b/0"])
def test_explicit_setting_must_be_one_redis(url):
    with pytest.raises(ValueError, match="singleton_lock_url"):
        cfg.lock_url(bare_app(singleton_lock_url=url).conf)


# -- 2. Celery's spellings, translated for redis-py -------------------------------------------------


@pytest.mark.parametrize("celery_value, redis_value, mode", [
    ("CERT_REQUIRED", "required", ssl.CERT_REQUIRED),
    ("CERT_OPTIONAL", "optional", ssl.CERT_OPTIONAL),
    ("CERT_NONE", "none", ssl.CERT_NONE),
    ("required", "required", ssl.CERT_REQUIRED),
    ("none", "none", ssl.CERT_NONE),
])
def test_inherited_rediss_backend_reaches_redis_py(celery_value, redis_value, mode):
    backend = f"rediss://rb.example:6380/1?ssl_cert_reqs={celery_value}"
    url = cfg.lock_url(bare_app(result_backend=backend, broker_url="amqp://rabbit//").conf)
    pool = redis.Redis.from_url(url).connection_pool
    assert pool.connection_kwargs["ssl_cert_reqs"] == redis_value
    assert pool.connection_class is redis.SSLConnection
    assert (pool.connection_kwargs["host"], pool.connection_kwargs["port"], pool.connection_kwargs["db"]) == (
        "rb.example", 6380, 1)
    conn = pool.make_connection()  # builds the SSL settings; connects only on first use
    assert conn.cert_reqs == mode


def test_explicit_url_is_translated_too_and_keeps_everything_else():
    url = cfg.lock_url(bare_app(singleton_lock_url=(
        "rediss://bob:p%40ss@locks.example:6390/2?ssl_cert_reqs=CERT_REQUIRED"
        "&ssl_ca_certs=%2Fetc%2Fssl%2Fca.pem&ssl_certfile=/etc/ssl/me.crt&ssl_keyfile=/etc/ssl/me.key"
        "&socket_timeout=3&ssl_check_hostname=false"
    )).conf)
    kw = kwargs_of(url)
    assert (kw["username"], kw["password"], kw["host"], kw["port"], kw["db"]) == (
        "bob", "p@ss", "locks.example", 6390, 2)
    assert kw["ssl_cert_reqs"] == "required"
    assert (kw["ssl_ca_certs"], kw["ssl_certfile"], kw["ssl_keyfile"]) == (
        "/etc/ssl/ca.pem", "/etc/ssl/me.crt", "/etc/ssl/me.key")
    assert kw["socket_timeout"] == 3.0 and kw["ssl_check_hostname"] is False


def test_celery_decodes_the_tls_paths_twice_and_so_do_we():
    """Celery's backend unquotes ssl_* values after parsing the query: %2520 is a space there."""
    kw = kwargs_of(cfg.redis_url_for("rediss://h/0?ssl_cert_reqs=none&ssl_ca_certs=%2Fmy%2520certs%2Fca.pem"))
    assert kw["ssl_ca_certs"] == "/my certs/ca.pem"


def test_plain_urls_pass_unchanged():
    for url in ("redis://rb:6390/1", "redis://:pw@b:6391/3", "rediss://h:6380/0", "unix:///tmp/r.sock?db=2",
                "redis://h/0?socket_timeout=2&health_check_interval=10", "redis://[::1]:6380/0"):
        assert cfg.redis_url_for(url) == url


def test_redis_socket_becomes_unix():
    url = cfg.redis_url_for("redis+socket://:pw@/var/run/redis.sock?virtual_host=3&socket_timeout=2")
    kw = kwargs_of(url)
    assert (kw["path"], kw["db"], kw["password"], kw["socket_timeout"]) == ("/var/run/redis.sock", 3, "pw", 2.0)
    assert redis.Redis.from_url(url).connection_pool.connection_class is redis.UnixDomainSocketConnection


@pytest.mark.parametrize("url, names", [
    ("rediss://h:6380/0?ssl_cert_reqs=CERT_MAYBE", ["ssl_cert_reqs", "CERT_MAYBE"]),
    ("rediss://h:6380/0?ssl_cert_reqs=Required", ["ssl_cert_reqs", "Required"]),
    ("redis://h:6379/0?ssl_cert_reqs=CERT_REQUIRED", ["ssl_cert_reqs", "rediss://"]),
    ("unix:///tmp/r.sock?ssl_ca_certs=/ca.pem", ["ssl_ca_certs", "rediss://"]),
    ("redis://h:6379/0?credential_provider=my.Provider", ["credential_provider", "singleton_lock_redis_options"]),
    ("redis://h:6379/0?virtual_host=3", ["virtual_host", "path"]),
    ("redis://h:6379/first", ["'first'", "database"]),
    ("redis://h:6379/1/2", ["'1/2'", "database"]),
    ("redis://h:port/0", ["port"]),
    ("redis+socket://tmp/redis.sock", ["redis+socket:///"]),
    ("redis://:pa#ss@h:6379/0", ["'#'", "%23"]),
    ("redis://:pa?ss@h:6379/0", ["port"]),
    ("redis://:pa/ss@h:6379/0", ["port"]),
])
def test_untranslatable_urls_raise_naming_the_parameter(url, names):
    with pytest.raises(ValueError) as info:
        cfg.redis_url_for(url)
    for name in names:
        assert name in str(info.value), (name, str(info.value))
    if ":pa" in url:  # a password the URL's author did not percent-encode: none of it in the message
        assert "'pa'" not in str(info.value) and "ss@" not in str(info.value), str(info.value)


def test_untranslatable_setting_names_the_setting():
    app = bare_app(result_backend="rediss://h:6380/0?ssl_cert_reqs=CERT_MAYBE", broker_url="amqp://rabbit//")
    with pytest.raises(ValueError, match=r"result_backend.*ssl_cert_reqs.*CERT_MAYBE"):
        cfg.lock_url(app.conf)
    app = bare_app(singleton_lock_url="rediss://h:6380/0?ssl_cert_reqs=maybe")
    with pytest.raises(ValueError, match=r"singleton_lock_url.*ssl_cert_reqs.*maybe"):
        cfg.lock_url(app.conf)


def test_backend_use_ssl_settings_come_along():
    """Celery's backend takes TLS settings from redis_backend_use_ssl too (the URL's query wins)."""
    app = bare_app(
        result_backend="redis://rb:6380/1",  # Celery makes this TLS when redis_backend_use_ssl is set
        redis_backend_use_ssl={"ssl_cert_reqs": ssl.CERT_REQUIRED, "ssl_ca_certs": "/etc/ca dir/ca.pem",
                               "ssl_certfile": "/etc/me%.crt", "ssl_check_hostname": False},
        broker_url="amqp://rabbit//",
    )
    url = cfg.lock_url(app.conf)
    pool = redis.Redis.from_url(url).connection_pool
    kw = pool.connection_kwargs
    assert pool.connection_class is redis.SSLConnection
    assert (kw["ssl_cert_reqs"], kw["ssl_ca_certs"], kw["ssl_certfile"], kw["ssl_check_hostname"]) == (
        "required", "/etc/ca dir/ca.pem", "/etc/me%.crt", False)
    app.conf.result_backend = "rediss://rb:6380/1?ssl_cert_reqs=CERT_NONE"
    assert kwargs_of(cfg.lock_url(app.conf))["ssl_cert_reqs"] == "none"


def test_broker_use_ssl_settings_come_along():
    app = bare_app(broker_url="rediss://b:6380/0", broker_use_ssl={"ssl_cert_reqs": ssl.CERT_OPTIONAL})
    assert kwargs_of(cfg.lock_url(app.conf))["ssl_cert_reqs"] == "optional"
    app = bare_app(broker_url="rediss://b:6380/0", broker_use_ssl={"ssl_context": object()})
    with pytest.raises(ValueError, match=r"broker_use_ssl.*ssl_context"):
        cfg.lock_url(app.conf)


# -- 3. passwords never reach logs ----------------------------------------------------------------


@pytest.mark.parametrize("url, redacted", [
    ("redis://h:6379/0?password=s3cret", "redis://h:6379/0?password=***"),
    ("redis://h/0?username=bob&password=s3cret&db=1", "redis://h/0?username=***&password=***&db=1"),
    ("unix:///tmp/redis.sock?db=1&password=x", "unix:///tmp/redis.sock?db=1&password=***"),
    ("unix://:pw@/tmp/redis.sock?db=1", "unix://:***@/tmp/redis.sock?db=1"),
    ("redis://bob:pw@[::1]:6380/0?password=pw2", "redis://bob:***@[::1]:6380/0?password=***"),
    ("redis://:pw@[fe80::1]/0", "redis://:***@[fe80::1]/0"),
    ("redis://:pw@host/0", "redis://:***@host/0"),
    ("redis://:pw@MyHost.Example/0", "redis://:***@MyHost.Example/0"),
    ("redis://bob:p@ss@host:1/0", "redis://bob:***@host:1/0"),
    ("redis://:pa;ss@host:1/0", "redis://:***@host:1/0"),
    ("rediss://h/0?ssl_cert_reqs=none&ssl_password=keypw", "rediss://h/0?ssl_cert_reqs=none&ssl_password=***"),
    ("redis://h/0?pass%77ord=x", "redis://h/0?pass%77ord=***"),
    ("sentinel://:pw@h1:26379;sentinel://:pw@h2:26379", "sentinel://:***@h1:26379;sentinel://:***@h2:26379"),
    ("sentinel://:pw@h1:26379/0; sentinel://h2:26379/0", "sentinel://:***@h1:26379/0; sentinel://h2:26379/0"),
    ("redis://bob@host/0", "redis://bob@host/0"),
    ("redis://h:6379/0", "redis://h:6379/0"),
])
def test_redact_url(url, redacted):
    assert redact_url(url) == redacted


@pytest.mark.parametrize("url", [
    "redis://:pa#ss@host:1/0",
    "redis://:pa?ss@host:1/0",
    "redis://:pa/ss@host:1/0",
    "redis://:pa?ss@host:1/0?db=1",
    "redis://:pa/ss@host:1/0?db=1&password=x",
])
def test_redact_url_of_a_url_no_parser_reads_right_still_hides_the_password(url):
    """A '#', '?' or '/' in a password cuts the URL short for every parser: hide all of it that might be."""
    shown = redact_url(url)
    assert "pa" not in shown and "ss" not in shown, shown
    assert shown.startswith("redis://")


def test_lock_server_url_hides_a_query_password():
    server = LockServer.from_url(f"redis://127.0.0.1:{free_port()}/0?password={SECRET}")  # does not connect
    try:
        assert SECRET not in server.url and "password=***" in server.url
    finally:
        server.close()
