"""``celery locks ...``: the locks as Redis holds them, a call's key, and a force-release.

Registered through the ``celery.commands`` entry point, so it runs with the
app's own settings, and finds the lock Redis (``singleton_lock_url``, else the
Redis result backend or broker, as the workers do) and the prefixes (the app's
``singleton_lock_prefix`` and every LockedTask's own ``lock_prefix``)::

    celery -A proj locks list [--task NAME] [--json]
    celery -A proj locks show KEY [--json]
    celery -A proj locks key TASK_NAME [--args JSON] [--kwargs JSON] [--json]
    celery -A proj locks release KEY [--yes]                (cli_release.py)
    celery -A proj locks release --task NAME --all [--yes]  (cli_release.py)
    celery -A proj locks line KEY [--json]           (cli_line.py)
    celery -A proj locks drop KEY TASK_ID [--yes]    (cli_line.py)
    celery -A proj locks check                       (cli_check.py: before a deploy)

``list`` walks the keyspace with SCAN (never KEYS), a batch at a time, and
reads each batch in one pipelined round trip, so it never blocks Redis however
many keys it holds. ``--task NAME`` takes a LockedTask's full name or its last part (``deduct``
for ``proj.tasks.deduct``, when only one task ends so); an unknown name exits 2
and names the close matches. Exit status: 0 done (``show``: the lock is held;
``release``: a lock was released), 1 no such lock (or the release was not
confirmed), 2 a bad key, task or argument, or a lock Redis that is
misconfigured or unreachable, with a one-line error.

Every key of a lock ``K`` is described in :mod:`celery_singleton_lock.engine.scripts`.
"""


from __future__ import annotations

import json
from typing import Any

import click

from ..engine import layout
from ..exceptions import LockKeyError
from . import listed
from .base import Target, fail, locks, open_target, resolve_task
from .nodes import node_of_key
from .reading import SCAN_COUNT, in_slot, read_locks, read_one, scan
from .survey import (
    IN_SLOT,
    KINDS,
    STATES,
    describe,
    duration,
    glob_escape,
    lock_row,
    message_summary,
    parse_key,
    table,
    to_json,
)

__all__ = ["locks", "duration", "glob_escape", "parse_key"]


@locks.command(name="list")
@click.option("--task", "task_name", metavar="NAME", help="Only the locks of this task.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON array of objects.")
@click.option("--count", default=SCAN_COUNT, show_default=True, type=click.IntRange(1, 100_000),
              help="Keys per SCAN batch (and per pipelined read).")
@click.pass_context
def list_locks(ctx: click.Context, task_name: str | None, as_json: bool, count: int) -> None:
    """One line per held lock: key, task, holder, host, pid, held for, expires in, fencing token, waiters."""
    target = open_target(ctx)
    task_name = resolve_task(target, task_name) if task_name else None
    listing = target.server.listing()
    if listing is not None:  # its locks are no Redis keys to SCAN: it lists them itself (etcd)
        listed.list_locks(target, listing, task_name, as_json)
        return
    rows: list[dict[str, Any]] = []
    for node, batch in scan(target, task_name, count):
        rows.extend(read_locks(target, batch, node.client))
    rows.sort(key=lambda row: row["key"])
    if as_json:
        click.echo(to_json(rows))
    elif rows:
        click.echo(table(rows, len(target.nodes) if target.majority else 0))
    else:
        where = ", ".join(f"{p}:*" for p in target.prefixes)
        click.echo(f"no locks held{f' by task {task_name}' if task_name else ''} ({where} on {target.url})")


def _line(target: Target, key: str, now_ms: int, records: dict[bytes, bytes],
          entries: list[bytes]) -> list[dict[str, Any]]:
    """The key's waiters, next first, then those handed the key and gone from the line (yet to claim it)."""
    out = []
    slot = in_slot(target, key, records, node_of_key(target.server, key).client)
    order = [e for e in entries if e in records] + [e for e in records if e not in set(entries)]
    for entry in order:
        waiter = layout.Waiter.parse(records[entry])
        item = {
            "entry": entry.decode(),
            "owner": waiter.owner,
            "kind": KINDS.get(waiter.kind, waiter.kind),
            "state": IN_SLOT if entry in slot else STATES.get(waiter.state, waiter.state),
            "in_line": entry in entries,
            "gives_up_in_ms": waiter.deadline_ms - now_ms,
            "ttl_ms": waiter.ttl_ms,
        }
        item.update(message_summary(waiter.message))
        out.append(item)
    return out


