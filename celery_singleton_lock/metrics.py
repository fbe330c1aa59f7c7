"""Prometheus metrics, fed by our signals (optional: ``pip install "celery-singleton-lock[prometheus]"``).

    from celery_singleton_lock import metrics

    metrics.install()                  # in the app module every worker process imports

    @worker_init.connect               # in the worker's main process: serve /metrics
    def serve(**_):
        metrics.start_http_server(9808)

Under prefork the locks live in the pool's children, so their figures must be
added up across processes: run the worker with ``PROMETHEUS_MULTIPROC_DIR``
set to an empty directory of its own (prometheus_client's multiprocess mode).
Every process then writes its figures there, :func:`start_http_server` serves
their sum, and the figures of a child that exits are dropped from the gauge.
Without that variable, each process counts alone (fine for solo and threads).

What is measured (every name starts with ``celery_singleton_lock_``):

=============================  =========  =============================================================
``acquired_total``             counter    locks taken, by ``task``
``duplicates_total``           counter    deliveries that did not run now, by ``task`` and ``policy``
                                          (skip, raise, retry = waited in line, backoff, redelivery)
``lost_total``                 counter    locks lost, by ``task`` and ``reason``: ``not_owner`` (taken,
                                          deleted or expired, found by a renewal), ``deadline`` (not
                                          confirmed in time), ``at_release``
``hold_seconds``               histogram  from acquire to release, by ``task``
``wait_seconds``               histogram  how long a duplicate waited in line before it ran, by ``task``
``renewal_round_seconds``      histogram  the watchdog's renewal round trips (one per server per round)
``locks_held``                 gauge      locks held right now, by ``task`` (summed over live processes)
=============================  =========  =============================================================
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from .delivery.headers import turn_of
from .signals import duplicate_skipped, lock_acquired, lock_lost, lock_released
from .watchdog import rounds as watchdog

PREFIX = "celery_singleton_lock_"

_installed = False
_install_lock = threading.Lock()
_m: dict[str, Any] = {}
_held_since: dict[tuple[str, str], float] = {}


def install() -> None:
    """Create the metrics and connect them to our signals (once per process; safe to call again)."""
    global _installed
    with _install_lock:
        if _installed:
            return
        from prometheus_client import Counter, Gauge, Histogram  # imported here: an optional extra

        _m["acquired"] = Counter(PREFIX + "acquired_total", "Locks taken", ["task"])
        _m["duplicates"] = Counter(
            PREFIX + "duplicates_total", "Deliveries that did not run now, by duplicate policy", ["task", "policy"]
        )
        _m["lost"] = Counter(PREFIX + "lost_total", "Locks lost, by reason", ["task", "reason"])
        _m["hold"] = Histogram(
            PREFIX + "hold_seconds", "Time a lock was held", ["task"],
            buckets=(0.005, 0.025, 0.1, 0.5, 1, 5, 30, 120, 600, 3600),
        )
        _m["wait"] = Histogram(
            PREFIX + "wait_seconds", "Time a duplicate waited in line before it ran", ["task"],
            buckets=(0.005, 0.025, 0.1, 0.5, 1, 5, 30, 120, 600, 3600),
        )
        _m["round"] = Histogram(
            PREFIX + "renewal_round_seconds", "The watchdog's renewal round trips",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1),
        )
        _m["held"] = Gauge(PREFIX + "locks_held", "Locks held now", ["task"], multiprocess_mode="livesum")
        lock_acquired.connect(_on_acquired, weak=False)
        lock_released.connect(_on_released, weak=False)
        duplicate_skipped.connect(_on_duplicate, weak=False)
        lock_lost.connect(_on_lost, weak=False)
        watchdog.ROUND_HOOKS.append(_on_round)
        from celery.signals import worker_process_shutdown

        worker_process_shutdown.connect(_on_process_exit, weak=False)
        _installed = True


def start_http_server(port: int, addr: str = "0.0.0.0") -> Any:
    """Serve /metrics on ``port``: the sum over every process in multiprocess mode, else this process's."""
    import prometheus_client

    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import CollectorRegistry, multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return prometheus_client.start_http_server(port, addr=addr, registry=registry)
    return prometheus_client.start_http_server(port, addr=addr)


def _name(sender: Any) -> str:
    return str(getattr(sender, "name", None) or "?")


def _on_acquired(sender: Any = None, key: str = "", task_id: str = "", **_: Any) -> None:
    task = _name(sender)
    _m["acquired"].labels(task).inc()
    _m["held"].labels(task).inc()
    _held_since[(key, task_id)] = time.monotonic()
    parked_at = turn_of(getattr(getattr(sender, "request", None), "headers", None)).parked_at
    if parked_at is not None:
        _m["wait"].labels(task).observe(max(0.0, time.time() - parked_at))


def _on_released(sender: Any = None, key: str = "", task_id: str = "", **_: Any) -> None:
    task = _name(sender)
    _m["held"].labels(task).dec()
    since = _held_since.pop((key, task_id), None)
    if since is not None:
        _m["hold"].labels(task).observe(time.monotonic() - since)


def _on_duplicate(sender: Any = None, policy: str = "", **_: Any) -> None:
    _m["duplicates"].labels(_name(sender), policy or "?").inc()


def _on_lost(sender: Any = None, reason: str = "", **_: Any) -> None:
    _m["lost"].labels(_name(sender), reason_category(reason)).inc()


def reason_category(reason: str) -> str:
    """A loss reason (free text) as a label with few values."""
    if reason.startswith("found at release"):
        return "at_release"
    if reason.startswith("no longer the owner"):
        return "not_owner"
    if reason.startswith("not confirmed"):
        return "deadline"
    return "other"


def _on_round(server: Any, seconds: float, renewed: int, failed: int) -> None:
    _m["round"].observe(seconds)


def _on_process_exit(**_: Any) -> None:
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(os.getpid())
