"""The quorum tests' shared helpers (tests/topologies/test_quorum*.py): fresh key names, a key's
History of grants (checked for overlap and token order), and ``take``, an acquire tried until a
majority grants it. Their fixtures (``masters``, ``quorum``) are in topologies/conftest.py."""

from __future__ import annotations

import threading
import time
import uuid

from celery_singleton_lock import LockBackendUnavailable
from celery_singleton_lock.engine.lock import Lock
from celery_singleton_lock.testing.servers import wait_until
from celery_singleton_lock.topologies.quorum import QuorumLockServer


def name() -> str:
    return f"q-{uuid.uuid4().hex[:10]}"


class History:
    """Grant intervals and tokens of one key's holders, checked for overlap and token order."""

    def __init__(self) -> None:
        self.grants: list[tuple[float, float, int]] = []
        self._lock = threading.Lock()

    def hold(self, lock: Lock, seconds: float) -> None:
        start = time.monotonic()
        time.sleep(seconds)
        lock.ensure()  # still ours by the clock when the hold ends: the interval really was held
        with self._lock:
            self.grants.append((start, time.monotonic(), lock.fencing_token))

    def check(self) -> None:
        ordered = sorted(self.grants)
        for (s1, e1, t1), (s2, e2, t2) in zip(ordered, ordered[1:], strict=False):
            assert e1 <= s2, f"two holders overlapped: [{s1}, {e1}] and [{s2}, {e2}]"
            assert t1 < t2, f"a later holder got a token not above the earlier one's: {t1} then {t2}"


def take(q: QuorumLockServer, key: str, ttl: float = 5.0, deadline: float = 10.0) -> Lock:
    def attempt() -> Lock | None:
        try:
            got = q.acquire(key, ttl)
        except LockBackendUnavailable:
            return None
        return got if isinstance(got, Lock) else None

    return wait_until(attempt, deadline, 0.01, f"{key} to be taken")
