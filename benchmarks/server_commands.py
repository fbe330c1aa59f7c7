"""Phase 3 of the worker-side measurements: what each variant sends to the lock server per task.

Per variant, the commands clients sent (MONITOR: round trips, at publish and at execution) and
the commands the server ran (INFO commandstats: counts and usec), and the renewals sent for
tasks shorter and longer than TTL/3. The worker is harness.BenchWorker, frozen while we publish.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import Any

from harness import BenchWorker, next_seq

from celery_singleton_lock.engine import line_scripts
from celery_singleton_lock.testing.servers import Monitor, RedisServer

BACKGROUND = {hashlib.sha1(script.encode()).hexdigest() for script in (line_scripts.INDEX_DUE, line_scripts.INDEX_DONE)}
"""The SHAs of the sweeper's look at the waiting index: once a second per worker process, whatever the
tasks do. Counted apart from the tasks' own commands (``exec_background``)."""


def _background(words: list[str]) -> bool:
    return len(words) > 1 and words[0].upper() == "EVALSHA" and words[1].lower() in BACKGROUND


IGNORED = {"info", "echo", "monitor", "hello", "select", "ping", "client", "command"}


def _stats(server: RedisServer) -> dict[str, tuple[int, int]]:
    """INFO commandstats: command -> (calls, usec), e.g. {"evalsha": (3, 41)}."""
    with server.client() as c:
        stats = c.info("commandstats")
    return {name.split("_", 1)[1].lower(): (int(v["calls"]), int(v["usec"])) for name, v in stats.items()}


def _delta(after: dict[str, tuple[int, int]], before: dict[str, tuple[int, int]]) -> dict[str, int]:
    out = {}
    for name, (calls, _) in after.items():
        base = name.split("|", 1)[0]
        if base in IGNORED:
            continue
        d = calls - before.get(name, (0, 0))[0]
        if d:
            out[name] = d
    return out


def _server_usec(after: dict, before: dict, sent: dict[str, int]) -> float:
    """Server time of the commands clients sent (a script's own time includes the commands it runs)."""
    total = 0
    for name in sent:
        key = name.lower()
        total += after.get(key, (0, 0))[1] - before.get(key, (0, 0))[1]
    return float(total)


def _names(cmds: list[list[str]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for words in cmds:
        out[words[0].upper()] = out.get(words[0].upper(), 0) + 1
    return out


def commands(worker: BenchWorker, lock_server: RedisServer, variants: dict[str, Any], n: int) -> dict[str, Any]:
    """Per variant: commands the clients sent (MONITOR: round trips) and the server ran (commandstats).

    Two passes of n tasks each: one under MONITOR for what went over the wire, one without it for
    the server-side counts and times (MONITOR slows the server, and more so for scripts, whose inner
    commands it also reports).
    """
    out: dict[str, Any] = {}
    for name, task in variants.items():
        worker.run_batch([(name, task)] * 3)  # warm: connections made, scripts loaded
        out[name] = _commands_of(worker, lock_server, task, n)
    return out


def _commands_of(worker: BenchWorker, lock_server: RedisServer, task: Any, n: int) -> dict[str, Any]:
    marks: list[int] = []
    with Monitor(lock_server) as mon:
        mon.clear()

        def mark() -> None:
            mon.sync()
            marks.append(len(mon.round_trips()))

        _publish_then_drain(worker, task, n, on_published=mark)
        mon.sync()
        trips = mon.round_trips()  # commands grouped by the write they came in (a pipeline is one trip)
    trips_publish, trips_exec = trips[: marks[0]], trips[marks[0]:]
    sent_publish = [words for trip in trips_publish for words in trip]
    background = [words for trip in trips_exec for words in trip if _background(words)]
    trips_exec = [trip for trip in trips_exec if not any(_background(words) for words in trip)]
    sent_exec = [words for trip in trips_exec for words in trip]
    stats: list[dict[str, tuple[int, int]]] = []
    _publish_then_drain(worker, task, n, on_published=lambda: stats.append(_stats(lock_server)),
                        before=lambda: stats.append(_stats(lock_server)))
    stats.append(_stats(lock_server))
    before, middle, after = stats
    executed = _delta(after, middle)
    # the sweeper's looks at the waiting index during this pass: INDEX_DUE runs SET NX, GET and the one
    # ZRANGEBYSCORE of the package inside its EVALSHA; they are not the tasks' commands
    looks = executed.get("zrangebyscore", 0)
    for name in ("evalsha", "set", "get", "zrangebyscore"):
        if name in executed:
            executed[name] -= looks
            if executed[name] <= 0:
                del executed[name]
    return {
        "publish_sent": {k: v / n for k, v in _names(sent_publish).items()},
        "exec_sent": {k: v / n for k, v in _names(sent_exec).items()},
        "publish_server": {k: v / n for k, v in _delta(middle, before).items()},
        "exec_server": {k: v / n for k, v in executed.items()},
        "exec_server_background": looks,  # the sweeper's looks in the counted pass (left out above)
        "publish_server_us": _server_usec(middle, before, _names(sent_publish)) / n,
        "exec_server_us": _server_usec(after, middle, _names(sent_exec)) / n,
        # per command sent at execution: usec per task (a script's includes what it runs)
        "exec_server_us_by_cmd": {k: _server_usec(after, middle, {k: 1}) / n for k in _names(sent_exec)},
        "publish_rt": len(trips_publish) / n,
        "exec_rt": len(trips_exec) / n,
        "exec_background": len(background),  # the sweeper's looks during the pass, not per task
        "n": n,
    }


def _publish_then_drain(worker: BenchWorker, task: Any, n: int, on_published: Callable[[], Any],
                        before: Callable[[], Any] | None = None) -> None:
    """Publish n tasks while the worker is frozen, call on_published, then let them run to the end."""
    seqs = [next_seq() for _ in range(n)]
    worker.pause()
    try:
        if before is not None:
            before()
        for seq in seqs:
            task.apply_async((seq,))
        on_published()
    finally:
        worker.resume()
    worker.records.wait_for(seqs, 120)
    time.sleep(0.05)  # (every release is sent before its completion record is written)


def renewal_check(worker: BenchWorker, lock_server: RedisServer, short: float, long: float,
                  count: int) -> dict[str, Any]:
    """Renewals sent for locked tasks shorter and longer than TTL/3 (bench.ours_sleep: ttl 1.5 s)."""
    import hashlib

    import bench_app

    from celery_singleton_lock.engine.scripts import RENEW_MANY

    renew_sha = hashlib.sha1(RENEW_MANY.encode()).hexdigest()
    out = {}
    with Monitor(lock_server) as mon:
        for label, seconds in (("short", short), ("long", long)):
            mon.clear()
            seqs = []
            for _ in range(count):
                seq = next_seq()
                bench_app.ours_sleep.apply_async((seq, seconds))
                seqs.append(seq)
            worker.records.wait_for(seqs, 60 + count * seconds * 2)
            time.sleep(0.05)
            mon.sync()
            cmds = mon.commands()
            renewals = sum(1 for w in cmds if w[0].upper() == "EVALSHA" and w[1] == renew_sha)
            out[label] = {"seconds": seconds, "tasks": count, "renewals": renewals,
                          "renewals_per_task": renewals / count}
    out["ttl"] = bench_app.ours_sleep.lock_ttl
    return out
