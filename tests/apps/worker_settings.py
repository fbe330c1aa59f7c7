"""The settings of apps/worker_app.py's app, from the environment the tests start its workers with
(not an app of its own; a module of functions only, so reloading worker_app.py needs nothing here).

worker_app.py calls :func:`base` right after it makes its app and :func:`from_test_env` after its
last task, as the same settings were applied before they moved here.
"""

from __future__ import annotations

import json
import os


def base(app, base: str) -> None:
    """The databases on the Redis at ``base`` (locks in 2), the lock TTL (CSL_LOCK_TTL), acks_late
    (CSL_ACKS_LATE, CSL_REJECT_ON_LOST), the visibility timeout (CSL_VISIBILITY) and the children's
    lifetime (CSL_MAX_TASKS_PER_CHILD)."""
    app.conf.update(
        singleton_lock_url=f"{base}/2",
        singleton_lock_ttl=float(os.environ.get("CSL_LOCK_TTL", "5")),
        singleton_lock_retry_backoff=0.1,
        singleton_lock_retry_backoff_max=0.5,
        worker_prefetch_multiplier=1,
        task_acks_late=os.environ.get("CSL_ACKS_LATE") == "1",
        task_reject_on_worker_lost=os.environ.get("CSL_REJECT_ON_LOST") == "1",
        broker_transport_options={
            "visibility_timeout": float(os.environ.get("CSL_VISIBILITY", "3600")),
            # restore unacked messages every second: real redeliveries in tests (see _task_support.redeliver)
            "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1,
        },
        worker_max_tasks_per_child=int(os.environ.get("CSL_MAX_TASKS_PER_CHILD", "0")) or None,
    )


def from_test_env(app) -> None:
    """What a test may add: another broker (CSL_BROKER_URL, e.g. RabbitMQ; CSL_BROKER_READ_URL, the
    consuming side through a delaying proxy), settings as JSON (CSL_EXTRA_CONF), the prefetch
    (CSL_PREFETCH) and the turn timeout (CSL_TURN_TIMEOUT)."""
    if os.environ.get("CSL_BROKER_URL"):  # e.g. RabbitMQ
        app.conf.broker_url = os.environ["CSL_BROKER_URL"]
    if os.environ.get("CSL_BROKER_READ_URL"):  # the consuming side through a delaying proxy
        app.conf.broker_read_url = os.environ["CSL_BROKER_READ_URL"]
        app.conf.broker_write_url = app.conf.broker_url
    if os.environ.get("CSL_EXTRA_CONF"):  # JSON: settings a test adds, e.g. a misspelt one
        app.conf.update(json.loads(os.environ["CSL_EXTRA_CONF"]))
    if os.environ.get("CSL_PREFETCH"):  # "4": Celery's default
        app.conf.worker_prefetch_multiplier = int(os.environ["CSL_PREFETCH"])
    if os.environ.get("CSL_TURN_TIMEOUT"):
        app.conf.singleton_lock_turn_timeout = float(os.environ["CSL_TURN_TIMEOUT"])
