"""A hashed timer wheel: the watchdog's bookkeeping, with no I/O and no threads.

Time is cut into ticks; a timer due at tick ``t`` sits in bucket ``t % size``.
Scheduling and cancelling are O(1) (a dict insert or delete); each tick looks
at one bucket and takes out the timers whose tick has come (timers further
away, "later rounds", stay). This is Netty's HashedWheelTimer without its
worker: whoever drives the wheel decides what to do with what comes due.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Generic, TypeVar

T = TypeVar("T", bound=Hashable)


class TimerWheel(Generic[T]):
    def __init__(self, tick: float, size: int = 512, start: float = 0.0) -> None:
        if not tick > 0:
            raise ValueError(f"tick must be > 0 seconds, got {tick!r}")
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size!r}")
        self.tick = tick
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
        return math.ceil((when - self.start) / self.tick - 1e-9)

    def time_of(self, tick: int) -> float:
        return self.start + tick * self.tick

    def schedule(self, item: T, when: float) -> None:
        """(Re)schedule ``item`` for time ``when``; a past time means the next tick."""
        self.cancel(item)
        due = max(self.tick_of(when), self.current)
        self._buckets[due % self.size][item] = due
        self._where[item] = due

    def cancel(self, item: T) -> bool:
        due = self._where.pop(item, None)
        if due is None:
            return False
        del self._buckets[due % self.size][item]
        return True

    def advance(self, now: float) -> list[T]:
        """Process every tick up to ``now``; return (and unschedule) what came due."""
        last = math.floor((now - self.start) / self.tick + 1e-9)
        due: list[T] = []
        # Never walk more than one lap: after a long stall every bucket is visited once.
        stop = min(last, self.current + self.size - 1)
        for t in range(self.current, stop + 1):
            bucket = self._buckets[t % self.size]
            if not bucket:
                continue
            ready = [item for item, when in bucket.items() if when <= last]
            for item in ready:
                del bucket[item]
                del self._where[item]
            due.extend(ready)
        self.current = max(self.current, last + 1)
        return due
