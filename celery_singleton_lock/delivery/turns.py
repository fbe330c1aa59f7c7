"""The turns queues: a waiter whose turn came does not queue a second time.

A parked task has already waited once, in the key's line. When its turn
comes (the hand-off, the sweeper's re-send, or the "you waited too long"
copy), its message is published to ``<queue>.singleton_turns``, where
``<queue>`` is the queue it was first delivered from, instead of to the back
of ``<queue>`` behind whatever arrived meanwhile. Every worker that consumes
``<queue>`` also consumes its turns queue, on a channel of its own with a
prefetch window of its own (:class:`TurnsConsumer`, a consumer bootstep
added at worker start: the ``worker_init`` signal, sent after ``-Q``/``-X``
were applied and before the consumer starts, by ``celery worker`` and by
``celery.contrib.testing.worker.start_worker`` alike).

Why a turn is not stuck behind the backlog: it is not in ``<queue>``, and on
a channel of its own it does not wait for room in the worker's task prefetch
window either (there, with the backlog's tasks prefetched, it would come only
once one of them had started): the broker delivers it at once.

Nor behind the worker's own prefetched messages: a prefork worker keeps the
messages it has taken but not yet given to a child in a buffer of its own
(up to ``worker_prefetch_multiplier`` x concurrency of them), in arrival order.
A turn received goes to the front of that buffer, behind earlier turns only
(``turns_first``), so it runs on the next free child. That
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
import weakref
from collections.abc import Mapping
from typing import Any

from celery import bootsteps
from celery.signals import task_received, worker_init, worker_ready
from kombu.entity import Exchange, Queue
from kombu.messaging import Consumer

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
    """Make the worker consume the turns queue of every queue it consumes, on a channel of its own
    (:class:`TurnsConsumer`); returns the names added."""
    added = []
    for name, queue in list(app.amqp.queues.consume_from.items()):
        exchange_type = getattr(queue.exchange, "type", "direct")
        if name.endswith(SUFFIX) or exchange_type == "fanout" or getattr(queue, "no_declare", False):
            continue  # a turns queue itself, or a broadcast queue: no turns of its own
        _consumed.add(name)
        added.append(name + SUFFIX)
    _of_app[app] = [turns_queue(name[: -len(SUFFIX)]) for name in added]
    app.steps["consumer"].add(TurnsConsumer)
    return added


_of_app: weakref.WeakKeyDictionary[Any, list[Queue]] = weakref.WeakKeyDictionary()
"""The turns queues each app's worker consumes (an app's worker, started in this process)."""


class TurnsConsumer(bootsteps.ConsumerStep):
    """The worker's turns queues, on a channel of their own with a prefetch window of their own.

    On the worker's task channel, a turn shares the prefetch window with the backlog: the broker
    delivers it only once one of the worker's prefetched tasks has started. On a channel of its
    own it is delivered at once, and :func:`turns_first` puts it ahead of the prefetched tasks, so
    it runs on the worker's next free child. Its messages go through the worker's own task handler
    (the same strategies, acks and requests as any task)."""

    name = "celery-singleton-lock turns"
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def start(self, c: Any) -> None:
        queues = _of_app.get(c.app) or []
        self.consumers = []
        if not queues:
            return
        channel = c.connection.channel()
        consumer = Consumer(channel, queues=queues, on_message=c.create_task_handler(),
                            accept=c.app.conf.accept_content, prefetch_count=max(1, c.initial_prefetch_count or 0))
        consumer.consume()
        self.consumers = [consumer]


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
            "celery-singleton-lock: worker_prefetch_multiplier is %d: under a busy queue a waiter's turn runs "
            "on the next free child of a prefork worker, but in the threads, solo, gevent and eventlet pools "
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
    """Whether the app has a LockedTask (the worker imported its task modules before worker_init).

    Known by the mark every LockedTask carries (``singleton_lock``), not by isinstance: this module
    is below task.py, which imports it (through the hand-off)."""
    return any(getattr(task, "singleton_lock", False) is True for task in list(app.tasks.values()))


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
