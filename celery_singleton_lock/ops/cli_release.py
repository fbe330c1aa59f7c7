"""``celery locks release``: force-release one lock, or every lock of one task.

Registered on the ``celery locks`` group (cli.py imports this module)::

    celery -A proj locks release KEY [--yes]
    celery -A proj locks release --task NAME --all [--yes]

The holder is not stopped: it learns that its lock is gone at its next renewal.
The key passes to the next waiter in its line, which this command publishes.
Each release is logged (WARNING on logger ``celery_singleton_lock``) with who did it.

Exit status: 0 released (with ``--all``: at least one lock), 1 no such lock (or
the release was not confirmed), 2 a bad key, task or argument, or a lock Redis
that is misconfigured or unreachable, with a one-line error.
"""

from __future__ import annotations

from typing import Any

import click

from ..delivery import handoff
from ..engine.lock import Forced
from ..exceptions import LockError
from . import listed
from .base import Target, audit, fail, locks, open_target, resolve_task, who_am_i
from .nodes import node_of_key
from .reading import read_batch, read_locks, read_one, scan
from .survey import KINDS, describe, duration, lock_row


@locks.command(name="release")
@click.argument("key", required=False)
@click.option("--task", "task_name", metavar="NAME", help="With --all: the task whose locks to release.")
@click.option("--all", "every", is_flag=True, help="Release every lock of --task NAME (one confirmation).")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@click.pass_context
def release(ctx: click.Context, key: str | None, task_name: str | None, every: bool, yes: bool) -> None:
    """Force-release lock KEY (or, with --task NAME --all, every lock of one task), whoever holds it,
    and hand the key to the next waiter in its line.

    The holder is not stopped: it learns that its lock is gone at its next
    renewal (a third of its ttl at most: .lost, lock_lost, .ensure() raising).
    Exit status 0 released, 1 no such lock (or not confirmed).
    """
    if key is not None and (every or task_name):
        fail("give either a KEY or --task NAME --all, not both")
    if key is None and not (every and task_name):
        fail("give the KEY of a lock (celery locks list shows them), or --task NAME --all for every lock of a task")
    target = open_target(ctx)
    if key is None:
        assert task_name is not None
        _release_task(ctx, target, resolve_task(target, task_name), yes)
        return
    task = target.task_of(key)
    listing = target.server.listing()
    if listing is not None:  # (etcd) its locks are no Redis keys: it reads them itself
        listed.release(ctx, target.server, listing, key, task, yes, lambda c, k, row: confirm(
            c, f"lock {k}: {describe(row)}", "Force-release it? Its holder keeps running, without the lock"))
        return
    held = _held(target, [(key, task)], node_of_key(target.server, key).client)
    if not held:
        click.echo(f"no lock {key}{' on any member' if target.majority else ''}: nothing released")
        ctx.exit(1)
    row, token = held[0]
    expected = ""
    if not yes:
        confirm(ctx, f"lock {key}: {describe(row)}", "Force-release it? Its holder keeps running, without the lock")
        expected = token
    status, line = _force(target, key, task, expected)
    click.echo(line)
    ctx.exit(0 if status is Forced.RELEASED else 1)


def _release_task(ctx: click.Context, target: Target, task: str, yes: bool) -> None:
    """Every lock of ``task``: listed, confirmed once, then released one by one (each audited)."""
    listing = target.server.listing()
    held: list[tuple[dict[str, Any], str]] = []
    if listing is not None:  # (etcd) it lists its own locks
        held = listed.held_of(target, listing, task)
    else:
        for node, batch in scan(target, task):
            held.extend(_held(target, batch, node.client))
    held.sort(key=lambda pair: pair[0]["key"])
    if not held:
        click.echo(f"no locks of task {task}: nothing released")
        ctx.exit(1)
    if not yes:
        for row, _ in held:
            click.echo(f"lock {row['key']}: {describe(row)}")
        confirm(ctx, f"{len(held)} lock(s) of task {task}",
                "Force-release all of them? Their holders keep running, without the lock")
    released = 0
    for row, token in held:
        expected = "" if yes else token
        status, line = (listed.force(target.server, row, expected) if listing is not None
                        else _force(target, row["key"], task, expected))
        released += status is Forced.RELEASED
        click.echo(line)
    click.echo(f"{released} of {len(held)} lock(s) of task {task} released")
    ctx.exit(0 if released else 1)


