"""The history check of tools/line_chaos.py: every call's final state against the journal of bodies.

The journal (db 3 of the broker Redis, which no fault touches) holds, per lock, each body's start
and end (``start:<sku>[:<task>]``, ``end:...``: run id, time, pid) and, per run id, how many bodies
ran to their end (``done``). A run id is the task id of the delivery that ran the body: for
``deduct`` and ``peek`` the order itself (published with ``task_id=order``), for ``refresh`` the
waiter that ran (with the latest merged call's arguments), for ``restock`` the id ``delay()`` made.

What must hold, per kind of call:

* ``deduct``: SUCCESS, its own result, its body ran to its end exactly once;
* ``peek`` (skip): SUCCESS and ran once, or REVOKED (skipped) and never ran;
* ``refresh`` (coalesce): SUCCESS, with the result ``[run, order]`` of the run that covered it. Either
  it ran itself (``run`` is its id, its body ran once, and ``order`` is its own or that of a call
  merged into it), or it was merged (its body never ran; ``run`` is another refresh of ours that
  ended SUCCESS with the very same result, whose body ran once, with the arguments of a call merged
  into it ("latest wins"), and STARTED AFTER this call was published: a run that began before a
  call existed cannot have covered it). A run that used another call's arguments must have covered
  that call (else that call's work ran twice, or not as itself). The one excuse: a
  call still WAITING, merged into a waiter, when the lock Redis lost its data after the call was
  published and before that waiter's body started (merged calls live in the lock Redis and are
  lost with it: docs/how-to/dedupe.md, "Limits"); those are counted apart, never hidden;
* ``restock`` (``lock_publish="join"``): a publish whose AsyncResult has an id no earlier publish
  returned made a call: SUCCESS, result ``[its id, its own order]``, body ran once. A publish that
  returned an id an earlier one returned JOINED that call. Its state and result are then the
  joined call's by construction (the same id, the same stored result: there is nothing of its own
  to compare), so what is checked is the join itself: the id is one our publishes made, that call
  ended SUCCESS, and it was still pending when the join was published (its result stored at or
  after the join's publish began; a lock is released before Celery stores the result, so a call
  seen queued, waiting or running has its result stored later). A join of a call that had already
  ended would be a lost call: the caller's work never runs.

And over all of them: no body ran to its end twice (but where the process of its first end was
SIGKILLed before the second: the window between a body's end and its release, which the guarantees
page documents as at least once; counted apart), no body ran under an id that is no call of ours,
and no two bodies of one lock overlapped, except within a TTL of a fault that took the running
holder's lock (the lock Redis stopped past the TTL, flushed, or restarted EMPTY): those are counted
apart. A restart that keeps the data is no loss, and excuses nothing.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any, NamedTuple


class Call(NamedTuple):
    kind: str  # deduct, peek, refresh or restock
    result: Any  # its AsyncResult (a joined restock's: the joined call's)
    published: float  # time.time() before its publish began


class Loss(NamedTuple):
    at: float  # time.time() of the fault
    wipes: bool  # the lock Redis's data went (flush, empty restart); False: a stop past the TTL


class Kill(NamedTuple):
    at: float  # time.time() of the SIGKILL
    pid: int  # the worker child killed


class History:
    """The journal, read once: bodies run to their end per run id, and each lock's body spans."""

    def __init__(self, journal: Any) -> None:
        self.done = {k.decode(): int(v) for k, v in journal.hgetall("done").items()}
        self.spans: dict[str, list[tuple[float, float, str]]] = {}
        self.ran: dict[str, tuple[float, float]] = {}  # run id -> the span of its body that ran to its end
        self.ends: dict[str, list[tuple[float, int]]] = {}  # run id -> (time, pid) of each end of its body
        for key in journal.scan_iter("start:*"):
            lock = key.decode().split(":", 1)[1]
            ends = {}
            for e in journal.lrange(f"end:{lock}", 0, -1):
                run, at, pid = e.decode().split()
                ends[(run, pid)] = float(at)
                self.ends.setdefault(run, []).append((float(at), int(pid)))
            spans = []
            for s in journal.lrange(key, 0, -1):
                run, at, pid, _fence = s.decode().split()
                if (run, pid) in ends:
                    spans.append((float(at), ends[(run, pid)], run))
                    self.ran[run] = (float(at), ends[(run, pid)])
            self.spans[lock] = sorted(spans)


