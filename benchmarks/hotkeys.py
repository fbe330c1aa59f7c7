"""Hot keys: many tasks on ONE key, on real prefork workers (issue "Hot keys").

Two measurements, on ``hot_app`` workers with a broker and a lock redis-server of
their own (started here, stopped by PID):

* :func:`handoff_latency`: one worker node. A gate task takes the key and holds
  it until every duplicate has parked; then the key passes down the line, and
  each hand-off is timed from the holder's body end (its release) to the next
  waiter's body start.
* :func:`drain`: N deductions on one key published at once to every node. Wall
  time (first publish to last body end), broker publishes made by the workers
  per duplicate, lost tasks, overlapping bodies, and the share of waiters that
  started in the order they arrived at the lock (read from the lock server's
  MONITOR: the order in which Redis ran their PARK, first ACQUIRE or first
  SET NX). The polling variants may be cut at a time cap.

Body records use ``CLOCK_MONOTONIC`` (one clock for every process on the
machine); see ``hot_app.py`` for what the workers write, and ``hot_records.py`` for how
they and the MONITOR copy are read back.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import BenchWorker, stop_all
from hot_records import HotRecords, RawMonitor, _ms, arrival_order, longest_in_order

from celery_singleton_lock.testing.servers import RedisServer, wait_until

_seq = itertools.count(1)
HANDOFF_QUEUE = "hot-one"
"""The queue of the hand-off latency run: only the first node consumes it."""


class HotCluster:
    """Worker nodes of hot_app (prefork), on a broker and a lock redis-server of their own."""

    def __init__(self, out_dir: Path, nodes: int, concurrency: int) -> None:
        self.out_dir = out_dir
        self.n_nodes = nodes
        self.concurrency = concurrency
        self.broker = RedisServer()
        self.locks = RedisServer()
        self.nodes: list[BenchWorker] = []
        self.records = HotRecords([])
        self.env: dict[str, str] = {}
        self.app: Any = None

    def __enter__(self) -> HotCluster:
        try:
            self.broker.start()
            self.locks.start()
            self.env = {"BENCH_HOT_BROKER_URL": self.broker.url(0), "BENCH_HOT_LOCK_URL": self.locks.url(0)}
            os.environ.update(self.env)  # before the client imports hot_app
            import hot_app

            self.app = hot_app
            self.start_nodes()
        except BaseException:
            self.__exit__()
            raise
        return self

    def start_nodes(self) -> None:
        """Start every node at once; the first one also consumes the hand-off run's own queue."""
        self.nodes = []  # filled as they are made, so __exit__ stops any that started
        for i in range(self.n_nodes):
            queues = f"celery,{HANDOFF_QUEUE}" if i == 0 else "celery"
            self.nodes.append(BenchWorker("prefork", self.concurrency, self.env, self.out_dir, app="hot_app",
                                          name=f"hot-node{i + 1}", extra=["-Q", queues]))
        for node in self.nodes:
            node.launch()
        for node in self.nodes:
            node.wait_ready()
        self.records.dirs = [n.record_dir for n in self.nodes]
        self.warm()

    def restart(self) -> None:
        """Stop the nodes, empty both servers (ours, private), start again: after a run cut at its cap."""
        stop_all(self.nodes)
        for server in (self.broker, self.locks):
            with server.client() as c:
                c.flushall()
        self.start_nodes()

    def warm(self) -> None:
        """Every child: connections made, scripts loaded, the park / hand-off / publish paths run once."""
        app = self.app
        sku = f"warm-{next(_seq)}"
        seqs = [next(_seq) for _ in range(4 * self.n_nodes * self.concurrency)]
        for s in seqs:
            app.hot_ours.apply_async((sku, s, 0.005), task_id=f"warm-ours-{s}")
        one = [next(_seq) for _ in range(2 * self.concurrency)]
        for s in one:  # the first node's hand-off queue too
            app.hot_ours.apply_async((sku + "-one", s, 0.005), task_id=f"warm-one-{s}", queue=HANDOFF_QUEUE)
        rl = [next(_seq) for _ in range(2 * self.n_nodes * self.concurrency)]
        for s in rl:
            app.hot_rlock.apply_async((f"warm-{s}", s, 0.0, 5.0), task_id=f"warm-rlock-{s}")
        want = [("ours", s) for s in seqs + one] + [("rlock", s) for s in rl]

        def done() -> bool:
            self.records.poll()
            return all(k in self.records.bodies for k in want)

        wait_until(done, 60, 0.05, "the hot-key warm-up tasks")

    def __exit__(self, *exc: object) -> None:
        try:
            stop_all(self.nodes)
        finally:
            self.broker.__exit__()
            self.locks.__exit__()

    def pause(self) -> None:
        for node in self.nodes:
            node.pause()

    def resume(self) -> None:
        for node in self.nodes:
            node.resume()


