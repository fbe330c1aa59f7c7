"""turns.turns_first: a prefork worker's wait for a free child puts turns first, FIFO among them.

Pure: kombu's own LaxBoundedSemaphore (the object the worker uses), plain request stand-ins."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from kombu.asynchronous.semaphore import LaxBoundedSemaphore

from celery_singleton_lock.delivery.turns import SUFFIX, turns_first

pytestmark = pytest.mark.timeout(10)


def req(name: str, turn: bool) -> SimpleNamespace:
    return SimpleNamespace(name=name, delivery_info={"routing_key": "q" + (SUFFIX if turn else "")})


def test_turns_wait_ahead_of_other_tasks_in_turn_order() -> None:
    ran: list[str] = []
    sem = LaxBoundedSemaphore(1)
    assert turns_first(sem) and turns_first(sem), "installs once, then says it is installed"
    sem.acquire(lambda r: ran.append(r.name), req("running", False))
    for name, turn in [("a", False), ("b", False), ("t1", True), ("c", False), ("t2", True)]:
        sem.acquire(lambda r: ran.append(r.name), req(name, turn))
    for _ in range(5):
        sem.release()
    assert ran == ["running", "t1", "t2", "a", "b", "c"]


def test_something_that_is_not_such_a_semaphore_is_left_alone() -> None:
    assert turns_first(None) is False
    assert turns_first(SimpleNamespace(_waiting=None, _add_waiter=print)) is False
