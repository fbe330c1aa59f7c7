"""Liveness: one thread per process renews every lock the process holds.

``wheel`` is the timer wheel's bookkeeping, ``renewer`` the thread that renews on a tick,
in batches, and declares a lock lost at its deadline (etcd's Session: liveness kept apart
from exclusion).
"""

from .process import get_watchdog, shutdown_watchdog
from .renewer import Watchdog

__all__ = ["Watchdog", "get_watchdog", "shutdown_watchdog"]
