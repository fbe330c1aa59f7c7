"""The Celery app that the beat tests run as real `celery beat` (and `celery worker`) subprocesses.

Its Redis comes from CSL_REDIS_URL_BASE (db 0 broker, 2 locks, 3 journal). One
entry, ``tick``, is due on every whole second of the wall clock
(:class:`EverySecond`), so a "tick" has a name all processes agree on: the
second it is due at (:data:`DUE`). Each send is journalled by the sending beat process
(before_task_publish: ``sends`` gets "<tick> <pid> <time> <task id>"), each run
by the worker (``runs`` gets "<task id> <pid> <time>"), so the tests can count
sends per tick, tell which beat sent them, and match every send to its run.
"""

from __future__ import annotations

import math
import os
import time
from datetime import datetime, timedelta

import redis
from celery import Celery
from celery.schedules import schedstate, schedule
from celery.signals import before_task_publish

BASE = os.environ.get("CSL_REDIS_URL_BASE", "redis://127.0.0.1:6399")

app = Celery("beat_app", broker=f"{BASE}/0")
app.conf.update(
    singleton_lock_url=os.environ.get("CSL_LOCK_URL") or f"{BASE}/2",  # e.g. etcd://... (tests/_backends.py)
    singleton_lock_beat_ttl=float(os.environ.get("CSL_BEAT_TTL", "2")),
    singleton_lock_beat_poll=float(os.environ.get("CSL_BEAT_POLL", "0.25")),
    broker_connection_retry_on_startup=True,
    task_ignore_result=True,
    beat_max_loop_interval=1,
)

journal = redis.Redis.from_url(f"{BASE}/3")


DUE = [0]
"""The tick this (beat) process's scheduler last found due: what its next send is for. A send is
named by it, not by the second it leaves in: a leader confirms its lock before each send (on etcd a
consensus write, milliseconds), so the send of a tick found due at 8.999 may leave at 9.004, and the
send time would then name it after the next tick, which follows at 9.02."""


class EverySecond(schedule):
    """Due once per whole wall-clock second: tick N is due at N.000."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(run_every=timedelta(seconds=1))

    def is_due(self, last_run_at: datetime) -> schedstate:
        now = time.time()
        last = self.maybe_make_aware(last_run_at).timestamp()
        due = math.floor(now) > math.floor(last)
        if due:
            DUE[0] = math.floor(now)
        return schedstate(due, max(0.001, math.floor(now) + 1 - now))

    def __reduce__(self):  # the shelve pickles the entries
        return (self.__class__, ())

    def __repr__(self) -> str:
        return "<every whole second>"


app.conf.beat_schedule = {"tick": {"task": "beat_app.tick", "schedule": EverySecond()}}


@app.task(name="beat_app.tick", bind=True)
def tick(self) -> None:
    journal.rpush("runs", f"{self.request.id} {os.getpid()} {time.time()}")


@before_task_publish.connect
def journal_send(sender=None, headers=None, **_):
    if sender == "beat_app.tick":  # in the beat process that sends it
        now = time.time()
        journal.rpush("sends", f"{DUE[0] or math.floor(now)} {os.getpid()} {now} {(headers or {}).get('id')}")
