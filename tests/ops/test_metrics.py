"""Prometheus metrics from a real prefork worker (examples/metrics/app.py), scraped over HTTP.

The worker runs with PROMETHEUS_MULTIPROC_DIR, so the figures of its pool children are
added up by the main process's /metrics. Tasks, a skipped duplicate and a waiting one are sent;
the scrape must show exactly those counts.
"""

from __future__ import annotations

import os
import re
import urllib.request
import uuid

import pytest
from celery import Celery
from celery.exceptions import TaskRevokedError

from celery_singleton_lock.testing.servers import WorkerProcess, free_port, wait_until

pytest.importorskip("prometheus_client")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "metrics")

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        return reply.read().decode()


def value(text: str, name: str, **labels: str) -> float:
    """The sample ``name{labels}`` (labels matched as a subset), 0 if absent."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(r"^(\w+)(?:\{(.*)\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total


def test_metrics_of_a_prefork_worker_add_up_across_its_children(redis_server, tmp_path):
    port = free_port()
    multiproc = tmp_path / "prom"
    multiproc.mkdir()
    base = f"redis://127.0.0.1:{redis_server.port}"
    for db in (1, 2):
        redis_server.client(db).flushdb()  # our private server only
    env = {
        "METRICS_REDIS_URL": base, "METRICS_PORT": str(port), "PROMETHEUS_MULTIPROC_DIR": str(multiproc),
        "PYTHONPATH": os.pathsep.join([EXAMPLE, ROOT]),
    }
    queue = f"metrics-{uuid.uuid4().hex[:8]}"
    worker = WorkerProcess("app", pool="prefork", concurrency=4, env=env, cwd=EXAMPLE,
                           logfile=str(tmp_path / "worker.log"), extra=("-Q", queue))
    client = Celery("metrics_client", broker=f"{base}/0", backend=f"{base}/1", set_as_current=False)
    deduct, refresh = client.signature("app.deduct"), client.signature("app.refresh")
    with worker:
        worker.wait_ready(60)
        wait_until(lambda: _up(port), 20, 0.1, "/metrics to answer")
        sku = f"sku-{uuid.uuid4().hex[:6]}"
        # 3 deductions on distinct SKUs, then a slow holder with one waiter and one skipped duplicate
        for i in range(3):
            assert deduct.clone((f"{sku}-{i}",)).apply_async(queue=queue).get(timeout=30) == f"{sku}-{i}"
        holder = refresh.clone((sku, 1.5)).apply_async(queue=queue)
        wait_until(lambda: redis_server.client(2).keys("*app.refresh*"), 20, 0.02, "the holder's lock")
        skipped = refresh.clone((sku, 0.0)).apply_async(queue=queue)
        waiter_holder = deduct.clone((sku, 3.0)).apply_async(queue=queue)  # long enough for the waiter to meet it
        wait_until(lambda: redis_server.client(2).keys("*app.deduct*"), 20, 0.02, "the second holder's lock")
        waiter = deduct.clone((sku, 0.0)).apply_async(queue=queue)
        assert holder.get(timeout=30) == sku
        assert waiter_holder.get(timeout=30) == sku and waiter.get(timeout=30) == sku
        with pytest.raises(TaskRevokedError):
            skipped.get(timeout=30)
        # every lock is released: the gauge is back at 0 once the last release was counted
        text = wait_until(lambda: (t := scrape(port)) and value(t, "celery_singleton_lock_acquired_total") >= 6
                          and value(t, "celery_singleton_lock_locks_held") == 0 and t, 20, 0.1, "the figures")
    acquired = value(text, "celery_singleton_lock_acquired_total")
    assert acquired == 6  # 3 deductions + holder + second holder + the waiter, in several processes
    assert value(text, "celery_singleton_lock_acquired_total", task="app.deduct") == 5
    assert value(text, "celery_singleton_lock_duplicates_total", task="app.refresh", policy="skip") == 1
    assert value(text, "celery_singleton_lock_duplicates_total", task="app.deduct", policy="retry") == 1
    assert value(text, "celery_singleton_lock_hold_seconds_count") == 6
    assert value(text, "celery_singleton_lock_hold_seconds_sum", task="app.refresh") >= 1.5
    assert value(text, "celery_singleton_lock_wait_seconds_count", task="app.deduct") == 1
    assert value(text, "celery_singleton_lock_wait_seconds_sum", task="app.deduct") > 0
    assert value(text, "celery_singleton_lock_lost_total") == 0


def _up(port: int) -> bool:
    try:
        scrape(port)
        return True
    except OSError:
        return False


def test_reason_categories_have_few_values():
    from celery_singleton_lock.metrics import reason_category

    assert reason_category("no longer the owner (expired, deleted or taken)") == "not_owner"
    assert reason_category("not confirmed by its deadline (ttl 3s ...)") == "deadline"
    assert reason_category("found at release: the key had expired") == "at_release"
    assert reason_category("anything else") == "other"