def confirm(ctx: click.Context, shown: str, question: str) -> None:
    """Show what would be released and ask; exit 1 (not released) unless the operator says yes."""
    click.echo(shown)
    if not click.confirm(question, default=False):
        click.echo("not released")
        ctx.exit(1)


def _held(target: Target, batch: list[tuple[str, str]], client: Any) -> list[tuple[dict[str, Any], str]]:
    """The batch's held locks, each as a row and the holder shown to the operator (not whoever may take
    the key after): the release only deletes a value that starts with it (a token, or a reservation's
    entry, and a space). On a quorum, a key that any member holds, even a minority (it is deleted on
    every member that has it): its holder is the one most members name (see nodes.verdict)."""
    if target.majority:
        out = []
        for row in read_locks(target, batch):
            tokens = [t for t in row["members"].values() if t and not t.startswith("unreachable")]
            out.append((row, str(max(set(tokens), key=tokens.count)) + " "))
        return out
    now_us, found = read_batch(target, batch, client)
    return [(lock_row(key, name, value, pttl, waiters, now_us), value.decode("utf-8", "replace").split(" ", 1)[0] + " ")
            for key, name, value, pttl, waiters in found]


def _force(target: Target, key: str, task: str, expected: str) -> tuple[Forced, str]:
    """Release one lock: what it found, and the line to print."""
    if target.majority:  # each member holds its own copy of the key: it goes on every member
        return _force_on_quorum(target, key, task, expected)
    for task_obj in target.tasks.values():  # waiting copies of these tasks are published from here
        handoff.register(task_obj)
    target.server.send_handoff = handoff.SEND
    now_us, found = read_batch(target, [(key, task)], node_of_key(target.server, key).client)
    waiters = found[0][4] if found else 0
    try:
        done = target.server.force_release(key, expected)
    except LockError as exc:
        fail(str(exc))
    passed = "".join(
        f"; the key was handed to waiting {KINDS.get(h.kind, h.kind)} {h.owner_id}" if h.what == "run"
        else f"; waiting {KINDS.get(h.kind, h.kind)} {h.owner_id} had waited too long (it fails)"
        for h in done.handoffs
    )
    if done.status is Forced.CHANGED_HANDS:
        now = read_one(target, key, task)
        shown = describe(now) if now else "now free"
        return Forced.CHANGED_HANDS, f"lock {key} changed hands since it was shown ({shown}): nothing released"
    if done.status is Forced.NO_LOCK:
        return Forced.NO_LOCK, f"no lock {key}: nothing released{passed}"
    was = lock_row(key, task, done.value, -2, waiters, now_us)
    if was["reserved"]:
        holder = f"reserved for waiting task {was['task_id']}"
    elif was["cooldown"]:
        holder = f"cooling down after task {was['task_id']}"
    else:
        holder = (f"held by task {was['task_id']} on host {was['host']} (pid {was['pid']}) for "
                  f"{duration(was['held_ms'])}, fencing token {was['fencing_token']}")
    line = f"lock {key} force-released by {who_am_i()}: it was {holder}{passed}"
    audit(line)
    return Forced.RELEASED, line


def _force_on_quorum(target: Target, key: str, task: str, expected: str) -> tuple[Forced, str]:
    """A quorum: the key deleted on every member that has it, whatever the majority says."""
    row = read_one(target, key, task)
    try:
        status, _value, on, _ = target.server.force_release(key, expected)
    except LockError as exc:
        fail(str(exc))
    if status is not Forced.RELEASED or row is None:
        gone = "changed hands since it was shown" if status is Forced.CHANGED_HANDS else "is gone"
        return status, f"lock {key} {gone}: " \
                       "nothing released"
    line = (f"lock {key} force-released on {on} of {len(target.nodes)} members by {who_am_i()}: it was "
            f"{describe(row)}")
    audit(line)
    return Forced.RELEASED, line
