"""The bytes we send: an EVALSHA (and a WAIT) packed in the Redis protocol, and the lock value's metadata.

Packing a command here costs a few microseconds; redis-py's generic command path costs about
as much as the round trip itself, so the hot path sends these bytes on a held connection.
"""

from __future__ import annotations

import json
import os
import re
import socket
from collections.abc import Sequence
from typing import Any

from .lock import ms


def pack(sha: str, keys: Sequence[str], args: Sequence[Any]) -> bytes:
    """``EVALSHA sha numkeys keys... args...`` in the Redis protocol (RESP).

    The common call (every part an ASCII str or an int: a task's acquire and release) is made
    as one str and encoded once, a third cheaper than a bytes part per argument (the way below).
    """
    items = (*keys, *args)
    parts = []
    for item in items:
        kind = type(item)
        if kind is int:
            item = str(item)
        elif kind is not str or not item.isascii():  # bytes, or a length that is not the str's
            return _pack_bytes(sha, keys, args)
        parts.append(f"${len(item)}\r\n{item}\r\n")
    n = str(len(keys))
    return (f"*{3 + len(items)}\r\n$7\r\nEVALSHA\r\n$40\r\n{sha}\r\n${len(n)}\r\n{n}\r\n"
            + "".join(parts)).encode()


def _pack_bytes(sha: str, keys: Sequence[str], args: Sequence[Any]) -> bytes:
    nkeys = str(len(keys)).encode()
    parts = [b"*%d\r\n$7\r\nEVALSHA\r\n$40\r\n%s\r\n$%d\r\n%s\r\n" % (
        3 + len(keys) + len(args), sha.encode(), len(nkeys), nkeys)]
    for arg in (*keys, *args):
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


def pack_renewals(sha: str, locks: Sequence[Any]) -> bytes:
    """``EVALSHA`` of RENEW_MANY over ``locks`` (each with ``key``, ``prefix``, ``ttl``).

    A lock's key, prefix and TTL never change, so its part of the command is packed once, on
    its first renewal, and kept on it (``renewal_parts``): a round of 10,000 locks is then a join
    of bytes, not 30,000 arguments formatted again every period.
    """
    keys: list[bytes] = []
    args: list[bytes] = []
    for lock in locks:
        parts = lock.renewal_parts
        if parts is None:
            parts = lock.renewal_parts = _renewal_parts(lock)
        keys.append(parts[0])
        args.append(parts[1])
    n = str(len(locks))
    head = f"*{3 + 3 * len(locks)}\r\n$7\r\nEVALSHA\r\n$40\r\n{sha}\r\n${len(n)}\r\n{n}\r\n"
    return head.encode() + b"".join(keys) + b"".join(args)


def _renewal_parts(lock: Any) -> tuple[bytes, bytes]:
    """A lock's key, and its (prefix, ttl ms) pair, in RESP: RENEW_MANY's ARGV takes them side by side."""
    key, prefix = lock.key.encode(), lock.prefix.encode()
    ttl = str(ms(lock.ttl)).encode()
    return (b"$%d\r\n%s\r\n" % (len(key), key),
            b"$%d\r\n%s\r\n$%d\r\n%s\r\n" % (len(prefix), prefix, len(ttl), ttl))


def pack_wait(replicas: int, timeout_ms: int) -> bytes:
    """``WAIT replicas timeout`` in RESP."""
    n, t = str(replicas).encode(), str(timeout_ms).encode()
    return b"*3\r\n$4\r\nWAIT\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n" % (len(n), n, len(t), t)


_static = (-1, "")


def meta(owner_id: str | None) -> str:
    """The lock value's metadata, for operators: owner, host, pid. Only the owner changes per call: the
    same owner gives the same bytes again (etcd's release compares them)."""
    global _static
    pid = os.getpid()
    if _static[0] != pid:  # made once per process (and again after a fork)
        _static = (pid, f',"host":{json.dumps(socket.gethostname())},"pid":{pid}')
    if owner_id is None:
        owner = "null"
    elif _PLAIN_ID.fullmatch(owner_id):  # a task id: nothing to escape
        owner = '"' + owner_id + '"'
    else:
        owner = json.dumps(owner_id)
    return '{"owner":' + owner + _static[1] + "}"


_PLAIN_ID = re.compile(r"[\w.:-]*", re.ASCII)
