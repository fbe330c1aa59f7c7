"""Plain records on etcd that take no lock: beat's run record, as the few Redis-hash calls it makes."""

from __future__ import annotations

import json
from typing import Any, Protocol

from ..engine import layout
from .etcd_session import Transport, b64, unb64


class Server(Protocol):
    """What the records need of their etcd lock server (:class:`.etcd.EtcdLockServer`)."""

    transport: Transport
    url: str


class EtcdRecords:
    """The few plain Redis-hash calls beat's run record makes (``hgetall``, ``hset``), as etcd keys
    ``<root>hash/<name>/<field>`` without a lease."""

    def __init__(self, server: Server) -> None:
        self.server = server

    def _prefix(self, name: str) -> str:
        return f"{layout.ETCD_ROOT}hash/{name}/"

    def hgetall(self, name: str) -> dict[bytes, bytes]:
        prefix = self._prefix(name)
        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        reply = self.server.transport.call("/kv/range", {"key": b64(prefix), "range_end": b64(end)}, name)
        return {unb64(kv["key"])[len(prefix):]: unb64(kv.get("value")) for kv in reply.get("kvs") or []}

    def hset(self, name: str, field: str, value: str | bytes) -> int:
        self.server.transport.call("/kv/put", {"key": b64(self._prefix(name) + field), "value": b64(value)}, name)
        return 1

    def config_get(self, *_: Any) -> dict[str, str]:
        return {}

    def __repr__(self) -> str:
        return f"EtcdRecords({json.dumps(self.server.url)})"
