"""Plain code waiting for a lock on etcd: one watch on the lock key, then one more try.

Plain code has no place in an etcd line (the line holds parked task messages, handed on by a
release). A ``held(..., wait=...)`` that finds the key taken waits for the lock key to change (its
holder's release or the expiry of its lease deletes it; a waiter's claim puts it) and tries again at
once. It used to sleep between tries (20 ms doubling to 0.5 s), so a release was seen up to half a
second late.

* **Nothing is missed.** The watch is in place before the waiter reads the key: a release before it
  shows in the read (the key is gone: try again now), one after it comes through the watch. It
  watches from the current revision, so etcd streams each change at once (a watch from an older
  revision is caught up by a loop that runs every 100 ms).
* **Nothing is written.** A read and a watch are safe to send twice; only the acquire writes, as before.
* **Not first come, first served.** Every waiter wakes at a release and tries; one takes the key.
  etcd's mutex orders its waiters, at the cost of a key per waiter and a process to keep it alive.
* **A bounded wait.** A watch lasts at most :data:`LONGEST` (a stream that hangs costs no more), and
  :data:`QUEUED` for a key that is free but reserved for a task, or held back by a line of tasks: such
  a key may free up without a change one could watch (the line's last waiter revoked).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from ..exceptions import LockError
from .etcd_session import Transport, b64

LONGEST = 5.0
"""Seconds one watch lasts at most; then the waiter tries again."""
QUEUED = 0.5
"""Seconds one watch lasts at most on a key held back by a line of tasks (the old back-off's longest pause)."""


def wait_for_change(transport: Transport, lock_key: str, queued: bool, seconds: float) -> bool:
    """Block until ``lock_key`` changes or ``seconds`` (at most :data:`LONGEST`) pass, after an acquire
    that found it held (``queued``: free, but reserved for a waiter or held back by a line). False if
    etcd could not be watched: the caller backs off, and its next acquire says what is wrong."""
    import requests

    client = transport.client()
    with requests.Session() as session:  # a connection of its own: the stream holds it while it waits
        session.verify, session.cert = client.session.verify, client.session.cert
        token = client.session.headers.get("Authorization")  # (one get: another thread may renew it)
        if token:
            session.headers["Authorization"] = token
        try:
            with session.post(client.get_url("/watch"), json={"create_request": {"key": b64(lock_key)}},
                              stream=True, timeout=(transport.timeout, min(seconds, QUEUED if queued else LONGEST))
                              ) as reply:
                reply.raise_for_status()
                results = _results(reply)
                first = next(results, {})
                if not first.get("created") or first.get("canceled"):  # refused (etcd's auth)
                    return False
                if not queued and not _held(transport, lock_key):
                    return True  # released since the acquire: try again now
                for result in results:  # up to the first change (or a cancel: the watch ended)
                    if result.get("events") or result.get("canceled"):
                        break
                return True
        except requests.RequestException as exc:  # a read that timed out: nothing changed meanwhile
            return _timed_out(exc)
        except (LockError, ValueError):  # the read, or a stream that is not etcd's: the next acquire tells
            return False


def _held(transport: Transport, lock_key: str) -> bool:
    """Whether ``lock_key`` exists, read once the watch is in place (a change after it is an event)."""
    return bool(transport.call("/kv/range", {"key": b64(lock_key), "keys_only": True}, lock_key).get("kvs"))


def _results(reply: Any) -> Iterator[dict[str, Any]]:
    """The watch stream's messages, one JSON object a line (its first says the watch was created)."""
    pending = b""
    for chunk in reply.iter_content(chunk_size=None):
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if line.strip():
                yield json.loads(line).get("result") or {}


def _timed_out(exc: Exception) -> bool:
    """Whether a watch's error is its read timing out (requests wraps it while it streams)."""
    import requests
    from urllib3.exceptions import ReadTimeoutError

    return isinstance(exc, requests.ReadTimeout) or any(isinstance(a, ReadTimeoutError) for a in exc.args)
