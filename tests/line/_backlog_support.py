"""The line-under-load tests' shared helpers (tests/line/test_line_backlog.py, test_line_waiters.py,
test_line_turns.py): two prefork worker nodes on a queue of their own with a client app that sends
by task name (:func:`start_nodes`; their fixtures ``redis_nodes`` and ``amqp_nodes`` are in
line/conftest.py), the workers' settings, a key's line read from the lock Redis (its waiters and
their deadlines), and the sweepers' looks at it seen by a MONITOR."""

from __future__ import annotations

import contextlib
import uuid

from _line_support import worker_nodes
from _task_support import load_worker_app
from celery import Celery

from celery_singleton_lock.delivery.turns import SUFFIX
from celery_singleton_lock.engine.layout import Waiter
from celery_singleton_lock.engine.line import SWEEP_INTERVAL, SWEEP_LEASE
from celery_singleton_lock.engine.lock import slot_safe
from celery_singleton_lock.testing.servers import Monitor

AMQP_URL = "amqp://guest:guest@127.0.0.1:5672//"
LOCK_TTL = 2.0


SWEEP_SLACK = SWEEP_INTERVAL * 1.25 + SWEEP_LEASE + 5.0  # a sweeper's look, plus a loaded machine's slack
WORKER_ENV = {"CSL_LOCK_TTL": str(LOCK_TTL), "CSL_JOURNAL_HANDOFF": "1", "CSL_PREFETCH": "4"}


class Nodes:
    """Two prefork workers x 2 children on ``queue``, and a client app that sends by task name."""

    def send(self, task: str, args, **options):
        return self.client.send_task(f"apps.worker_app.{task}", args, queue=options.pop("queue", self.queue),
                                     **options)

    def depth(self) -> int:
        if self.broker == "redis":
            return int(self.broker_redis.llen(self.queue))
        with self.client.connection_for_write() as conn:
            return int(conn.default_channel.queue_declare(self.queue, passive=True).message_count)


@contextlib.contextmanager
def start_nodes(redis_server, tmp_path_factory, broker: str, env: dict | None = None, count: int = 2,
                concurrency: int = 2):
    wa = load_worker_app(redis_server)
    n = Nodes()
    # locks of their own per broker: a sweeper sends a waiter through its OWN app's broker
    lock_db = 4 if broker == "amqp" else 2
    n.wa, n.locks, n.broker = wa, redis_server.client(lock_db), broker
    n.broker_redis = redis_server.client(0)
    n.queue = f"csl-ll-{broker}-{uuid.uuid4().hex[:8]}"
    url = AMQP_URL if broker == "amqp" else redis_server.url(0)
    n.client = Celery(f"client-{uuid.uuid4().hex[:6]}", broker=url, backend=redis_server.url(1),
                      set_as_current=False)
    n.client.conf.update(result_expires=None, broker_heartbeat=0)
    logdir = tmp_path_factory.mktemp(f"line-load-{broker}")
    extra_env = {**WORKER_ENV, **(env or {}), "CSL_LOCK_URL": redis_server.url(lock_db),
                 **({"CSL_BROKER_URL": AMQP_URL} if broker == "amqp" else {})}
    specs = {f"{broker}-node{i}": (n.queue, concurrency, extra_env) for i in range(count)}
    try:
        with worker_nodes(redis_server, logdir, specs) as started:
            n.workers = list(started.values())
            yield n
    finally:
        if broker == "amqp":
            with n.client.connection_for_write() as conn:
                for q in (n.queue, n.queue + SUFFIX):
                    with contextlib.suppress(Exception):
                        conn.default_channel.queue_delete(q)


# -- the workers' journal (Redis db 3; the rest in tests/_line_support.py) ----------------------------


def line_of(locks, key: str) -> list[str]:
    """The task ids in ``key``'s line, next first."""
    entries = locks.lrange(key + ":q", 0, -1)
    if not entries:
        return []
    return [rec.split(b"\n", 4)[3].decode() for rec in locks.hmget(key + ":w", entries) if rec]


def last_deadline_ms(locks, key: str) -> int:
    """The latest lock_max_wait deadline of ``key``'s waiters, in the lock Redis's clock (ms)."""
    return max(Waiter.parse(rec).deadline_ms for rec in locks.hvals(key + ":w"))


def server_ms(locks) -> int:
    """The lock Redis's clock (TIME), in ms: what the line's deadlines are written in."""
    seconds, micros = locks.time()
    return int(seconds) * 1000 + int(micros) // 1000


def looks_left_to_others(mon: Monitor, key: str) -> int:
    """How many times, by ``mon``'s count, a sweeper looked at ``key`` and left it to a process that can
    send its waiters: an INDEX_DONE that makes the key due again at once (the pair ``key, 1``)."""
    name = slot_safe(key)
    return sum(1 for words in mon.commands() if words[0].upper() in ("EVALSHA", "EVAL")
               and (name, "1") in zip(words[5::2], words[6::2], strict=False))
