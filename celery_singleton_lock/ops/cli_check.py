"""``celery -A proj locks check``: the deploy pipeline's check, in the manner of ``django check``.

Importing a tasks module checks nothing (``@app.task`` returns a lazy proxy until the app is
finalized), so a leftover option would first fail in a live process, at its first ``.delay()``. This
command does what a worker does at start, and looks at the lock server, then prints one line per
problem (``error: ...`` or ``warning: ...``) and exits 1 if any is an error, 0 otherwise:

* the app's task modules import, the app finalizes, and every LockedTask's options resolve;
* every ``singleton_lock_*`` setting is one we read, and the settings resolve;
* each lock server (every master of a Cluster, every member of a quorum) answers; Redis is 6.2 or
  newer; ``maxmemory-policy`` is ``noeviction`` (an evicted lock is a lost lock); it persists its
  data (a warning if not: a restart empties every line, and parked calls are sent again, at least
  once); it has the replicas ``singleton_lock_min_replicas`` asks for.

Exit status 2, as for every command, when no app is given.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import click

from ..delivery import config, options
from ..delivery.task import LockedTask
from ..engine.addresses import redact_url
from ..topologies import servers
from .base import fail, locks
from .nodes import nodes_of

OLDEST_REDIS = (6, 2)
"""The oldest Redis (or Valkey) the package is tested on."""

Problem = tuple[str, str]
"""("error" or "warning", what is wrong and what to do)."""


@locks.command(name="check")
@click.pass_context
def check(ctx: click.Context) -> None:
    """Check the app's LockedTasks, its settings and its lock server before a deploy.

    One line per problem; exit status 1 if any is an error, else 0."""
    root = ctx.find_root()
    if "app" in root.params and root.params["app"] is None and not root.params.get("config"):
        fail("no app given: pass the one your workers run, as in `celery -A proj locks check`")
    problems = list(app_problems(ctx.obj.app))
    try:
        settings = config.app_settings(ctx.obj.app)
    except ValueError:
        settings = None  # (app_problems reported it: without settings there is no server to look at)
    if settings is not None:
        problems += list(server_problems(settings))
    for level, what in problems:
        click.echo(f"{level}: {what}")
    errors = sum(level == "error" for level, _ in problems)
    warnings = len(problems) - errors
    click.echo(f"{errors} error(s), {warnings} warning(s)" if problems else "no problems found")
    ctx.exit(1 if errors else 0)


def app_problems(app: Any) -> Iterator[Problem]:
    """The app's side: its modules, its LockedTasks' options, its settings."""
    try:
        app.loader.import_default_modules()
    except Exception as exc:
        yield "error", f"cannot import the app's task modules: {type(exc).__name__}: {exc}"
        return
    try:
        app.finalize(auto=True)  # where a LockedTask's options are checked
    except ValueError as exc:
        yield "error", str(exc)
        return
    count = 0
    for name, task in sorted(app.tasks.items()):
        if isinstance(task, LockedTask):
            count += 1
            try:
                task.lock_settings()
            except ValueError as exc:
                yield "error", f"task {name}: {exc}"
    if not count:
        yield "warning", "the app has no LockedTask: nothing takes a lock (is the app the one the workers run?)"
    try:
        names = list(app.conf.keys())
    except Exception:  # an exotic conf object
        names = []
    for line in options.unknown_settings(names):
        yield "warning", line
    try:
        config.app_settings(app)
    except ValueError as exc:
        yield "error", f"the settings: {exc}"


def server_problems(settings: config.LockSettings) -> Iterator[Problem]:
    """The lock server's side, node by node."""
    url = redact_url(settings.url)
    try:
        server = servers.from_settings(
            settings.url, transport_options=settings.transport_options, redis_options=settings.redis_options,
            min_replicas=settings.min_replicas, replica_timeout=settings.replica_timeout,
        )
    except (ValueError, TypeError, ImportError) as exc:
        yield "error", f"cannot use the lock server URL {url}: {exc}"
        return
    try:
        nodes, _ = nodes_of(server)
        if not nodes:  # no Redis server to look at (etcd): whether it answers is what there is to check
            try:
                server.holder("celery-locks-check")
            except Exception as exc:
                yield "error", f"the lock server {url} does not answer: {exc}"
        for node in nodes:
            yield from node_problems(node.label, node.client, settings.min_replicas)
    finally:
        server.close()


def node_problems(label: str, client: Any, min_replicas: int) -> Iterator[Problem]:
    """One Redis: it answers, its version, its eviction policy, its persistence, its replicas."""
    where = f"lock Redis {redact_url(label)}"
    try:
        info = client.info()
    except Exception as exc:
        yield "error", f"{where} does not answer: {exc}"
        return
    version = str(info.get("valkey_version") or info.get("redis_version") or "0")
    if tuple(int(p) for p in version.split(".")[:2] if p.isdigit()) < OLDEST_REDIS:
        yield "error", f"{where} is version {version}: the oldest supported is 6.2"
    policy = info.get("maxmemory_policy")
    if policy is None:
        try:
            policy = client.config_get("maxmemory-policy").get("maxmemory-policy")
        except Exception:  # a managed Redis may refuse CONFIG
            policy = None
    if policy is None:
        yield "warning", f"{where}: its maxmemory-policy could not be read; it must be noeviction"
    elif policy != "noeviction":
        yield "error", (f"{where} has maxmemory-policy {policy}: under memory pressure it may evict a held lock "
                        "(a second holder could then run); set it to noeviction")
    if not int(info.get("aof_enabled", 0)) and not _saves(client):
        yield "warning", (f"{where} keeps no data on disk (no AOF, no RDB save points): a restart empties every "
                          "lock and line; parked calls are then sent again (at least once; exactly once with a "
                          "result backend)")
    if min_replicas:
        replicas = int(info.get("connected_slaves", 0))
        if replicas < min_replicas:
            yield "error", (f"{where} has {replicas} connected replica(s), and singleton_lock_min_replicas is "
                            f"{min_replicas}: every acquire would fail as unreplicated")


def _saves(client: Any) -> bool:
    """Whether RDB save points are set (INFO does not say; CONFIG may be refused: then assume so)."""
    try:
        save = client.config_get("save").get("save")
    except Exception:
        return True
    return bool(save)
