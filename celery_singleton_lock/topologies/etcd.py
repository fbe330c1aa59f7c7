"""Locks on an etcd v3 cluster: consensus behind the same interface as one Redis.

``singleton_lock_url = "etcd://host:2379"`` or a comma-separated list of the cluster's endpoints
(``etcd://h1:2379,h2:2379,h3:2379``); ``etcds://`` for TLS (query ``ca_cert``, ``cert_cert``,
``cert_key``), ``etcd://user:password@...`` for etcd's auth, ``?timeout=`` for the requests'.
The client is the ``[etcd]`` extra (etcd3gw: etcd's gRPC-gateway JSON API).

The design is etcd's concurrency package:

* a **session**: one lease per worker process (and lock TTL), granted on first use; every lock of
  the process is put with it, and the watchdog keeps the SESSION alive, on one timer with ONE
  keep-alive per period however many locks hang on it (:meth:`EtcdLockServer.keep_session`): no
  per-lock work. A lost lease marks every lock on it lost at once (``lock_lost``, ``.lost``, ``ensure()``);
* **acquire** is one txn: ``create_revision(K) == 0``, nobody in K's line and no turn reserved
  (and, for a redelivery, no done record) -> put K on the session's lease; else read who holds it;
* **release** is one txn: ``create_revision(K) == ours`` and nobody waits -> delete K (and keep a
  done record on a lease of its own when asked), so only the holder's own incarnation of the key is
  ever deleted; with waiters, one more txn deletes K and reserves the key for the first of them;
* an acquire whose reply never came is settled later, so its put, if it lands late, never keeps a
  lock nobody holds (:mod:`.etcd_txn`);
* **fencing**: ``fencing_token`` is K's create revision. Raft orders every write of the cluster,
  so the next holder's revision is strictly greater, across leader changes too;
* **the waiting line**: waiters are keys ordered by create revision, handed the key on release
  (:mod:`.etcd_line`).

Not here: ``singleton_lock_min_replicas`` (every write is already committed by a majority), merging
calls and waiting in a worker slot (see :mod:`.etcd_line`).
"""

from __future__ import annotations

import copy
import logging
import os
import secrets
import time
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any

from ..engine import layout
from ..engine.backend import ForceReleased, HandoffSender
from ..engine.line import entry_for
from ..engine.lock import Done, Forced, Handoff, Holder, Lock, Release, Released, Verdict, check_ttl, slot_safe
from ..engine.server import DEFAULT_TURN_TIMEOUT, TOKEN_BYTES, renew_one
from ..exceptions import LockBackendUnavailable, LockError
from . import etcd_watch
from .etcd_line import EtcdLine, anyone_waits, line_is_empty
from .etcd_listing import EtcdListing
from .etcd_records import EtcdRecords
from .etcd_session import DoneLeases, LeaseGone, Session, Sessions, Transport, b64, lease_ttl, parse_etcd_url, unb64
from .etcd_txn import LATE, Doubts, _compare_create, _compare_value, _kvs, _put, _range, _value, not_tombed, tomb

logger = logging.getLogger("celery_singleton_lock")

FRESH_FOR = 1 / 3
"""A session confirmed less than this share of its TTL ago (one renewal period) needs no keep-alive
before a lock is put on it: the lock takes that confirmation as its own (a :class:`.SessionLock`
reads its session's), and the watchdog keeps the session alive one period after it."""
VERIFY_UP_TO = 128
"""A session with at most this many locks on it also has their keys read when it is kept alive (one
txn: etcd's default limit of operations per txn); a larger one only keeps the lease alive."""