@locks.command(name="show")
@click.argument("key")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.pass_context
def show(ctx: click.Context, key: str, as_json: bool) -> None:
    """One lock: its holder, raw value, line of waiters (in order, with their state) and done records.

    Exit status 0 if the lock is held, 1 if not (its line and done records are shown all the same).
    """
    target = open_target(ctx)
    task = target.task_of(key)
    listing = target.server.listing()
    if listing is not None:
        listed.show(ctx, listing, key, task, as_json)
        return

    def read(client: Any) -> list[Any]:
        pipe = client.pipeline(transaction=False)
        pipe.time()
        pipe.get(key)
        pipe.pttl(key)
        pipe.lrange(layout.line(key), 0, -1)
        pipe.hgetall(layout.waiters(key))
        pipe.zrange(layout.done(key), 0, -1, withscores=True)
        return list(pipe.execute())

    (secs, micros), value, pttl, entries, records, done = target.run(read, node_of_key(target.server, key).client)
    now_us = secs * 1_000_000 + micros
    now_ms = now_us // 1000
    row = lock_row(key, task, value, pttl, len(entries), now_us) if value is not None else None
    if target.majority:  # a quorum: every member read, and the majority's verdict
        row = read_one(target, key, task)
        value = None if row is None else value
    waiting = _line(target, key, now_ms, records, entries)
    remembered = [{"task_id": owner.decode(), "remembered_ms": int(until) - now_ms} for owner, until in done]
    if as_json:
        data = row or {"key": key, "task": task, "task_id": None, "host": None, "pid": None, "held_ms": None,
                       "ttl_ms": -2, "fencing_token": None, "waiters": len(entries), "reserved": False}
        data = {**data, "held": row is not None, "value": None if value is None else value.decode("utf-8", "replace"),
                "line": waiting, "done": remembered}
        click.echo(to_json(data))
    else:
        click.echo(f"lock      {key}")
        click.echo(f"task      {task}")
        click.echo(f"state     {describe(row) if row else 'free: nobody holds it'}")
        if value is not None:
            click.echo(f"value     {value.decode('utf-8', 'replace')}")
        for label, token in (row or {}).get("members", {}).items():
            click.echo(f"member    {label}: {'free' if token is None else token}")
        click.echo(f"line      {len(entries)} waiting" + (":" if waiting else ""))
        for n, item in enumerate(waiting, 1):
            call = ""
            if item.get("task"):
                call = f" {item['task']}(args={json.dumps(item['args'])}, kwargs={json.dumps(item['kwargs'])})"
            place = f"{n}." if item["in_line"] else "-"
            click.echo(f"  {place} {item['owner']}  {item['kind']}, {item['state']}, gives up in "
                       f"{duration(item['gives_up_in_ms'])}, entry {item['entry']}{call}")
        click.echo(f"done      {len(remembered)} record(s)" + (":" if remembered else ""))
        for item in remembered:
            click.echo(f"  {item['task_id']} succeeded: its redeliveries are dropped for "
                       f"{duration(item['remembered_ms'])} more")
    ctx.exit(0 if row is not None and row.get("held", True) else 1)


@locks.command(name="key")
@click.argument("task_name")
@click.option("--args", "args_json", default="[]", metavar="JSON", help="The call's positional arguments.")
@click.option("--kwargs", "kwargs_json", default="{}", metavar="JSON", help="The call's keyword arguments.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.pass_context
def key_of(ctx: click.Context, task_name: str, args_json: str, kwargs_json: str, as_json: bool) -> None:
    """The key a call of TASK_NAME locks (the task's own lock_key_for), and who holds it now.

    The arguments are JSON, as the message carries them: "why is my task skipped?" With lock_key a
    list of names, those arguments alone will do.
    """
    target = open_target(ctx)
    task_name = resolve_task(target, task_name)
    task = target.tasks[task_name]
    args = _json_arg("--args", args_json, list)
    kwargs = _json_arg("--kwargs", kwargs_json, dict)
    try:
        key = task.lock_key_for(args, kwargs, partial=True)  # (the lock_key arguments alone will do)
    except (LockKeyError, ValueError) as exc:
        fail(f"task {task_name}: {exc}")
    row = read_one(target, key, task_name)
    if as_json:
        click.echo(to_json({"key": key, "task": task_name, "held": row is not None, "holder": row}))
        return
    click.echo(key)
    click.echo(describe(row) if row else "free: nobody holds it")


def _json_arg(option: str, text: str, kind: type) -> Any:
    try:
        value = json.loads(text)
    except ValueError as exc:
        fail(f"{option} must be JSON: {exc} in {text!r}")
    if not isinstance(value, kind):
        fail(f"{option} must be a JSON {'array' if kind is list else 'object'}, got {text!r}")
    return value


from . import cli_check, cli_line, cli_release  # noqa: E402,F401 - register "check", "line", "drop", "release"
