"""The lock backends the contract tests run on, as a fixture parameter (not a copy of the tests).

``redis``: the session's private redis-server (db 2). ``etcd``: a private one-member etcd started
once per session (``etcd_server`` in conftest.py; skipped with one line where no etcd binary
exists). What a test reads or writes of the lock store directly goes through a :class:`LockStore`:
the Redis client itself, or :class:`EtcdStore`, which answers the same few calls on etcd.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

from celery_singleton_lock.engine import layout
from celery_singleton_lock.topologies.etcd import EtcdLockServer

BACKENDS = ["redis", "etcd"]


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


class EtcdStore:
    """The Redis calls the contract tests make on the locks' database, answered on etcd's lock keys.

    Only lock keys exist there: a line's or done record's Redis key (``K:q``, ``K:w``) never does."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.server = EtcdLockServer.from_url(url)

    def _kvs(self, key: str) -> list[dict[str, Any]]:
        reply = self.server.transport.call("/kv/range", {"key": _b64(layout.etcd_lock(key))})
        return reply.get("kvs") or []

    def exists(self, *keys: str) -> int:
        return sum(1 for key in keys if self._kvs(key))

    def get(self, key: str) -> bytes | None:
        kvs = self._kvs(key)
        return base64.b64decode(kvs[0].get("value", "")) if kvs else None

    def delete(self, *keys: str) -> int:
        deleted = 0
        for key in keys:
            reply = self.server.transport.call("/kv/deleterange", {"key": _b64(layout.etcd_lock(key))})
            deleted += int(reply.get("deleted", 0) or 0)
        return deleted

    def set(self, key: str, value: str, px: int = 60_000) -> bool:
        """Another holder takes the key: a new incarnation (a new create revision), on a lease of ``px``."""
        self.delete(key)
        lease = self.server.transport.call("/lease/grant", {"TTL": str(max(2, px // 1000)), "ID": "0"})["ID"]
        self.server.transport.call("/kv/put", {"key": _b64(layout.etcd_lock(key)), "value": _b64(value),
                                               "lease": str(lease)})
        return True

    def keys(self, pattern: str = "*") -> list[bytes]:
        return [h.key.encode() for h in self.server.locks()]

    def close(self) -> None:
        self.server.close()


@dataclass
class LockBackendUnderTest:
    name: str
    url: str
    store: Any


def lock_store(backend: str, redis_server: Any, etcd_url: str | None) -> tuple[str, Any]:
    """(the lock URL, the store tests read) for ``backend``."""
    if backend == "etcd":
        assert etcd_url is not None
        return etcd_url, EtcdStore(etcd_url)
    return redis_server.url(2), redis_server.client(2)


def backend_of(request: Any) -> tuple[str, str | None]:
    """The backend a parametrized fixture runs on, and the etcd URL when it is etcd (started, or skipped, here)."""
    param = request.param
    backend = param[1] if isinstance(param, tuple) else param
    if backend != "etcd":
        return backend, None
    return backend, request.getfixturevalue("etcd_server").url()
