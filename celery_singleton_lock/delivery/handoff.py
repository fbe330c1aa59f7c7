"""A parked task's message: packed when it parks, sent again when its turn comes.

The lock engine hands the key to a waiter and gives back the bytes the waiter
parked; this module is the Celery side of that: :func:`pack` turns the running
request into those bytes (the same signature ``self.retry()`` would send: task
id, arguments, chain, links, chord, group, routing, priority), and
:func:`send` is the function the engine calls to publish it again (through
the app that registered the task), its ``singleton_lock_turn`` header (:class:`.headers.Turn`) saying
why: its turn came (``run``: claim the key reserved for its entry), the lock Redis lost its data
(``recovered``: sent again, with its entry), or it waited longer than its ``lock_max_wait``
(``expired``: fail it).

Each of them goes to the turns queue of the queue the task was first
delivered from (see :mod:`celery_singleton_lock.delivery.turns`), so a waiter does
not queue a second time behind work that arrived after it.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import replace
from typing import Any

from celery import Celery

from ..engine import sweeper as sweeping
from ..engine.backend import HandoffSender
from ..engine.lock import Handoff
from . import releasing, turns
from .headers import Turn, turn_of

logger = logging.getLogger("celery_singleton_lock")


def pack(task: Any, request: Any, args: Any, kwargs: Any) -> bytes:
    """The message that runs this request again, as bytes to park.

    Serialised with the task's own serializer, so whatever its arguments can
    travel in (JSON by default) they can park in.
    """
    sig = task.signature_from_request(request, args, kwargs)
    sig.options.pop("redelivered", None)  # delivery_info, copied by Celery: not an option to publish
    turn = turn_of(request.headers)
    queue = turn.queue or turns.original_queue(task.app, request.delivery_info)
    ours = Turn(parked_at=turn.parked_at or time.time(), queue=queue or None).header()
    if queue:
        if turns.SUFFIX in str(sig.options.get("queue") or sig.options.get("routing_key") or ""):
            # a copy that came from a turns queue: it goes back to its own queue when it is published again
            sig.options.pop("exchange", None)
            sig.options.pop("routing_key", None)
            sig.options["queue"] = queue
    sig.options["headers"] = {**(sig.options.get("headers") or {}), **ours}
    return releasing.packed(dict(sig), task.serializer)


_apps: dict[str, Celery] = {}
"""task name -> the app that sends it: a process may hold several apps (tests do), and a waiting
task must go through its own app's broker."""


_heads: set[str] = set()
"""``<prefix>:<task name>``, the start of the lock keys of every task this process can send."""
_prefixes: set[str] = set()


def register(task: Any) -> None:
    """Remember which app sends ``task``'s waiting copies (called when the task first locks), and let
    this process's sweeper look only at lines whose waiters it can send (:func:`knows_key`)."""
    _apps[task.name] = task.app
    try:
        prefix = task.lock_settings().prefix
    except ValueError:
        return  # its settings are refused at its first lock, with a clear error
    _heads.add(f"{prefix}:{task.name}")
    _prefixes.add(prefix)
    sweeping.get_sweeper().sweepable = knows_key


def knows_key(key: str) -> bool:
    """Whether this process can send the waiters of lock ``key``: False for a task's key (under a prefix
    of ours) whose task no app here knows. Another app on the same lock Redis and prefix has its own
    workers, and their sweepers send them (before, a sweeper here timed such a waiter out and could not
    send its copy: it stayed WAITING for ever). A plain ``held()`` name is always ours to sweep."""
    head, tag, _ = key.rpartition(":{")
    if not tag or head in _heads:
        return True
    return not any(head.startswith(prefix + ":") for prefix in _prefixes)


def send(server: Any, handoff: Handoff) -> bool:
    """Publish a waiter whose turn came (or whose wait ran out): what the lock engine calls.

    False when no app of this process knows the task: then a sweeper elsewhere sends it.
    """
    body = releasing.unpack_value(handoff.message)
    app = _apps.get(body.get("task"))
    if app is None:
        logger.info("lock %s: no app in this process sends task %s; left for a sweeper", handoff.key, body.get("task"))
        return False
    sig = app.signature(body)
    headers = dict(sig.options.get("headers") or {})
    turn = turn_of(headers)
    if handoff.what in ("run", "next"):  # its turn, or (next) sent ahead of it to wait in a worker slot
        turn = replace(turn, entry=handoff.entry, why="run")
    elif handoff.what == "recovered":  # (the copy's id: a STARTED it stores names it)
        turn = replace(turn, entry=handoff.entry, why="recovered", copy=uuid.uuid4().hex)
    elif handoff.what == "expired":
        turn = replace(turn, why="expired")
    else:
        raise ValueError(f"unknown hand-off {handoff.what!r}")
    sig.options["headers"] = {**headers, **turn.header()}
    queue = turn.queue
    if isinstance(queue, str) and turns.consumed(queue):  # our worker reads it: no waiting behind the backlog
        for option in ("exchange", "routing_key"):  # they would win over the queue's own
            sig.options.pop(option, None)
        sig.options["queue"] = turns.turns_queue(queue)
    sig.apply_async()
    logger.debug("lock %s: sent waiting task %s (%s)", handoff.key, handoff.owner_id, handoff.what)
    return True


SEND: HandoffSender = send
