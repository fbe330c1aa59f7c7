"""The message headers this package adds to Celery task messages: three, each read here, once.

A call that waits in line, and a call this package sends again, carry what the next delivery must
know about the ones before it (identity before policy):

``singleton_lock_turn`` (:class:`Turn`)
    on a parked call's message and every copy of it: when it first parked and from which queue;
    on a copy sent by the line, its ``entry`` and ``why`` it was sent: its turn came (``run``), a
    sweeper sent it again after the lock Redis lost its data (``recovered``, with the copy's id),
    or it waited too long (``expired``). One kind of message for a turn, whatever sent it.
``singleton_lock_resend`` (:class:`Resend`)
    on a call this package published again: how many times for an unreachable lock Redis and for
    the ``"backoff"`` policy, the token of an acquire whose reply was lost, and whether it was a
    broker redelivery.
``singleton_lock_marked``
    published under ``lock_publish``: its key's publish mark names it until its delivery starts.

All start with ``singleton_lock_``, so ``LockedTask.signature_from_request`` leaves them out of a
retry's or a chain's new message. Messages from before these three (one header per field) are
still read, so that calls parked before an upgrade run after it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

PREFIX = "singleton_lock_"
"""What every header of ours starts with."""

TURN = PREFIX + "turn"
RESEND = PREFIX + "resend"
MARKED = PREFIX + "marked"

WHY = ("run", "recovered", "expired")
"""Why the line sent a copy: its turn came, it was sent again after a loss of the data, it waited too long."""


@dataclass(frozen=True)
class Turn:
    """A waiting call's record on its message (``singleton_lock_turn``)."""

    parked_at: float | None = None
    """When it FIRST parked (epoch seconds): its ``lock_max_wait`` counts from there, whatever re-parks
    follow; also how long it waited, for metrics."""
    queue: str | None = None
    """The queue it was first delivered from: its turn goes to that queue's turns queue."""
    entry: str | None = None
    """Its entry in the key's line (a copy claims that entry's turn)."""
    why: str = ""
    """Why the line sent this copy (:data:`WHY`); "" on the parked message itself."""
    copy: str = ""
    """Which recovered copy (``why="recovered"``): a STARTED it stores names it."""

    @property
    def expired(self) -> bool:
        return self.why == "expired"

    @property
    def recovered(self) -> bool:
        return self.why == "recovered"

    def header(self) -> dict[str, Any]:
        return {TURN: {k: v for k, v in asdict(self).items() if v not in (None, "")}}


@dataclass(frozen=True)
class Resend:
    """What a copy this package published again carries (``singleton_lock_resend``)."""

    unreachable: int = 0
    """Re-sends because the lock Redis was unreachable, counted."""
    backoff: int = 0
    """Re-sends of the ``"backoff"`` policy, counted."""
    token: str = ""
    """The token of an acquire whose reply was lost (its lock, if taken, is taken back, not doubled)."""
    redelivered: bool = False
    """A re-send of a broker redelivery (a quorum has no line to park it in): the copy keeps its
    identity, so it is dropped once the running task succeeded rather than run again as new work."""

    def header(self) -> dict[str, Any]:
        return {RESEND: {k: v for k, v in asdict(self).items() if v}}


def turn_of(headers: dict[str, Any] | None) -> Turn:
    """The :class:`Turn` a message's headers carry (an empty one for a call that never waited)."""
    headers = headers or {}
    raw = headers.get(TURN)
    if not isinstance(raw, dict):
        raw = {k: headers[PREFIX + k] for k in ("parked_at", "queue", "entry") if headers.get(PREFIX + k)}
        if headers.get(PREFIX + "recovered"):  # (a message from before the one header)
            raw.update(why="recovered", copy=str(headers[PREFIX + "recovered"]))
        elif headers.get(PREFIX + "expired"):
            raw["why"] = "expired"
        elif raw.get("entry"):
            raw["why"] = "run"
    return Turn(parked_at=_number(raw.get("parked_at")), queue=_text(raw.get("queue")), entry=_text(raw.get("entry")),
                why=str(raw.get("why") or ""), copy=str(raw.get("copy") or ""))


def resend_of(headers: dict[str, Any] | None) -> Resend:
    """The :class:`Resend` a message's headers carry (an empty one for a call never sent again)."""
    headers = headers or {}
    raw = headers.get(RESEND)
    if not isinstance(raw, dict):  # (a message from before the one header)
        raw = {k: headers.get(PREFIX + k) for k in ("unreachable", "backoff", "token", "redelivered")}
    return Resend(unreachable=int(_number(raw.get("unreachable")) or 0), backoff=int(_number(raw.get("backoff")) or 0),
                  token=str(raw.get("token") or ""), redelivered=bool(raw.get("redelivered")))


def described(headers: dict[str, Any] | None) -> dict[str, Any]:
    """What our headers say, as one flat dict (for logs, tools and tests): ``entry``, ``recovered`` (the
    copy's id), ``expired``, ``parked_at``, ``queue``, ``unreachable``, ``backoff``, ``token``,
    ``redelivered`` and ``marked``, those present only."""
    turn, resend = turn_of(headers), resend_of(headers)
    said = {"entry": turn.entry, "parked_at": turn.parked_at, "queue": turn.queue,
            "recovered": turn.copy if turn.recovered else None, "expired": 1 if turn.expired else None,
            **asdict(resend), "marked": (headers or {}).get(MARKED)}
    return {k: v for k, v in said.items() if v}


def _number(value: Any) -> float | None:
    try:
        return float(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _text(value: Any) -> str | None:
    return str(value) if value else None
