"""The Sentinel tests' shared helpers (tests/topologies/test_sentinel*.py): the locks' database and a
SentinelLockServer on a deployment. Their fixture (``sentinel``) is in topologies/conftest.py."""

from __future__ import annotations

from _deployments import SentinelDeployment

from celery_singleton_lock.topologies import servers
from celery_singleton_lock.topologies.servers import SentinelLockServer

LOCK_DB = 2


def server_for(sentinel: SentinelDeployment, **kwargs) -> SentinelLockServer:
    srv = servers.from_settings(sentinel.url(LOCK_DB), transport_options=sentinel.transport_options, **kwargs)
    assert isinstance(srv, SentinelLockServer)
    return srv
