"""The snapshots ``celery inspect locks`` answers with: one process's locks and watchdog figures, and,
for a prefork worker, the files its children keep them in (see :mod:`.control` for why files).
"""

from __future__ import annotations

import getpass
import json
import logging
import os
import stat
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from ..engine import timing
from ..watchdog.process import current_watchdog
from ..watchdog.renewer import Watchdog

logger = logging.getLogger("celery_singleton_lock")

REFRESH = 1.0
"""Seconds between two snapshots of a prefork child that holds locks (renewals show this late at most)."""


# -- one process's snapshot ----------------------------------------------------------


def watchdog_snapshot(wd: Watchdog) -> dict[str, Any]:
    """What this watchdog renews right now and how its rounds go (``celery inspect locks``).

    Read-only, through the watchdog's public reads: the locks it renews and the failing servers
    are of one instant (:meth:`Watchdog.tracked_now`), its counters of a moment later.
    Times are relative to now (``confirmed_ago``: seconds since the send time
    of the last confirmed acquire or renewal; ``deadline_in``: seconds until
    the watchdog would declare the lock lost), because monotonic instants mean
    nothing to another process. Holds no token: the snapshot may be shown to
    anyone who can inspect the worker.
    """
    tracked, failing = wd.tracked_now()
    now, wall = time.monotonic(), time.time()
    locks = [
        {
            "key": lock.key,
            "task_id": lock.owner_id,
            "fencing_token": lock.known_fence(),
            "taken_at": round(wall - (now - lock.acquired_at), 3),  # (this host's clock, from its own monotonic)
            "ttl": lock.ttl,
            "confirmed_ago": round(now - lock.confirmed_at, 3),
            "deadline_in": round(lock.deadline - now, 3),
            "last_error": lock.last_error,
            "server": lock.server.url,
        }
        for lock in tracked
    ]
    return {
        "pid": wd.pid,
        "alive": wd.alive,
        "tick": wd.tick,
        "tracked": len(tracked),
        "rounds": wd.rounds,
        "batches": wd.batches,
        "last_round_ms": round(wd.last_round_seconds * 1000, 3),
        "failed_rounds": wd.failed_rounds,
        "losses": wd.losses,
        "failing_servers": failing,
        "locks": sorted(locks, key=lambda item: item["key"]),
    }



def process_snapshot() -> dict[str, Any]:
    """This process's watchdog snapshot (:func:`watchdog_snapshot`), or an empty one.

    Never creates the watchdog: the first task to lock creates it, with its
    app's ``singleton_lock_watchdog_*`` options; one created here would have
    the defaults, and every later task would be told its options are ignored.
    """
    wd = current_watchdog()  # the process's one, if any (get_watchdog() would create it)
    if wd is not None:
        return watchdog_snapshot(wd)
    return empty_snapshot(os.getpid())


def empty_snapshot(pid: int) -> dict[str, Any]:
    """The snapshot of a process that has no watchdog yet (it never locked anything)."""
    return {
        "pid": pid, "alive": False, "tick": timing.DEFAULT_TICK, "tracked": 0, "rounds": 0,
        "batches": 0, "last_round_ms": 0.0, "failed_rounds": 0, "losses": 0, "failing_servers": [], "locks": [],
    }


def _to_wall(snapshot: dict[str, Any], now: float) -> dict[str, Any]:
    """A snapshot with its relative times made wall-clock instants, so another process can read it later."""
    out = dict(snapshot, written_at=now)
    out["locks"] = [
        {**{k: v for k, v in lock.items() if k not in ("confirmed_ago", "deadline_in")},
         "confirmed_at": now - lock["confirmed_ago"], "deadline_at": now + lock["deadline_in"]}
        for lock in snapshot["locks"]
    ]
    return out


def _from_wall(snapshot: dict[str, Any], now: float) -> dict[str, Any]:
    """The inverse of :func:`_to_wall`, as of ``now``; adds ``snapshot_age``."""
    out = {k: v for k, v in snapshot.items() if k != "written_at"}
    out["snapshot_age"] = round(max(0.0, now - snapshot["written_at"]), 3)
    out["locks"] = [
        {**{k: v for k, v in lock.items() if k not in ("confirmed_at", "deadline_at")},
         "confirmed_ago": round(now - lock["confirmed_at"], 3), "deadline_in": round(lock["deadline_at"] - now, 3)}
        for lock in snapshot["locks"]
    ]
    return out


# -- prefork: the children's snapshot files --------------------------------------------


