"""The lock operations against one Redis server: :class:`LockServer`.

It knows redis-py and nothing of Celery. Every script call is ONE round trip: one EVALSHA, or one
pipeline for a batch (a release that hands the key on then publishes the waiter and confirms the
hand-off: :meth:`LockServer.dispatch`). An unreachable or stalled Redis raises
:class:`LockBackendUnavailable` (worth trying again); a refusal that trying again cannot fix (a wrong
password, a server that is not Redis, a key that holds something else) :class:`LockBackendRefused`.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from ..exceptions import LockBackendUnavailable, LockError
from . import layout, line_scripts, scripts, wire
from .addresses import redact_url
from .backend import ForceReleased, HandoffSender
from .lock import Done, Forced, Handoff, Holder, Lock, Release, Released, Verdict, check_ttl, ms, slot_safe
from .plumbing import DEFAULT_REPLICA_TIMEOUT, ScriptClient, Unreplicated
from .refusals import REDIS_ERRORS

logger = logging.getLogger("celery_singleton_lock")

TOKEN_BYTES = 16  # 128 bits
DEFAULT_CLIENT_OPTIONS = {"socket_connect_timeout": 5.0, "socket_timeout": 10.0}
"""What every lock client gets unless its options say otherwise."""

DEFAULT_TURN_TIMEOUT = 300.0
"""Seconds the key stays reserved for a waiter whose turn was sent, until its copy arrives
(``singleton_lock_turn_timeout``): then it passes to the next waiter."""


def renew_one(backend: Any, lock: Lock) -> bool:
    """``renew(lock)`` for a backend that renews in batches (``renew_many``, which answers an error per
    lock rather than raising it): that one lock's answer, its error raised."""
    result = backend.renew_many([lock])[0]
    if isinstance(result, LockError):
        raise result
    return bool(result)


