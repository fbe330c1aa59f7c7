"""What a delivery does once its acquire has answered: the whole duplicate and redelivery logic
as one table. Pure: no Redis, no Celery; ``LockedTask.before_start`` carries the action out.

Identity comes before policy: a delivery of a task id that already succeeded
here, a redelivery, our own copy of a waiting task, or the task's own retry
is never treated as somebody's duplicate. Only a fresh delivery of *another*
call with the same key meets the task's ``on_duplicate``.

============================  =============================================  ===========================
the acquire found             who is asking                                  action
============================  =============================================  ===========================
the lock, taken               anyone                                         RUN
"already succeeded here"      a redelivery (only a redelivery asks)          DROP
"already succeeded here",     a redelivery                                   REPLAY (return the recorded
its result never stored                                                      value: Celery stores it and
                                                                             sends the chain; no body run)
its waiter entry gone         a hand-off copy the broker redelivered         AGAIN (its run never ended)
its waiter entry gone         a hand-off copy                                DROP (a twin already ran)
its waiter entry gone         a copy sent again after Redis lost its data    AGAIN (acquire again, as a
                                                                             redelivery)
entry gone, and the task      anyone                                         DROP (its entry ran: only a
started since it parked                                                      lost park is sent again)
held by the same task id      eager, and that run is up this call stack      REENTER (Celery's replace())
held by the same task id      eager, elsewhere                               WAIT_HERE
held by the same task id      a hand-off or recovered copy, or a slot        DROP (it runs already)
                              waiter's copy not redelivered
held by the same task id      a broker redelivery                            PARK_SAME: first in line,
                                                                             dropped if the holder succeeds
held by the same task id      a fresh message (retry, replace, re-sent)      PARK_FIRST
held by another / line        eager, and the holder is up this call stack    DEADLOCK
held by another / line        a recovered copy still in line                 DROP (its entry will run);
                                                                             redelivered: PARK (its entry
                                                                             anew, as its own)
held by another / line        a hand-off copy that lost its reservation      PARK_FIRST
held by another / line        a redelivery, or the task's own retry          PARK (never skipped)
held by another / line        a redelivery that provably never ran (early    the task's on_duplicate, as a
                              ack; or track_started and no state stored)     fresh delivery
held by another / line        policy "skip"                                  SKIP (REVOKED)
held by another / line        policy "raise"                                 RAISE (DuplicateTask)
held by another / line        policy "retry", in a worker                    PARK (WAITING), handed the
                                                                             key in turn
held by another / line        policy "retry", eager                          WAIT_HERE (blocks in line)
held by another / line        policy "coalesce", in a worker                 COALESCE: merged into the
                                                                             task last in line, else
                                                                             PARK (one follow-up run)
held by another / line        policy "coalesce", eager                       WAIT_HERE (blocks in line)
held by another / line        policy "backoff"                               BACKOFF (re-sent later)
any of the above              on a quorum (no line), where the row says      BACKOFF (a quorum of masters
                              PARK_*, COALESCE or WAIT_HERE                  cannot order a line); the
                                                                             re-send of a redelivery
                                                                             stays one (dropped once the
                                                                             holder succeeded)
============================  =============================================  ===========================
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Found(Enum):
    TAKEN = "taken"
    HELD_BY_SELF = "held by the same task id"
    HELD = "held by another"
    QUEUED = "free, but waiters are in line"
    ALREADY_SUCCEEDED = "already succeeded"
    RESULT_MISSING = "already succeeded, its result never stored (the value is recorded)"
    ENTRY_GONE = "entry gone"
    ENTRY_RAN = "entry gone, and the result backend shows the task started since it parked"


class Action(Enum):
    RUN = "run"
    DROP = "drop"
    REPLAY = "return the recorded value without running the body"
    AGAIN = "acquire again as a new delivery"
    REENTER = "run under the lock of the same task id up this call stack"
    WAIT_HERE = "wait in line, blocking"
    PARK_SAME = "park first in line, dropped if the holder succeeds"
    PARK_FIRST = "park first in line"
    PARK = "park at the end of the line"
    COALESCE = "merge into the task last in line, or park at the end of the line"
    DEADLOCK = "fail: it would wait for its own caller"
    SKIP = "skip"
    RAISE = "raise"
    BACKOFF = "re-send after a back-off"


@dataclass(frozen=True)
class Delivery:
    """Who is asking."""

    policy: str
    eager: bool = False
    redelivered: bool = False
    """The broker says this message was delivered before (``delivery_info["redelivered"]``)."""
    handoff: bool = False
    """Our own copy of a waiting task, sent when its turn came."""
    never_ran: bool = False
    """A redelivery that provably never started: early-acked (acked as it starts, so a redelivered
    one was requeued unstarted, e.g. prefetched at a worker restart), or ``track_started`` with no
    state stored. Its policy applies as to a fresh delivery."""
    recovered: bool = False
    """Our own copy of a waiting task whose place may be gone: sent again after the lock Redis lost its
    data, or a turn's claim sent again because the lock Redis did not answer it."""
    retry: bool = False
    """The task's own ``self.retry()`` (or autoretry): the continuation of an earlier run."""
    holder_on_stack: bool = False
    """Eager: the execution holding the key is up this thread's call stack."""
    line: bool = True
    """The lock server keeps waiting lines (False for a quorum of independent masters)."""


_LINE_ACTIONS = (Action.PARK, Action.PARK_FIRST, Action.PARK_SAME, Action.WAIT_HERE, Action.COALESCE)


def decide(found: Found, who: Delivery) -> Action:
    action = _by_table(found, who)
    if not who.line and action in _LINE_ACTIONS:
        return Action.BACKOFF
    return action


def _by_table(found: Found, who: Delivery) -> Action:
    if found is Found.TAKEN:
        return Action.RUN
    if found is Found.ALREADY_SUCCEEDED or found is Found.ENTRY_RAN:
        return Action.DROP
    if found is Found.RESULT_MISSING:
        return Action.REPLAY
    if found is Found.ENTRY_GONE:
        return Action.AGAIN if who.recovered or (who.handoff and who.redelivered) else Action.DROP
    if found is Found.HELD_BY_SELF:
        if who.eager:
            return Action.REENTER if who.holder_on_stack else Action.WAIT_HERE
        if who.handoff or who.recovered:
            return Action.DROP
        return Action.PARK_SAME if who.redelivered else Action.PARK_FIRST
    # held by another, or free with waiters in line
    if who.eager and who.holder_on_stack:
        return Action.DEADLOCK
    if who.recovered and not who.redelivered:  # (redelivered, it may have died waiting in its slot:
        return Action.DROP                       # it parks its entry anew, or a key handed to it is lost)
    if who.handoff:
        return Action.PARK_FIRST
    if (who.redelivered and not who.never_ran) or who.retry:
        return Action.PARK
    if who.policy == "skip":
        return Action.SKIP
    if who.policy == "raise":
        return Action.RAISE
    if who.policy == "backoff":
        return Action.BACKOFF
    if who.eager:
        return Action.WAIT_HERE
    return Action.COALESCE if who.policy == "coalesce" else Action.PARK
