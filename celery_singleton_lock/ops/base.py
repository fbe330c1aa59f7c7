"""What every ``celery locks`` command shares: the group, the app's lock server as its workers find
it (:class:`Target`), one-line errors (exit status 2), and the audit line of a change.

The commands themselves are in cli.py (list, show, key, release) and cli_line.py (line, drop);
each registers on the group defined here, so neither imports the other's module but cli.py,
which imports cli_line.py to register it (the ``celery.commands`` entry point is cli.py's group).
"""

from __future__ import annotations

import difflib
import getpass
import logging
import os
import socket
from dataclasses import dataclass
from typing import Any, NoReturn

import click
from redis.exceptions import RedisError

from ..delivery import config
from ..delivery.task import LockedTask
from ..engine.addresses import redact_url
from ..engine.backend import LockBackend
from ..exceptions import LockError
from ..topologies import servers
from .nodes import Node, nodes_of
from .survey import parse_key

logger = logging.getLogger("celery_singleton_lock")


class CliError(click.ClickException):
    """A one-line error, exit status 2: a bad key or argument, or a lock Redis we cannot use."""

    exit_code = 2


def fail(message: str) -> NoReturn:
    raise CliError(message)


# -- keys ------------------------------------------------------------------------------


@dataclass
class Target:
    """Where the app's locks live, as the workers find them."""

    app: Any
    server: LockBackend
    url: str
    prefixes: tuple[str, ...]
    tasks: dict[str, LockedTask]
    nodes: list[Node]
    """Every server to read (each master of a Cluster, each member of a quorum: see nodes.py)."""
    majority: int = 0
    """A quorum's majority (its verdict decides whether a key is held); 0 for any other topology."""

    def run(self, what: Any, client: Any = None) -> Any:
        """Run ``what(client)`` (the lock server's own client by default), turning Redis errors into
        one-line errors (exit status 2)."""
        try:
            return what(client if client is not None else self.server.client)
        except RedisError as exc:
            fail(str(self.server.error(exc, "")))
        except LockError as exc:
            fail(str(exc))

    def task_of(self, key: str) -> str:
        try:
            return parse_key(key, self.prefixes)
        except ValueError as exc:
            fail(str(exc))


def open_target(ctx: click.Context) -> Target:
    """The app's lock Redis, prefixes and LockedTasks (its task modules imported, as a worker does)."""
    root = ctx.find_root()
    if "app" in root.params and root.params["app"] is None and not root.params.get("config"):
        # Celery's default app has no broker, no tasks: every later error would mislead
        rest = ctx.command_path[len(root.command_path):].strip()  # "locks list", however celery was started
        fail(f"no app given: pass the one your workers run, as in `celery -A proj {rest}` (proj: the module or "
             "package holding your Celery app), or set CELERY_APP=proj")
    app = ctx.obj.app
    try:
        app.loader.import_default_modules()
    except Exception as exc:
        fail(f"cannot import the app's task modules: {type(exc).__name__}: {exc}")
    try:
        settings = config.app_settings(app)  # as the workers resolve theirs
    except ValueError as exc:
        fail(str(exc))
    prefixes = {settings.prefix}
    tasks: dict[str, LockedTask] = {}
    for name, task in sorted(app.tasks.items()):
        if not isinstance(task, LockedTask):
            continue
        tasks[name] = task
        try:
            prefixes.add(task.lock_settings().prefix)
        except ValueError as exc:
            click.echo(f"warning: task {name}: {exc} (its own lock_prefix, if any, is not looked at)", err=True)
    try:  # one Redis, Sentinel, Cluster or quorum, as the workers build it (min_replicas included)
        server = servers.from_settings(
            settings.url, transport_options=settings.transport_options, redis_options=settings.redis_options,
            min_replicas=settings.min_replicas, replica_timeout=settings.replica_timeout,
        )
    except (ValueError, TypeError) as exc:
        fail(f"cannot use the lock Redis URL {redact_url(settings.url)}: {exc}")
    nodes, majority = nodes_of(server)
    return Target(app, server, server.url, tuple(sorted(prefixes)), tasks, nodes, majority)


def resolve_task(target: Target, name: str) -> str:
    """The LockedTask ``name`` means: its full name, or the last part of exactly one task's name
    (``deduct`` for ``proj.tasks.deduct``). Else exit 2 naming the close matches, so a typo never
    reads as "no locks held"."""
    if name in target.tasks:
        return name
    if name in target.app.tasks:
        fail(f"task {name!r} is not a LockedTask: it takes no lock")
    by_last: dict[str, list[str]] = {}
    for known in target.tasks:
        by_last.setdefault(known.rsplit(".", 1)[-1], []).append(known)
    if len(by_last.get(name, ())) == 1:
        full: str = by_last[name][0]
        click.echo(f"(task {name!r} is {full})", err=True)
        return full
    close = list(by_last.get(name, []))
    close += [full for last, fulls in by_last.items() if name in last for full in fulls]  # "deduct": deduct_locked
    close += difflib.get_close_matches(name, list(target.tasks), n=5, cutoff=0.6)
    for last in difflib.get_close_matches(name, list(by_last), n=5, cutoff=0.6):
        close += by_last[last]
    close = list(dict.fromkeys(close))
    where = f"no task named {name!r} in app {target.app.main!r}"
    if close:
        fail(f"{where}: did you mean {', '.join(close)}?")
    names = list(target.tasks)
    shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
    fail(f"{where} (its LockedTasks: {shown or 'none'})")


@click.group(name="locks")
@click.pass_context
def locks(ctx: click.Context) -> None:
    """celery-singleton-lock: list, explain and force-release the app's locks.

    Uses the app's settings (celery -A proj locks ...): the same lock Redis and
    prefixes as its workers. Exit status: 0 done, 1 no such lock, 2 a bad key or
    argument, or the lock Redis misconfigured or unreachable.
    """



def who_am_i() -> str:
    """user@host (pid N): who force-released a lock, for the log."""
    try:
        user = getpass.getuser()
    except Exception:  # no name for this uid (a container)
        user = f"uid {os.getuid()}" if hasattr(os, "getuid") else "unknown"
    return f"user {user} on host {socket.gethostname()} (pid {os.getpid()})"



def audit(line: str) -> None:
    """The force-release's WARNING line on logger celery_singleton_lock: where the app's logging
    sends it, else to stderr as a dated log line (not Python's bare last-resort message)."""
    if logger.hasHandlers():
        logger.warning("%s", line)
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[%(asctime)s: %(levelname)s/%(name)s] %(message)s"))
    logger.addHandler(handler)
    try:
        logger.warning("%s", line)
    finally:
        logger.removeHandler(handler)

