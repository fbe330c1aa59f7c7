"""The app that tests/topologies/test_slot_failover.py's real ``celery worker`` subprocesses run: slot waiters
(``lock_wait_in_slot``) whose lock Redis is a Sentinel deployment that fails over.

Broker (db 0), results (db 1) and the journal (db 3) on CSL_REDIS_URL_BASE (a plain private Redis);
the LOCKS on the Sentinel deployment named by CSL_LOCK_URL (``sentinel://...;...``) with the master
name CSL_MASTER_NAME, and ``singleton_lock_min_replicas`` from CSL_MIN_REPLICAS.
Bodies journal each start and end (apps/_slot_journal.py), so the tests count runs per call and
check that no two bodies of one key overlapped.
"""

from __future__ import annotations

import os

import redis
from celery import Celery

from apps._slot_journal import journal_deliveries, run_body
from celery_singleton_lock import LockedTask

BASE = os.environ.get("CSL_REDIS_URL_BASE", "redis://127.0.0.1:6399")
LOCK_URL = os.environ.get("CSL_LOCK_URL", f"{BASE}/2")

app = Celery("slot_failover_app", broker=f"{BASE}/0", backend=f"{BASE}/1")
app.conf.update(
    singleton_lock_url=LOCK_URL,
    singleton_lock_ttl=6.0,
    singleton_lock_retry_backoff=0.3,
    singleton_lock_retry_backoff_max=1.0,
    singleton_lock_max_retries=40,
    worker_prefetch_multiplier=1,
    result_expires=None,
    broker_transport_options={"unacked_restore_interval": 1, "unacked_restore_throttle": 1,
                              "visibility_timeout": 3600},
)
if LOCK_URL.startswith("sentinel://"):
    app.conf.singleton_lock_transport_options = {"master_name": os.environ.get("CSL_MASTER_NAME", "mymaster")}
if os.environ.get("CSL_MIN_REPLICAS"):
    app.conf.singleton_lock_min_replicas = int(os.environ["CSL_MIN_REPLICAS"])
    app.conf.singleton_lock_replica_timeout = 0.5

journal = redis.Redis.from_url(f"{BASE}/3")
journal_deliveries(journal)


@app.task(base=LockedTask, bind=True, lock_key=["key"], on_duplicate="retry", lock_wait_in_slot=5.0)
def slot_long(self, key: str, seconds: float = 0.0, tag: str = "", gate: str = "") -> dict:
    """Waits up to 5 s (the most allowed) in its worker slot. ``gate``: the body ends only once the
    journal has that key (the test decides when the holder releases)."""
    return run_body(journal, self, key, seconds, tag, gate)
