"""The duplicate and redelivery table (decide.py), row by row: a pure function, no Redis.

Each case is one row of the table in decide.py's docstring; the workers' tests
(test_identity, test_task_redelivery, test_handoff, test_reentrant) show the same
rows carried out against real Redis and real workers.
"""

from __future__ import annotations

import pytest

from celery_singleton_lock.delivery.decide import Action, Delivery, Found, decide

HELD = (Found.HELD, Found.QUEUED)  # "held by another / line": the same rows for both

ROWS = [
    # (found, who, action)
    (Found.TAKEN, Delivery("skip"), Action.RUN),
    (Found.TAKEN, Delivery("retry", redelivered=True, line=False), Action.RUN),
    (Found.ALREADY_SUCCEEDED, Delivery("skip", redelivered=True), Action.DROP),
    (Found.RESULT_MISSING, Delivery("skip", redelivered=True), Action.REPLAY),
    (Found.ENTRY_GONE, Delivery("retry", handoff=True, redelivered=True), Action.AGAIN),
    (Found.ENTRY_GONE, Delivery("retry", handoff=True), Action.DROP),
    (Found.ENTRY_GONE, Delivery("retry", recovered=True), Action.AGAIN),
    (Found.ENTRY_RAN, Delivery("retry", recovered=True), Action.DROP),
    (Found.ENTRY_RAN, Delivery("retry", recovered=True, redelivered=True), Action.DROP),
    (Found.HELD_BY_SELF, Delivery("skip", eager=True, holder_on_stack=True), Action.REENTER),
    (Found.HELD_BY_SELF, Delivery("skip", eager=True), Action.WAIT_HERE),
    (Found.HELD_BY_SELF, Delivery("skip", handoff=True), Action.DROP),
    (Found.HELD_BY_SELF, Delivery("skip", recovered=True), Action.DROP),
    (Found.HELD_BY_SELF, Delivery("skip", redelivered=True), Action.PARK_SAME),
    (Found.HELD_BY_SELF, Delivery("skip"), Action.PARK_FIRST),
    (Found.HELD_BY_SELF, Delivery("skip", retry=True), Action.PARK_FIRST),
    *[(f, Delivery("retry", eager=True, holder_on_stack=True), Action.DEADLOCK) for f in HELD],
    *[(f, Delivery("retry", recovered=True), Action.DROP) for f in HELD],
    *[(f, Delivery("retry", recovered=True, redelivered=True), Action.PARK) for f in HELD],
    *[(f, Delivery("skip", handoff=True), Action.PARK_FIRST) for f in HELD],
    *[(f, Delivery("skip", redelivered=True), Action.PARK) for f in HELD],
    *[(f, Delivery("skip", redelivered=True, never_ran=True), Action.SKIP) for f in HELD],
    *[(f, Delivery("raise", redelivered=True, never_ran=True), Action.RAISE) for f in HELD],
    *[(f, Delivery("backoff", redelivered=True, never_ran=True), Action.BACKOFF) for f in HELD],
    (Found.HELD_BY_SELF, Delivery("skip", redelivered=True, never_ran=True), Action.PARK_SAME),
    *[(f, Delivery("raise", retry=True), Action.PARK) for f in HELD],
    *[(f, Delivery("skip"), Action.SKIP) for f in HELD],
    *[(f, Delivery("raise"), Action.RAISE) for f in HELD],
    *[(f, Delivery("retry"), Action.PARK) for f in HELD],
    *[(f, Delivery("retry", eager=True), Action.WAIT_HERE) for f in HELD],
    *[(f, Delivery("backoff"), Action.BACKOFF) for f in HELD],
    *[(f, Delivery("coalesce"), Action.COALESCE) for f in HELD],
    *[(f, Delivery("coalesce", eager=True), Action.WAIT_HERE) for f in HELD],
    *[(f, Delivery("coalesce", redelivered=True), Action.PARK) for f in HELD],  # a redelivery is no duplicate
    *[(f, Delivery("coalesce", retry=True), Action.PARK) for f in HELD],
]


@pytest.mark.parametrize(("found", "who", "action"), ROWS)
def test_each_row_of_the_table(found: Found, who: Delivery, action: Action) -> None:
    assert decide(found, who) is action


@pytest.mark.parametrize(("found", "who", "action"), ROWS)
def test_without_a_line_every_line_action_backs_off_and_nothing_else_changes(
    found: Found, who: Delivery, action: Action
) -> None:
    """A quorum of independent masters cannot order a waiting line: whatever would park or wait in
    line backs off instead; every other action (run, drop, skip, raise, reenter...) is unchanged."""
    no_line = Delivery(**{**who.__dict__, "line": False})
    in_line = action in (Action.PARK, Action.PARK_FIRST, Action.PARK_SAME, Action.WAIT_HERE, Action.COALESCE)
    assert decide(found, no_line) is (Action.BACKOFF if in_line else action)


def test_every_action_is_reached_by_some_row() -> None:
    assert {action for _, _, action in ROWS} == set(Action)
