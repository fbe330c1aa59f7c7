"""Where an app's locks live, node by node, for the operators' commands.

One Redis (or a Sentinel-watched master) is one node. A Redis Cluster spreads the keys over
its masters: a SCAN of one node sees only that node's keys, so ``celery locks list`` scans
each master. A quorum of independent masters keeps each lock on several members, maybe not
on all of them (one was stopped, or restarted empty), so the commands read every member and
show the majority's verdict beside what each member holds (:func:`verdict`), the same rule
the workers use: a key is held only when a majority holds it under one token. Each backend says
which nodes it has (``nodes()``): etcd has none, its locks are no Redis keys (see listed.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..engine.backend import LockBackend
from ..topologies.quorum import most_held


@dataclass(frozen=True)
class Node:
    """One Redis server the app's locks may be on: a label for people, and a client of its own."""

    label: str
    client: Any


def nodes_of(server: LockBackend) -> tuple[list[Node], int]:
    """The nodes to read, and the majority needed for a verdict (0: not a quorum, one node decides):
    what the backend says it has (:meth:`~celery_singleton_lock.engine.backend.LockBackend.nodes`)."""
    return [Node(label, client) for label, client in server.nodes()], server.majority


def node_of_key(server: LockBackend, key: str) -> Node:
    """The node to read ``key`` on (the master of its slot on a Cluster; the one Redis otherwise)."""
    label, client = server.nodes(key)[0]
    return Node(label, client)


def token_of(value: bytes | None) -> str | None:
    """The token a lock value starts with (a reservation's ``~entry``), None for no lock."""
    if value is None:
        return None
    return value.split(b" ", 1)[0].decode("utf-8", "replace")


def verdict(seen: dict[str, bytes | None | Exception], majority: int) -> tuple[bytes | None, int]:
    """A quorum's verdict on one key from what each member holds (``seen``: label -> value, None for
    nothing, an exception for a member that did not answer): the value of the token most members
    hold, and on how many; (None, 0) when no member holds it. Held only when that count is at least
    ``majority``."""
    values = list(seen.values())
    i, count = most_held(values)
    held = values[i] if count else None
    return (held if isinstance(held, bytes) else None), count


def member_states(seen: dict[str, bytes | None | Exception]) -> dict[str, str | None]:
    """Per member: the token it holds the key under, None for free, ``"unreachable: ..."`` otherwise."""
    return {label: (f"unreachable: {value}" if isinstance(value, Exception) else token_of(value))
            for label, value in seen.items()}
