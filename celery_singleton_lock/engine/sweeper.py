"""The per-process sweeper of the waiting lines (:mod:`celery_singleton_lock.engine.line` has the
lines themselves, and its sweep script): it passes on keys whose holder died, times waiters out,
and sends again the parks this process made that were lost with the lock Redis's data.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from ..exceptions import LockError
from . import layout, line_scripts
from .backend import LockBackend
from .line import SWEEP_BATCH, SWEEP_INTERVAL, SWEEP_LEASE, own_line, sweep
from .lock import Handoff, ms, slot_safe
from .refusals import REDIS_ERRORS
from .server import LockServer

logger = logging.getLogger("celery_singleton_lock")


@dataclass(frozen=True)
class _Parked:
    server: LockServer
    key: str
    entry: str
    owner_id: str
    ttl_ms: int
    message: bytes


class Sweeper:
    """One thread per process that keeps the lines of its servers moving (see the module doc).

    ``watch(server, index)`` starts it for a server; every worker process runs
    one, so a line keeps moving whichever processes die.
    """

    def __init__(self, interval: float = SWEEP_INTERVAL) -> None:
        self.interval = interval
        self.pid = os.getpid()
        self._cond = threading.Condition()
        self._watched: dict[tuple[LockBackend, str], str | None] = {}  # (server, index) -> epoch seen
        self._parked: dict[tuple[LockServer, str, str], _Parked] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        # every key by default: a process with no Celery app sends nothing (its plain waiters are woken
        # by the scripts themselves); a worker narrows it to the keys whose tasks it can send
        self.sweepable: Callable[[str], bool] = lambda key: True
        """Whether this process may sweep lock ``key``. A sweep that times a waiter out removes it and
        leaves its "waited too long" copy to this process to send: a process that cannot send that
        task (no app of it here) would drop it. The Celery side sets this (handoff.knows_key)."""

    def watch(self, server: LockBackend, index: str) -> None:
        with self._cond:
            self._watched.setdefault((server, index), None)
            self._start()

    def remember(self, server: LockBackend, name: str, entry: str, owner_id: str, ttl: float, message: bytes) -> None:
        """Keep a parked task's message here until it leaves the line, in case Redis loses it (a
        consensus backend, with lines of its own, does not lose them)."""
        if not isinstance(server, LockServer):
            return
        with self._cond:
            self._parked[(server, slot_safe(name), entry)] = _Parked(
                server, slot_safe(name), entry, owner_id, ms(ttl), message
            )
            self._start()

    def forget(self, server: LockServer, name: str, entry: str) -> None:
        """A parked task of this process took its turn here (woken in its worker slot): its message
        needs no keeping, nor a look each round to learn that it left."""
        with self._cond:
            self._parked.pop((server, slot_safe(name), entry), None)

    def stop(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _start(self) -> None:
        if self._stopping or (self._thread is not None and self._thread.is_alive()):
            return
        self._thread = threading.Thread(target=self._loop, name=f"celery-singleton-lock-sweeper-{self.pid}",
                                        daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        first = True
        while True:
            with self._cond:
                if not first:  # the first look is at once: it learns the data's epoch
                    # jittered, so the sweepers of many processes spread out
                    self._cond.wait(self.interval * random.uniform(0.75, 1.25))
                first = False
                if self._stopping:
                    return
                watched = list(self._watched)
            for server, index in watched:
                try:
                    self.sweep_once(server, index)
                except LockError as exc:
                    logger.debug("sweeping %s on %s failed: %s", index, server.url, exc)
                except Exception:
                    logger.exception("celery-singleton-lock sweeper: sweeping %s on %s failed", index, server.url)
            try:
                self._prune()
            except Exception:
                logger.exception("celery-singleton-lock sweeper: checking parked messages failed")

    def sweep_once(self, server: LockBackend, index: str) -> int:
        """One look at the due keys of ``index``; returns how many hand-offs it made."""
        own = own_line(server)
        if own is not None:  # (etcd) every key with a line, whatever the index
            return own.sweep_all(self.sweepable)
        assert isinstance(server, LockServer)
        made = 0
        while True:
            reply = server.run(
                line_scripts.INDEX_DUE, (index, index + ":epoch"), (SWEEP_BATCH, ms(SWEEP_LEASE), uuid.uuid4().hex)
            )
            text = [x.decode() if isinstance(x, bytes) else str(x) for x in reply]
            epoch, lease, keys = text[0], text[1], text[2:]
            self._check_epoch(server, index, epoch)
            looks: list[tuple[str, int]] = []
            for key in keys:
                if not self.sweepable(key):
                    looks.append((key, 1))  # left to a process that can send its waiters: due again at once
                    continue
                try:
                    next_ms, handoffs = sweep(server, key)
                except LockError as exc:
                    logger.warning("sweeping lock %s failed: %s", key, exc)
                    continue
                made += sum(1 for h in handoffs if h.what == "run")
                looks.append((key, next_ms))
            if looks:
                flat = [x for key, when in looks for x in (key, str(when))]
                server.run(line_scripts.INDEX_DONE, (index,), (lease, *flat))
            if len(keys) < SWEEP_BATCH:
                return made

    def _check_epoch(self, server: LockBackend, index: str, epoch: str) -> None:
        """A new epoch means the lock Redis lost its data: say so (the parked messages are looked at as ever)."""
        with self._cond:
            seen = self._watched.get((server, index))
            self._watched[(server, index)] = epoch
            if seen is None or seen == epoch:
                return
            count = sum(1 for (srv, _, _) in self._parked if srv is server)
        logger.log(
            logging.ERROR if count else logging.WARNING,
            "the lock Redis at %s lost its data (epoch %s, now %s): this process parked %d task(s) there; "
            "those whose place is gone are sent again", server.url, seen, epoch, count,
        )

    def _prune(self) -> None:
        """Forget the parked messages that left their line, and send again those lost with the data.

        An entry that left for good (it ran, timed out, gave up) leaves a tombstone in its key's
        slot (``K:g``); an entry whose record AND tombstone are gone was lost with the data: a
        restart without persistence, a failover to a lagging replica, a Cluster shard restarted
        empty, whatever the epoch says. Its copy goes out marked "recovered"; the task side runs it
        only if it did not start since it parked (see identity.py). One pipelined look per server
        and round: at most ``interval`` x 1.25 after the loss, while this process lives.
        """
        with self._cond:
            parked = list(self._parked.values())
        by_server: dict[LockServer, list[_Parked]] = {}
        for p in parked:
            by_server.setdefault(p.server, []).append(p)
        for server, items in by_server.items():
            try:
                pipe = server.client.pipeline(transaction=False)
                for p in items:
                    pipe.hexists(layout.waiters(p.key), p.entry)
                    pipe.zscore(layout.gone(p.key), p.entry)
                answers = pipe.execute()
            except REDIS_ERRORS:
                continue  # unreachable: keep them, look again next round
            lost = []
            with self._cond:
                for i, p in enumerate(items):
                    here, left = answers[2 * i], answers[2 * i + 1]
                    if here:
                        continue
                    if self._parked.pop((server, p.key, p.entry), None) is not None and left is None:
                        lost.append(p)
            if lost:
                logger.error("lock Redis %s: %d parked task(s) of this process lost their place (data lost): "
                             "sending them again", server.url, len(lost))
            for p in lost:
                if not server.send_one(Handoff(p.key, "recovered", p.entry, "t", p.owner_id, p.ttl_ms, p.message)):
                    with self._cond:  # (the broker unreachable: kept, and sent at the next look)
                        self._parked.setdefault((server, p.key, p.entry), p)

    def parked_count(self) -> int:
        return len(self._parked)

    def kept_entries(self) -> set[str]:
        """The entries whose messages this process keeps (for tests and operators)."""
        with self._cond:
            return {entry for (_, _, entry) in self._parked}


_sweeper: Sweeper | None = None
_sweeper_lock = threading.Lock()


def get_sweeper() -> Sweeper:
    """This process's sweeper (anew after a fork)."""
    global _sweeper
    sw = _sweeper
    if sw is not None and sw.pid == os.getpid():
        return sw
    with _sweeper_lock:
        if _sweeper is None or _sweeper.pid != os.getpid():
            _sweeper = Sweeper()
        return _sweeper


def shutdown_sweeper(timeout: float = 5.0) -> None:
    sw = _sweeper
    if sw is not None and sw.pid == os.getpid():
        sw.stop(timeout)


def _forget_parent_sweeper() -> None:
    global _sweeper, _sweeper_lock
    _sweeper = None
    _sweeper_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_parent_sweeper)

