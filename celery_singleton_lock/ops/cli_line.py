"""``celery locks line KEY`` and ``celery locks drop KEY TASK_ID``: a key's waiting line, for operators.

Registered on the ``celery locks`` group (cli.py imports this module)::

    celery -A proj locks line KEY [--json]
    celery -A proj locks drop KEY TASK_ID [--yes]

``line`` lists the waiters in order: place (``-`` for one whose turn was
handed and is on its way, out of the line), task id, kind, state, how long
it has waited (since it first parked), and when it gives up
(``lock_max_wait``). ``drop`` takes one task out of the line (the engine's
:func:`celery_singleton_lock.engine.line_ops.remove`; if the key was reserved for
it, it passes on at once), stores REVOKED for it, and logs who did it.

Exit status, as ``release``: 0 done (``line``: the key has waiters; ``drop``:
the task left the line), 1 nothing there (no waiters; no such waiter, or the
drop was not confirmed), 2 a bad key or argument, or a lock Redis that is
misconfigured or unreachable, with a one-line error.
"""

from __future__ import annotations

import json
import time
from typing import Any

import click

from ..delivery import handoff
from ..delivery.headers import turn_of
from ..engine import layout, line_ops
from ..exceptions import LockError
from .base import Target, audit, fail, locks, open_target, who_am_i
from .reading import in_slot
from .survey import IN_SLOT, KINDS, STATES, duration, message_summary, to_json


def read_line(target: Target, key: str) -> list[dict[str, Any]]:
    """The key's waiters, next first, then those handed the key and on their way (out of the line)."""
    listing = target.server.listing()
    if listing is not None:  # (etcd) its lines are no Redis keys either: it reads them itself
        waiters, reserved_for = listing.waiters(key)
        now = time.time()
        return [_row(record, entry, i + 1, entry == reserved_for, now) for i, (entry, record) in enumerate(waiters)]

    def read(client: Any) -> list[Any]:
        pipe = client.pipeline(transaction=False)
        pipe.time()
        pipe.get(key)
        pipe.lrange(layout.line(key), 0, -1)
        pipe.hgetall(layout.waiters(key))
        return list(pipe.execute())

    (secs, micros), held, entries, records = target.run(read)
    now_ms = secs * 1000 + micros // 1000
    reserved = held.split(b" ", 1)[0][1:] if held and held.startswith(b"~") else None
    slot = in_slot(target, key, records)
    order = [e for e in entries if e in records] + [e for e in records if e not in set(entries)]
    return [_row(layout.Waiter.parse(records[entry]), entry.decode(),
                 entries.index(entry) + 1 if entry in entries else None, entry == reserved, now_ms / 1000,
                 entry in slot)
            for entry in order]


def _row(waiter: layout.Waiter, entry: str, place: int | None, reserved: bool, now: float,
         slot: bool = False) -> dict[str, Any]:
    """One waiter as ``line`` shows it (``now``: the lock server's clock, or on etcd this host's)."""
    parked_at = _parked_at(waiter.message)
    now_ms = int(now * 1000)
    return {
        "place": place,
        "task_id": waiter.owner,
        "kind": KINDS.get(waiter.kind, waiter.kind),
        "state": IN_SLOT if slot else STATES.get(waiter.state, waiter.state),
        "reserved": reserved,
        "waited_ms": None if parked_at is None else max(0, now_ms - int(parked_at * 1000)),
        "gives_up_in_ms": waiter.deadline_ms - now_ms,
        "entry": entry,
        **message_summary(waiter.message),
    }


def _parked_at(message: bytes) -> float | None:
    """When the parked task first parked (epoch seconds), from its JSON message's headers."""
    try:
        content_type, _encoding, data = layout.split_message(message)
        if content_type != "application/json":
            return None
        return turn_of(json.loads(data)["options"]["headers"]).parked_at
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


@locks.command(name="line")
@click.argument("key")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON array of objects.")
@click.pass_context
def line(ctx: click.Context, key: str, as_json: bool) -> None:
    """KEY's waiters in order: place, task id, kind, state, waited, gives up in.

    Exit status 0 if it has waiters, 1 if not.
    """
    target = open_target(ctx)
    target.task_of(key)
    rows = read_line(target, key)
    if as_json:
        click.echo(to_json(rows))
    elif not rows:
        click.echo(f"nobody waits for lock {key}")
    else:
        click.echo(f"{'PLACE':<6} {'TASK ID':<36}  {'KIND':<16} {'WAITED':>8} {'GIVES UP IN':>11}  STATE")
        for row in rows:
            place = str(row["place"]) if row["place"] else "-"
            state = row["state"] + (", the key is reserved for it" if row["reserved"] else "")
            click.echo(f"{place:<6} {row['task_id']:<36}  {row['kind']:<16} {duration(row['waited_ms']):>8} "
                       f"{duration(row['gives_up_in_ms']):>11}  {state}")
    ctx.exit(0 if rows else 1)


@locks.command(name="drop")
@click.argument("key")
@click.argument("task_id")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@click.pass_context
def drop(ctx: click.Context, key: str, task_id: str, yes: bool) -> None:
    """Take waiting task TASK_ID out of KEY's line, and store REVOKED for it.

    If the key was reserved for it, the key passes to the next waiter at once
    (this command publishes that waiter). Exit status 0 dropped, 1 no such
    waiter (or not confirmed).
    """
    target = open_target(ctx)
    target.task_of(key)
    rows = [row for row in read_line(target, key) if row["task_id"] == task_id and row["kind"] != KINDS["p"]]
    if not rows:
        click.echo(f"task {task_id} does not wait for lock {key}: nothing dropped")
        ctx.exit(1)
    if not yes:
        where = f"place {rows[0]['place']}" if rows[0]["place"] else "its turn on its way"
        click.echo(f"task {task_id} waits for lock {key} ({where}, {rows[0]['state']})")
        if not click.confirm("Drop it from the line? It will never run, and is stored REVOKED", default=False):
            click.echo("not dropped")
            ctx.exit(1)
    for task in target.tasks.values():  # a waiter the key passes to is published from here
        handoff.register(task)
    server = target.server
    if not server.supports_line:
        fail(f"{target.url} has no waiting line (a quorum of masters orders none)")
    server.send_handoff = handoff.SEND
    try:
        removed, handoffs = line_ops.remove(server, key, task_id)  # (its own line's drop, on etcd)
    except (LockError, ValueError) as exc:
        fail(str(exc))
    if not removed:
        click.echo(f"task {task_id} left the line of lock {key} meanwhile: nothing dropped")
        ctx.exit(1)
    try:
        target.app.backend.mark_as_revoked(task_id, f"dropped from the line of lock {key} by {who_am_i()}")
    except Exception as exc:  # no result backend, or it is down: the drop itself is done
        click.echo(f"warning: could not store REVOKED for task {task_id}: {type(exc).__name__}: {exc}", err=True)
    passed = "".join(f"; the key was handed to waiting task {h.owner_id}" for h in handoffs if h.what == "run")
    message = f"task {task_id} dropped from the line of lock {key} by {who_am_i()}{passed}"
    audit(message)
    click.echo(message)