class EtcdLockServer:
    """An etcd v3 cluster as a :class:`~celery_singleton_lock.engine.backend.LockBackend` (see the
    module doc). Create one per URL and process (``servers.shared``): it holds the sessions."""

    supports_line = True
    supports_slot_wait = supports_merge = supports_publish = supports_cooldown = False
    may_lose_data = False  # (consensus: a member's restart loses nothing the cluster acknowledged)
    majority = 0  # (Raft's majority decides inside etcd: the cluster answers as one)

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self.url = transport.url
        self.send_handoff: HandoffSender | None = None  # the Celery side sets it
        self.turn_timeout = DEFAULT_TURN_TIMEOUT
        self.min_replicas = 0
        self.replica_timeout = 0.0
        self.client = EtcdRecords(self)
        """Plain reads and writes that take no lock (beat's run record)."""
        self._registry = Sessions(self.keep_session)  # shared with the twins
        self._done_leases = DoneLeases()
        self._doubts = Doubts()  # shared with the twins: acquires whose reply never came
        self._twins: dict[float, EtcdLockServer] = {}
        self.waiting = EtcdLine(self)
        """The keys' waiting lines (:mod:`.etcd_line`)."""

    @classmethod
    def from_url(cls, url: str, **options: Any) -> EtcdLockServer:
        """``options`` (``singleton_lock_redis_options`` on etcd): ``timeout`` (or ``socket_timeout``),
        ``ca_cert``, ``cert_cert``, ``cert_key``, ``user``, ``password``; anything else is a ValueError."""
        settings = parse_etcd_url(url)
        if "socket_timeout" in options:
            options["timeout"] = options.pop("socket_timeout")
        unknown = set(options) - {"timeout", "ca_cert", "cert_cert", "cert_key", "user", "password"}
        if unknown:
            raise ValueError(f"etcd lock server {settings['url']}: unknown option(s) {', '.join(sorted(unknown))} "
                             "(it takes timeout, ca_cert, cert_cert, cert_key, user, password)")
        settings.update(options)
        return cls(Transport(**settings))

    def close(self) -> None:
        self.transport.close()

    def with_timeout(self, seconds: float) -> EtcdLockServer:
        """A twin whose requests time out after ``seconds``, sharing this server's sessions."""
        twin = self._twins.get(seconds)
        if twin is None:
            twin = copy.copy(self)
            twin.transport = self.transport.twin(seconds)
            twin._twins = {}
            twin.waiting = EtcdLine(twin)
            self._twins[seconds] = twin
        twin.send_handoff = self.send_handoff  # what the server has now (a task sets it after creating it)
        twin.turn_timeout = self.turn_timeout
        return twin

    def error(self, exc: Exception, key: str) -> LockError:
        return exc if isinstance(exc, LockError) else LockBackendUnavailable(self.url, f"{key}: {exc!r}")

    def dispatch(self, handoffs: Iterable[Handoff]) -> None:
        """Send the waiting tasks the key was passed to (or that waited too long); a turn sent stays
        reserved up to ``turn_timeout`` (:meth:`.etcd_line.EtcdLine.confirm`). Without a sender (no
        Celery app here) a turn is left to run out, and a sweeper sends it."""
        for handoff in handoffs:
            if self.send_handoff is None:
                logger.info("lock %s: waiting task %s (%s) left for a sweeper: nothing in this process sends "
                            "tasks", handoff.key, handoff.owner_id, handoff.what)
                continue
            try:
                sent = self.send_handoff(self, handoff)
                if sent and handoff.what == "run":
                    self.waiting.confirm(handoff.key, handoff.entry)
            except Exception:
                logger.exception("lock %s: sending waiting task %s (%s) failed; a sweeper will send it",
                                 handoff.key, handoff.owner_id, handoff.what)

    # -- sessions ---------------------------------------------------------------------

    def session(self, ttl: float) -> Session:
        """This process's session for locks of ``ttl`` seconds (one lease; a fork starts its own)."""
        return self._registry.get(lease_ttl(ttl))

    def sessions(self) -> list[Session]:
        return self._registry.all()

    # -- operations -------------------------------------------------------------------

    def acquire(self, name: str, ttl: float, *, owner_id: str | None = None, token: str | None = None,
                entry: str | None = None, check_done: bool = False,
                retake: str | None = None, slot_claim: bool = False) -> Lock | Holder | Verdict | Done:
        """Try once to take ``name``: one txn (plus a lease grant or keep-alive when the session is new
        or idle). A lock held under ``retake`` or under ``token`` (an earlier attempt of this very
        delivery whose reply was lost) is taken back, under ``token``, at its revision."""
        ttl = check_ttl(ttl)
        key = slot_safe(name)
        take_back = retake if retake is not None else (token or "")
        token = token or secrets.token_hex(TOKEN_BYTES)
        session = self.session(ttl)
        if self._doubts:
            self._doubts.settle(self.transport, self._done_leases)
        for attempt in (1, 2):
            session.ensure(self.transport, fresh_for=session.ttl * FRESH_FOR)
            try:
                return self._try(session, key, token, take_back, owner_id, check_done, entry)
            except LeaseGone:  # the lease expired between the check and the put: a new session
                session.drop(session.lease, "its etcd lease expired")
                if attempt == 2:
                    raise
            except LockBackendUnavailable:  # its put may still land, late: settled soon (etcd_txn)
                self._doubts.add(key, token, _value(token, session.ttl, owner_id))
                raise
        raise AssertionError("unreachable")

    def _try(self, session: Session, key: str, token: str, take_back: str, owner_id: str | None,
             check_done: bool, entry: str | None = None, again: bool = True) -> Lock | Holder | Verdict | Done:
        lock_key, lease, confirmed = layout.etcd_lock(key), session.lease, session.confirmed_at
        value = _value(token, session.ttl, owner_id)
        compare = [_compare_create(lock_key, 0), not_tombed(key, token), *self.waiting.free(key, entry)]
        failure = [_range(lock_key)]
        if check_done and owner_id:
            done_key = layout.etcd_done(key, owner_id)
            compare.append({"key": b64(done_key), "target": "VERSION", "result": "EQUAL", "version": "0"})
            failure.append(_range(done_key))
        looks_at = len(failure)
        failure += self.waiting.looks(key, entry)
        success = [_put(lock_key, value, lease), *self.waiting.taken(key, entry)]
        if take_back and take_back != token:  # the lost attempt's put, if it is still on its way, lands on a tomb
            tombstone = _put(tomb(key, take_back), b"", self._done_leases.lease_for(self.transport, LATE))
            success.append(tombstone)
            failure.append(tombstone)
        reply = self.transport.txn(compare, success, failure, key)
        if reply.get("succeeded"):
            return self._handle(session, key, token, int(reply["header"]["revision"]), owner_id, confirmed)
        responses = reply.get("responses") or []
        if looks_at > 1 and _kvs(responses[1]):
            kept = unb64(_kvs(responses[1])[0].get("value"))
            return Done(kept) if kept else Verdict.ALREADY_SUCCEEDED
        held = _kvs(responses[0]) if responses else []
        if not held:  # free, yet not taken: a line, a turn, or released between the compare and the read
            why = self.waiting.refused(key, entry, responses[looks_at:])
            if isinstance(why, Holder):
                return why
            if why == "gone":
                return Verdict.ENTRY_GONE
            if again and (why is None or (entry and self.waiting.reserve_if_first(key, entry))):
                return self._try(session, key, token, take_back, owner_id, False, entry, again=False)
            return Holder.parse(key, "", -2)  # someone is ahead of the claim whose reservation ran out
        holder = self._holder(key, held[0])
        held_token = holder.raw.partition(" ")[0]
        if held_token and held_token in (token, take_back):  # ours: an attempt whose reply was lost
            self._doubts.forget(key, held_token)
            return self._take_back(session, key, token, holder, value, owner_id, confirmed)
        if entry and self.waiting.refused(key, entry, responses[looks_at:]) == "gone":
            return Verdict.ENTRY_GONE  # a copy whose entry already ran (or left): never parked again
        return holder

    def _take_back(self, session: Session, key: str, token: str, holder: Holder, value: str,
                   owner_id: str | None, confirmed: float) -> Lock | Holder:
        """Our own earlier attempt holds the key (its reply was lost, or a member failed it over to the
        next endpoint after it ran): keep its incarnation (its revision), under ``token``, on this
        session's lease (never left behind on a lease that this process keeps alive for other locks)."""
        revision = holder.fencing_token or 0
        lock_key = layout.etcd_lock(key)
        reply = self.transport.txn([_compare_create(lock_key, revision)], [_put(lock_key, value, session.lease)],
                                   [], key)
        if not reply.get("succeeded"):
            return holder
        return self._handle(session, key, token, revision, owner_id, confirmed)

    def _handle(self, session: Session, key: str, token: str, revision: int, owner_id: str | None,
                confirmed: float) -> Lock:
        """The handle of a lock put on ``session``'s lease: trusted as long as the lease lives (its
        last confirmation plus its TTL), renewed with the session."""
        lock = session.new_lock(self, key, token, revision, owner_id, confirmed)
        if time.monotonic() >= lock.deadline - lock.ttl / 3:  # no time left for the first keep-alive
            self.release(lock)
            raise LockBackendUnavailable(self.url, f"the acquire of {key} came too late to be trusted "
                                         "(its lease is nearly out); the lock was given back")
        return lock

    @staticmethod
    def _holder(key: str, kv: dict[str, Any]) -> Holder:
        raw = unb64(kv.get("value")).decode(errors="replace")
        token, _, rest = raw.partition(" ")
        ttl_ms, _, meta_text = rest.partition(" ")
        parsed = Holder.parse(key, f"{token} 0 {meta_text}", int(ttl_ms) if ttl_ms.isdigit() else -1)
        return replace(parsed, raw=raw, fencing_token=int(kv.get("create_revision", 0)) or None)

    def release(self, lock: Lock, *, succeeded: bool = False, remember: float = 0.0, value: bytes = b"",
                again: bool = False, retries: int = 0, cooldown: float = 0.0,
                presend: float = 0.0, request_id: str = "") -> Released:
        """Delete the key if it is still ours (its create revision is our fencing token, its value our
        token's) and nobody waits: one txn. If someone waits, one more look at the line's head and one
        txn that deletes the key and reserves it for the first live waiter at once; its message is
        then sent (:mod:`.etcd_line`).
        ``succeeded`` with ``remember`` > 0 keeps ``value`` as the owner's done record that long."""
        if lock.pid != os.getpid():
            return Released(Release.NOT_HERE)
        lock_key = layout.etcd_lock(lock.key)
        extra = []
        if succeeded and remember > 0 and lock.owner_id:
            lease = self._done_leases.lease_for(self.transport, remember)
            extra.append(_put(layout.etcd_done(lock.key, lock.owner_id), value, lease))
        delete = {"request_delete_range": {"key": b64(lock_key)}}
        ours = [_compare_create(lock_key, lock.fencing_token), _compare_value(lock_key, _value(lock.token, lock.ttl,
                                                                                            lock.owner_id))]
        # a lock already gone (expired) still records the success; one another holds records nothing
        record = [{"request_txn": {"compare": [_compare_create(lock_key, 0)], "success": extra}}] if extra else []
        free_line = line_is_empty(lock.key)
        reply = self.transport.txn([*ours, free_line], [delete, *extra],
                                   [_range(lock_key), *record, anyone_waits(lock.key)], lock.key)
        lock.released = True
        self.session(lock.ttl).locks.discard(lock)
        if reply.get("succeeded"):  # nobody waits: the common case, one txn
            return Released(Release.DELETED)
        responses = reply.get("responses") or [{}]
        held = _kvs(responses[0])
        mine = bool(held) and int(held[0].get("create_revision", 0)) == lock.fencing_token and \
            unb64(held[0].get("value")) == _value(lock.token, lock.ttl, lock.owner_id).encode()
        handoffs: list[Handoff] = []
        if mine:  # ours, and someone waits: deleted and handed on in one txn
            if succeeded and lock.owner_id:  # the holder's redelivered copy, if it parked, never runs
                self.waiting.drop_copy(lock.key, entry_for(lock.owner_id, retries))
            released, handoffs = self.waiting.hand_over(lock.key, ours, [delete, *extra])
            status = 1 if released else 0
        else:
            status = -1 if held else 0
            if not held and _kvs(responses[-1]):  # gone already (expired), with a line: pass the key on
                handoffs = self.waiting.hand_on(lock.key)
        self.dispatch(handoffs)
        return Released(Release(status), tuple(handoffs))

    def renew(self, lock: Lock) -> bool:
        return renew_one(self, lock)

    def renew_many(self, locks: Sequence[Lock], *, chunk: int = 500) -> list[bool | LockError]:
        """Locks renewed by hand (``lock.renew()``): each session kept alive once, as the watchdog
        keeps it (:meth:`keep_session`: the watchdog keeps sessions, never locks one by one)."""
        out: list[bool | LockError] = [False] * len(locks)  # False: a lease gone since, or a parent's lock
        by_session: dict[Session, list[int]] = {}
        for i, lock in enumerate(locks):
            session = self.session(lock.ttl)
            if lock.lease == session.lease and not lock.released and lock.pid == os.getpid():
                by_session.setdefault(session, []).append(i)
        for session, at in by_session.items():
            alive, gone = self.keep_session(session, [locks[i] for i in at], self.transport.timeout)
            for i in at:
                out[i] = alive if alive is not True else locks[i] not in gone
        if not by_session and self._doubts:
            self._doubts.settle(self.transport, self._done_leases)
        return out

    def keep_session(self, session: Session, locks: Sequence[Lock], timeout: float) -> tuple[bool | LockError,
                                                                                            list[Lock]]:
        """The watchdog's round for a whole session: its keep-alive (none if an acquire confirmed it
        within the last half period), and, when at most VERIFY_UP_TO locks hang on it, one read of their keys, so a lock
        deleted from outside (an operator's ``celery locks release``) is found lost at once."""
        twin = self.with_timeout(timeout)
        if self._doubts:  # acquires whose reply never came: tombed, and their key deleted if it landed
            self._doubts.settle(twin.transport, self._done_leases)
        alive = twin._keep(session, FRESH_FOR / 2)  # due a period after the last: kept unless an acquire just did
        if alive is not True or not locks or len(locks) > VERIFY_UP_TO:
            return alive, []
        return alive, [lock for lock, ours in zip(locks, twin._still_ours(locks), strict=True) if ours is False]

    def _still_ours(self, locks: Sequence[Lock]) -> list[bool | LockError]:
        """Whether each lock's key is still its incarnation (one txn of reads)."""
        reads = [{"request_range": {"key": b64(layout.etcd_lock(lock.key)), "keys_only": True}} for lock in locks]
        try:
            reply = self.transport.txn([], reads, [], locks[0].key)
        except LockError as exc:
            return [exc] * len(locks)
        responses = reply.get("responses") or []
        found: list[bool | LockError] = []
        for lock, response in zip(locks, responses, strict=True):
            kvs = _kvs(response)
            found.append(bool(kvs) and int(kvs[0].get("create_revision", 0)) == lock.fencing_token)
        return found

    def _keep(self, session: Session, fresh_for: float = FRESH_FOR) -> bool | LockError:
        with session.guard:
            if session.lease and time.monotonic() - session.confirmed_at < session.ttl * fresh_for:
                return True
            try:
                return session.keepalive(self.transport)
            except LockError as exc:
                return exc

    # -- for operators and tests ------------------------------------------------------

    def wait_for_change(self, name: str, holder: Holder, seconds: float) -> bool:
        return etcd_watch.wait_for_change(self.transport, layout.etcd_lock(slot_safe(name)), holder.queued, seconds)

    def holder(self, name: str) -> Holder | None:
        found = self.holder_and_lease(name)
        return None if found is None else found[0]

    def holder_and_lease(self, name: str) -> tuple[Holder, int] | None:
        """Who holds ``name``, and the lease its key is on (for operators: its time to live)."""
        key = slot_safe(name)
        reply = self.transport.call("/kv/range", {"key": b64(layout.etcd_lock(key))}, key)
        kvs = reply.get("kvs") or []
        return (self._holder(key, kvs[0]), int(kvs[0].get("lease", 0) or 0)) if kvs else None

    def locks(self, limit: int = 0) -> list[tuple[Holder, int]]:
        """Every lock held now, with its lease (one range read over the lock prefix)."""
        prefix = layout.ETCD_LOCKS
        body: dict[str, Any] = {"key": b64(prefix), "range_end": b64(prefix[:-1] + chr(ord(prefix[-1]) + 1))}
        if limit:
            body["limit"] = str(limit)
        reply = self.transport.call("/kv/range", body)
        return [(self._holder(unb64(kv["key"]).decode()[len(prefix):], kv), int(kv.get("lease", 0) or 0))
                for kv in reply.get("kvs") or []]

    def nodes(self, key: str | None = None) -> list[tuple[str, Any]]:
        """No Redis server: its locks are etcd keys (:meth:`listing` reads them)."""
        return []

    def listing(self) -> EtcdListing:
        """The operators' reads: etcd lists its own locks (:mod:`.etcd_listing`)."""
        return EtcdListing(self)

    def force_release(self, key: str, expected: str = "") -> ForceReleased:
        """For operators: delete ``key``'s lock whoever holds it (only if its value starts with
        ``expected``, when given). Nothing is handed on here: the next caller or a sweeper hands the key
        to its line, as after a holder whose lease ran out (:meth:`.EtcdLine.hand_on`)."""
        found = self.holder(key)
        if found is None:
            return ForceReleased(Forced.NO_LOCK, b"")
        if expected and not found.raw.startswith(expected):
            return ForceReleased(Forced.CHANGED_HANDS, found.raw.encode())
        lock_key = layout.etcd_lock(slot_safe(key))
        reply = self.transport.txn([_compare_create(lock_key, found.fencing_token or 0)],
                                   [{"request_delete_range": {"key": b64(lock_key)}}], [], key)
        done = bool(reply.get("succeeded"))
        return ForceReleased(Forced.RELEASED if done else Forced.CHANGED_HANDS, found.raw.encode(), int(done))
