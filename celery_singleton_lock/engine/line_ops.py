"""Operators' changes to a line: what a revoke and ``celery locks drop`` do to Redis.

A parked task has no message in any worker, so nothing in Celery can take it
out of the line by itself: :func:`remove` does, with the line's LEAVE by task id
(every record of that task id goes; if the key was reserved for it, the
key passes to the next waiter at once, as a release would), or through the
backend's own line (etcd's), and :func:`remove_everywhere` looks for the task
id in every line that has waiters (the sweeper's index: one round trip per such
key). ``celery locks release`` is each backend's own ``force_release`` (on one
Redis: :meth:`.server.LockServer.force_release`). Engine code: it knows nothing of Celery;
:mod:`celery_singleton_lock.worker.revoke` and :mod:`celery_singleton_lock.ops` call it.
"""

from __future__ import annotations

from . import line_scripts
from .backend import LockBackend
from .line import own_line
from .lock import Handoff, slot_safe
from .refusals import REDIS_ERRORS
from .server import LockServer


def remove(server: LockBackend, name: str, owner_id: str, request_id: str = "") -> tuple[int, tuple[Handoff, ...]]:
    """Take task ``owner_id`` out of ``name``'s line; (how many of its entries went, the hand-offs
    made, already sent through ``server.dispatch``). Callers ask ``supports_line`` first.
    ``request_id``: sent again with the one of a try whose answer was lost, it answers as that try
    did (see :mod:`.kept`)."""
    if not owner_id or "\n" in owner_id:
        raise ValueError(f"a task id must be a non-empty line of text, got {owner_id!r}")
    own = own_line(server)
    if own is not None:
        return own.drop(name, owner_id)
    assert isinstance(server, LockServer)
    key = slot_safe(name)
    reply = server.run(line_scripts.LEAVE, server.keys_for(key), ("", owner_id), request_id=request_id)
    handoffs = tuple(Handoff.parse(key, item) for item in reply[2:])
    server.dispatch(handoffs)
    return int(reply[0]), handoffs


def remove_everywhere(server: LockServer, index: str, owner_id: str, request_id: str = "",
                      answered: dict[str, int | None] | None = None) -> list[str]:
    """Take task ``owner_id`` out of every line listed in the sweeper's ``index``; the keys it left.

    A look that fails part way is tried again with the same ``request_id`` and ``answered`` (each key's
    answer so far, filled in here; None: asked, no answer came): a key answered already is not asked
    again (its hand-offs were sent), and one whose answer was lost is asked again even if it has left
    the index since (a LEAVE that emptied its line lets a sweeper drop it), and answers as it did the
    first time (its LEAVE is kept)."""
    answered = {} if answered is None else answered
    try:
        listed = server.client.zrange(index, 0, -1)
    except REDIS_ERRORS as exc:
        raise server.error(exc, index) from exc
    unanswered = [key for key, removed in answered.items() if removed is None]
    for key in dict.fromkeys([*unanswered, *(k.decode() if isinstance(k, bytes) else str(k) for k in listed)]):
        if answered.get(key) is None:
            answered[key] = None  # asked: if no answer comes, a look tried again asks it again
            answered[key] = remove(server, key, owner_id, request_id)[0]
    return [key for key, removed in answered.items() if removed]
