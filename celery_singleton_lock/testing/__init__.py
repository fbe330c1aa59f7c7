"""Test helpers for users' suites and ours: private redis-servers and worker processes (``servers``),
and our signals as events (``events``).

``from celery_singleton_lock.testing import RedisServer, WorkerProcess, wait_until`` keeps working:
the helpers of ``servers`` are found here on first use (PEP 562), so importing ``testing.events``
(the pytest plugin does) does not load the server machinery.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .servers import Monitor, RedisServer, WorkerProcess, find_redis_server, free_port, wait_until

__all__ = ["find_redis_server", "free_port", "wait_until", "RedisServer", "Monitor", "WorkerProcess"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import servers

        return getattr(servers, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
