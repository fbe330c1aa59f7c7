"""Fault injection for the crash tests, installed by the test worker app (never in the package).

A worker started with ``CSL_TEST_KILL_AT=<point>`` kills itself (SIGKILL) at that point; with
``CSL_TEST_KILL_ONCE=<path>`` only the first process to create that file dies there (so a
redelivery of the same message is not killed again). The points wrap the package's own functions
from outside:

* ``parked``: a duplicate's message was just parked in the key's line (the message lives on only
  there; the line's sweeper has not been told yet);
* ``handoff``: a release just handed the key to a waiter, before the waiter's message is sent
  (a release's hand-off only, not a sweeper's);
* ``released``: the lock was released, before Celery stores the task's result.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
from typing import Any


def _die(point: str) -> None:
    if os.environ.get("CSL_TEST_KILL_AT") != point:
        return
    once = os.environ.get("CSL_TEST_KILL_ONCE")
    if once:
        try:
            os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
    os.kill(os.getpid(), signal.SIGKILL)


def install() -> None:
    """Wrap the package's functions at the points the environment names (no-op without it)."""
    point = os.environ.get("CSL_TEST_KILL_AT")
    if not point:
        return
    from celery_singleton_lock.delivery import releasing
    from celery_singleton_lock.engine import line
    from celery_singleton_lock.engine.server import LockServer

    if point == "parked":
        park = line.park

        @functools.wraps(park)
        def parked(*args: Any, **kwargs: Any) -> Any:
            place = park(*args, **kwargs)
            if place.found is line.Park.PARKED:
                _die("parked")
            return place

        line.park = parked  # type: ignore[assignment]
    elif point == "handoff":
        # only a RELEASE's hand-off: the sweeper dispatches hand-offs too (a timed-out waiter's copy),
        # and a sweeper that killed its process there would lose that copy, which no test asks for
        from celery_singleton_lock.topologies.etcd import EtcdLockServer

        releasing_now = threading.local()
        for server_class in (LockServer, EtcdLockServer):
            _wrap_release(server_class, releasing_now)
    elif point == "released":
        release = releasing.release

        @functools.wraps(release)
        def released(*args: Any, **kwargs: Any) -> Any:
            status = release(*args, **kwargs)
            _die("released")
            return status

        releasing.release = released  # type: ignore[assignment]


def _wrap_release(server_class: Any, releasing_now: threading.local) -> None:
    """Kill the process when ``server_class``'s release dispatches a task's hand-off (see ``handoff``)."""
    release, dispatch = server_class.release, server_class.dispatch

    @functools.wraps(release)
    def released_here(self: Any, *args: Any, **kwargs: Any) -> Any:
        releasing_now.on = True
        try:
            return release(self, *args, **kwargs)
        finally:
            releasing_now.on = False

    @functools.wraps(dispatch)
    def dispatched(self: Any, handoffs: Any) -> None:
        handoffs = tuple(handoffs)
        if getattr(releasing_now, "on", False) and any(h.kind != "p" for h in handoffs):
            _die("handoff")
        dispatch(self, handoffs)

    server_class.release = released_here
    server_class.dispatch = dispatched
