"""A quorum of independent Redis masters: Redlock, with fencing tokens that still only rise.

Redlock (redlock-py's RedLock, the Redis distributed-lock page) takes a
lock on a majority of N independent masters within its validity: the TTL minus the time
the acquire took minus a drift allowance. So a minority of servers down, slow or
restarted neither blocks nor breaks the lock. :class:`QuorumLockServer` does that behind
the same interface as one Redis (acquire, release, renew_many), so the watchdog and the
task side use it unchanged:

* every operation goes to all members at once, on one pipelined connection per member and
  process (:mod:`.fanout`: no thread per member), and is decided as soon as a majority has
  answered either way: about one round trip of wall time, not N;
* a member still busy with an earlier operation (stopped, or slow) is skipped, so a dead
  minority costs nothing but its vote; but a release (or the give-back of a failed attempt)
  is written to every member its acquire may have reached, behind that acquire on the same
  connection, and ``Q_RELEASE`` leaves a tombstone where the lock is not (yet): an acquire that
  runs late on a member that was stopped then takes nothing, so a finished lock never lingers;
* a duplicate is refused only on a majority's verdict (:meth:`QuorumLockServer._verdict`);
* the watchdog renews on every member in each round; a lock no longer confirmed by a
  majority before its deadline is lost, like any other.

**Fencing across majorities.** Martin Kleppmann's critique of Redlock is that it has no
fencing token: each master has its own clock and counter. Here the client proposes a token
(its clock in microseconds) with the acquire; each member answers ``max(the proposal, kept
within CLOCK_WINDOW of its own clock, its floor + 1)`` and raises its floor ``K:f`` to that
answer in the same script. The token is the maximum over the granting majority. Where members
answered less than that (a floor was higher, or a clock disagreed), the token is written back
as their floor (``Q_FENCE``, a second fan-out) before the acquire returns; when a majority
answered the token itself, as it does whenever the clocks agree within the window, no second
round trip is needed. Either way a majority's floors are at least the token when the acquire
returns. Any two majorities share a member, so the next holder's majority includes a member
whose floor is at least the previous token, and the next token is strictly greater. This
holds as long as that shared member kept its floor: a member restarted without persistence
must stay out for a while (Redlock's "delayed restart", automatic here: see ``SINCE``). The
floor lives for ``FENCE_KEEP`` (60 s) after it was written: after that, every member's
answer (at least its clock minus the window) is past any token written before (at most a
member's clock plus the window), unless the members' clocks disagree by more than 58 s.
That trade keeps the footprint flat: a floor per key per member for 7 days (as before) meant
7 million keys per member for a million distinct keys a day; now nothing is left 2 minutes
after a run but one key per member (``SINCE``).

The waiting line (``on_duplicate="retry"``, ``held(..., wait=...)``) needs one Redis that
orders its waiters: in quorum mode a duplicate backs off and tries again instead.
"""

from __future__ import annotations

import copy
import logging
import os
import secrets
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

from ..engine import layout, scripts, wire
from ..engine.backend import ForceReleased, HandoffSender
from ..engine.lock import Forced, Holder, Lock, Release, Released, Verdict, check_ttl, ms, slot_safe
from ..engine.server import TOKEN_BYTES, LockServer, renew_one
from ..exceptions import LockBackendUnavailable, LockError
from . import quorum_scripts as qlua
from .fanout import PENDING, SKIPPED, MemberPipe, NotSent, gather

logger = logging.getLogger("celery_singleton_lock")

CLOCK_WINDOW = 1.0
"""Seconds the client's proposed fence may be from a member's clock before the member moves it (see
the module doc): clocks that agree this well make every member answer the same fence."""
YOUNG_FOR = 2 * CLOCK_WINDOW + 1.0
"""Seconds at least that a member restarted empty does not vote alone (its lock's ttl if longer): a
token may be up to CLOCK_WINDOW ahead of a member's clock and the next one as far behind, so a floor
lost in a restart must not matter until the clocks have passed it."""
FENCE_KEEP = 60.0
"""Seconds a key's fencing floor lives on each member (past it, fencing rests on the members' clocks)."""
DRIFT = 0.01
"""Clock drift allowed between this host and the members, as a share of the TTL (Redlock's factor)."""
MEMBER_TIMEOUT = 1.0
"""Default socket timeout of the members' connections: a stopped member costs no more than this."""
LATE = 60.0
"""Seconds past its ttl after which an acquire still on its way to a member takes nothing there (the
member's clock against this host's; a release's tombstone lives as long, plus a minute of skew)."""
SINCE = "celery_singleton_lock:{quorum}:since"
"""On each member: when its data began (its first use since it last started empty). A member with data
younger than a lock's TTL may have lost a lock it granted: it does not vote alone (a delayed restart)."""


