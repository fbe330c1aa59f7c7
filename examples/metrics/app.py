"""A worker that exposes Prometheus metrics of its locks on /metrics.

    cd examples/metrics
    mkdir -p /tmp/csl-metrics && rm -f /tmp/csl-metrics/*
    PROMETHEUS_MULTIPROC_DIR=/tmp/csl-metrics METRICS_REDIS_URL=redis://127.0.0.1:6390 \\
        celery -A app worker -c 2
    curl -s localhost:9808/metrics | grep celery_singleton_lock_

Under prefork the locks live in the pool's children: PROMETHEUS_MULTIPROC_DIR
(an empty directory of this worker's own) makes every process write its
figures there, and the main process serves their sum. See
celery_singleton_lock/metrics.py for what is measured.
"""

from __future__ import annotations

import os
import time

from celery import Celery
from celery.signals import worker_init

from celery_singleton_lock import LockedTask, metrics

BASE = os.environ.get("METRICS_REDIS_URL", "").rstrip("/")
if not BASE:
    raise RuntimeError("set METRICS_REDIS_URL to a Redis of your own without a database number")
PORT = int(os.environ.get("METRICS_PORT", "9808"))

app = Celery("metrics_example", broker=f"{BASE}/0", backend=f"{BASE}/1")
app.conf.update(singleton_lock_url=f"{BASE}/2", broker_connection_retry_on_startup=True)

metrics.install()  # every process: the main one and each pool child


@worker_init.connect
def serve_metrics(**_):
    """The main process serves /metrics: the sum over all of this worker's processes."""
    metrics.start_http_server(PORT, addr="127.0.0.1")


@app.task(base=LockedTask, bind=True, lock_key=["sku"], on_duplicate="retry")
def deduct(self, sku: str, seconds: float = 0.0) -> str:
    time.sleep(seconds)
    return sku


@app.task(base=LockedTask, bind=True, lock_key=["sku"], on_duplicate="skip")
def refresh(self, sku: str, seconds: float = 0.0) -> str:
    time.sleep(seconds)
    return sku
