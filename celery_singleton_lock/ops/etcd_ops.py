"""``celery locks list|show|key|release`` on etcd: the same rows, sentences and exit codes as on Redis.

A lock is one etcd key (see :mod:`celery_singleton_lock.topologies.etcd`), so ``list`` is one range
read over the lock prefix, plus one lease read per holding process (its time to live), and
``release`` one txn that deletes the key only while it is the incarnation that was shown; ``waiters``
is one count read per lock (``celery locks line`` lists them: cli_line.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from ..engine.lock import Forced, Holder, slot_safe
from ..exceptions import LockError
from ..topologies.etcd import EtcdLockServer
from .base import Target, audit, fail, who_am_i
from .survey import describe, parse_key, table, to_json


def row_of(server: EtcdLockServer, holder: Holder, lease: int, task: str, ttls: dict[int, int]) -> dict[str, Any]:
    """One held lock as the commands show it: held_ms unknown (a revision is not a clock), ttl_ms the
    remaining life of its holder's lease (read once per lease: per holding process)."""
    if lease not in ttls:
        ttls[lease] = lease_ttl_ms(server, lease)
    return {
        "key": holder.key, "task": task, "task_id": holder.owner_id, "host": holder.host, "pid": holder.pid,
        "held_ms": None, "ttl_ms": ttls[lease], "fencing_token": holder.fencing_token,
        "waiters": server.waiting.count(holder.key),
        "reserved": False,
    }


def lease_ttl_ms(server: EtcdLockServer, lease: int) -> int:
    if not lease:
        return -1
    try:
        reply = server.transport.call("/kv/lease/timetolive", {"ID": str(lease)})
    except LockError:
        return -1
    ttl = int(reply.get("TTL", -1) or -1)
    return ttl * 1000 if ttl >= 0 else -2


def rows(target: Target, server: EtcdLockServer, task_name: str | None) -> list[dict[str, Any]]:
    """Every lock held under the app's prefixes (of ``task_name`` only, when given)."""
    try:
        held = server.locks()
    except LockError as exc:
        fail(str(exc))
    out: list[dict[str, Any]] = []
    ttls: dict[int, int] = {}
    for holder, lease in held:
        try:
            task = parse_key(holder.key, target.prefixes)
        except ValueError:
            continue  # another app's lock on the same cluster
        if task_name is None or task == task_name:
            out.append(row_of(server, holder, lease, task, ttls))
    return out


def read_one(server: EtcdLockServer, key: str, task: str) -> dict[str, Any] | None:
    try:
        found = server.holder_and_lease(key)
    except LockError as exc:
        fail(str(exc))
    return None if found is None else row_of(server, found[0], found[1], task, {})


def list_locks(target: Target, server: EtcdLockServer, task_name: str | None, as_json: bool) -> None:
    found = sorted(rows(target, server, task_name), key=lambda row: row["key"])
    if as_json:
        click.echo(to_json(found))
    elif found:
        click.echo(table(found))
    else:
        where = ", ".join(f"{p}:*" for p in target.prefixes)
        click.echo(f"no locks held{f' by task {task_name}' if task_name else ''} ({where} on {target.url})")


def show(ctx: click.Context, server: EtcdLockServer, key: str, task: str, as_json: bool) -> None:
    """Exit 0 if the lock is held, 1 if not (done records are not listed)."""
    row = read_one(server, key, task)
    if as_json:
        data = row or {"key": key, "task": task, "task_id": None, "host": None, "pid": None, "held_ms": None,
                       "ttl_ms": -2, "fencing_token": None, "waiters": 0, "reserved": False}
        click.echo(to_json({**data, "held": row is not None, "line": server.waiting.line(key), "done": []}))
    else:
        click.echo(f"lock      {key}")
        click.echo(f"task      {task}")
        click.echo(f"state     {describe(row) if row else 'free: nobody holds it'}")
        waiting = server.waiting.line(key)
        click.echo(f"line      {len(waiting)} waiting{': ' + ', '.join(waiting) if waiting else ''}")
    ctx.exit(0 if row is not None else 1)


def release(ctx: click.Context, server: EtcdLockServer, key: str, task: str, yes: bool,
            confirm: Callable[[click.Context, str, dict[str, Any]], None]) -> None:
    """Delete ``key``'s lock (only the holder shown, when ``confirm`` asked). Exit 0 released, 1 not."""
    row = read_one(server, key, task)
    if row is None:
        click.echo(f"no lock {key}: nothing released")
        ctx.exit(1)
    expected = ""
    if not yes:
        confirm(ctx, key, row)
        shown = server.holder(key)
        expected = "" if shown is None else shown.raw.split(" ", 1)[0] + " "
    try:
        status, _value, _on = server.force_release(slot_safe(key), expected)
    except LockError as exc:
        fail(str(exc))
    if status is not Forced.RELEASED:
        gone = "changed hands since it was shown" if status is Forced.CHANGED_HANDS else "is gone"
        click.echo(f"lock {key} {gone}: nothing released")
        ctx.exit(1)
    line = f"lock {key} force-released by {who_am_i()}: it was {describe(row)}"
    audit(line)
    click.echo(line)