def handoff_latency(cluster: HotCluster, n: int, body_s: float, variant: str = "ours") -> dict[str, Any]:
    """Release (holder's body end) -> next waiter's body start, on the first node only."""
    rec = cluster.records
    task = {"ours": cluster.app.hot_ours, "ours-slot": cluster.app.hot_ours_slot}[variant]
    node = cluster.nodes[0]
    gate_seq = next(_seq)
    sku = f"handoff-{gate_seq}"
    gate = node.record_dir / f"gate-{gate_seq}"
    task.apply_async((sku, gate_seq, body_s, str(gate)), task_id=f"hot-{variant}-{gate_seq}", queue=HANDOFF_QUEUE)

    def gate_holds() -> bool:
        rec.poll()
        return gate_seq in rec.gates

    wait_until(gate_holds, 30, 0.01, "the gate task to take the key")
    seqs = [next(_seq) for _ in range(n)]
    ids = [f"hot-{variant}-{s}" for s in seqs]
    for s, tid in zip(seqs, ids, strict=True):
        task.apply_async((sku, s, body_s), task_id=tid, queue=HANDOFF_QUEUE)

    def all_parked() -> bool:
        rec.poll()
        return all(tid in rec.parks for tid in ids)

    wait_until(all_parked, 30 + n * 0.05, 0.02, "every duplicate to park")
    time.sleep(0.05)
    gate.touch()  # the gate's body ends: the key starts down the line

    def all_ran() -> bool:
        rec.poll()
        return all((variant, s) in rec.bodies for s in seqs)

    wait_until(all_ran, 30 + n * (body_s + 0.2), 0.02, "every waiter to run")
    runs = sorted((rec.bodies[(variant, s)][0], s) for s in [gate_seq, *seqs])
    gaps = [runs[i][0][0] - runs[i - 1][0][1] for i in range(1, len(runs))]
    to_pub, from_pub = _split_at_publish(rec, runs, variant)
    node_pids = set(node._pids())
    runs = [r for r, _ in runs]
    base = _dispatch_baseline(cluster, sku, n)
    return {
        "celery_dispatch_ms": _ms(base), "variant": variant,
        "n": n, "body_s": body_s, "nodes": 1, "concurrency": cluster.concurrency,
        "latency_ms": _ms(gaps),
        "release_to_publish_ms": _ms(to_pub),
        "publish_to_start_ms": _ms(from_pub),
        "overlaps": sum(1 for g in gaps if g < 0),
        "on_one_node": all(r[2] in node_pids for r in runs),
        "pids": len({r[2] for r in runs}),
    }


def _split_at_publish(rec: HotRecords, runs: list, variant: str) -> tuple[list[int], list[int]]:
    """Each hand-off split at its publish (after_task_publish in the releasing process): (release -> publish,
    publish -> next body start) in ns, over ``runs`` [((start, end, pid, waited), seq)] in start order."""
    published = {tid: t for _, tid, t, _, why in rec.pubs if why == "entry"}
    to_pub, from_pub = [], []
    for i in range(1, len(runs)):
        t = published.get(f"hot-{variant}-{runs[i][1]}") if variant == "ours" else None  # (slot: sent ahead)
        if t is not None:
            to_pub.append(t - runs[i - 1][0][1])
            from_pub.append(runs[i][0][0] - t)
    return to_pub, from_pub


