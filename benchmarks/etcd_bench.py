"""etcd against the Redis backend, side by side in one run (issue 21): quick, standalone.

    .venv/bin/python benchmarks/etcd_bench.py [--ops 2000] [--locks 10000] [--ttl 3] [--json]

Starts a private redis-server and a private one-member etcd on free loopback ports (stopped by
PID), then measures, for each backend, in this one process:

* **per-task lock cost**: ``--ops`` sequential acquire + release pairs of fresh keys, as a task does
  them (one owner id each); median and p99 of the pair, in microseconds;
* **keep-alive cost with ``--locks`` locks held**: the locks are taken, one watchdog tracks each as
  soon as it is taken, and over five TTLs (after one TTL to settle) we count the process CPU (every thread) per wall
  second and the round trips sent: on etcd the session's keep-alives (ONE per round however many
  locks), on Redis the watchdog's pipelined rounds of EVALSHA;
* **hand-off latency**: a waiter parked behind a held key, then the holder's release (which hands
  the key on and "sends" the waiter: here a function that records it, no broker) to the waiter's
  claim of the key with its entry; median and p99 over ``--handoffs`` rounds, in microseconds. The
  broker's own publish-to-start (about 1.5 ms here, see RESULTS.md) comes on top in a worker.

Not part of ``dev.py bench``: it prints a small table (or ``--json``), nothing is written. The CPU
figure includes the watchdog's own per-lock bookkeeping (its timer wheel and deadlines), the same on
both backends; what differs is the renewal itself (10,000 EVALSHA-renewals pipelined vs ONE keep-alive).
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent.parent / "tests")]

from _etcd_servers import NO_ETCD, EtcdCluster, find_etcd  # noqa: E402 - the suite's etcd helper (tests/)

from celery_singleton_lock.engine import line as lines  # noqa: E402
from celery_singleton_lock.engine.lock import Lock  # noqa: E402
from celery_singleton_lock.testing.servers import RedisServer  # noqa: E402
from celery_singleton_lock.topologies.servers import from_settings  # noqa: E402
from celery_singleton_lock.watchdog.renewer import Watchdog  # noqa: E402


def per_task(url: str, ops: int) -> dict[str, float]:
    """acquire + release of a fresh key, ``ops`` times after 100 warm-ups: median and p99 (us)."""
    server = from_settings(url)
    times = []
    for i in range(ops + 100):
        name = f"bench:{uuid.uuid4().hex}"
        start = time.perf_counter_ns()
        lock = server.acquire(name, 30, owner_id=f"task-{i}")
        assert isinstance(lock, Lock), lock
        assert server.release(lock)
        if i >= 100:
            times.append((time.perf_counter_ns() - start) / 1000)
    times.sort()
    return {"p50_us": statistics.median(times), "p99_us": times[int(len(times) * 0.99) - 1]}


MESSAGE = b"application/json\nutf-8\n{}"
"""A parked waiter's message (never published here)."""


def handoff(url: str, rounds: int) -> dict[str, float]:
    """release -> the waiter's claim, ``rounds`` times after 20 warm-ups: median and p99 (us)."""
    server = from_settings(url)
    sent: list[Any] = []
    server.send_handoff = lambda _server, h: sent.append(h) is None  # what the Celery side's publish would get
    times = []
    for i in range(rounds + 20):
        name = f"handoff:{uuid.uuid4().hex}"
        lock = server.acquire(name, 30, owner_id=f"holder-{i}")
        assert isinstance(lock, Lock), lock
        place = lines.park(server, name, lines.new_entry(), kind="t", wait=60, ttl=30, owner_id=f"waiter-{i}",
                           message=MESSAGE)
        assert place.place == 1, place
        start = time.perf_counter_ns()
        assert server.release(lock)
        [turn] = sent
        claimed = server.acquire(name, 30, owner_id=f"waiter-{i}", entry=turn.entry)
        assert isinstance(claimed, Lock), claimed
        if i >= 20:
            times.append((time.perf_counter_ns() - start) / 1000)
        sent.clear()
        server.release(claimed)
    times.sort()
    return {"p50_us": statistics.median(times), "p99_us": times[int(len(times) * 0.99) - 1]}


