"""Which of redis-py's errors mean "not now" (try again later) and which mean "fix something".

A transient error (a refused or dropped connection, a timeout, a failover's READONLY, a
loading replica, a busy script, a slot still moving) becomes :class:`LockBackendUnavailable`,
which the task side retries; a refusal that trying again cannot fix (a wrong password or
ACL, a server that is not Redis, a key holding something that is not our lock, a script
error) becomes :class:`LockBackendRefused`, which fails the task at once, saying what to fix.
"""

from __future__ import annotations

from redis.exceptions import (
    AskError,
    AuthenticationError,
    AuthenticationWrongNumberOfArgsError,
    AuthorizationError,
    ClusterDownError,
    InvalidResponse,
    MovedError,
    NoPermissionError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    RedisError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..exceptions import LockBackendRefused, LockBackendUnavailable, LockError

# Replies that mean "not now" rather than "never": a failover, a loading replica, a busy script, a slot
# still moving after every redirect was followed.
# A RedisClusterException (not a RedisError: a slot no node covers) is a cluster that cannot be reached now.
_TRANSIENT = (RedisConnectionError, RedisTimeoutError, ReadOnlyError, TryAgainError, ClusterDownError, OutOfMemoryError,
              MovedError, AskError, RedisClusterException)
_TRANSIENT_CODES = ("LOADING", "BUSY", "MASTERDOWN", "NOREPLICAS", "TRYAGAIN", "CLUSTERDOWN", "READONLY", "MOVED",
                    "ASK ")

REDIS_ERRORS = (RedisError, RedisClusterException)
"""What a redis-py call can raise when the server does not do it: a Cluster's own errors are not RedisErrors."""

_DENIED = (AuthenticationError, AuthorizationError, AuthenticationWrongNumberOfArgsError, NoPermissionError)


def classify(exc: Exception, url: str, key: str) -> LockError:
    """Our error for a redis-py one, on the server at ``url`` (shown without its password)."""
    text = str(exc) or type(exc).__name__
    if isinstance(exc, _DENIED):
        return LockBackendRefused(
            url, f"authentication or permission refused ({text}); check the password or ACL user "
            "in the URL, or singleton_lock_redis_options",
        )
    if isinstance(exc, InvalidResponse):
        return LockBackendRefused(
            url, f"the server did not answer the way Redis does ({text}); is this the address of a Redis?"
        )
    if isinstance(exc, _TRANSIENT) or text.startswith(_TRANSIENT_CODES):
        return LockBackendUnavailable(url, text)
    if text.startswith("WRONGTYPE"):
        return LockBackendRefused(
            url, f"key {key!r} (or a key beside it) holds a value that is not one of our locks "
            "(WRONGTYPE): something else writes there; delete it, or use another lock_prefix",
        )
    return LockBackendRefused(url, f"Redis refused the lock operation on {key!r}: {text}")
