"""TimerWheel bookkeeping: pure, no Redis, no threads, no clock (times are plain numbers)."""

from __future__ import annotations

import pytest

from celery_singleton_lock.watchdog.wheel import TimerWheel

pytestmark = pytest.mark.timeout(10)


def make(tick: float = 0.1, size: int = 8) -> TimerWheel[str]:
    return TimerWheel(tick, size=size, start=100.0)


def test_item_comes_due_on_its_tick_and_not_before():
    w = make()
    w.schedule("a", 100.35)  # between ticks 3 and 4: due at tick 4 (never early)
    assert w.due_tick("a") == 4
    assert "a" in w and len(w) == 1
    assert w.advance(100.1) == []
    assert w.advance(100.3) == []
    assert w.advance(100.39) == []
    assert w.advance(100.4) == ["a"]
    assert "a" not in w and len(w) == 0
    assert w.advance(100.5) == []  # handed back once only


def test_time_on_a_tick_maps_to_that_tick():
    w = make(tick=0.1)
    # 0.3 / 0.1 is 2.9999999999999996 in floats: still tick 3, not 4
    assert w.tick_of(100.3) == 3
    assert w.time_of(3) == pytest.approx(100.3)
    assert w.tick_of(w.time_of(7)) == 7
    w.schedule("a", w.time_of(3))
    assert w.advance(w.time_of(3)) == ["a"]


def test_items_on_the_same_tick_come_together_and_others_stay():
    w = make()
    for name in "abc":
        w.schedule(name, 100.2)
    w.schedule("later", 100.5)
    assert sorted(w.advance(100.2)) == ["a", "b", "c"]
    assert len(w) == 1
    assert w.advance(100.5) == ["later"]


def test_schedule_and_cancel_touch_one_bucket():
    w = make(size=8)
    for i in range(1000):
        w.schedule(f"k{i}", 100.0 + (i % 50) * 0.1)
    assert len(w) == 1000
    buckets_before = [len(b) for b in w._buckets]
    assert w.cancel("k7") is True
    buckets_after = [len(b) for b in w._buckets]
    changed = [i for i, (x, y) in enumerate(zip(buckets_before, buckets_after, strict=True)) if x != y]
    assert changed == [7 % 8]  # only the item's own bucket was touched
    assert "k7" not in w and len(w) == 999
    assert w.cancel("k7") is False  # twice is harmless


def test_cancel_of_an_unknown_item():
    w = make()
    assert w.cancel("never-scheduled") is False
    w.schedule("a", 100.1)
    assert w.cancel("b") is False
    assert w.advance(100.1) == ["a"]
    assert w.cancel("a") is False  # already handed back


def test_cancelled_item_never_comes_due():
    w = make()
    w.schedule("a", 100.2)
    w.schedule("b", 100.2)
    assert w.cancel("a") is True
    assert w.advance(101.0) == ["b"]


def test_later_rounds_stay_until_their_round():
    w = make(tick=0.1, size=8)  # one lap is 0.8 s
    w.schedule("near", 100.3)  # tick 3
    w.schedule("far", 100.3 + 0.8)  # tick 11: same bucket, next round
    w.schedule("farther", 100.3 + 1.6)  # tick 19: same bucket, the round after
    assert w.due_tick("far") == 11 and w.due_tick("farther") == 19
    assert w.advance(100.3) == ["near"]
    assert w.advance(101.0) == []  # tick 10: "far" still one tick away
    assert "far" in w and "farther" in w
    assert w.advance(101.1) == ["far"]
    assert w.advance(101.8) == []
    assert w.advance(101.9) == ["farther"]
    assert len(w) == 0


def test_reschedule_moves_the_item():
    w = make()
    w.schedule("a", 100.2)
    w.schedule("a", 100.6)  # later
    assert len(w) == 1 and w.due_tick("a") == 6
    assert w.advance(100.5) == []
    assert w.advance(100.6) == ["a"]
    w.schedule("b", 101.5)
    w.schedule("b", 100.8)  # earlier
    assert w.advance(100.8) == ["b"]
    assert w.advance(102.0) == []  # no copy left in the old bucket


def test_past_time_means_the_next_tick():
    w = make()
    assert w.advance(100.5) == []
    assert w.current == 6
    assert w.schedule("late", 99.0) == 6  # in the past: next processed tick
    assert w.advance(100.55) == []
    assert w.advance(100.6) == ["late"]


def test_advance_backwards_or_within_a_tick_does_nothing():
    w = make()
    w.schedule("a", 100.3)
    assert w.advance(100.25) == []
    current = w.current
    assert w.advance(100.0) == []  # an earlier time: nothing, and current does not go back
    assert w.current == current
    assert w.advance(100.3) == ["a"]


def test_long_stall_returns_everything_overdue_exactly_once():
    w = make(tick=0.1, size=8)  # one lap is 0.8 s
    names = [f"k{i}" for i in range(40)]
    for i, name in enumerate(names):
        w.schedule(name, 100.0 + i * 0.1)  # ticks 0..39: five laps
    w.schedule("future", 100.0 + 60 * 0.1)  # tick 60
    due = w.advance(103.05)  # a stall of 30 ticks, almost 4 laps
    assert sorted(due) == sorted(names[:31])  # ticks 0..30
    assert len(due) == len(set(due))
    assert w.current == 31
    rest = w.advance(104.0)  # ticks 31..40
    assert sorted(rest) == sorted(names[31:])
    assert "future" in w
    assert w.advance(200.0) == ["future"]  # a stall of hundreds of laps: still once
    assert w.advance(300.0) == [] and len(w) == 0


def test_a_stall_visits_each_bucket_at_most_once():
    w = make(tick=0.1, size=8)
    w.schedule("a", 100.1)
    visited = []

    class CountingList(list):
        def __getitem__(self, i):
            visited.append(i)
            return super().__getitem__(i)

    w._buckets = CountingList(w._buckets)
    assert w.advance(100.0 + 10_000 * 0.1) == ["a"]
    assert len(visited) <= w.size


@pytest.mark.parametrize("tick", [0, -0.1, float("nan"), float("inf"), "0.1", None, True])
def test_bad_tick_raises_naming_the_value(tick):
    with pytest.raises(ValueError) as info:
        TimerWheel(tick)
    assert repr(tick) in str(info.value)
    assert "tick" in str(info.value)


@pytest.mark.parametrize("size", [0, -3, 2.5, "8", None, False])
def test_bad_size_raises_naming_the_value(size):
    with pytest.raises(ValueError) as info:
        TimerWheel(0.1, size=size)
    assert repr(size) in str(info.value)
    assert "size" in str(info.value)


def test_schedule_all_moves_every_item_to_one_tick_and_keeps_later_laps():
    w: TimerWheel[str] = TimerWheel(0.1, size=8)
    w.schedule("a", 0.05)
    w.schedule("far", 2.0)  # more than one lap (0.8 s) away, in a bucket it shares with others
    w.schedule_all(["a", "b", "c"], 0.4)  # "a" moves; "b" and "c" are new
    assert [w.due_tick(x) for x in "abc"] == [4, 4, 4] and len(w) == 4
    assert w.advance(0.35) == []
    assert sorted(w.advance(0.4)) == ["a", "b", "c"]
    w.schedule_all(["x"], 2.8)  # tick 28: the bucket of "far"'s tick 20, a lap later
    assert w.advance(1.9) == [] and "far" in w and "x" in w
    assert w.advance(2.0) == ["far"] and "x" in w  # only what is due leaves a shared bucket