class LockServer(ScriptClient):
    """The lock operations against one Redis server.

    Create one per URL and process and share it: it holds a connection pool
    and the scripts' SHAs. ``with_timeout`` gives a twin with its own pool and
    short socket timeouts (what the watchdog and releases use).

    ``send_handoff`` is how a waiting task is sent when the key is passed to it:
    the Celery side sets it (it knows how to publish); without it such a waiter
    is left for a sweeper (see :mod:`celery_singleton_lock.engine.line`).

    ``min_replicas`` > 0 makes an acquire (and a renewal) count only once that
    many replicas acknowledged it (Redis ``WAIT``, sent with the script in the
    same round trip, waiting up to ``replica_timeout`` seconds): a lock a
    failover could lose is given back and :class:`LockBackendUnavailable`
    raised. See docs/operations/topologies.md. Other topologies (Sentinel, Cluster) are
    subclasses in :mod:`celery_singleton_lock.topologies.servers`.
    """

    supports_line = supports_slot_wait = supports_merge = supports_publish = supports_cooldown = True
    """What it can do (see :class:`~.backend.LockBackend`): everything, on one Redis (and Sentinel and Cluster)."""
    may_lose_data = True
    majority = 0  # one server's word decides

    def __init__(self, client: redis.Redis, *, url: str | None = None, min_replicas: int = 0,
                 replica_timeout: float = DEFAULT_REPLICA_TIMEOUT) -> None:
        super().__init__(client, url=url, min_replicas=min_replicas, replica_timeout=replica_timeout)
        self.send_handoff: HandoffSender | None = None
        self.turn_timeout = DEFAULT_TURN_TIMEOUT
        self._twins: dict[float, LockServer] = {}  # seconds -> its twin (with_timeout)

    @classmethod
    def from_url(cls, url: str, **client_options: Any) -> LockServer:
        options = {**DEFAULT_CLIENT_OPTIONS, **client_options}
        return cls(redis.Redis.from_url(url, **options), url=redact_url(url))

    def close(self) -> None:
        """Close this server's connections (they reopen on the next operation)."""
        self._held = threading.local()  # each thread takes a fresh one from the pool (Sentinel: asks again)
        self.client.close()
        self.client.connection_pool.disconnect()

    def with_timeout(self, seconds: float) -> LockServer:
        """The twin on its own connections whose commands time out after ``seconds``, without retries:
        made once per server and timeout (the watchdog's, the release's), and kept here.

        Its WAIT for replicas (if any) is cut to half of ``seconds``, so a missing
        replica answers "not acknowledged" before the socket times out.
        """
        twin = self._twins.get(seconds)
        if twin is None:
            twin = self._twins.setdefault(seconds, self._twin(seconds))
            twin._shas = self._shas  # same server, same scripts
        twin.send_handoff = self.send_handoff  # what the server has now (a task sets it after creating it)
        twin.turn_timeout = self.turn_timeout
        twin.min_replicas = self.min_replicas
        twin.replica_timeout = min(self.replica_timeout, seconds / 2)
        return twin

    def _twin(self, seconds: float) -> LockServer:
        """A server of the same kind and address with short timeouts (topologies override it)."""
        pool = self.client.connection_pool
        kwargs = dict(pool.connection_kwargs)
        kwargs.update(socket_timeout=seconds, socket_connect_timeout=seconds, retry=Retry(NoBackoff(), 0))
        return LockServer(
            redis.Redis(connection_pool=redis.ConnectionPool(connection_class=pool.connection_class, **kwargs)),
            url=self.url,
        )

    @staticmethod
    def keys_for(key: str) -> tuple[str, str, str, str]:
        return layout.lock_keys(key)

    # -- operations ------------------------------------------------------

    def acquire(self, name: str, ttl: float, *, owner_id: str | None = None, token: str | None = None,
                entry: str | None = None, check_done: bool = False,
                retake: str | None = None, slot_claim: bool = False) -> Lock | Holder | Verdict | Done:
        """Try once to take ``name``, in one round trip.

        Returns the :class:`Lock` when taken; the :class:`Holder` when another
        holds it (or, ``queued``, when it is free but waiters are in line:
        nobody jumps the line); a :class:`Verdict` otherwise. ``entry`` claims
        a waiter's turn (see :meth:`park`). ``check_done`` first checks whether
        ``owner_id`` already succeeded here (see ``release(remember=...)``).
        ``retake``: the token of an earlier attempt whose reply was lost; if that
        attempt did take the lock, it is taken back, under ``token`` (a new one):
        only one message that carries the old token can ever take it back. Without
        ``retake``, a given ``token`` is itself taken back (the same token kept). ``slot_claim``: the
        entry's first delivery claims from its worker slot (it leaves no tombstone).

        A reply that comes later than a third of the TTL is not trusted: the
        watchdog's first renewal would already be overdue. The lock is given
        back and :class:`LockBackendUnavailable` raised.
        """
        ttl = check_ttl(ttl)
        key = slot_safe(name)
        take_back = retake if retake is not None else (token or "")
        token = token or secrets.token_hex(TOKEN_BYTES)
        sent = time.monotonic()
        try:
            fresh = not (entry or take_back or check_done)
            if fresh:  # a fresh delivery: three arguments, the script's fresh path (see fresh.py)
                reply: Any = self.run(scripts.ACQUIRE, (key, layout.line(key)),
                                      (token, wire.meta(owner_id), ms(ttl)), replicated=True, fresh=True)
            else:
                reply = self.run(
                    scripts.ACQUIRE,
                    self.keys_for(key),
                    (token, wire.meta(owner_id), ms(ttl), owner_id or "", entry or "", take_back,
                     "1" if check_done else "", "1" if slot_claim else ""),
                    replicated=True,
                )
        except Unreplicated as short:
            reply = short.reply
            if type(reply) is int or int(reply[0]) == 1:
                fence = reply if type(reply) is int else int(reply[1])
                self._give_back_unreplicated(Lock(self, key, token, fence, ttl, owner_id, confirmed_at=sent),
                                             short.acked)
        return self._outcome(key, token, ttl, owner_id, sent, reply)

    def _outcome(self, key: str, token: str, ttl: float, owner_id: str | None, sent: float,
                 reply: Any) -> Lock | Holder | Verdict | Done:
        """An acquire's reply, decoded: taken (the fence alone, from the fresh path; or {1, fence}), held
        ({0, value, pttl}, hand-offs after it when a take-back handed the key on), done ({2, value}) or
        the entry gone ({3})."""
        if type(reply) is int:  # the fresh path's reply when taken: the fence alone
            status, fence = 1, reply
        else:
            status = int(reply[0])
            fence = int(reply[1]) if status == 1 else 0
        if status == 1:
            lock = Lock(self, key, token, fence, ttl, owner_id, confirmed_at=sent, fresh=type(reply) is int)
            late = time.monotonic() - sent
            if late >= ttl / 3:
                self._give_back(lock)
                raise LockBackendUnavailable(
                    self.url, f"the acquire's reply came after {late:.2f}s, more than a third of the lock's "
                    f"ttl of {ttl:g}s; the lock was given back rather than trusted",
                )
            return lock
        if status == 2:
            return Done(reply[1]) if len(reply) > 1 and reply[1] else Verdict.ALREADY_SUCCEEDED
        if status == 3:
            return Verdict.ENTRY_GONE
        return Holder.parse(key, reply[1], int(reply[2]))

    def _give_back_unreplicated(self, lock: Lock, acked: int) -> None:
        """A lock too few replicas acknowledged: given back, and the acquire fails as unavailable."""
        self._give_back(lock)
        raise LockBackendUnavailable(
            self.url, f"only {acked} of the {self.min_replicas} replica(s) required "
            f"(singleton_lock_min_replicas) acknowledged the lock within {self.replica_timeout:g}s: "
            "a failover could lose it, so it was given back and the task does not run unlocked",
        )

    def _give_back(self, lock: Lock) -> None:
        """Release a lock that is not to be trusted (its reply came too late, or unreplicated)."""
        try:
            self.release(lock)
        except LockError:
            pass  # it expires within its ttl

    def release(self, lock: Lock, *, succeeded: bool = False, remember: float = 0.0, value: bytes = b"",
                again: bool = False, retries: int = 0, cooldown: float = 0.0, presend: float = 0.0,
                request_id: str = "") -> Released:
        """Delete the lock if ``lock`` still holds it, and pass the key to the next waiter: one round trip.

        Idempotent. On an error it raises and the handle keeps its token, so the
        caller can simply call again. ``succeeded`` with ``remember`` > 0 keeps a
        done record for ``remember`` seconds, so a redelivery of the same owner is
        told so by ``acquire(check_done=True)``; ``succeeded`` also drops parked
        redelivered copies of this owner. ``value`` (what the body returned,
        serialised) is kept beside the done record. ``again``: this retries a
        release whose reply was lost; if that first try did run and handed the key
        on, this one says "deleted" and returns the hand-off, to be sent now.
        ``retries`` (Celery's count of the holder's request) names its redelivered
        copy's entry, dropped on success wherever it waits. ``cooldown`` > 0 keeps the
        key taken, by nobody, for that many seconds: waiters get it from the sweeper
        once it runs out (announce the key to it: :func:`line.announce`). ``presend`` > 0:
        if the lock was held no longer than that, the task second in line is sent now, ahead of
        its turn, to wait for it in a worker slot (the hot-key fast path). ``request_id``: the same for a
        release tried again (``again``), so that a try that ran and lost its reply answers the retry as it
        would have answered, hand-offs and all (see :mod:`.kept`). In another process than the one that
        took it, nothing is done (status -2).
        """
        if lock.pid != os.getpid():
            return Released(Release.NOT_HERE)
        if lock.fresh and not (remember or again or cooldown):  # the lightest way
            if self.run(scripts.RELEASE, (lock.key, layout.line(lock.key)), (lock.prefix,), fresh=True, once=True) == 1:
                lock.released = True
                return Released(Release.DELETED)  # (else: a line, or gone)
        args = (lock.prefix, lock.owner_id or "", "1" if succeeded else "0", str(ms(remember)) if remember else "0",
                value if remember else "", "1" if again else "0", str(retries), str(ms(cooldown)) if cooldown else "0",
                "1" if presend and time.monotonic() - lock.acquired_at <= presend else "0")
        reply = self.run(scripts.RELEASE, self.keys_for(lock.key), args, request_id=request_id)
        lock.released = True
        handoffs = tuple(Handoff.parse(lock.key, item) for item in reply[1:])
        self.dispatch(handoffs)
        return Released(Release(int(reply[0])), handoffs)

    def renew(self, lock: Lock) -> bool:
        """Set the lock's TTL again; True renewed, False no longer the owner (or not this process's lock)."""
        if lock.pid != os.getpid():
            return False
        sent = time.monotonic()
        try:
            reply = self.run(scripts.RENEW_MANY, (lock.key,), (lock.prefix, ms(lock.ttl)), replicated=True)
        except Unreplicated as short:
            raise LockBackendUnavailable(self.url, self._unreplicated_reason(short.acked)) from None
        ok = scripts.renewed(reply)[0]
        if ok:
            lock.confirmed_at = sent
            lock.last_error = None
        return ok

    def renew_many(self, locks: Sequence[Lock], *, chunk: int = 500) -> list[bool | LockError]:
        """Renew many locks in ONE pipelined round trip (one EVALSHA per chunk).

        Returns, per lock in order: True renewed, False not the owner, or a
        :class:`LockError` for a chunk that failed. A failed chunk does not
        stop the others. Confirmed locks get ``confirmed_at`` = send time.
        """
        if not locks:
            return []
        chunks = [locks[i : i + chunk] for i in range(0, len(locks), chunk)]
        sent = time.monotonic()
        try:
            replies = self._renew_replies(chunks)
        except REDIS_ERRORS as exc:
            return [self.error(exc, locks[0].key)] * len(locks)
        if self.min_replicas > 0:
            acked = replies.pop()
            if not isinstance(acked, int) or acked < self.min_replicas:
                why = str(acked) if isinstance(acked, Exception) else self._unreplicated_reason(int(acked))
                return [LockBackendUnavailable(self.url, why)] * len(locks)
        out: list[bool | LockError] = []
        for part, reply in zip(chunks, replies, strict=False):
            if isinstance(reply, Exception):
                out.extend([self.error(reply, part[0].key)] * len(part))
                continue
            flags = scripts.renewed(reply)
            for lock, ok in zip(part, flags, strict=False):
                if ok:
                    lock.confirmed_at = sent
                    lock.last_error = None
            out.extend(flags)
        return out

    def confirm(self, name: str, entry: str) -> bool:
        """The hand-off's message for ``entry`` was sent: no sweeper sends it again, and the key stays
        reserved for it until it arrives (up to ``turn_timeout``), however slow the broker."""
        key = slot_safe(name)
        return bool(self.run(line_scripts.CONFIRM, (key, layout.waiters(key)), (entry, ms(self.turn_timeout))))

    def dispatch(self, handoffs: Iterable[Handoff]) -> None:
        """Send the waiting tasks the key was passed to (plain waiters were woken by the script)."""
        for handoff in handoffs:
            self.send_one(handoff)

    def send_one(self, handoff: Handoff) -> bool:
        """Send one waiting task: its turn came, its wait ran out, or its place was lost with the data
        (``recovered``, from the sweeper of the process that parked it). False only when sending raised
        (the broker unreachable): the sweeper then keeps a recovered one and sends it at its next look."""
        if handoff.kind == "p":
            return True
        if self.send_handoff is None:
            logger.info("lock %s: waiting task %s (%s) left for a sweeper: nothing in this process sends tasks",
                        handoff.key, handoff.owner_id, handoff.what)
            return True
        try:
            sent = self.send_handoff(self, handoff)
        except Exception:
            # an expired waiter's record is gone already: nobody can fail it later
            later = {"expired": "it stays WAITING", "recovered": "sent again at the sweeper's next look"}.get(
                handoff.what, "a sweeper will send it")
            logger.exception("lock %s: sending waiting task %s (%s) failed; %s", handoff.key,
                             handoff.owner_id, handoff.what, later)
            return False
        if sent and handoff.what == "run":  # ("next" stays unconfirmed: its turn has not come)
            try:
                self.confirm(handoff.key, handoff.entry)
            except LockError as exc:
                logger.warning("lock %s: could not mark the hand-off to %s as sent: %s", handoff.key,
                               handoff.owner_id, exc)
        return True

    def wait_for_change(self, name: str, holder: Holder, seconds: float) -> bool:
        return False  # plain code waits in the line here (line.wait_turn): never asked

    # -- for operators and tests -------------------------------------------

    def holder(self, name: str) -> Holder | None:
        """Who holds ``name`` now; None when free."""
        key = slot_safe(name)
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.get(key)
            pipe.pttl(key)
            value, pttl = pipe.execute()
        except REDIS_ERRORS as exc:
            raise self.error(exc, key) from exc
        return None if value is None else Holder.parse(key, value, pttl)

    def nodes(self, key: str | None = None) -> list[tuple[str, Any]]:
        """The one Redis its locks are on (Sentinel: the master it finds now); a Cluster overrides it."""
        return [(self.url, self.client)]

    def listing(self) -> None:
        """None: its locks are Redis keys, which the operators' commands read on :meth:`nodes`."""

    def force_release(self, key: str, expected: str = "") -> ForceReleased:
        """For operators (see :class:`~.backend.LockBackend`): the holder's own RELEASE, sent in its name
        (``expected``, the "<token> " the operator was shown; else whoever holds it now, read first), so
        the key passes to the next waiter as at any release, and this sends its message. A key that changed
        hands between the read and the release is read again (three times at most). Raises the LockError
        of an unreachable Redis."""
        for _ in range(3):
            try:
                raw = self.client.get(key)
            except REDIS_ERRORS as exc:
                raise self.error(exc, key) from exc
            value = raw if isinstance(raw, bytes) else str(raw or "").encode()
            # in whose name: the one shown, the one read, or (nothing read) no one: a lock taken meanwhile
            # is not deleted unseen ("\n" starts no lock's value)
            name = expected or (value.split(b" ", 1)[0].decode() + " " if value else "\n")
            reply = self.run(scripts.RELEASE, self.keys_for(key), (name, "", "0", "0", "", "0", "0", "0", "0"))
            status = Forced(int(reply[0]))
            if status is not Forced.CHANGED_HANDS or expected:
                break
        handoffs = tuple(Handoff.parse(key, item) for item in reply[1:])
        self.dispatch(handoffs)  # publishes the waiting task the key was handed to
        return ForceReleased(status, value, int(status is Forced.RELEASED), handoffs)
