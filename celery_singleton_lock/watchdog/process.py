"""The one watchdog of this process: created on first use, again after a fork (a forked child does
not inherit its parent's thread, nor its parent's locks to renew), stopped with the worker process.
"""

from __future__ import annotations

import logging
import os
import threading

from .renewer import Watchdog

logger = logging.getLogger("celery_singleton_lock.watchdog")

_lock = threading.Lock()
_watchdog: Watchdog | None = None
_conflicts_warned: set[tuple[tuple[str, float | int], ...]] = set()


def current_watchdog() -> Watchdog | None:
    """This process's watchdog if one was created here (never creates it, unlike get_watchdog)."""
    wd = _watchdog
    return wd if wd is not None and wd.pid == os.getpid() else None


def get_watchdog(**options: float | int) -> Watchdog:
    """The watchdog of this process, created on first use (and anew after a fork or a shutdown).

    ``options`` (``tick``, ``chunk``, ``socket_timeout``) apply when it is
    created. Asking for other options later logs one WARNING (per set of
    options) and returns the existing one: a process has one watchdog.
    """
    global _watchdog
    wd = _watchdog
    if wd is None or wd.pid != os.getpid() or wd._stopping:
        with _lock:
            if _watchdog is None or _watchdog.pid != os.getpid() or _watchdog._stopping:
                _watchdog = Watchdog(**options)  # type: ignore[arg-type]
                return _watchdog
            wd = _watchdog
    if options and any(wd.options[name] != value for name, value in options.items()):
        wanted = tuple(sorted(options.items()))
        if wanted not in _conflicts_warned:
            _conflicts_warned.add(wanted)
            logger.warning(
                "celery-singleton-lock: this process's watchdog already runs with %s; %s are ignored "
                "(one watchdog per process: give every app the same singleton_lock_watchdog_* settings)",
                wd.options, dict(options),
            )
    return wd


def shutdown_watchdog(timeout: float = 5.0) -> None:
    """Stop and join this process's watchdog, if it has one."""
    wd = _watchdog
    if wd is not None and wd.pid == os.getpid():
        wd.shutdown(timeout)


def _forget_parent_watchdog() -> None:
    # The parent's thread does not exist in a forked child, and its locks are
    # not the child's to renew: the child starts afresh on its first acquire.
    global _watchdog, _lock
    _watchdog = None
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_parent_watchdog)
