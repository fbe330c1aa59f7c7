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

from apps._slot_journal import run_body, slot_app
from celery_singleton_lock import LockedTask

app, journal = slot_app("slot_failover_app", singleton_lock_ttl=6.0, singleton_lock_retry_backoff=0.3,
                        singleton_lock_max_retries=40)
if app.conf.singleton_lock_url.startswith("sentinel://"):
    app.conf.singleton_lock_transport_options = {"master_name": os.environ.get("CSL_MASTER_NAME", "mymaster")}
if os.environ.get("CSL_MIN_REPLICAS"):
    app.conf.singleton_lock_min_replicas = int(os.environ["CSL_MIN_REPLICAS"])
    app.conf.singleton_lock_replica_timeout = 0.5


@app.task(base=LockedTask, bind=True, lock_key=["key"], on_duplicate="retry", lock_wait_in_slot=5.0)
def slot_long(self, key: str, seconds: float = 0.0, tag: str = "", gate: str = "") -> dict:
    """Waits up to 5 s (the most allowed) in its worker slot. ``gate``: the body ends only once the
    journal has that key (the test decides when the holder releases)."""
    return run_body(journal, self, key, seconds, tag, gate)
