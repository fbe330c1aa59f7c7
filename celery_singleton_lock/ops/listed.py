"""``celery locks list|show|key|release`` on a backend that lists its own locks (etcd): the same rows,
sentences and exit codes as on Redis.

Such a backend's locks are not keys on Redis servers to SCAN, so its ``listing()``
(:class:`~celery_singleton_lock.engine.backend.Listing`) reads them: every held lock with its time
to live and its number of waiters (``celery locks line`` lists them: cli_line.py). ``release`` (of
one key, or ``--task NAME --all``) is the backend's ``force_release``, which deletes the key only
while it is the holder that was shown.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from ..engine.backend import Listed, Listing, LockBackend
from ..engine.lock import Forced, slot_safe
from ..exceptions import LockError
from .base import Target, audit, fail, who_am_i
from .survey import describe, parse_key, table, to_json


def row_of(listed: Listed, task: str) -> dict[str, Any]:
    """One held lock as the commands show it: held_ms unknown (a backend's own fencing token, such
    as etcd's revision, is no clock), ttl_ms what the backend says is left of it."""
    holder = listed.holder
    return {
        "key": holder.key, "task": task, "task_id": holder.owner_id, "host": holder.host, "pid": holder.pid,
        "held_ms": None, "ttl_ms": listed.ttl_ms, "fencing_token": holder.fencing_token,
        "waiters": listed.waiters,
        "reserved": False,
    }


def rows(target: Target, listing: Listing, task_name: str | None) -> list[dict[str, Any]]:
    """Every lock held under the app's prefixes (of ``task_name`` only, when given)."""
    return [row_of(listed, task) for listed, task in _held(target, listing, task_name)]


def held_of(target: Target, listing: Listing, task: str) -> list[tuple[dict[str, Any], str]]:
    """Every lock of ``task``, as a row and the token its holder was shown with (``release --all``
    deletes only that holder's)."""
    return [(row_of(listed, name), listed.holder.raw.split(" ", 1)[0] + " ")
            for listed, name in _held(target, listing, task)]


def _held(target: Target, listing: Listing, task_name: str | None) -> list[tuple[Listed, str]]:
    """(lock, its task) of the app's locks: a key is parsed once, while the backend lists it."""
    tasks: dict[str, str] = {}

    def wanted(key: str) -> bool:
        try:
            task = parse_key(key, target.prefixes)
        except ValueError:
            return False  # another app's lock on the same cluster
        tasks[key] = task
        return task_name is None or task == task_name

    try:
        held = listing.held_locks(wanted)
    except LockError as exc:
        fail(str(exc))
    return [(listed, tasks[listed.holder.key]) for listed in held]


def read_one(listing: Listing, key: str, task: str) -> dict[str, Any] | None:
    try:
        found = listing.held_lock(key)
    except LockError as exc:
        fail(str(exc))
    return None if found is None else row_of(found, task)


def list_locks(target: Target, listing: Listing, task_name: str | None, as_json: bool) -> None:
    found = sorted(rows(target, listing, task_name), key=lambda row: row["key"])
    if as_json:
        click.echo(to_json(found))
    elif found:
        click.echo(table(found))
    else:
        where = ", ".join(f"{p}:*" for p in target.prefixes)
        click.echo(f"no locks held{f' by task {task_name}' if task_name else ''} ({where} on {target.url})")


def show(ctx: click.Context, listing: Listing, key: str, task: str, as_json: bool) -> None:
    """Exit 0 if the lock is held, 1 if not (done records are not listed)."""
    row = read_one(listing, key, task)
    waiting = [record.owner for _, record in listing.waiters(key)[0]]
    if as_json:
        data = row or {"key": key, "task": task, "task_id": None, "host": None, "pid": None, "held_ms": None,
                       "ttl_ms": -2, "fencing_token": None, "waiters": 0, "reserved": False}
        click.echo(to_json({**data, "held": row is not None, "line": waiting, "done": []}))
    else:
        click.echo(f"lock      {key}")
        click.echo(f"task      {task}")
        click.echo(f"state     {describe(row) if row else 'free: nobody holds it'}")
        click.echo(f"line      {len(waiting)} waiting{': ' + ', '.join(waiting) if waiting else ''}")
    ctx.exit(0 if row is not None else 1)


def release(ctx: click.Context, server: LockBackend, listing: Listing, key: str, task: str, yes: bool,
            confirm: Callable[[click.Context, str, dict[str, Any]], None]) -> None:
    """Delete ``key``'s lock (only the holder shown, when ``confirm`` asked). Exit 0 released, 1 not."""
    row = read_one(listing, key, task)
    if row is None:
        click.echo(f"no lock {key}: nothing released")
        ctx.exit(1)
    expected = ""
    if not yes:
        confirm(ctx, key, row)
        shown = server.holder(key)
        expected = "" if shown is None else shown.raw.split(" ", 1)[0] + " "
    status, line = force(server, row, expected)
    click.echo(line)
    ctx.exit(0 if status is Forced.RELEASED else 1)


def force(server: LockBackend, row: dict[str, Any], expected: str) -> tuple[Forced, str]:
    """Release the lock of ``row`` (only while it starts with ``expected``, when given): what it found,
    and the line to print (audited when released)."""
    key = row["key"]
    try:
        status = server.force_release(slot_safe(key), expected).status
    except LockError as exc:
        fail(str(exc))
    if status is not Forced.RELEASED:
        gone = "changed hands since it was shown" if status is Forced.CHANGED_HANDS else "is gone"
        return status, f"lock {key} {gone}: nothing released"
    line = f"lock {key} force-released by {who_am_i()}: it was {describe(row)}"
    audit(line)
    return status, line