def _dispatch_baseline(cluster: HotCluster, sku: str, n: int) -> list[int]:
    """The baseline: Celery's own latency (ns) from a publish to the body start of a task with no lock,
    one at a time on the same idle node (the client's apply_async included)."""
    rec = cluster.records
    base: list[int] = []
    for _ in range(min(n, 100)):
        s = next(_seq)
        t0 = time.monotonic_ns()
        cluster.app.hot_plain.apply_async((sku, s, 0.0), task_id=f"hot-plain-{s}", queue=HANDOFF_QUEUE)

        def ran(s: int = s) -> bool:
            rec.poll()
            return ("plain", s) in rec.bodies

        wait_until(ran, 30, 0.001, "a plain task to run")
        base.append(rec.bodies[("plain", s)][0][0] - t0)
    return base


def drain(cluster: HotCluster, variant: str, n: int, body_s: float, cap: float,
          progress: Callable[[str], None] = print) -> dict[str, Any]:
    """N tasks on one key, published at once while every node is frozen, drained by all of them."""
    rec = cluster.records
    app = cluster.app
    task = getattr(app, {"ours": "hot_ours", "ours-slot": "hot_ours_slot", "backoff": "hot_backoff",
                         "rlock": "hot_rlock", "plain": "hot_plain"}[variant])
    seqs = [next(_seq) for _ in range(n)]
    sku = f"drain-{variant}-{seqs[0]}"
    ids = {f"hot-{variant}-{s}": s for s in seqs}
    extra: tuple[Any, ...] = (cap + 30.0,) if variant == "rlock" else ()  # blocking_timeout: past the cap
    with RawMonitor(cluster.locks, cluster.out_dir / f"monitor-{sku}.txt") as mon:
        mon.clear()
        t0, published_s = _publish_paused(cluster, task, ids, sku, body_s, extra)
        ran, gave_up = _wait_drained(rec, variant, seqs, n, cap, published_s, t0, progress)
        stopped = time.monotonic_ns()
        time.sleep(0.1)
        mon.sync()
        cmds = mon.commands()
    rec.poll()
    finished = ran + gave_up >= n

    firsts = {s: rec.bodies[(variant, s)] for s in seqs if (variant, s) in rec.bodies}
    runs = sorted((b[0], b[1], s, b[3]) for s, bl in firsts.items() for b in bl)
    overlaps = _overlaps(runs)
    gaps = [runs[i][0] - runs[i - 1][1] for i in range(1, len(runs))]

    pubs = [p for p in rec.pubs if p[1] in ids]
    why: dict[str, int] = {}
    for p in pubs:
        why[p[4]] = why.get(p[4], 0) + 1

    order, waiters = arrival_order(variant, cmds, ids, rec.parks, sku)
    starts = [firsts[s][0][0] for s in order if s in firsts]
    in_order = longest_in_order(starts) / len(starts) if starts else None

    last_end = max((r[1] for r in runs), default=t0)
    first_start = min((r[0] for r in runs), default=t0)
    return {
        "variant": variant, "n": n, "body_s": body_s, "nodes": cluster.n_nodes, "concurrency": cluster.concurrency,
        "ideal_s": n * body_s, "cap_s": cap, "finished": finished,
        "wall_s": (last_end - t0) / 1e9 if finished else None,
        "elapsed_s": (stopped - t0) / 1e9, "publish_s": published_s,
        "completed": len(firsts), "gave_up": gave_up,
        "lost": (n - len(firsts)) if finished or variant.startswith("ours") else None,
        "rate": len(firsts) / ((last_end - t0) / 1e9) if finished and last_end > t0 else None,
        # sustained: from the first body's start, so not the client's publishing (the nodes paused meanwhile)
        "sustained": len(firsts) / ((last_end - first_start) / 1e9) if finished and last_end > first_start else None,
        "ran_twice": sum(1 for bl in firsts.values() if len(bl) > 1),
        "overlaps": overlaps,
        "publishes_client": n, "publishes_worker": len(pubs), "publishes_by_why": why,
        "duplicates": len(waiters),
        "publishes_per_duplicate": len(pubs) / len(waiters) if waiters else None,
        "waiters_ran": len(starts), "in_order": in_order,
        "gap_ms": _ms(gaps),
        "slot_wait_s": sum(r[3] for r in runs) / 1e9,
    }


