"""The lock URL for Sentinel and Cluster (section 5 of the lock URL's tests): Celery's Sentinel form,
``redis+cluster://``, their transport options, and the replica settings.

Nothing here connects to 127.0.0.1:6379: URLs are compared as strings, turned into clients
without connecting (``connection_kwargs``, ``make_connection()``), or point at private servers.
"""

from __future__ import annotations

import pytest
from _urls_support import (
    _no_celery_env,  # noqa: F401 (autouse: no CELERY_* from a developer's shell)
    bare_app,
)

from celery_singleton_lock import LockedTask
from celery_singleton_lock.delivery import config
from celery_singleton_lock.topologies import urls as cfg

pytestmark = pytest.mark.timeout(60)


# -- 5. Sentinel and Cluster URLs: Celery's Sentinel form, redis+cluster://, and their transport options ---


@pytest.mark.parametrize("url, expected", [
    ("sentinel://h1:26379/2;sentinel://h2:26380/2", "sentinel://h1:26379/2;sentinel://h2:26380/2"),
    ("sentinel://:pw@h1:26379", "sentinel://:pw@h1:26379/0"),
    ("sentinel://h1", "sentinel://h1:26379/0"),
    ("redis+cluster://h1:7000,h2:7001", "redis+cluster://h1:7000,h2:7001"),
    ("redis+cluster://u:pw@h1:7000/0", "redis+cluster://u:pw@h1:7000"),
    ("rediss+cluster://h1:7000?ssl_cert_reqs=CERT_REQUIRED", "rediss+cluster://h1:7000?ssl_cert_reqs=required"),
])
def test_sentinel_and_cluster_urls_are_accepted(url, expected):
    assert cfg.lock_url(bare_app(singleton_lock_url=url).conf) == expected


@pytest.mark.parametrize("url, words", [
    ("sentinel://h1:26379/x", ["'x'", "not a number"]),
    ("sentinel://h1:26379/0?socket_timeout=1", ["query", "singleton_lock_redis_options"]),
    ("sentinel://:pw@h1:port/0", ["port"]),
    ("redis+cluster://h1:7000/2", ["database 0", "'2'"]),
    ("redis+cluster://h1", ["'h1'", "host:port"]),
    ("redis+cluster://h1:7000?ssl_cert_reqs=CERT_NONE", ["rediss"]),
])
def test_bad_sentinel_and_cluster_urls_name_the_bad_part(url, words):
    with pytest.raises(ValueError) as info:
        cfg.lock_url(bare_app(singleton_lock_url=url).conf)
    assert "pw" not in str(info.value).replace("***", "")
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_transport_options_follow_the_source_of_the_url():
    sentinel = "sentinel://s1:26379/1;sentinel://s2:26379/1"
    own = bare_app(singleton_lock_url=sentinel, singleton_lock_transport_options={"master_name": "locks"},
                   result_backend_transport_options={"master_name": "results"}).conf
    assert cfg.lock_source(own) == ("sentinel://s1:26379/1;sentinel://s2:26379/1", "singleton_lock_url")
    assert cfg.transport_options(own, "singleton_lock_url") == {"master_name": "locks"}
    backend = bare_app(result_backend=sentinel, result_backend_transport_options={
        "master_name": "results", "sentinel_kwargs": {"password": "x"}, "retry_policy": {}}).conf
    assert cfg.lock_source(backend)[1] == "result_backend"
    assert cfg.transport_options(backend, "result_backend") == {"master_name": "results",
                                                                "sentinel_kwargs": {"password": "x"}}
    broker = bare_app(broker_url=sentinel, broker_transport_options={"master_name": "b", "visibility_timeout": 5},
                      singleton_lock_transport_options={"sentinel_kwargs": {"socket_timeout": 1}}).conf
    assert cfg.lock_source(broker)[1] == "broker_url"
    assert cfg.transport_options(broker, "broker_url") == {"master_name": "b", "sentinel_kwargs": {"socket_timeout": 1}}
    with pytest.raises(ValueError, match="singleton_lock_transport_options must be a dict"):
        cfg.transport_options(bare_app(singleton_lock_transport_options="mymaster").conf, "singleton_lock_url")


@pytest.mark.parametrize("conf, words", [
    ({"singleton_lock_min_replicas": -1}, ["singleton_lock_min_replicas", "-1"]),
    ({"singleton_lock_min_replicas": "1"}, ["singleton_lock_min_replicas", "'1'"]),
    ({"singleton_lock_replica_timeout": -2}, ["singleton_lock_replica_timeout", "-2"]),
])
def test_replica_settings_are_checked(conf, words):
    app = bare_app(singleton_lock_url="redis://h:6379/0", **conf)

    @app.task(base=LockedTask, shared=False, name="urls.replicas")
    def f(a):
        return a

    app.finalize()
    with pytest.raises(ValueError) as info:
        config.resolve(f)
    for word in words:
        assert word in str(info.value)


def test_a_sentinel_url_without_a_master_name_is_an_error_naming_the_setting():
    from celery_singleton_lock.topologies import servers

    with pytest.raises(ValueError, match="singleton_lock_transport_options.*master_name"):
        servers.from_settings("sentinel://127.0.0.1:1/0")
    with pytest.raises(ValueError, match="unknown option"):
        servers.from_settings("sentinel://127.0.0.1:1/0", transport_options={"master_name": "m", "mastername": "x"})
