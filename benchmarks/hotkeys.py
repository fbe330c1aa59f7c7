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
machine); see ``hot_app.py`` for what the workers write.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from harness import BenchWorker, percentile, stop_all

from celery_singleton_lock.engine import line_scripts, scripts
from celery_singleton_lock.testing.servers import RedisServer, _parse_monitor_line, wait_until

_COPY_MONITOR = """
import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
s.sendall(b"MONITOR\\r\\n")
with open(sys.argv[2], "wb", buffering=0) as out:
    while chunk := s.recv(1 << 20):
        out.write(chunk)
"""


class RawMonitor:
    """MONITOR, copied byte for byte into a file by a process of its own and parsed after the run.

    The drain measures throughput: the test suite's Monitor parses every line in a thread of this
    process as it comes, and that took a third of the machine's CPU from the workers (a hot-key drain
    ran 30 % slower under it). A copy costs almost nothing; Redis's own MONITOR output remains.
    """

    def __init__(self, server: RedisServer, path: Path) -> None:
        self.server, self.path = server, path
        self._proc: subprocess.Popen[bytes] | None = None
        self._offset = 0

    def __enter__(self) -> RawMonitor:
        self._proc = subprocess.Popen([sys.executable, "-c", _COPY_MONITOR, str(self.server.port), str(self.path)])

        def live() -> bool:  # a marker sent before its MONITOR began is never seen: send them until one is
            marker = self._marker()
            time.sleep(0.02)
            return self.path.exists() and marker in self.path.read_bytes()

        wait_until(live, 10, 0.0, "MONITOR to start")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.terminate()  # (by PID)
            self._proc.wait(10)

    def _marker(self) -> bytes:
        marker = f"csl-sync-{time.monotonic_ns()}"
        with self.server.client() as c:
            c.echo(marker)
        return f'"ECHO" "{marker}"'.encode()

    def sync(self) -> None:
        """Wait until every command sent before this call is in the file."""
        marker = self._marker()
        wait_until(lambda: self.path.exists() and marker in self.path.read_bytes()[self._offset:], 10, 0.01,
                   "MONITOR sync")

    def clear(self) -> None:
        """Forget what was recorded so far."""
        self.sync()
        self._offset = self.path.stat().st_size

    def commands(self) -> list[list[str]]:
        """The commands clients sent since :meth:`clear` (not those of scripts, nor the connections' set-up)."""
        skip = {"HELLO", "SELECT", "CLIENT", "ECHO", "PING", "MONITOR", "INFO"}
        out = []
        for line in self.path.read_bytes()[self._offset:].split(b"\r\n"):
            if not line.startswith(b"+") or line == b"+OK":
                continue
            _, _, client, words = _parse_monitor_line(line[1:])
            if client != "lua" and words and words[0].upper() not in skip:
                out.append(words)
        return out


_seq = itertools.count(1)
HANDOFF_QUEUE = "hot-one"
"""The queue of the hand-off latency run: only the first node consumes it."""

PARK_SHA = hashlib.sha1(line_scripts.PARK.encode()).hexdigest()
ACQUIRE_SHA = hashlib.sha1(scripts.ACQUIRE.encode()).hexdigest()
FRESH_SHA = hashlib.sha1(scripts.ACQUIRE_FRESH.encode()).hexdigest()
"""A fresh delivery's ACQUIRE (2 keys: token, metadata, ttl): its owner is in the metadata."""


def _argv(w: list[str]) -> list[str]:
    """A MONITORed EVALSHA's arguments (ARGV[1] first), past its keys (their count is its third word)."""
    return w[3 + int(w[2]):]


def _acquire_owner(w: list[str]) -> str | None:
    """The owner id of a MONITORed ACQUIRE (full: its 4th argument; fresh: in its metadata, the
    script's 2nd argument), else None."""
    if w[0].upper() != "EVALSHA":
        return None
    if w[1] == ACQUIRE_SHA and len(_argv(w)) > 3:
        return _argv(w)[3]
    if w[1] == FRESH_SHA and len(_argv(w)) > 1:
        try:
            return json.loads(_argv(w)[1]).get("owner")
        except ValueError:
            return None
    return None


class HotRecords:
    """What the hot_app workers wrote (``hot-<pid>.txt`` in each node's record directory)."""

    def __init__(self, dirs: Sequence[Path]) -> None:
        self.dirs = list(dirs)
        self._offsets: dict[Path, int] = {}
        self.bodies: dict[tuple[str, int], list[tuple[int, int, int, int]]] = {}
        """(variant, seq) -> [(start ns, end ns, pid, ns waited in acquire)]"""
        self.gave_up: dict[tuple[str, int], int] = {}
        self.gates: dict[int, int] = {}
        self.parks: dict[str, list[tuple[int, str]]] = {}
        """task id -> [(t ns, policy)]"""
        self.pubs: list[tuple[str, str, int, int, str]] = []
        """(task name, task id, t ns, pid, why)"""
        self._counts: dict[str, int] = {}

    def poll(self) -> None:
        for directory in self.dirs:
            for path in directory.glob("hot-*.txt"):
                offset = self._offsets.get(path, 0)
                with open(path, "rb") as f:
                    f.seek(offset)
                    data = f.read()
                end = data.rfind(b"\n") + 1
                self._offsets[path] = offset + end
                for line in data[:end].decode().splitlines():
                    self._parse(line.split())

    def count(self, variant: str) -> int:
        """How many body and gave-up records of ``variant`` were read so far (all its runs)."""
        return self._counts.get(variant, 0)

    def _parse(self, w: list[str]) -> None:
        kind = w[0]
        if kind == "body":
            self.bodies.setdefault((w[1], int(w[2])), []).append((int(w[3]), int(w[4]), int(w[5]), int(w[6])))
            self._counts[w[1]] = self._counts.get(w[1], 0) + 1
        elif kind == "gave-up":
            self.gave_up[(w[1], int(w[2]))] = int(w[3])
            self._counts[w[1]] = self._counts.get(w[1], 0) + 1
        elif kind == "gate":
            self.gates[int(w[1])] = int(w[2])
        elif kind == "park":
            self.parks.setdefault(w[1], []).append((int(w[2]), w[4]))
        elif kind == "pub":
            self.pubs.append((w[1], w[2], int(w[3]), int(w[4]), w[5]))