def _publish_paused(cluster: HotCluster, task: Any, ids: dict[str, int], sku: str, body_s: float,
                    extra: tuple[Any, ...]) -> tuple[int, float]:
    """Publish every task while all nodes are frozen; (monotonic ns at the first publish, seconds spent)."""
    cluster.pause()
    try:
        t0 = time.monotonic_ns()
        for tid, s in ids.items():
            task.apply_async((sku, s, body_s, *extra), task_id=tid)
        published_s = (time.monotonic_ns() - t0) / 1e9
    finally:
        cluster.resume()
    return t0, published_s


def _wait_drained(rec: HotRecords, variant: str, seqs: list[int], n: int, cap: float, published_s: float, t0: int,
                  progress: Callable[[str], None]) -> tuple[int, int]:
    """Wait until every task ran or gave up, or the cap (publishing included) ran out: (ran, gave up)."""
    deadline = time.monotonic() + cap - published_s
    last_say = time.monotonic()
    ran = gave_up = 0
    before = rec.count(variant)
    while True:  # (light: this process shares the machine with the workers it measures)
        rec.poll()
        if ran + gave_up < rec.count(variant) - before:  # (only then the exact count, over this run's tasks)
            ran = sum(1 for s in seqs if (variant, s) in rec.bodies)
            gave_up = sum(1 for s in seqs if (variant, s) in rec.gave_up)
        if ran + gave_up >= n or time.monotonic() > deadline:
            break
        if time.monotonic() - last_say > 15:
            last_say = time.monotonic()
            progress(f"    {variant}: {ran} of {n} done after {(time.monotonic_ns() - t0) / 1e9:.0f} s")
        time.sleep(0.1)
    return ran, gave_up


def _overlaps(runs: list[tuple[int, int, int, int]]) -> int:
    """Bodies that started before an earlier-started one had ended (runs sorted by start)."""
    overlaps, latest_end = 0, 0
    for start, end, _, _ in runs:
        if start < latest_end:
            overlaps += 1
        latest_end = max(latest_end, end)
    return overlaps


def run(out_dir: Path, p: dict[str, Any], progress: Callable[[str], None]) -> dict[str, Any]:
    """Both hot-key measurements on one pair of nodes (the hand-off run uses the first node only)."""
    out: dict[str, Any] = {}
    with HotCluster(out_dir, p["hot_nodes"], p["hot_concurrency"]) as cluster:
        for variant, name in (("ours-slot", "handoff_slot"), ("ours", "handoff")):
            progress(f"  hand-off latency, {variant}: {p['handoff_n']} waiters, {p['handoff_body'] * 1000:g} ms "
                     f"body, one node (prefork -c {p['hot_concurrency']})")
            out[name] = handoff_latency(cluster, p["handoff_n"], p["handoff_body"], variant)
            lat = out[name]["latency_ms"]
            progress(f"    p50 {lat['p50']:.2f} ms, p99 {lat['p99']:.2f} ms, max {lat['max']:.2f} ms")
        drains = {}
        variants = ("ours-slot", "ours", "rlock", "backoff", "plain")
        for i, variant in enumerate(variants):
            cap = p["hot_cap_ours"] if variant.startswith("ours") else p["hot_cap"]
            progress(f"  drain, {variant}: {p['hot_n']} tasks on one key, {p['hot_body'] * 1000:g} ms body, "
                     f"{p['hot_nodes']} nodes x prefork -c {p['hot_concurrency']} (cap {cap:g} s)")
            d = drain(cluster, variant, p["hot_n"], p["hot_body"], cap, progress)
            drains[variant] = d
            progress("    " + drain_line(d))
            if not d["finished"] and i + 1 < len(variants):
                progress("    (cut at its cap: nodes restarted on empty servers for the next variant)")
                cluster.restart()
        out["drain"] = drains
    return out


def drain_line(d: dict[str, Any]) -> str:
    done = (f"wall {d['wall_s']:.1f} s" if d["finished"]
            else f"did not finish in {d['cap_s']:g} s ({d['completed']} of {d['n']} done)")
    ppd = d["publishes_per_duplicate"]
    order = d["in_order"]
    return (f"{done}; {d['publishes_worker']} worker publishes for {d['duplicates']} duplicates"
            + (f" ({ppd:.2f} each)" if ppd is not None else "")
            + f"; lost {d['lost']}, overlaps {d['overlaps']}"
            + (f", {order * 100:.1f}% in order" if order is not None else ""))