def overlaps(history: History, losses: list[Loss], ttl: float) -> tuple[int, int]:
    """(overlaps, overlaps within a TTL of a loss): two bodies of one lock at once."""
    bad, near_loss = 0, 0
    for lock, spans in history.spans.items():
        reach = None  # the body seen so far that ends last
        for s2, e2, o2 in spans:
            s1, e1, o1 = reach or (0.0, 0.0, "")
            if reach is None or e2 > e1:
                reach = (s2, e2, o2)
            if s2 < e1 - 1e-3:
                if any(loss.at - 1 <= s2 <= loss.at + ttl + 2 for loss in losses):
                    near_loss += 1
                else:
                    bad += 1
                    print(f"[chaos] OVERLAP on {lock}: {o1} {s1:.3f}-{e1:.3f} and {o2} {s2:.3f}-{e2:.3f}")
    return bad, near_loss


class Checker:
    """Each call's final state against the history (the module doc); ``problems`` lists what failed."""

    def __init__(self, calls: dict[str, Call], history: History, losses: list[Loss],
                 kills: list[Kill] | None = None) -> None:
        self.calls, self.history, self.losses = calls, history, losses
        # The one excuse for a body that ran to its end twice (docs/concepts/guarantees.md, "a holder after
        # its body"): the process that first ran it to its end was SIGKILLed before the next run ended, so
        # its release (which records that the body ran) may not have reached Redis, and the broker
        # redelivered the call (acks_late: at least once there). Counted apart, never hidden.
        self.reran = {run for run, n in history.done.items() if n == 2 and _killed_after_first_end(
            sorted(history.ends.get(run, [])), kills or [])}
        self.problems: list[str] = []
        self.tally: Counter[str] = Counter()
        self.excused: list[str] = []
        self.made: dict[str, str] = {}  # restock task id -> the order whose publish made the call

    def run(self) -> None:
        for order, call in self.calls.items():  # (in publish order: a join follows the publish it joins)
            getattr(self, call.kind)(order, call)
        runs = set(self.calls) | set(self.made)
        self.problems += [f"{run}: ran to its end {n} times" for run, n in self.history.done.items()
                          if n > 1 and run not in self.reran]
        self.problems += [f"{run}: a body ran under an id that is no call of ours" for run in self.history.done
                          if run not in runs]

    def _fail(self, order: str, what: str) -> None:
        self.problems.append(f"{order}: {what}")

    def _ran_once(self, order: str, run: str) -> None:
        if self.history.done.get(run, 0) != 1 and run not in self.reran:
            self._fail(order, f"its run {run} ran to its end {self.history.done.get(run, 0)} times, not once")

    def deduct(self, order: str, call: Call) -> None:
        state = call.result.state
        self.tally[f"deduct {state}"] += 1
        if state != "SUCCESS" or call.result.result != order:
            self._fail(order, f"deduct ended {state} ({call.result.result!r})")
        self._ran_once(order, order)

    def peek(self, order: str, call: Call) -> None:
        state = call.result.state
        self.tally[f"peek {state}"] += 1
        if state == "SUCCESS" and call.result.result == order:
            self._ran_once(order, order)
        elif state != "REVOKED":
            self._fail(order, f"peek ended {state} ({call.result.result!r})")
        elif self.history.done.get(order, 0):
            self._fail(order, "peek ended REVOKED (skipped), yet its body ran")

    def refresh(self, order: str, call: Call) -> None:
        state, value = call.result.state, call.result.result
        if state != "SUCCESS":
            self.tally[f"refresh {state}"] += 1
            if self._lost_with_data(call):
                self.excused.append(f"{order} (merged into {call.result.info.get('merged_into')})")
            else:
                self._fail(order, f"refresh ended {state} ({value!r})")
            return
        if not (isinstance(value, list) and len(value) == 2):
            self._fail(order, f"refresh ended SUCCESS with {value!r}, not [run, order]")
            return
        run, ran_with = value
        if run == order:
            self.tally["refresh SUCCESS ran"] += 1
            self._ran_once(order, order)
            merged = self.calls.get(ran_with)
            if ran_with != order and (merged is None or merged.kind != "refresh"
                                      or merged.result.result != value):
                got = (merged.result.state, merged.result.result) if merged else "no call of ours"
                self._fail(order, f"ran with the arguments of {ran_with}, a call this run did not cover: "
                                  f"{ran_with} ended {got}")
            return
        self.tally["refresh SUCCESS coalesced"] += 1
        self._covered(order, call, run, value)

    def _covered(self, order: str, call: Call, run: str, value: list[str]) -> None:
        """A coalesced call's covering run: a refresh of ours, ended as this call did, started after it."""
        if self.history.done.get(order, 0):
            self._fail(order, f"coalesced into {run}, yet its own body ran")
        cover = self.calls.get(run)
        if cover is None or cover.kind != "refresh":
            self._fail(order, f"coalesced into {run}, no refresh of ours")
            return
        if cover.result.state != "SUCCESS" or cover.result.result != value:
            self._fail(order, f"coalesced into {run}, which ended {cover.result.state} ({cover.result.result!r})")
        self._ran_once(order, run)
        if value[1] == run:  # "latest wins": a run that covers merged calls runs with the latest one's arguments
            self._fail(order, f"coalesced into {run}, which ran with its own arguments, not a merged call's")
        span = self.history.ran.get(run)
        if span is not None and span[0] <= call.published:
            self._fail(order, f"coalesced into {run}, whose body started at {span[0]:.3f}, before this call "
                              f"was published ({call.published:.3f})")

    def _lost_with_data(self, call: Call) -> bool:
        """A call merged into a waiter, whose record a wipe of the lock Redis took (the module doc)."""
        info = call.result.info
        into = info.get("merged_into") if isinstance(info, dict) else None
        if call.result.state != "WAITING" or not into:
            return False
        start = self.history.ran.get(into, (math.inf, math.inf))[0]
        return any(loss.wipes and call.published <= loss.at <= start for loss in self.losses)

    def restock(self, order: str, call: Call) -> None:
        res = call.result
        first = self.made.setdefault(res.id, order)
        state, value = res.state, res.result
        if first == order:
            self.tally[f"restock {state} published"] += 1
            if state != "SUCCESS" or value != [res.id, order]:
                self._fail(order, f"restock {res.id} ended {state} ({value!r}), not [its id, its order]")
            self._ran_once(order, res.id)
            return
        self.tally[f"restock {state} joined"] += 1
        if state != "SUCCESS":  # (the joined call's own check names it too)
            self._fail(order, f"joined {res.id} (published by {first}), which ended {state}")
        done_at = res.date_done
        if done_at is not None and done_at.timestamp() < call.published:
            self._fail(order, f"joined {res.id} (published by {first}), whose result was stored at "
                              f"{done_at.timestamp():.3f}, before this publish began ({call.published:.3f})")


