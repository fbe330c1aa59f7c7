"""Reading the app's locks off every node: SCAN batches, one pipelined read per batch, and rows (on a
quorum, every member read and the majority's verdict: see nodes.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ..engine import layout
from . import listed
from .base import CliError, Target, fail
from .nodes import Node, member_states, node_of_key, verdict
from .survey import glob_escape, lock_row, parse_key

SCAN_COUNT = 500
"""Keys per SCAN call (a hint to Redis), and so per pipelined read."""


def scan(target: Target, task: str | None = None,
         count: int = SCAN_COUNT) -> Iterator[tuple[Node, list[tuple[str, str]]]]:
    """Batches of (lock key, task name) and the node they are on, by SCAN under each prefix on every
    node: never KEYS, never a long call. A key found on several quorum members comes once."""
    seen: set[str] = set()
    for node in target.nodes:
        for batch in _scan_node(target, node, task, count, seen):
            yield node, batch


def _scan_node(target: Target, node: Node, task: str | None, count: int,
               seen: set[str]) -> Iterator[list[tuple[str, str]]]:
    tail = f"{glob_escape(task)}:*" if task else "*"
    for prefix in target.prefixes:
        pattern = f"{glob_escape(prefix)}:{tail}"
        cursor = 0
        while True:
            cursor, found = target.run(lambda c, cur=cursor, pat=pattern: c.scan(cur, match=pat, count=count),
                                       node.client)
            batch = []
            for raw in found:
                key = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
                if key in seen:
                    continue
                try:
                    name = parse_key(key, target.prefixes)
                except ValueError:
                    continue  # a line, waiters, done records, wake-up list, the index...
                if task is None or name == task:
                    seen.add(key)
                    batch.append((key, name))
            if batch:
                yield batch
            if int(cursor) == 0:
                break


def read_batch(target: Target, batch: list[tuple[str, str]],
               client: Any = None) -> tuple[int, list[tuple[str, str, bytes, int, int]]]:
    """One pipelined round trip (on ``client``: a node's; else the lock server's): TIME, then GET, PTTL
    and LLEN of the line, of each key.

    Returns the server clock (microseconds) and (key, task, value, pttl, waiters) of the keys
    still held (a key released since the SCAN, or not a string, is left out).
    """

    def read(client: Any) -> list[Any]:
        pipe = client.pipeline(transaction=False)
        pipe.time()
        for key, _ in batch:
            pipe.get(key)
            pipe.pttl(key)
            pipe.llen(layout.line(key))
        return list(pipe.execute(raise_on_error=False))

    replies = target.run(read, client)
    if isinstance(replies[0], Exception):
        fail(str(target.server.error(replies[0], batch[0][0])))
    now_us = replies[0][0] * 1_000_000 + replies[0][1]
    out = []
    for i, (key, name) in enumerate(batch):
        value, pttl, waiters = replies[1 + 3 * i: 4 + 3 * i]
        if value is None or isinstance(value, Exception):
            continue
        pttl = pttl if isinstance(pttl, int) else -2
        out.append((key, name, value, pttl, waiters if isinstance(waiters, int) else 0))
    return now_us, out


def read_locks(target: Target, batch: list[tuple[str, str]], client: Any = None) -> list[dict[str, Any]]:
    """The batch's held locks, as rows (of a quorum: every member read, see :func:`read_quorum`)."""
    if target.majority:
        return read_quorum(target, batch)
    now_us, found = read_batch(target, batch, client)
    return [lock_row(key, name, value, pttl, waiters, now_us) for key, name, value, pttl, waiters in found]


def read_quorum(target: Target, batch: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """The batch's locks on a quorum: one pipelined read per member, then one row per key that any
    member holds, with ``members`` (label -> the token it holds, None, or why it did not answer),
    ``held_on`` and ``held`` (the majority's verdict, as the workers decide it)."""
    seen: dict[str, dict[str, Any]] = {key: {} for key, _ in batch}
    found: dict[str, tuple[str, bytes, int, int, int]] = {}
    for node in target.nodes:
        try:
            now_us, rows = read_batch(target, batch, node.client)
        except CliError as exc:
            for key in seen:
                seen[key][node.label] = exc
            continue
        held = {key: (name, value, pttl, waiters) for key, name, value, pttl, waiters in rows}
        for key, _ in batch:
            seen[key][node.label] = held[key][1] if key in held else None
            if key in held:
                found.setdefault(key, (*held[key], now_us))
    if all(isinstance(v, Exception) for values in seen.values() for v in values.values()):
        fail(f"no member of {target.url} answered")
    out = []
    for key, name in batch:
        value, count = verdict(seen[key], target.majority)
        if value is None:
            continue
        _, _, pttl, waiters, now_us = found[key]
        row = lock_row(key, name, value, pttl, waiters, now_us)
        row.update(held=count >= target.majority, held_on=count, members=member_states(seen[key]))
        out.append(row)
    return out



def read_one(target: Target, key: str, task: str) -> dict[str, Any] | None:
    """The lock ``key`` now, as a row (None when nobody holds it; on a quorum, a row also when only
    a minority holds it, with ``held`` False)."""
    listing = target.server.listing()
    if listing is not None:  # (etcd) no Redis node to read it on
        return listed.read_one(listing, key, task)
    rows = read_locks(target, [(key, task)], node_of_key(target.server, key).client)
    return rows[0] if rows else None


def in_slot(target: Target, key: str, records: dict[bytes, bytes], client: Any = None) -> set[bytes]:
    """The parked waiters of ``key`` still waiting in their worker slot (``lock_wait_in_slot``): those
    whose slot mark lives (plain code has one too: not counted). One pipelined read, none if nobody is parked."""
    parked = [entry for entry, record in records.items() if record[1:2] == b"p" and record[0:1] != b"p"]
    if not parked:
        return set()

    def read(c: Any) -> list[Any]:
        pipe = c.pipeline(transaction=False)
        for entry in parked:
            pipe.exists(layout.blocking(key, entry.decode()))
        return list(pipe.execute())

    return {entry for entry, marked in zip(parked, target.run(read, client), strict=True) if marked}
