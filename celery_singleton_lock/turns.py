"""The turns queues: a waiter whose turn came does not queue a second time.

A parked task has already waited once, in the key's line. When its turn
comes (the hand-off, the sweeper's re-send, or the "you waited too long"
copy), its message is published to ``<queue>.singleton_turns``, where
``<queue>`` is the queue it was first delivered from, instead of to the back
of ``<queue>`` behind whatever arrived meanwhile. Every worker that consumes
``<queue>`` also consumes its turns queue: it is added at worker start
(the ``worker_init`` signal, sent after ``-Q``/``-X`` were applied and before
the consumer starts, by ``celery worker`` and by
``celery.contrib.testing.worker.start_worker`` alike), the way Celery's own
documentation adds a queue with ``app.amqp.queues.select_add``.

Why a turn is not stuck behind the backlog:

* kombu's Redis transport BRPOPs all of a worker's queues and rotates their
  order on every fetch, so the turns queue is read at the latest on the
  next-but-one fetch, whatever the depth of ``<queue>``;
* on RabbitMQ each queue has its own consumer on the worker's channel, and
  the broker serves the consumers of a channel in turn as prefetch credit
  comes back (with RabbitMQ 3.x's channel-wide QoS, Celery's default there)
  or independently (per-consumer QoS, RabbitMQ 4): either way the turn waits
  for at most one prefetch window of the worker that takes it, never for the
  whole queue.

Nor behind the worker's own prefetched messages: a prefork worker keeps the
messages it has taken but not yet given to a child in a buffer of its own
(up to ``worker_prefetch_multiplier`` x concurrency of them), in arrival order,
and the broker delivers a turn to it only when that buffer has room.
A turn received from a turns queue goes to the front of that buffer, behind
earlier turns only (``turns_first``), so it runs on the next free child. That
buffer (the worker's pool semaphore) is a private detail of Celery's prefork
worker: where it is not found (the threads, solo, gevent and eventlet pools,
or another Celery release), the turn keeps its place in arrival order and
nothing else changes.

A turn is published to the turns queue only by a process whose worker
consumes that turns queue (so somebody reads it while that worker lives);
any other process (``celery locks``, a worker of an older release in a
rolling deploy, a worker not consuming ``<queue>``) publishes it to
``<queue>`` itself, where it is slower but never stranded.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from celery.signals import task_received, worker_init, worker_ready
from kombu.entity import Exchange, Queue

logger = logging.getLogger("celery_singleton_lock")

SUFFIX = ".singleton_turns"
"""Appended to a queue's name: the name of its turns queue."""

_consumed: set[str] = set()
"""The queues whose turns queue this process's worker consumes (filled at worker start; a
forked pool child inherits it)."""


def turns_queue(name: str) -> Queue:
    """``name``'s turns queue, declared alike by every publisher and consumer (a direct exchange of
    its own name, as Celery makes a missing queue)."""
    turns = name + SUFFIX
    return Queue(turns, Exchange(turns, type="direct"), routing_key=turns)


def original_queue(app: Any, delivery_info: Mapping[str, Any] | None) -> str | None:
    """The name of the queue a message was delivered from, as far as its delivery info tells.

    A copy delivered from a turns queue is of the queue it names. A routing key
    that is a known queue's name is that queue (Celery's usual direct routing);
    otherwise the known queue bound by that exchange and routing key; otherwise
    the routing key itself. None when there is nothing to go on (eager).
    """
    info = delivery_info or {}
    key = info.get("routing_key")
    if not key or not isinstance(key, str):
        return None
    if key.endswith(SUFFIX):
        return key[: -len(SUFFIX)]
    queues = app.amqp.queues
    if key in queues:
        return key
    exchange = info.get("exchange") or ""
    for queue in queues.values():
        if queue.routing_key == key and getattr(queue.exchange, "name", "") == exchange:
            return str(queue.name)
    return key


def consumed(name: str | None) -> bool:
    """Whether this process's worker consumes ``name``'s turns queue."""
    return name is not None and name in _consumed


def add_turns_queues(app: Any) -> list[str]:
    """Make the worker consume the turns queue of every queue it consumes; returns the names added."""
    queues = app.amqp.queues
    added = []
    for name, queue in list(queues.consume_from.items()):
        exchange_type = getattr(queue.exchange, "type", "direct")
        if name.endswith(SUFFIX) or exchange_type == "fanout" or getattr(queue, "no_declare", False):
            continue  # a turns queue itself, or a broadcast queue: no turns of its own
        turns = turns_queue(name)
        queues.select_add(turns)
        _consumed.add(name)
        added.append(turns.name)
    return added


