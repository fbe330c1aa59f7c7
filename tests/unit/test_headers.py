"""The three message headers of ours, read and written in one place (pure functions)."""

from __future__ import annotations

import pytest

from celery_singleton_lock.delivery.headers import MARKED, RESEND, TURN, Resend, Turn, described, resend_of, turn_of


def test_a_turn_written_is_read_back_with_only_what_it_says():
    turn = Turn(parked_at=12.5, queue="celery", entry="t1", why="recovered", copy="c1")
    headers = turn.header()
    assert headers == {TURN: {"parked_at": 12.5, "queue": "celery", "entry": "t1", "why": "recovered", "copy": "c1"}}
    assert turn_of(headers) == turn and turn_of(headers).recovered and not turn_of(headers).expired
    assert Turn(parked_at=1.0).header() == {TURN: {"parked_at": 1.0}}  # a parked message: no entry, no why


def test_a_message_with_none_of_ours_reads_as_no_turn_and_no_resend():
    assert turn_of(None) == Turn() and turn_of({"x": 1}) == Turn()
    assert resend_of(None) == Resend() and described({}) == {}


@pytest.mark.parametrize(("legacy", "expected"), [
    ({"singleton_lock_entry": "t1", "singleton_lock_parked_at": "5.5", "singleton_lock_queue": "q"},
     Turn(parked_at=5.5, queue="q", entry="t1", why="run")),
    ({"singleton_lock_entry": "t1", "singleton_lock_recovered": "c9"}, Turn(entry="t1", why="recovered", copy="c9")),
    ({"singleton_lock_expired": 1, "singleton_lock_parked_at": 3}, Turn(parked_at=3.0, why="expired")),
])
def test_a_message_from_before_the_one_header_reads_the_same(legacy, expected):
    """A call parked by an earlier version (one header per field) still runs after an upgrade."""
    assert turn_of(legacy) == expected


def test_a_resend_counts_and_token_round_trip_and_old_ones_read():
    resend = Resend(unreachable=2, backoff=1, token="tok", redelivered=True)
    assert resend_of(resend.header()) == resend
    assert Resend(backoff=1).header() == {RESEND: {"backoff": 1}}
    old = {"singleton_lock_unreachable": "3", "singleton_lock_token": "t"}
    assert resend_of(old) == Resend(unreachable=3, token="t")


def test_described_flattens_what_the_headers_say():
    headers = {**Turn(parked_at=1.0, entry="t1", why="expired").header(), **Resend(unreachable=1).header(),
               MARKED: "1"}
    assert described(headers) == {"entry": "t1", "parked_at": 1.0, "expired": 1, "unreachable": 1, "marked": "1"}


def test_a_bad_value_in_a_header_reads_as_absent():
    assert turn_of({TURN: {"parked_at": "soon"}}).parked_at is None
    assert resend_of({RESEND: {"unreachable": "many"}}).unreachable == 0