class QuorumLockServer:
    """N >= 3 independent Redis masters, used as one lock server (see the module doc).

    A :class:`~celery_singleton_lock.engine.backend.LockBackend` (not a LockServer: there is no single
    Redis to run a script on, so no waiting line): every operation goes to the members.
    """

    supports_line = supports_slot_wait = supports_merge = supports_publish = False
    supports_cooldown = may_lose_data = True

    def __init__(self, members: Sequence[LockServer]) -> None:
        self.send_handoff: HandoffSender | None = None  # nothing is handed on: no line
        self.turn_timeout = 0.0
        self.min_replicas = 0
        self.replica_timeout = 0.0
        self.client = members[0].client  # for operators' plain reads; the locks live on every member
        if len(members) < 3:
            raise ValueError(f"a quorum needs at least 3 independent Redis servers, got {len(members)}")
        self.members = list(members)
        self._pipes = [MemberPipe(m, _SCRIPTS) for m in members]
        self.majority = len(members) // 2 + 1
        self.url = "quorum(" + ", ".join(m.url for m in members) + ")"
        self.timeout = max(m.client.connection_pool.connection_kwargs.get("socket_timeout") or MEMBER_TIMEOUT
                           for m in members)
        """Seconds an operation waits for a majority's answers (the members' socket timeout)."""
        self._twins: dict[float, QuorumLockServer] = {}
        self._reached: dict[str, list[int]] = {}  # token -> the members its acquire may have reached

    @classmethod
    def from_urls(cls, urls: Sequence[str], **client_options: Any) -> QuorumLockServer:
        client_options.setdefault("socket_timeout", MEMBER_TIMEOUT)
        client_options.setdefault("socket_connect_timeout", MEMBER_TIMEOUT)
        return cls([LockServer.from_url(url, **client_options) for url in urls])

    def close(self) -> None:
        for pipe in self._pipes:
            pipe.close()
        for m in self.members:
            m.close()

    def with_timeout(self, seconds: float) -> QuorumLockServer:
        """A twin that waits ``seconds`` at most for a majority, on the same connections (so a release
        through it is still written behind the acquire it undoes)."""
        twin = self._twins.get(seconds)
        if twin is None:
            twin = self._twins[seconds] = copy.copy(self)
            twin.timeout = seconds
            twin._twins = {}
        return twin

    def error(self, exc: Exception, key: str) -> LockError:
        return self.members[0].error(exc, key)

    def dispatch(self, handoffs: Any) -> None:
        """Nothing to send: no line in quorum mode."""

    # -- fan-out ------------------------------------------------------------------

    def _fan_out(self, script: str, commands: Sequence[tuple[Sequence[str], Sequence[Any]]],
                 decided: Callable[[list[Any]], bool], only: Collection[int] | None = None,
                 force: Collection[int] = ()) -> list[Any]:
        """Send ``script`` (once per (keys, args) in ``commands``) to every member, or those in ``only``,
        at once; answers in member order. Members in ``force`` get it even if they seem stuck.

        An answer is the member's reply (a list of replies for several commands), an exception, or
        ``SKIPPED`` (busy, or not asked). Returns as soon as ``decided(answers so far)`` holds, every
        member asked answered, or :attr:`timeout` passed (later answers are read by the next operation).
        """
        calls = [pipe.send(script, commands, force=i in force) if only is None or i in only else None
                 for i, pipe in enumerate(self._pipes)]
        deadline = time.monotonic() + self.timeout + 0.05
        results = gather(self._pipes, calls, decided, deadline)
        return [LockBackendUnavailable(self.members[i].url, "no answer in time") if r is PENDING else r
                for i, r in enumerate(results)]

    def _settled(self, yes: Callable[[Any], bool]) -> Callable[[list[Any]], bool]:
        """Decided once a majority said yes, or so many said no (or could not) that no majority can."""
        def decided(results: list[Any]) -> bool:
            ayes = sum(1 for r in results if _ok(r) and yes(r))
            nays = sum(1 for r in results if r is not PENDING and not (_ok(r) and yes(r)))
            return ayes >= self.majority or nays > len(results) - self.majority
        return decided

    def _acquire_decided(self, results: list[Any]) -> bool:
        """An acquire is decided once a majority granted it; or once no majority can grant, young
        grants (status 4) counted as grants still to come; or once so many are young that no trusted
        majority can be, and trusted and young grants together make a majority (see acquire)."""
        status = [int(r[0]) if _ok(r) else -1 for r in results if r is not PENDING]
        trusted, young = status.count(1), status.count(4)
        spare = len(results) - self.majority
        nays = len(status) - trusted - young
        return trusted >= self.majority or nays > spare or (young > spare and trusted + young >= self.majority)

    def _answered(self, results: list[Any]) -> bool:
        """Decided once a majority answered at all."""
        return sum(1 for r in results if _ok(r)) >= self.majority

    # -- operations ---------------------------------------------------------------

    def acquire(
        self, name: str, ttl: float, *, owner_id: str | None = None, token: str | None = None,
        entry: str | None = None, check_done: bool = False, retake: str | None = None, slot_claim: bool = False,
    ) -> Lock | Holder | Verdict:
        """Take ``name`` on a majority within its validity, then write its fencing token back.

        ``retake`` takes back an earlier attempt's lock under ``token`` (a new one), as on one
        server; a given ``token`` without ``retake`` is itself taken back."""
        ttl = check_ttl(ttl)
        key = slot_safe(name)
        token = token or secrets.token_hex(TOKEN_BYTES)
        too_late = int((time.time() + ttl + LATE) * 1000)
        args = (token, wire.meta(owner_id), ms(ttl), owner_id or "", "1" if check_done else "", retake or "",
                too_late, _proposal(), int(CLOCK_WINDOW * 1e6), ms(FENCE_KEEP), ms(max(ttl, YOUNG_FOR)))
        sent = time.monotonic()

        keys = (key, layout.floor(key), layout.done(key), SINCE, layout.tomb(key, token))
        replies = self._fan_out(qlua.Q_ACQUIRE, [(keys, args)], self._acquire_decided)
        # where this acquire may have taken the key: granted, or sent and not answered (it may run later)
        self._reached[token] = [i for i, r in enumerate(replies)  # not sent at all: it cannot run later
                                if r is not SKIPPED and not isinstance(r, NotSent)
                                and not (_ok(r) and int(r[0]) in (0, 2, 3))]
        if any(_ok(r) and int(r[0]) == 2 for r in replies):
            self._give_back_all(key, token)
            return Verdict.ALREADY_SUCCEEDED
        trusted = [(i, int(r[1])) for i, r in enumerate(replies) if _ok(r) and int(r[0]) == 1]
        young = [(i, int(r[1])) for i, r in enumerate(replies) if _ok(r) and int(r[0]) == 4]
        granted = trusted
        if len(trusted) < self.majority and len(young) >= self.majority:
            # A majority whose data is younger than max(ttl, YOUNG_FOR): a new deployment, or a majority that
            # restarted empty at once, which no quorum can survive. Only then do their votes count.
            logger.warning("%s: a majority of the quorum's servers started empty less than %gs ago; "
                           "taking %s on their votes", self.url, max(ttl, YOUNG_FOR), key)
            granted = trusted + young
        elapsed = time.monotonic() - sent
        validity = ttl - elapsed - DRIFT * ttl - 0.002
        if len(granted) >= self.majority and validity > 0 and elapsed < ttl / 3:
            fence = max(f for _, f in granted)
            floored = sum(1 for _, f in granted if f == fence)  # members whose floor is the fence already
            if floored < self.majority:  # members that disagreed: write the fence back to the others
                on = [i for i, f in granted if f < fence]
                write_back = ((key, layout.floor(key)), (token + " ", fence, ms(FENCE_KEEP)))
                acks = self._fan_out(qlua.Q_FENCE, [write_back],
                                     lambda rs: floored + sum(1 for r in rs if _ok(r) and int(r) == 1) >= self.majority,
                                     only=on)
                floored += sum(1 for r in acks if _ok(r) and int(r) == 1)
            if floored >= self.majority and time.monotonic() - sent < ttl / 3:
                lock = Lock(self, key, token, fence, ttl, owner_id, confirmed_at=sent)
                lock.extra_margin = DRIFT * ttl  # Redlock's drift allowance, on top of the watchdog's margin
                return lock
        self._give_back_all(key, token)
        held, seen = self._verdict(replies)
        if held is not None and seen >= self.majority:
            return Holder.parse(key, held[1], int(held[2]))
        errors = [r for r in replies if not _ok(r)]
        reason = "; ".join(str(e) for e in errors[:3]) or "no majority answered in time"
        if held is not None:  # a minority's lock (a holder's release still on its way there) refuses nobody
            reason = f"held by {Holder.parse(key, held[1], int(held[2])).owner_id} on only {seen}; {reason}"
        raise LockBackendUnavailable(self.url, f"no majority of {len(self.members)} granted the lock: {reason}")

    @staticmethod
    def _verdict(replies: list[Any]) -> tuple[Any, int]:
        """The "held" reply of the token most members hold the key under, and on how many.

        A duplicate is refused only on a majority's verdict: a lock seen on a minority (the release
        of a finished holder still queued for a paused or slow member) beside members that are down
        or young makes the acquire fail as unavailable (tried again later), never "held by" a task
        that may have ended."""
        values = [(r[1] if isinstance(r[1], bytes) else str(r[1]).encode()) if _ok(r) and int(r[0]) == 0 else None
                  for r in replies]
        i, count = most_held(values)
        return (replies[i] if count else None), count

    def _give_back_all(self, key: str, token: str) -> None:
        """Undo a failed or untrusted acquire on every member it may have reached (not waited for: a
        member that does not run it in time keeps a tombstone that makes the late acquire a no-op)."""
        reached = self._reached.pop(token, range(len(self.members)))
        self._fan_out(qlua.Q_RELEASE, [self._releaser(key, token, ("", "0", "0", "0"))], lambda r: True,
                      only=reached, force=reached)

    @staticmethod
    def _releaser(key: str, token: str, rest: tuple[str, str, str, str]) -> tuple[Sequence[str], Sequence[Any]]:
        """The keys and args of a release: Q_RELEASE of ``token``'s lock (``rest``: owner id, succeeded,
        remember ms, cooldown ms), leaving a tombstone where the lock is not (yet) there."""
        owner, succeeded, remember, cooldown = rest
        return (key, layout.done(key), layout.tomb(key, token)), (
            token + " ", owner, succeeded, remember, ms(LATE + 60.0), cooldown)

    def release(self, lock: Lock, *, succeeded: bool = False, remember: float = 0.0, value: bytes = b"",
                again: bool = False, retries: int = 0, cooldown: float = 0.0,
                presend: float = 0.0, request_id: str = "") -> Released:
        """Release on every member; deleted (status 1) when a majority still had our token.

        ``value`` is not kept (a quorum's done record drops a redelivery; it cannot replay it), and
        ``again`` changes nothing (a quorum hands no key on)."""
        if lock.pid != os.getpid():
            return Released(Release.NOT_HERE)
        rest = (lock.owner_id or "", "1" if succeeded else "0", str(ms(remember)) if remember else "0",
                str(ms(cooldown)) if cooldown else "0")
        # every member the acquire may have reached gets the release, queued behind that acquire even
        # where the member seems stuck (before: skipped, so the late acquire left a lingering lock)
        reached = self._reached.pop(lock.token, range(len(self.members)))
        # decided once a majority deleted it, or so many did not that no majority can: a member that
        # answers "gone" first (its acquire had found the key held, a late lock since deleted) does
        # not decide the status while the members that had it are still answering
        replies = self._fan_out(qlua.Q_RELEASE, [self._releaser(lock.key, lock.token, rest)],
                                self._settled(lambda r: int(r) == 1), force=reached)
        statuses = [int(r) for r in replies if _ok(r)]
        if len(statuses) < self.majority:
            errors = [r for r in replies if not _ok(r)]
            raise LockBackendUnavailable(self.url, f"no majority answered the release: {errors[0] if errors else ''}")
        lock.released = True
        if sum(1 for s in statuses if s == 1) >= self.majority:
            return Released(Release.DELETED)
        return Released(Release.TAKEN if any(s == -1 for s in statuses) else Release.GONE)

    def renew(self, lock: Lock) -> bool:
        return renew_one(self, lock)

    def renew_many(self, locks: Sequence[Lock], *, chunk: int = 500) -> list[bool | LockError]:
        """Renew on every member; a lock is confirmed by a majority, lost once no majority can confirm it."""
        if not locks:
            return []
        chunks = [locks[i : i + chunk] for i in range(0, len(locks), chunk)]
        sent = time.monotonic()

        commands = [([lk.key for lk in part], [a for lk in part for a in (lk.prefix, ms(lk.ttl))])
                    for part in chunks]  # RENEW_MANY's arguments: each lock's prefix and ttl side by side
        per_member = [self._flat(chunks, r) for r in self._fan_out(scripts.RENEW_MANY, commands, self._answered)]
        out: list[bool | LockError] = []
        for i, lock in enumerate(locks):
            votes = [m[i] if isinstance(m, list) else m for m in per_member]
            ayes = sum(1 for v in votes if v is True)
            nays = sum(1 for v in votes if v is False)
            if ayes >= self.majority:
                lock.confirmed_at = sent
                lock.last_error = None
                out.append(True)
            elif nays > len(votes) - self.majority:
                out.append(False)
            else:
                shown = next((v for v in votes if not isinstance(v, bool)), "no majority")
                out.append(LockBackendUnavailable(self.url, f"renewal confirmed by {ayes} of {len(votes)}: {shown}"))
        return out

    @staticmethod
    def _flat(chunks: Sequence[Sequence[Lock]], answer: Any) -> Any:
        """One member's renewal answer, one flag (or error) per lock; an error of the member as such."""
        if not _ok(answer):
            return answer
        replies = answer if len(chunks) > 1 else [answer]
        flat: list[Any] = []
        for part, reply in zip(chunks, replies, strict=True):
            flat.extend([reply] * len(part) if isinstance(reply, Exception) else scripts.renewed(reply))
        return flat

    def nodes(self, key: str | None = None) -> list[tuple[str, Any]]:
        """Every member, whatever the key: each keeps its own copy of a lock, and a majority decides."""
        return [(m.url, m.client) for m in self.members]

    def listing(self) -> None:
        """None: its locks are Redis keys, read on every member (:meth:`nodes`)."""

    def force_release(self, key: str, expected: str = "") -> ForceReleased:
        """For operators: delete ``key``'s lock on every member, whoever holds it (only where it
        starts with ``expected``, when given): RELEASED (on at least one member: the value deleted,
        on how many), NO_LOCK, or CHANGED_HANDS (nothing deleted). No line: nothing is handed on."""
        every = range(len(self.members))
        replies = self._fan_out(qlua.Q_FORCE, [((key,), (expected,))], lambda r: False, force=every)
        answered = [r for r in replies if _ok(r)]
        if len(answered) < self.majority:
            errors = [r for r in replies if not _ok(r)]
            raise LockBackendUnavailable(self.url, f"no majority answered the release: {errors[0] if errors else ''}")
        deleted = [r for r in answered if int(r[0]) == 1]
        if deleted:
            return ForceReleased(Forced.RELEASED, bytes(deleted[0][1]), len(deleted))
        changed = [bytes(r[1]) for r in answered if int(r[0]) == -1]
        return ForceReleased(Forced.CHANGED_HANDS, changed[0]) if changed else ForceReleased(Forced.NO_LOCK, b"")

    def wait_for_change(self, name: str, holder: Holder, seconds: float) -> bool:
        return False  # independent masters: nothing to watch; the caller backs off

    def holder(self, name: str) -> Holder | None:
        for member in self.members:
            try:
                return member.holder(name)
            except LockError:
                continue
        raise LockBackendUnavailable(self.url, "no member answered")


def most_held(values: Sequence[Any]) -> tuple[int, int]:
    """Of the lock values the members hold (anything but bytes: nothing there), the index of one
    held under the token most members share, and on how many: the majority's verdict once that
    count reaches a majority (the acquire's refusal, and ``celery locks`` on a quorum)."""
    groups: dict[bytes, list[int]] = {}
    for i, value in enumerate(values):
        if isinstance(value, bytes):
            groups.setdefault(value.split(b" ", 1)[0], []).append(i)
    best = max(groups.values(), key=len, default=[])
    return (best[0] if best else -1), len(best)


def _proposal() -> int:
    """The fence this client proposes: its clock, in microseconds since 1970 (see the module doc)."""
    return time.time_ns() // 1000


_SCRIPTS = (qlua.Q_ACQUIRE, qlua.Q_FENCE, qlua.Q_RELEASE, scripts.RENEW_MANY, qlua.Q_FORCE)
"""What a quorum sends its members (each member's connection loads them as it connects)."""


def _ok(reply: Any) -> bool:
    return reply is not PENDING and not isinstance(reply, BaseException) and reply is not None
