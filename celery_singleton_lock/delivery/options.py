"""Options and settings that are not ours: refused or reported, never silently ignored.

Celery turns every keyword of ``@app.task(...)`` into a class attribute and
never complains about one it does not know. So ``lock_tll=5`` (a typo) or
``unique_on=["sku"]`` (celery-singleton's option, copied across) would leave
the task on the defaults: a TTL of 30 s and every argument in its key, which
silently widens the key. Here:

* a task option that looks like ours (``lock_*``, ``on_duplicate*``) but is
  not one fails when the task is defined, naming the closest known option;
* an option of celery-once, celery-singleton or celery-heimdall fails the same way, naming
  ours and pointing to the migration guide;
* an unknown ``singleton_lock_*`` app setting is logged as a WARNING at worker
  start, with the closest known name (a setting may be meant for a newer
  release in a rolling deploy, so it does not stop the worker).
"""

from __future__ import annotations

import difflib
import inspect
import logging
from collections.abc import Iterable
from typing import Any

from celery.signals import worker_ready

from .config import OPTIONS, SETTINGS

logger = logging.getLogger("celery_singleton_lock")

MIGRATION = "see the migration guide: https://celery-singleton-lock.github.io/celery-singleton-lock/migration/"

PEER_OPTIONS: dict[str, str] = {
    "once": "celery-once's option: it refuses at publish, as lock_publish does: lock_publish='raise' is its "
            "default (AlreadyQueued), lock_publish='join' its graceful mode (the pending call's AsyncResult); "
            "lock_key=[...] are its keys; its timeout is not lock_ttl (ours is renewed while the task runs)",
    "unique_on": "celery-singleton's option: use lock_key=[...] (the argument names to key on)",
    "raise_on_duplicate": "celery-singleton's option: use on_duplicate='raise'",
    "lock_expiry": "celery-singleton's option: use lock_ttl (how long the lock lives without renewal, renewed "
                   "every third of it while the task runs; not the longest run)",
    "heimdall": "celery-heimdall's option: its unique=True is our default (on_duplicate='skip'), or "
                "lock_publish='raise' to refuse at publish; its key is lock_key, its unique_timeout is not lock_ttl",
}
"""Other libraries' task options -> what to write instead."""

TASK_OPTIONS: frozenset[str] = frozenset({*OPTIONS, "lock_key"})
"""Every lock option a task may set (the rest of LockedTask's lock_* names are its own API)."""


def check_unknown_options(task_name: str, task_cls: type, base: type) -> None:
    """Fail on an attribute of ``task_cls`` (set below ``base``, LockedTask) that looks like a lock
    option and is none, or is another library's option. Methods and properties are the user's
    own code, not options."""
    known = TASK_OPTIONS | {name for klass in base.__mro__ for name in vars(klass)}
    for klass in task_cls.__mro__:
        if klass in base.__mro__:
            continue
        for name, value in vars(klass).items():
            if name in known or _is_code(value):
                continue
            where = f"task {task_name!r}: option {name}={value!r}"
            if name in PEER_OPTIONS:
                raise ValueError(f"{where} is {PEER_OPTIONS[name]} ({MIGRATION})")
            if name.startswith(("lock_", "on_duplicate")):
                raise ValueError(f"{where} is not an option of celery-singleton-lock; "
                                 f"{_closest(name, sorted(TASK_OPTIONS))}")


def unknown_settings(names: Iterable[str]) -> list[str]:
    """One line per ``singleton_lock_*`` setting in ``names`` that we do not read."""
    out = []
    for name in sorted({str(n).lower() for n in names}):
        bare = name[len("celery_"):] if name.startswith("celery_singleton_lock_") else name  # Django's namespace
        if bare.startswith("singleton_lock_") and bare not in SETTINGS:
            out.append(f"unknown setting {name}: ignored; {_closest(bare, sorted(SETTINGS))}")
    return out


def _closest(name: str, known: list[str]) -> str:
    match = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f"did you mean {match[0]}?" if match else f"the known ones: {', '.join(known)}"


def _is_code(value: Any) -> bool:
    return inspect.isfunction(value) or isinstance(value, (staticmethod, classmethod, property))


@worker_ready.connect(weak=False)
def _warn_unknown_settings(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None)
    if app is None:
        return
    try:
        names = list(app.conf.keys())
    except Exception:  # an exotic conf object: nothing to report
        return
    for line in unknown_settings(names):
        logger.warning("celery-singleton-lock: %s", line)