def longest_in_order(values: Sequence[int]) -> int:
    """Length of the longest increasing subsequence: how many kept their order (the rest were overtaken)."""
    tails: list[int] = []
    for v in values:
        i = bisect.bisect_left(tails, v)
        if i == len(tails):
            tails.append(v)
        else:
            tails[i] = v
    return len(tails)


def _ms(values_ns: Sequence[int]) -> dict[str, Any]:
    vals = [v / 1e6 for v in values_ns]
    if not vals:
        return {"n": 0, "p50": None, "p99": None, "max": None, "mean": None}
    return {"n": len(vals), "p50": percentile(vals, 50), "p99": percentile(vals, 99), "max": max(vals),
            "mean": sum(vals) / len(vals)}


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
    # split at the hand-off's publish (after_task_publish in the releasing process)
    published = {tid: t for _, tid, t, _, why in rec.pubs if why == "entry"}
    to_pub, from_pub = [], []
    for i in range(1, len(runs)):
        t = published.get(f"hot-{variant}-{runs[i][1]}") if variant == "ours" else None  # (slot: sent ahead)
        if t is not None:
            to_pub.append(t - runs[i - 1][0][1])
            from_pub.append(runs[i][0][0] - t)
    node_pids = set(node._pids())
    runs = [r for r, _ in runs]
    # the baseline: Celery's own latency from a publish to the body start of a task with no lock,
    # one at a time on the same idle node (the client's apply_async included)
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
        cluster.pause()
        try:
            t0 = time.monotonic_ns()
            for tid, s in ids.items():
                task.apply_async((sku, s, body_s, *extra), task_id=tid)
            published_s = (time.monotonic_ns() - t0) / 1e9
        finally:
            cluster.resume()
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
        stopped = time.monotonic_ns()
        time.sleep(0.1)
        mon.sync()
        cmds = mon.commands()
    rec.poll()
    finished = ran + gave_up >= n

    firsts = {s: rec.bodies[(variant, s)] for s in seqs if (variant, s) in rec.bodies}
    runs = sorted((b[0], b[1], s, b[3]) for s, bl in firsts.items() for b in bl)
    overlaps, latest_end = 0, 0
    for start, end, _, _ in runs:
        if start < latest_end:
            overlaps += 1
        latest_end = max(latest_end, end)
    gaps = [runs[i][0] - runs[i - 1][1] for i in range(1, len(runs))]

    pubs = [p for p in rec.pubs if p[1] in ids]
    why: dict[str, int] = {}
    for p in pubs:
        why[p[4]] = why.get(p[4], 0) + 1

    # arrival at the lock, in the order Redis ran it (MONITOR)
    order: list[int] = []
    seen: set[int] = set()
    attempts: dict[int, int] = {}
    if variant in ("ours", "ours-slot"):
        # each waiter's place: its last PARK that is not a copy's re-park at the head (again: ARGV[8]).
        # A PARK that found the key free and nobody waiting (it then takes it, or parks again) held no place.
        placed: dict[int, int] = {}
        for i, w in enumerate(cmds):
            argv = _argv(w) if w[0].upper() == "EVALSHA" and w[1] == PARK_SHA else []
            if len(argv) > 7 and argv[4] in ids and argv[7] != "1":
                placed[ids[argv[4]]] = i
        order = sorted(placed, key=placed.__getitem__)
        seen = set(order)
        # ours: those that parked (its duplicate_skipped record); ours-slot: every PARK, a slot wait too
        waiters = {ids[t] for t in rec.parks if t in ids} if variant == "ours" else seen
    elif variant == "plain":  # no lock: nobody waits
        waiters = set()
    elif variant == "backoff":
        for w in cmds:
            owner = _acquire_owner(w)
            if owner in ids:
                s = ids[owner]
                if s not in seen:
                    seen.add(s)
                    order.append(s)
        waiters = {ids[t] for t in rec.parks if t in ids}
    else:
        name = f"hot-rlock:{sku}"
        for w in cmds:
            if w[0].upper() == "SET" and len(w) > 2 and w[1] == name and w[2].startswith("seq-"):
                s = int(w[2][4:])
                attempts[s] = attempts.get(s, 0) + 1
                if s not in seen:
                    seen.add(s)
                    order.append(s)
        waiters = {s for s, k in attempts.items() if k >= 2}
    order = [s for s in order if s in waiters]
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
