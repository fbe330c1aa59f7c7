"""Where locks live: one Redis, a Sentinel-watched master, or a Redis Cluster.

Topology is a choice of client, never an ``if cluster:`` inside the scripts.
Every kind is a :class:`~celery_singleton_lock.engine.server.LockServer` (acquire,
release, renew_many, ...); what differs is only how a packed EVALSHA reaches
the right Redis, so each subclass overrides the transport pieces and nothing
else:

* one Redis: :class:`LockServer` itself (``LockServer.from_url``);
* Sentinel: :class:`SentinelLockServer`, on redis-py's ``Sentinel.master_for``
  client, whose connections ask the Sentinels for the master each time they
  (re)connect. The thread-held connection of the hot path and the watchdog's
  short-timeout twin both follow a failover: a READONLY reply from a demoted
  master disconnects, and the command is sent again to the new master; a new
  master without the scripts answers NOSCRIPT and they are loaded again;
* Redis Cluster: :class:`ClusterLockServer`, on redis-py's ``RedisCluster``
  for the slot map and the plain commands, with its own routing for the
  scripts: one EVALSHA to the node serving the first key's slot (every key of
  one lock shares that slot), following MOVED and ASK, waiting out TRYAGAIN
  while a slot moves, and finding the new master after a node failover. The
  watchdog's batched renewal sends one pipeline per node (to every node at
  once, then reads them all), each EVALSHA touching the keys of one slot only,
  since redis-py's ``ClusterPipeline`` cannot run scripts.

:func:`from_settings` builds the right one for a URL; ``config.server_for``
calls it (one per URL, options and process), and so can benchmarks and plain
code. Optional ``min_replicas`` (Redis ``WAIT`` in the same round trip) works
on every kind; see docs/operations/topologies.md for what it buys and costs.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from ..engine.addresses import redact_url
from ..engine.backend import LockBackend
from ..engine.lock import check_ttl
from ..engine.plumbing import DEFAULT_REPLICA_TIMEOUT
from ..engine.server import LockServer
from .cluster import ClusterLockServer
from .sentinel import SentinelLockServer
from .urls import quorum_members, redis_url_for, topology

__all__ = ["from_settings", "shared", "SentinelLockServer", "ClusterLockServer", "topology"]

logger = logging.getLogger("celery_singleton_lock")



def from_settings(
    url: str,
    *,
    transport_options: dict[str, Any] | None = None,
    redis_options: dict[str, Any] | None = None,
    min_replicas: int = 0,
    replica_timeout: float = DEFAULT_REPLICA_TIMEOUT,
) -> LockBackend:
    """The lock server for ``url``: one Redis, Sentinel (``sentinel://...;sentinel://...``, with
    ``transport_options["master_name"]``), Redis Cluster (``redis+cluster://h:p,h:p``), a quorum of
    masters, or an etcd cluster (``etcd://h:p,h:p``; ``redis_options`` then go to its transport).

    ``redis_options`` go to every connection to a data node (not to the Sentinels: those take
    ``transport_options["sentinel_kwargs"]``). ``min_replicas`` > 0 makes every acquire and renewal
    WAIT for that many replicas, up to ``replica_timeout`` seconds.
    """
    if isinstance(min_replicas, bool) or not isinstance(min_replicas, int) or min_replicas < 0:
        raise ValueError(f"singleton_lock_min_replicas must be an int >= 0, got {min_replicas!r}")
    replica_timeout = check_ttl(replica_timeout, "singleton_lock_replica_timeout")
    kind = topology(url)
    server = BACKENDS[kind](url, transport_options or {}, dict(redis_options or {}))
    if kind != "etcd":  # (consensus: every etcd write is already a majority's; min_replicas does not apply)
        server.min_replicas = min_replicas
        server.replica_timeout = replica_timeout
    return server


def _etcd(url: str, _transport_options: dict[str, Any], options: dict[str, Any]) -> LockBackend:
    from .etcd import EtcdLockServer  # (only with the [etcd] extra: imported when named)

    return EtcdLockServer.from_url(url, **options)


def _quorum(url: str, _transport_options: dict[str, Any], options: dict[str, Any]) -> LockBackend:
    from .quorum import QuorumLockServer

    return QuorumLockServer.from_urls(quorum_members(url) or [], **options)


BACKENDS: dict[str, Callable[[str, dict[str, Any], dict[str, Any]], LockBackend]] = {
    "redis": lambda url, _t, options: LockServer.from_url(redis_url_for(url), **options),
    "sentinel": lambda url, t, options: SentinelLockServer.from_url(redis_url_for(url), t, **options),
    "cluster": lambda url, _t, options: ClusterLockServer.from_url(redis_url_for(url), **options),
    "quorum": _quorum,
    "etcd": _etcd,
}
"""Each topology (:func:`.urls.topology` names it from the URL's scheme) -> how to build its backend from
(url, transport options, client options). A new backend is its module and one line here."""


# -- one LockServer per connection and process ---------------------------------------------------

_shared: dict[tuple[str, ...], LockBackend] = {}
_shared_lock = threading.Lock()


def shared(url: str, *, transport_options: dict[str, Any] | None = None, redis_options: dict[str, Any] | None = None,
           min_replicas: int = 0, replica_timeout: float = DEFAULT_REPLICA_TIMEOUT) -> LockBackend:
    """The process's one LockServer for this connection (:func:`from_settings` on first use): what
    tasks (``config.server_for``) and ``held(url, ...)`` both use, so a lock taken by one is found
    by the other (reentrancy).

    Servers are told apart by their whole connection identity (the full URL with its credentials,
    and the client options), never by the redacted URL. The first use logs where the locks live and
    checks the server's eviction policy.
    """
    key = (url, repr(sorted((redis_options or {}).items())), repr(sorted((transport_options or {}).items())),
           str(min_replicas), repr(replica_timeout))
    server = _shared.get(key)
    if server is None:
        with _shared_lock:
            server = _shared.get(key)
            if server is None:
                server = from_settings(url, transport_options=transport_options, redis_options=redis_options,
                                       min_replicas=min_replicas, replica_timeout=replica_timeout)
                logger.info("celery-singleton-lock: locks live at %s", redact_url(url))
                for member in getattr(server, "members", [server]) if topology(url) != "etcd" else []:
                    check_eviction_policy(member.client, member.url)  # every master of a quorum
                _shared[key] = server
    return server


# -- eviction: a Redis that may delete a held lock ---------------------------------------------------

_eviction_policies: dict[str, str | None] = {}
"""URL -> its server's maxmemory-policy (None: CONFIG refused), once per URL and process."""
_eviction_locks: dict[str, threading.Lock] = {}
_eviction_guard = threading.Lock()


def check_eviction_policy(client: Any, url_for_logs: str) -> str | None:
    """Warn once when the server may evict a held lock; return its ``maxmemory-policy`` (None: unknown).

    At its ``maxmemory``, a Redis under any policy but ``noeviction`` deletes keys to make
    room, and lock keys always carry a TTL, so ``volatile-*`` policies pick them as readily
    as ``allkeys-*`` ones: the lock vanishes and a duplicate runs. Hence ONE warning per URL
    and process. Quiet when CONFIG is refused (managed Redis often renames or forbids it):
    there is nothing to learn. An unreachable server is not remembered, so a later call asks
    again. After the first answer a call costs a dict lookup; concurrent first calls for a
    URL wait for the one round trip.
    """
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import RedisError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    key = url_for_logs
    if key in _eviction_policies:
        return _eviction_policies[key]
    with _eviction_guard:
        lock = _eviction_locks.setdefault(key, threading.Lock())
    with lock:
        if key in _eviction_policies:
            return _eviction_policies[key]
        try:
            reply = client.config_get("maxmemory-policy")
        except (RedisConnectionError, RedisTimeoutError, OSError):
            return None  # not remembered: the next call asks again
        except RedisError:  # CONFIG renamed away, disabled, or refused by an ACL
            policy = None
        else:
            policy = _policy_from(reply)
        _eviction_policies[key] = policy
        if policy is not None and policy != "noeviction":
            logger.warning(
                "celery-singleton-lock: the Redis at %s has maxmemory-policy %s: at its maxmemory it may evict a "
                "held lock, and a duplicate then runs. Locks are only safe with maxmemory-policy noeviction.",
                redact_url(url_for_logs), policy,
            )
    return policy


def _policy_from(reply: Any) -> str | None:
    """The policy out of a CONFIG GET reply (a dict; bytes under RESP3 without decoding)."""
    if not isinstance(reply, dict):
        return None
    value = reply.get("maxmemory-policy", reply.get(b"maxmemory-policy"))
    if isinstance(value, bytes):
        value = value.decode()
    return value if isinstance(value, str) and value else None


def _forget_eviction_locks_in_child() -> None:
    """A fork may copy a lock held by another thread mid-check: the child starts with fresh ones."""
    global _eviction_guard, _eviction_locks
    _eviction_guard = threading.Lock()
    _eviction_locks = {}


def _register_fork_hook() -> None:

    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_forget_eviction_locks_in_child)


_register_fork_hook()