def keepalive(url: str, count: int, ttl: float) -> dict[str, Any]:
    """``count`` locks held and tracked by one watchdog: CPU per wall second and round trips over 5 TTLs (a
    window long enough that the CPU clock's 10 ms steps and one round more or less do not move the figure)."""
    server = from_settings(url)
    watchdog = Watchdog()
    taken_at = time.monotonic()
    locks = []
    for _ in range(count):  # tracked as soon as taken, as a task's lock is
        lock = server.acquire(f"held:{uuid.uuid4().hex}", ttl)
        assert isinstance(lock, Lock), lock
        watchdog.track(lock)
        locks.append(lock)
    took = time.monotonic() - taken_at
    time.sleep(ttl)  # settle: every lock renewed once
    sessions = getattr(server, "sessions", lambda: [])()
    keepalives_before = sum(s.keepalives for s in sessions)
    rounds_before = watchdog.rounds
    cpu_before, wall_before = time.process_time(), time.monotonic()
    time.sleep(5 * ttl)
    cpu = time.process_time() - cpu_before
    wall = time.monotonic() - wall_before
    lost = sum(1 for lock in locks if lock.lost)
    out = {
        "locks": count, "take_all_s": round(took, 2), "window_s": round(wall, 2),
        "cpu_percent_of_a_core": round(100 * cpu / wall, 2),
        "watchdog_rounds": watchdog.rounds - rounds_before, "lost": lost,
    }
    if sessions:
        out["keepalives"] = sum(s.keepalives for s in sessions) - keepalives_before
        out["keepalives_per_period"] = round(out["keepalives"] / (wall / (ttl / 3)), 2)
    for lock in locks:
        watchdog.forget(lock)
    watchdog.shutdown()
    for lock in locks:
        server.release(lock)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=2000)
    parser.add_argument("--locks", type=int, default=10_000)
    parser.add_argument("--ttl", type=float, default=3.0)
    parser.add_argument("--handoffs", type=int, default=200)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # a stopped run still stops its servers (finally)
    if find_etcd() is None:
        print(NO_ETCD, file=sys.stderr)
        return 2
    results: dict[str, dict[str, Any]] = {}
    with RedisServer() as redis_server:
        etcd = EtcdCluster(members=1, fsync=True).start()  # a real member's cost: it fsyncs its log
        try:
            for name, url in (("redis", redis_server.url(2)), ("etcd", etcd.url())):
                results[name] = {"per_task": per_task(url, args.ops),
                                 "keepalive": keepalive(url, args.locks, args.ttl),
                                 "handoff": handoff(url, args.handoffs)}
        finally:
            etcd.stop()
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"{'':8}{'acquire+release p50':>20}{'p99':>10}{'CPU, ' + str(args.locks) + ' held':>18}"
          f"{'round trips / period':>22}{'hand-off p50':>14}{'p99':>10}")
    for name, r in results.items():
        k, h = r["keepalive"], r["handoff"]
        per_period = k.get("keepalives_per_period", round(k["watchdog_rounds"] / (k["window_s"] / (args.ttl / 3)), 2))
        print(f"{name:8}{r['per_task']['p50_us']:>17.0f} us{r['per_task']['p99_us']:>7.0f} us"
              f"{k['cpu_percent_of_a_core']:>16.2f} %{per_period:>22}{h['p50_us']:>11.0f} us{h['p99_us']:>7.0f} us")
    print(json.dumps({name: r["keepalive"] for name, r in results.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())


# -- for benchmarks/run.py and report.py: one section and its goals in RESULTS.md ---------------------


def render(res: dict[str, Any], table: Any) -> str:
    """The etcd section: per-task cost and keep-alive cost, etcd beside Redis, from one run."""
    rows = []
    for name in ("redis", "etcd"):
        r = res.get(name)
        if not r:
            continue
        k = r["keepalive"]
        per_period = k.get("keepalives_per_period")
        rounds = round(k["watchdog_rounds"] / (k["window_s"] / 1.0), 2)  # TTL 3 s: a period is 1 s
        h = r.get("handoff")
        rows.append([name, f"{r['per_task']['p50_us']:.0f}", f"{r['per_task']['p99_us']:.0f}",
                     f"{k['cpu_percent_of_a_core']:.2f} %", f"{k['locks']:,}",
                     f"{rounds:g} rounds of pipelined EVALSHA" if per_period is None else f"{per_period:g} keep-alives",
                     str(k["lost"]),
                     f"{h['p50_us']:.0f} / {h['p99_us']:.0f}" if isinstance(h, dict) else "n/a"])
    return ("**etcd against Redis** (benchmarks/etcd_bench.py, one process, a private redis-server and a private "
            "one-member etcd that fsyncs its log; per-task cost = one acquire + release of a fresh key, µs; "
            "keep-alive cost = the process's CPU while one watchdog keeps the locks alive, over five TTLs of 3 s; "
            "hand-off = a waiter parked behind a held key, from the holder's release (which hands the key on "
            "and sends the waiter: here to a function, no broker) to the waiter's claim, µs p50 / p99; in a "
            "worker the broker's publish-to-start comes on top)\n\n"
            + table(["backend", "acquire + release p50 µs", "p99 µs", "CPU, locks held", "locks held",
                     "renewals per period (a third of the TTL)", "lost", "hand-off µs p50 / p99"], rows))


def goals(res: dict[str, Any]) -> list[dict[str, Any]]:
    etcd, red = res.get("etcd"), res.get("redis")
    if not etcd:
        return []
    k = etcd["keepalive"]
    ratio = etcd["per_task"]["p50_us"] / red["per_task"]["p50_us"] if red else None
    return [{
        "goal": "etcd keep-alive (one keep-alive per period, < 2 % of a core with 10,000 locks held)",
        "met": k.get("keepalives_per_period") is not None and k["keepalives_per_period"] <= 1.05
               and k["cpu_percent_of_a_core"] < 2 and k["lost"] == 0,
        "figure": (f"{k.get('keepalives_per_period')} keep-alives per period, {k['cpu_percent_of_a_core']:.2f} % "
                   f"of a core with {k['locks']:,} locks held, {k['lost']} lost; per-task cost on etcd "
                   f"{etcd['per_task']['p50_us']:.0f} µs p50"
                   + (f", {ratio:.1f}× Redis's {red['per_task']['p50_us']:.0f} µs (a consensus write is fsynced "
                      "by the etcd member)" if ratio else "") + "."),
    }]
