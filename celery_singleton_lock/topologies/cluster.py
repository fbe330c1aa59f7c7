"""Redis Cluster: one EVALSHA to the node of the lock's slot, and batched renewals per node.

:class:`ClusterLockServer` is a :class:`~celery_singleton_lock.engine.server.LockServer` on
redis-py's ``RedisCluster`` for the slot map and the plain commands, with its own routing
for the scripts (every key of one lock shares the first key's slot): MOVED and ASK are
followed, TRYAGAIN waited out while a slot moves, and the new master found after a node
failover. The watchdog's batched renewal sends one pipeline per node, each EVALSHA touching
the keys of one slot only, since redis-py's ``ClusterPipeline`` cannot run scripts.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any, cast

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import parse_url
from redis.crc import key_slot
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MovedError,
    NoScriptError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.retry import Retry

from ..engine import exchange, scripts, wire
from ..engine.addresses import redact_url
from ..engine.lock import Lock, ms
from ..engine.plumbing import Unreplicated
from ..engine.server import DEFAULT_CLIENT_OPTIONS, LockServer
from ..exceptions import LockBackendUnavailable, LockError

logger = logging.getLogger("celery_singleton_lock")


# -- Redis Cluster ------------------------------------------------------------------------------------

_ASKING = b"*1\r\n$6\r\nASKING\r\n"
MAX_REDIRECTS = 5
"""MOVED/ASK redirects followed for one command before it counts as failed (transient)."""
TRYAGAIN_FOR = 2.0
"""Seconds a command keeps retrying TRYAGAIN / CLUSTERDOWN (a slot half-moved, a failover under way)."""


class ClusterLockServer(LockServer):
    """The lock operations against a Redis Cluster.

    The scripts are sent by this class (not through redis-py's generic command
    path): one packed EVALSHA to the master of the first key's slot, on a
    connection per node that each thread keeps, following MOVED (the slot map
    is patched) and ASK (``ASKING`` + the script in one write) and waiting out
    TRYAGAIN. Plain commands (holder, the waiting line, BLPOP of a plain waiter,
    SCRIPT LOAD on every master after a NOSCRIPT) go through redis-py's ``RedisCluster``.
    """

    pipelines_sent = 0
    """Renewal pipelines sent (one per node per round), for the benchmarks."""

    def __init__(self, startup: Sequence[tuple[str, int]], *, url: str, connection_kwargs: dict[str, Any]) -> None:
        self.startup = [(str(h), int(p)) for h, p in startup]
        self._connection_kwargs = dict(connection_kwargs)
        self.cluster = RedisCluster(
            startup_nodes=[ClusterNode(h, p) for h, p in self.startup], **self._connection_kwargs
        )
        self._refresh_lock = threading.Lock()
        # the base class's plain commands (holder, queue.line, BLPOP, SCRIPT LOAD) have the same API here
        super().__init__(cast(redis.Redis, self.cluster), url=url)

    @classmethod
    def from_url(cls, url: str, **client_options: Any) -> ClusterLockServer:
        scheme, _, rest = url.partition("://")
        end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
        authority, tail = rest[:end], rest[end:]
        userinfo, at, hosts = authority.rpartition("@")
        nodes = []
        for node in hosts.split(","):
            host, _, port = node.rpartition(":")
            nodes.append((host.strip("[]"), int(port)))
        single = ("rediss" if scheme == "rediss+cluster" else "redis") + f"://{userinfo}{at}{hosts.split(',')[0]}"
        query = tail.partition("?")[2]
        kwargs = dict(DEFAULT_CLIENT_OPTIONS)
        kwargs.update(parse_url(single + (f"/0?{query}" if query else "/0")))
        for name in ("host", "port", "db"):
            kwargs.pop(name, None)
        kwargs.update(client_options)
        return cls(nodes, url=redact_url(url), connection_kwargs=kwargs)

    # -- transport --------------------------------------------------------------------------------

    def _conn(self, node: ClusterNode) -> Any:
        """This thread's connection to ``node`` (a forked child takes new ones)."""
        held = self._held
        conns: dict[str, Any] | None = getattr(held, "conns", None)
        if conns is None or getattr(held, "pid", None) != os.getpid():
            conns = held.conns = {}
            held.pid = os.getpid()
        conn = conns.get(node.name)
        if conn is None:
            conn = conns[node.name] = exchange.checkout(self.cluster.get_redis_connection(node).connection_pool)
        return conn

    def _drop(self, node: ClusterNode, conn: Any) -> None:
        conn.disconnect()
        conns = getattr(self._held, "conns", None)
        if conns is not None:
            conns.pop(node.name, None)

    def _refresh(self) -> None:
        """Read the slot map again (after a node stopped answering: a failover, a node gone)."""
        with self._refresh_lock:
            try:
                self.cluster.nodes_manager.initialize()
            except (RedisError, RedisClusterException):
                pass  # the next command tries again

    def _call(self, sha: str, keys: Sequence[str], args: Sequence[Any], wait: bool = False,
              resend: bool = True) -> Any:
        """One EVALSHA on the master of ``keys[0]``'s slot, following the cluster's redirects; sent
        again on a broken connection only with ``resend`` (see ``ScriptClient.run``)."""
        return self._on_slot(key_slot(keys[0].encode()), self._packed(sha, keys, args, wait), wait, resend)

    def _on_slot(self, slot: int, data: bytes, wait: bool, resend: bool = True) -> Any:
        nodes = self.cluster.nodes_manager
        ask: ClusterNode | None = None
        redirects = 0
        broken = 0
        give_up = time.monotonic() + TRYAGAIN_FOR
        while True:
            try:
                node = ask or nodes.get_node_from_slot(slot)
            except RedisClusterException as exc:  # the slot is not covered: the map is stale or the cluster down
                if time.monotonic() > give_up:
                    raise ClusterDownError(str(exc)) from None
                self._refresh()
                time.sleep(0.05)
                continue
            conn = None
            try:
                conn = self._conn(node)
                if ask is None:
                    exchange.send(conn, data)
                    return self._read(conn, wait)
                exchange.send(conn, _ASKING + data)  # ASKING's +OK, then the script's reply (and WAIT's)
                asking, *replies = exchange.read(conn, 3 if wait else 2)
                if isinstance(asking, ResponseError):
                    raise asking
                return self._replied(*replies)
            except MovedError as exc:
                redirects += 1
                if redirects > MAX_REDIRECTS:
                    raise
                nodes.move_slot(exc)
                ask = None
            except AskError as exc:  # the slot is moving: each ASK may be followed by a TRYAGAIN, so time-bound
                if time.monotonic() > give_up:
                    raise
                ask = nodes.get_node(host=exc.host, port=exc.port)
                if ask is None:
                    self._refresh()
                    ask = nodes.get_node(host=exc.host, port=exc.port)
                    if ask is None:
                        raise
            except (TryAgainError, ClusterDownError):
                if time.monotonic() > give_up:
                    raise
                ask = None
                time.sleep(0.02)
            except RedisConnectionError:
                if conn is not None:
                    self._drop(node, conn)
                broken += 1
                if not resend:
                    raise
                if broken == 1:
                    continue  # maybe only this socket was stale: the same node once more
                if broken > 2:
                    raise
                self._refresh()  # the node is gone: where is its slot now?
                ask = None

    def renew_many(self, locks: Sequence[Lock], *, chunk: int = 500) -> list[bool | LockError]:
        """Renew many locks: one pipeline per node, sent to every node before any is read.

        Each EVALSHA carries the keys of one slot only (a script's keys must share a slot,
        even on one node). A chunk whose slot moved (MOVED, ASK, TRYAGAIN) or whose node
        lacks the script is sent once more on its own, following the redirect.
        """
        if not locks:
            return []
        return _Renewal(self, locks, chunk).run()

    def _load_here(self, script: str) -> str:
        """After NOSCRIPT: SCRIPT LOAD on every master, since a slot may move to any of them (the
        command's own node connection is picked per slot in _call). The SHA itself is computed in the
        process (``ScriptClient._sha``): a process whose scripts another loaded already loads nothing."""
        sha = self._shas[script] = str(self.cluster.script_load(script))
        return sha

    def run(self, script: str, keys: Sequence[str], args: Sequence[Any], *, replicated: bool = False,
            request_id: str = "", fresh: bool = False, once: bool = False) -> Any:
        try:
            return super().run(script, keys, args, replicated=replicated, request_id=request_id, fresh=fresh,
                               once=once)
        except RedisClusterException as exc:  # e.g. no node could be reached to load a script
            raise LockBackendUnavailable(self.url, str(exc)) from exc

    def nodes(self, key: str | None = None) -> list[tuple[str, Any]]:
        """Every master (a SCAN of one sees only its own slots' keys), or the master of ``key``'s slot."""
        found = [self.cluster.get_node_from_key(key)] if key is not None else self.cluster.get_primaries()
        return [(node.name, self.cluster.get_redis_connection(node)) for node in found]

    def _twin(self, seconds: float) -> LockServer:
        kwargs = dict(self._connection_kwargs)
        kwargs.update(socket_timeout=seconds, socket_connect_timeout=seconds, retry=Retry(NoBackoff(), 0))
        known = [(n.host, int(n.port)) for n in self.cluster.get_nodes()] or self.startup
        return ClusterLockServer(known, url=self.url, connection_kwargs=kwargs)

    def close(self) -> None:
        conns = getattr(self._held, "conns", None) or {}
        for conn in conns.values():
            conn.disconnect()
        self.cluster.close()