def check_broker(app: Any) -> None:
    """Say at worker start how this broker and prefetch serve the turns queues (logged once)."""
    url = str(app.conf.broker_url or "")
    scheme = url.split("://", 1)[0].lower()
    if scheme not in ("redis", "rediss", "sentinel", "amqp", "amqps", "pyamqp"):
        logger.warning(
            "celery-singleton-lock: broker %r is not Redis or RabbitMQ: the turns queues are consumed, but whether "
            "a turn overtakes a backlog depends on how this transport serves several queues", scheme,
        )
    multiplier = app.conf.worker_prefetch_multiplier
    if isinstance(multiplier, int) and multiplier > 1 and not app.conf.worker_disable_prefetch:
        logger.info(
            "celery-singleton-lock: worker_prefetch_multiplier is %d: under a busy queue a waiter's turn waits "
            "behind up to %d x concurrency prefetched tasks of the worker that takes it; 1 makes that about one "
            "task", multiplier, multiplier,
        )


_pending: list[Any] = []
"""What worker_init found, logged at worker_ready: the worker configures its logging in between."""


@worker_init.connect(weak=False)
def _consume_turns(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None)
    if app is None or not has_locked_tasks(app):
        return
    added = add_turns_queues(app)
    _pending.append((app, added))


@worker_ready.connect(weak=False)
def _say_turns(**_: Any) -> None:
    while _pending:
        app, added = _pending.pop()
        if added:
            logger.info("celery-singleton-lock: this worker also consumes the turns queues %s", ", ".join(added))
        check_broker(app)


def has_locked_tasks(app: Any) -> bool:
    """Whether the app has a LockedTask (the worker imported its task modules before worker_init)."""
    from .task import LockedTask

    return any(isinstance(task, LockedTask) for task in list(app.tasks.values()))



# -- a turn goes to the front of the prefork worker's own buffer ---------------------------------------


def _is_turn(request: Any) -> bool:
    """Whether a worker's request is of a message delivered from a turns queue."""
    key = (getattr(request, "delivery_info", None) or {}).get("routing_key")
    return isinstance(key, str) and key.endswith(SUFFIX)


@task_received.connect(weak=False)
def _turn_received(sender: Any = None, request: Any = None, **_: Any) -> None:
    """Sent in the worker's main process just before the request waits for a free child: a turn
    makes sure turns go first in that wait (installed at the first turn, once per worker)."""
    if _is_turn(request):
        turns_first(getattr(getattr(sender, "controller", None), "semaphore", None))


def turns_first(semaphore: Any) -> bool:
    """Make a prefork worker's wait for a free child put a turn ahead of the other waiting tasks,
    behind the turns already waiting (FIFO among turns).

    The worker hands a child one task at a time through ``semaphore`` (kombu's
    ``LaxBoundedSemaphore``, one slot per child); the tasks it has prefetched wait in its
    ``_waiting`` deque, appended through ``_add_waiter`` in arrival order and taken from the
    front. The wrapper places a turn's ``(callback, (request,), kwargs)`` after the waiting turns
    instead. Idempotent. Returns whether turns go first now (False: not such a semaphore, nothing
    changed).
    """
    waiting = getattr(semaphore, "_waiting", None)
    add = getattr(semaphore, "_add_waiter", None)
    if waiting is None or not callable(add) or not hasattr(waiting, "insert"):
        return False
    if getattr(add, "_csl_turns_first", False):
        return True

    def add_turns_first(waiter: Any) -> None:
        if not _is_turn(_request_of(waiter)):
            add(waiter)
            return
        ahead = 0
        while ahead < len(waiting) and _is_turn(_request_of(waiting[ahead])):
            ahead += 1
        waiting.insert(ahead, waiter)

    add_turns_first._csl_turns_first = True  # type: ignore[attr-defined]
    semaphore._add_waiter = add_turns_first
    return True


def _request_of(waiter: Any) -> Any:
    """The request in a semaphore waiter ``(callback, (request,), kwargs)``, or None."""
    try:
        return waiter[1][0]
    except (IndexError, TypeError, KeyError):
        return None