RELEASE_WINDOW = 2 * 2.0 + 1.0
"""How long after a body's end its release may still be on its way: two tries of the default
``singleton_lock_release_timeout`` (2 s), and 1 s for the scheduling of a loaded host."""


def _killed_after_first_end(ends: list[tuple[float, int]], kills: list[Kill]) -> bool:
    """Was the process of a body's first end SIGKILLed after that end, while its release could still be on
    its way (RELEASE_WINDOW), and before the second end? A kill after that release had its time to
    reach Redis excuses nothing: the release records that the body ran."""
    if len(ends) != 2:
        return False
    (first, pid), (second, _) = ends
    return any(kill.pid == pid and first <= kill.at <= min(second, first + RELEASE_WINDOW) for kill in kills)


def check(calls: dict[str, Call], journal: Any, losses: list[Loss], ttl: float, logdir: Path,
          kills: list[Kill] | None = None) -> int:
    """Print the verdict; 0 when every guarantee held."""
    history = History(journal)
    checker = Checker(calls, history, losses, kills)
    checker.run()
    bad, near_loss = overlaps(history, losses, ttl)
    print(f"[chaos] states: {dict(sorted(checker.tally.items()))}")
    print(f"[chaos] merged calls lost with the lock Redis's data (documented): {len(checker.excused)} "
          f"{checker.excused[:10]}")
    print(f"[chaos] bodies run again after the process that ran them to their end was killed before it "
          f"released (documented): {len(checker.reran)} {sorted(checker.reran)[:10]}")
    print(f"[chaos] problems: {len(checker.problems)}")
    for line in checker.problems[:30]:
        print(f"[chaos]   {line}")
    print(f"[chaos] overlaps: {bad} (and {near_loss} within a TTL of a lock-Redis data loss)")
    print(f"[chaos] worker logs: {logdir}")
    ok = not checker.problems and not bad
    print("[chaos] OK" if ok else "[chaos] FAILED")
    return 0 if ok else 1
