"""A hashed timer wheel: the watchdog's bookkeeping, with no I/O and no threads.

Time is cut into ticks of ``tick`` seconds from ``start``; tick ``n`` is the
instant ``start + n * tick``. A timer due at tick ``t`` sits in bucket
``t % size``. Scheduling and cancelling are O(1) (a dict insert or delete);
processing a tick looks at one bucket and takes out the timers whose tick has
come, while timers further away ("later rounds", more than ``size`` ticks
ahead) stay where they are. This is Netty's HashedWheelTimer without its
worker: whoever drives the wheel decides what to do with what comes due.

A timer never fires early: it is due at the first tick at or after its time.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T", bound=Hashable)

_EPS = 1e-9  # in ticks: absorbs float error, so a time on a tick maps to that tick


class TimerWheel(Generic[T]):
    """Items scheduled for a time, handed back by :meth:`advance` on their tick.

    ``current`` is the next tick to process; a time at or before it means
    "on the next processed tick".
    """

    def __init__(self, tick: float, size: int = 512, start: float = 0.0) -> None:
        if isinstance(tick, bool) or not isinstance(tick, (int, float)) or not 0 < tick < math.inf:
            raise ValueError(f"tick must be a number of seconds > 0, got {tick!r}")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"size must be an int >= 1, got {size!r}")
        self.tick = float(tick)
        self.size = size
        self.start = start
        self.current = 0  # the next tick to process
        self._buckets: list[dict[T, int]] = [{} for _ in range(size)]
        self._where: dict[T, int] = {}  # item -> its due tick

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, item: object) -> bool:
        return item in self._where

    def tick_of(self, when: float) -> int:
        """The first tick at or after the time ``when``."""
        return math.ceil((when - self.start) / self.tick - _EPS)

    def time_of(self, tick: int) -> float:
        """The instant of tick ``tick``."""
        return self.start + tick * self.tick

    def due_tick(self, item: T) -> int | None:
        """The tick ``item`` is due at, or None when it is not scheduled."""
        return self._where.get(item)

    def schedule(self, item: T, when: float) -> int:
        """(Re)schedule ``item`` for time ``when``; a past time means the next tick. O(1).

        Returns the tick it is due at.
        """
        self.cancel(item)
        due = max(self.tick_of(when), self.current)
        self._buckets[due % self.size][item] = due
        self._where[item] = due
        return due

    def schedule_all(self, items: Sequence[T], when: float) -> None:
        """(Re)schedule every one of ``items`` for the one time ``when``: a renewal round's locks of one
        TTL, rescheduled together (the tick is worked out once, not once per lock)."""
        due = max(self.tick_of(when), self.current)
        bucket, where, buckets, size = self._buckets[due % self.size], self._where, self._buckets, self.size
        for item in items:
            old = where.get(item)
            if old is not None:
                del buckets[old % size][item]
            bucket[item] = where[item] = due

    def cancel(self, item: T) -> bool:
        """Unschedule ``item``; False when it was not scheduled. O(1)."""
        due = self._where.pop(item, None)
        if due is None:
            return False
        del self._buckets[due % self.size][item]
        return True

    def advance(self, now: float) -> list[T]:
        """Process every tick up to ``now``; return (and unschedule) what came due.

        After a long stall every overdue item comes back once, and each bucket
        is visited at most once (one lap), however many ticks were missed.
        """
        last = math.floor((now - self.start) / self.tick + _EPS)
        if last < self.current:
            return []
        due: list[T] = []
        stop = min(last, self.current + self.size - 1)
        for t in range(self.current, stop + 1):
            bucket = self._buckets[t % self.size]
            if not bucket:
                continue
            if max(bucket.values()) <= last:  # the common case: nothing in it is a lap or more away
                ready = list(bucket)
                bucket.clear()
            else:
                ready = [item for item, when in bucket.items() if when <= last]
                for item in ready:
                    del bucket[item]
            for item in ready:
                del self._where[item]
            due.extend(ready)
        self.current = last + 1
        return due
