"""Reading the locks a Redis holds, for operators: what a key means, one row per lock, and the table.

Pure functions of what Redis answered (the layout is described in
:mod:`celery_singleton_lock.engine.scripts`); ``cli.py`` does the reading and the printing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from ..engine import layout
from ..engine.lock import Holder

# every key beside a lock (engine/layout.py): line, waiters, done records, tombstones, publish mark, slot
# marks, wake-ups, merged calls (and 0.2's K:mm), kept replies
_COMPANIONS = re.compile(r"^(?P<lock>.+:\{[^{}]+\}):(?:q|w|d|g|p|d:.*|wake:.*|b:.*|m:.*|mm:.*|mo:.*|r:.*)$")
_LOCK = re.compile(r"^(?P<task>[^{}]+):\{[^{}]+\}$")
KINDS = {"t": "task", "s": "redelivered copy", "p": "plain code"}
STATES = {"p": "parked", "h": "handed the key (its message not yet confirmed sent)", "c": "handed the key, sent",
          "n": "sent ahead of its turn (to wait for it in a worker slot)"}
IN_SLOT = "waiting in its worker slot"
"""A parked waiter's state while its slot mark lives (``lock_wait_in_slot``)."""


def parse_key(key: str, prefixes: Sequence[str]) -> str:
    """The task name in lock key ``key`` (``<prefix>:<task name>:{<hash>}``); ValueError if not one of ours.

    The longest matching prefix wins (``a`` and ``a:b`` may both be prefixes).
    """
    for prefix in sorted(prefixes, key=len, reverse=True):
        if key.startswith(prefix + ":"):
            rest = key[len(prefix) + 1:]
            match = _LOCK.match(rest)
            if match:
                return match["task"]
            companion = _COMPANIONS.match(key)
            if companion:
                raise ValueError(
                    f"{key!r} is not a lock but a key beside one (its line, waiters, tombstones, done records, "
                    f"publish mark, merged calls, a wake-up list or a kept reply); the lock is {companion['lock']!r}"
                )
            raise ValueError(
                f"{key!r} is not a lock key: a lock key is {prefix}:<task name>:{{<hash>}}, with the hash "
                "tag in braces at its end"
            )
    shown = ", ".join(repr(p) for p in sorted(prefixes))
    raise ValueError(f"{key!r} is not a lock key of this app: it does not start with a lock prefix ({shown}) and ':'")


def glob_escape(text: str) -> str:
    """``text`` matched literally by a Redis MATCH pattern."""
    return re.sub(r"([\\*?\[\]])", r"\\\1", text)


# -- durations -----------------------------------------------------------------------


def duration(ms: float | None) -> str:
    """A duration for people: ``850ms``, ``4.2s``, ``3m04s``, ``2h01m``, ``3d04h``; ``-`` for none."""
    if ms is None:
        return "-"
    if ms < 0:
        return "-"
    if ms < 1000:
        return f"{ms:.0f}ms"
    s = ms / 1000
    if s < 60:
        return f"{s:.1f}s"
    s = int(s)
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def expiry(ttl_ms: int) -> str:
    """What PTTL says, for people (-1: no expiry, which no lock of ours has; -2: gone)."""
    if ttl_ms == -1:
        return "never"
    if ttl_ms == -2:
        return "gone"
    return duration(ttl_ms)


# -- the app's locks ---------------------------------------------------------------------


def held_ms(holder: Holder, now_us: int) -> int | None:
    """Since when ``holder`` holds its key: its fencing token is the lock Redis's clock at the acquire
    (microseconds); None for a value with none (a reservation, a cooldown)."""
    if not holder.fencing_token:
        return None
    return max(0, now_us // 1000 - holder.fencing_token // 1000)


def lock_row(key: str, task: str, value: bytes | str, pttl: int, waiters: int, now_us: int) -> dict[str, Any]:
    """One held lock as the commands show it (``--json`` prints these objects)."""
    holder = Holder.parse(key, value, pttl)
    fence = holder.fencing_token
    return {
        "key": key,
        "task": task,
        "task_id": holder.owner_id,
        "host": holder.host,
        "pid": holder.pid,
        "held_ms": held_ms(holder, now_us),
        "ttl_ms": int(pttl),
        "fencing_token": fence,
        "waiters": int(waiters),
        "reserved": holder.reserved,
        "cooldown": holder.cooldown,
    }


def describe(row: dict[str, Any]) -> str:
    """One sentence about a held lock (on a quorum, with how many members hold it)."""
    if row["reserved"]:
        text = (f"reserved for waiting task {row['task_id']} (being handed the key), expires in "
                f"{expiry(row['ttl_ms'])}; {row['waiters']} waiting")
    elif row.get("cooldown"):
        text = (f"cooling down after task {row['task_id']}: no run until it ends, in {expiry(row['ttl_ms'])}; "
                f"{row['waiters']} waiting")
    else:
        text = (f"held by task {row['task_id']} on host {row['host']} (pid {row['pid']}) for "
                f"{duration(row['held_ms'])}, expires in {expiry(row['ttl_ms'])}, fencing token "
                f"{row['fencing_token']}; {row['waiters']} waiting")
    if "members" in row:
        text += f"; on {members_cell(row, len(row['members']))}"
    return text


def members_cell(row: dict[str, Any], of: int) -> str:
    """``3/5`` on a quorum; ``2/5, no majority: not held`` for a lock a minority still has."""
    return f"{row['held_on']}/{of}" + ("" if row["held"] else ", no majority: not held")


def table(rows: list[dict[str, Any]], members: int = 0) -> str:
    """The ``list`` table; with ``members`` (a quorum's size) a MEMBERS column: how many hold each key."""
    header: tuple[str, ...] = ("KEY", "TASK", "HOLDER", "HOST", "PID", "HELD", "EXPIRES", "FENCE", "WAITING")
    header += ("MEMBERS",) if members else ()
    lines: list[tuple[str, ...]] = [header]
    for row in rows:
        holder = (f"reserved for {row['task_id']}" if row["reserved"]
                  else f"cooldown after {row['task_id']}" if row.get("cooldown") else str(row["task_id"]))
        lines.append((
            row["key"], row["task"], holder, str(row["host"] or "-"), str(row["pid"] or "-"),
            duration(row["held_ms"]), expiry(row["ttl_ms"]), str(row["fencing_token"] or "-"), str(row["waiters"]),
        ) + ((members_cell(row, members),) if members else ()))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in lines)


def to_json(data: Any) -> str:
    return json.dumps(data, indent=2, sort_keys=False)


# -- the commands ------------------------------------------------------------------------


def message_summary(message: bytes) -> dict[str, Any]:
    """The parked task's name and arguments, if its message is JSON (nothing else is ever decoded here)."""
    try:
        content_type, _encoding, data = layout.split_message(message)
        if content_type != "application/json":
            return {}
        body = json.loads(data)
        return {"task": body.get("task"), "args": body.get("args"), "kwargs": body.get("kwargs")}
    except (ValueError, AttributeError):
        return {}