def snapshot_dir(main_pid: int) -> Path:
    """Where the prefork children of worker ``main_pid`` keep their snapshots."""
    user = str(os.getuid()) if hasattr(os, "getuid") else getpass.getuser()
    return Path(tempfile.gettempdir()) / f"celery-singleton-lock-{user}" / str(main_pid)


def _make_private_dir(path: Path) -> None:
    """Create ``path`` (and its parent) for this user only; refuse a parent someone else controls.

    The parent sits in the shared temp directory: another user could have made
    it first, or put a symlink there, to read or plant snapshots.
    """
    path.parent.mkdir(mode=0o700, exist_ok=True)
    problem = _not_private(path.parent)
    if problem:
        raise OSError(problem)
    path.mkdir(mode=0o700, exist_ok=True)


def _not_private(directory: Path) -> str | None:
    """Why ``directory`` is not a private directory of this user (None when it is, or is absent)."""
    try:
        info = os.lstat(directory)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        return f"{directory} is not a directory"
    if hasattr(os, "getuid") and (info.st_uid != os.getuid() or info.st_mode & 0o077):
        return f"{directory} belongs to another user or is open to others (mode {oct(info.st_mode & 0o777)})"
    return None


class SnapshotWriter:
    """The prefork child's thread that keeps its snapshot file current (see the module's doc)."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / f"{os.getpid()}.json"
        self._directory = directory
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="celery-singleton-lock-snapshot", daemon=True)
        self._start_lock = threading.Lock()
        self._started = False
        self._last_error = ""

    def start(self) -> SnapshotWriter:
        with self._start_lock:
            if self._thread.ident is None and not self._stopping:  # a thread starts once
                self._thread.start()
        return self

    def poke(self, *_: Any, **__: Any) -> None:
        """The set of locks changed (a signal receiver: must cost next to nothing).

        The first one starts the thread: a child that never locks anything has none.
        """
        self._wake.set()
        if not self._started:
            self._started = True
            self.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        try:
            self.path.unlink()
        except OSError:
            pass

    def _loop(self) -> None:
        written: tuple[Any, ...] | None = None
        while not self._stopping:
            self._wake.wait(REFRESH)
            self._wake.clear()
            if self._stopping:
                return
            try:
                snap = process_snapshot()
                # the set of locks and the counters; while locks are held, the rounds too (renewals)
                seen = (
                    tuple((lock["key"], lock["fencing_token"]) for lock in snap["locks"]),
                    snap["losses"], snap["failed_rounds"], snap["rounds"] if snap["tracked"] else None,
                )
                if seen != written:
                    self.write(snap)
                    written = seen
            except Exception as exc:  # never let the thread die: the next wake-up tries again
                if repr(exc) != self._last_error:  # once per distinct error, not every second
                    self._last_error = repr(exc)
                    logger.warning("celery-singleton-lock: cannot write this process's lock snapshot %s "
                                   "(`celery inspect locks` will not show its locks): %s", self.path, exc)
            time.sleep(_tick())  # at most one write per watchdog tick

    def write(self, snapshot: dict[str, Any]) -> None:
        """Write the snapshot atomically (a reader never sees half a file)."""
        if not self._directory.exists():
            _make_private_dir(self._directory)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(_to_wall(snapshot, time.time())))
        os.replace(tmp, self.path)


def _tick() -> float:
    """The process watchdog's tick (the default before it exists)."""
    wd = current_watchdog()
    return wd.tick if wd is not None else timing.DEFAULT_TICK




def read_children(directory: Path, children: list[int], now: float) -> tuple[list[dict[str, Any]], list[str]]:
    """The live children's snapshots (a child that never locked anything has none), and any errors.

    Files of processes that are no longer children are deleted (a child killed
    by a time limit or a crash cannot remove its own).
    """
    out: list[dict[str, Any]] = []
    errors: list[str] = []
    problem = _not_private(directory.parent)
    if problem:
        return [], [f"the children's lock snapshots are not read: {problem}"]
    live = set(children)
    for pid in children:
        path = directory / f"{pid}.json"
        try:
            out.append(_from_wall(json.loads(path.read_text()), now))
        except FileNotFoundError:
            out.append({**empty_snapshot(pid), "snapshot_age": None})
        except (OSError, ValueError, KeyError, TypeError) as exc:
            errors.append(f"process {pid}: unreadable snapshot {path}: {exc}")
    if not live:
        return out, errors  # the pool's children unknown (being restarted): delete nothing
    try:
        for path in directory.glob("*.json"):
            if path.stem.isdigit() and int(path.stem) not in live:
                path.unlink(missing_ok=True)
    except OSError:
        pass
    return out, errors
