"""Stock deduction, twice: as a plain task (loses updates) and as a LockedTask (exact).

Both tasks run the same non-atomic read-modify-write on a stock counter: GET
the stock, pause a little (a real app would call a service or a database
here), SET the stock minus the quantity. Two executions for one SKU that
overlap both read the same value, and one deduction is lost. The locked task
takes a lock per SKU (``lock_key=["sku"]``), so executions for one SKU never
overlap, while different SKUs still run in parallel. A duplicate waits its turn
(``on_duplicate="retry"``): it parks in the SKU's line, holding no worker slot,
and the holder's release hands it the lock, first come first served. Every
setting is the default: no back-off to tune.

Everything lives on one Redis, given as a base URL without a database number
in ``$INVENTORY_REDIS_URL`` (``demo.py`` starts a private one and sets it):
db 0 broker, db 1 results, db 2 locks, db 3 the stock and the demo's counters.

    INVENTORY_REDIS_URL=redis://127.0.0.1:6390 celery -A app worker -c 4
"""

from __future__ import annotations

import logging
import os
import time

import redis
from celery import Celery
from celery.signals import after_setup_logger

from celery_singleton_lock import LockedTask, duplicate_skipped

BASE = os.environ.get("INVENTORY_REDIS_URL", "").rstrip("/")
if not BASE:
    raise RuntimeError(
        "set INVENTORY_REDIS_URL to a Redis of your own without a database number, "
        "e.g. redis://127.0.0.1:6390 (examples/inventory/demo.py starts a private one and sets it)"
    )

PAUSE = float(os.environ.get("INVENTORY_PAUSE", "0.005"))
"""Seconds between the read and the write: the race window."""

app = Celery("inventory", broker=f"{BASE}/0", backend=f"{BASE}/1")
app.conf.update(
    singleton_lock_url=f"{BASE}/2",
    broker_connection_retry_on_startup=True,
    result_expires=3600,
)

store = redis.Redis.from_url(f"{BASE}/3")


def stock_key(kind: str, sku: str) -> str:
    return f"stock:{kind}:{sku}"


def deduct(kind: str, sku: str, qty: int) -> int:
    """The shared body: a read-modify-write that is NOT atomic on purpose."""
    key = stock_key(kind, sku)
    stock = int(store.get(key) or 0)  # read
    time.sleep(PAUSE)  # ...think...
    store.set(key, stock - qty)  # write: whatever happened meanwhile is overwritten
    return stock - qty


@app.task(name="inventory.deduct_plain")
def deduct_plain(sku: str, qty: int) -> int:
    return deduct("plain", sku, qty)


@app.task(name="inventory.deduct_locked", base=LockedTask, lock_key=["sku"], on_duplicate="retry")
def deduct_locked(sku: str, qty: int) -> int:
    return deduct("locked", sku, qty)


@duplicate_skipped.connect
def count_duplicate(sender=None, policy=None, **_):
    """Count duplicates per policy ("retry" here: each one waited in line once), for the demo's table."""
    store.hincrby("duplicates", policy or "?", 1)


@after_setup_logger.connect
def quiet_logs(**_):
    """One line per task and per retry would only slow the demo down."""
    for name in ("celery.app.trace", "celery.worker.strategy", "celery_singleton_lock"):
        logging.getLogger(name).setLevel(logging.WARNING)
