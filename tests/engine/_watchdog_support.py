"""The watchdog tests' shared helpers (tests/engine/test_watchdog*.py): the renewal and release
scripts' SHAs, the slack allowed a loaded machine, the loggers, the renewals a MONITOR saw, a server
made to answer late (:class:`SlowRedis`), and whether a lock is still its owner's. Their fixtures
(``server``, ``wd``) are in engine/conftest.py."""

from __future__ import annotations

import hashlib
import threading
import time

from celery_singleton_lock.engine.lock import Lock
from celery_singleton_lock.engine.scripts import RELEASE, RENEW_MANY
from celery_singleton_lock.testing.servers import Monitor, RedisServer, wait_until

RENEW_SHA = hashlib.sha1(RENEW_MANY.encode()).hexdigest()
RELEASE_SHAS = {hashlib.sha1(RELEASE.encode()).hexdigest()}
SLACK = 1.0  # seconds of scheduling noise we tolerate on a loaded machine (never a speed claim)
WD_LOGGER = "celery_singleton_lock.watchdog"
LOST_LOGGER = "celery_singleton_lock"  # the ERROR line of a loss: the handle logs it, wherever it was found


def renewals(mon: Monitor, key: str | None = None) -> list[tuple[float, list[str]]]:
    """(server time, keys) of every renewal EVALSHA the monitor saw, optionally only those naming ``key``."""
    mon.sync()
    out = []
    for when, _db, words, _client in list(mon._records):  # the records keep MONITOR's timestamps
        if len(words) > 3 and words[0].upper() == "EVALSHA" and words[1] == RENEW_SHA:
            keys = words[3 : 3 + int(words[2])]
            if key is None or key in keys:
                out.append((when, keys))
    return out


BUSY_SCRIPT = "local n = 0 for i = 1, tonumber(ARGV[1]) do n = n + i end return 1"


class SlowRedis:
    """Make a server answer late: a busy script of ``busy`` seconds every ``every`` seconds."""

    def __init__(self, server: RedisServer, busy: float = 0.06, every: float = 0.15) -> None:
        self.client = server.client(2)
        self.busy, self.every = busy, every
        turns = 1_000_000
        started = time.perf_counter()
        self.client.eval(BUSY_SCRIPT, 0, turns)  # the server's speed, measured first
        self.turns = max(1, int(turns * busy / max(time.perf_counter() - started, 1e-6)))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.client.eval(BUSY_SCRIPT, 0, self.turns)

    def __enter__(self) -> SlowRedis:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self.client.close()


def owns(redis_client, lock: Lock) -> bool:
    value = redis_client.get(lock.key)
    return value is not None and value.decode().startswith(lock.prefix)


def renewed_after(lock: Lock, since: float, timeout: float) -> None:
    wait_until(lambda: lock.confirmed_at > since, timeout, what=f"a renewal of {lock.key}")
