"""The topologies' shared fixtures: quorum mode's five ``masters`` (one set per module) and a
``quorum`` server on them, every member resumed first (tests/topologies/test_quorum*.py); and a
``sentinel`` deployment, 1 master, 1 replica, 3 Sentinels (one per module: test_sentinel*.py)."""

from __future__ import annotations

from contextlib import ExitStack

import pytest
from _deployments import SentinelDeployment

from celery_singleton_lock.testing.servers import RedisServer
from celery_singleton_lock.topologies.quorum import QuorumLockServer
from celery_singleton_lock.topologies.servers import from_settings


@pytest.fixture(scope="module")
def masters():
    with ExitStack() as stack:
        servers = [stack.enter_context(RedisServer()) for _ in range(5)]
        yield servers
        for s in servers:
            if s.paused:
                s.resume()


@pytest.fixture
def quorum(masters):
    for s in masters:
        if s.paused:
            s.resume()
        if s.proc is None:
            s.start()
        s.client(2).flushdb()  # our private servers only
    q = from_settings(";".join(s.url(2) for s in masters), redis_options={"socket_timeout": 0.5})
    assert isinstance(q, QuorumLockServer) and q.majority == 3
    yield q
    q.close()


@pytest.fixture(scope="module")
def sentinel():
    with SentinelDeployment(replicas=1, sentinels=3) as deployment:
        yield deployment