class _Renewal:
    """One batched renewal round on a Cluster (:meth:`ClusterLockServer.renew_many`): the locks grouped
    by node and slot, one pipeline written to each node, then each node's replies read."""

    def __init__(self, server: ClusterLockServer, locks: Sequence[Lock], chunk: int) -> None:
        self.server, self.locks, self.chunk = server, locks, chunk
        self.sent = time.monotonic()
        self.results: list[bool | LockError | None] = [None] * len(locks)
        self.broken = False  # a node's connection broke: read the slot map again at the end
        self.again: list[list[int]] = []  # chunks whose slot moved, or whose node lacked the script

    def run(self) -> list[bool | LockError]:
        by_node = self._by_node()
        sha = self.server._sha(scripts.RENEW_MANY)  # (a node without it answers NOSCRIPT: _one_more loads it)
        sends = [sent for node, slots in by_node.values() if (sent := self._send(node, slots, sha)) is not None]
        for node, conn, parts in sends:
            self._read(node, conn, parts)
        if self.broken:
            self.server._refresh()
        for part in self.again:
            self._one_more(part)
        return [r if r is not None else LockError("not renewed") for r in self.results]

    def _by_node(self) -> dict[str, tuple[ClusterNode, dict[int, list[int]]]]:
        """Lock indexes by node, then by slot (a lock whose slot has no node fails at once)."""
        nodes = self.server.cluster.nodes_manager
        by_node: dict[str, tuple[ClusterNode, dict[int, list[int]]]] = {}
        for i, lock in enumerate(self.locks):
            slot = key_slot(lock.key.encode())
            try:
                node = nodes.get_node_from_slot(slot)
            except RedisClusterException as exc:
                self.results[i] = LockBackendUnavailable(self.server.url, str(exc))
                continue
            by_node.setdefault(node.name, (node, {}))[1].setdefault(slot, []).append(i)
        return by_node

    def _send(self, node: ClusterNode, slots: dict[int, list[int]],
              sha: str) -> tuple[ClusterNode, Any, list[list[int]]] | None:
        """Write one node's pipeline (one EVALSHA per slot chunk, then WAIT if replicas are required)."""
        server, locks, chunk = self.server, self.locks, self.chunk
        parts = [idx[j : j + chunk] for idx in slots.values() for j in range(0, len(idx), chunk)]
        data = b"".join(wire.pack_renewals(sha, [locks[i] for i in part]) for part in parts)
        if server.min_replicas > 0:
            data += wire.pack_wait(server.min_replicas, ms(server.replica_timeout))
        conn = None
        try:
            conn = server._conn(node)
            conn.send_packed_command([data], check_health=False)
        except RedisError as exc:
            if conn is not None:
                server._drop(node, conn)
            self.broken = True
            for part in parts:
                self._fail(part, server.error(exc, locks[part[0]].key))
            return None
        server.pipelines_sent += 1
        return node, conn, parts

    def _read(self, node: ClusterNode, conn: Any, parts: list[list[int]]) -> None:
        """Read one node's replies (and its WAIT's), and sort each chunk: renewed, failed, or again."""
        server = self.server
        replies: list[Any] = []
        try:
            for _ in parts:
                try:
                    replies.append(conn.read_response())
                except ResponseError as exc:
                    replies.append(exc)
            acked: Any = server.min_replicas
            if server.min_replicas > 0:
                try:
                    acked = conn.read_response()
                except ResponseError as exc:
                    acked = exc
        except RedisError as exc:
            server._drop(node, conn)
            self.broken = True
            for part in parts:
                self._fail(part, server.error(exc, self.locks[part[0]].key))
            return
        short = not isinstance(acked, int) or acked < server.min_replicas
        for part, reply in zip(parts, replies, strict=True):
            if isinstance(reply, (MovedError, AskError, TryAgainError, ClusterDownError, NoScriptError)):
                if isinstance(reply, MovedError):
                    server.cluster.nodes_manager.move_slot(reply)
                self.again.append(part)
            elif isinstance(reply, Exception):
                self._fail(part, server.error(reply, self.locks[part[0]].key))
            elif short:
                why = str(acked) if isinstance(acked, Exception) else server._unreplicated_reason(int(acked))
                self._fail(part, LockBackendUnavailable(server.url, why))
            else:
                self._ok(part, reply)

    def _one_more(self, part: list[int]) -> None:
        """A chunk whose slot moved: sent once more on its own, following the redirect."""
        server, locks = self.server, self.locks
        keys = [locks[i].key for i in part]
        args = [a for i in part for a in (locks[i].prefix, ms(locks[i].ttl))]  # side by side (RENEW_MANY)
        try:
            self._ok(part, server.run(scripts.RENEW_MANY, keys, args, replicated=True))
        except Unreplicated as short_reply:
            self._fail(part, LockBackendUnavailable(server.url, server._unreplicated_reason(short_reply.acked)))
        except LockError as exc:
            self._fail(part, exc)

    def _ok(self, part: list[int], reply: Any) -> None:
        for i, renewed in zip(part, scripts.renewed(reply), strict=False):
            if renewed:
                self.locks[i].confirmed_at = self.sent
                self.locks[i].last_error = None
            self.results[i] = renewed

    def _fail(self, part: list[int], error: LockError) -> None:
        for i in part:
            self.results[i] = error
