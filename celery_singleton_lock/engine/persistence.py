"""Does the lock Redis keep its data across a restart? Checked once per server and process.

A waiting line lives in the lock Redis. On a Redis that forgets on restart (no AOF, no RDB
snapshots) every restart is a data loss: parked tasks are then sent again from the memory of
the processes that parked them, and one whose process died meanwhile is lost. So a worker says
so at start. ``CONFIG`` may be disabled or renamed (managed Redis): then nothing can be told,
and nothing is said beyond a debug line.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from redis.exceptions import RedisError

from .backend import LockBackend

logger = logging.getLogger("celery_singleton_lock")

_checked: set[str] = set()
_guard = threading.Lock()


def check_once(server: LockBackend) -> bool | None:
    """Warn if ``server`` keeps no data across a restart; True persistent, False not, None unknown."""
    with _guard:
        if server.url in _checked:
            return None
        _checked.add(server.url)
    try:
        verdict = persistent(server.client)
    except Exception as exc:  # never stops a worker from starting
        logger.debug("lock Redis %s: could not read its persistence settings (%r)", server.url, exc)
        return None
    if verdict is False:
        logger.warning(
            "the lock Redis at %s keeps no data across a restart (appendonly no, no save points): "
            "a restart loses every waiting line; parked tasks are sent again only by the processes that "
            "parked them, while they live. Turn on appendonly (or RDB save points) for the lock Redis",
            server.url,
        )
    return verdict


def persistent(client: Any) -> bool | None:
    """From ``CONFIG GET appendonly`` and ``save``; None when CONFIG is not allowed."""
    try:
        aof = client.config_get("appendonly")
        save = client.config_get("save")
    except RedisError:
        return None
    if not isinstance(aof, dict) or not isinstance(save, dict) or "appendonly" not in aof:
        return None  # a cluster client's per-node replies, or a server that does not say
    return str(aof.get("appendonly")).lower() == "yes" or bool(str(save.get("save") or "").strip())
