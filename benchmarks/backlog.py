"""Hot key under a backlog (issue 17): the hot-key drain while the same queue is kept deep.

For each broker (the Redis broker, and RabbitMQ when it accepts connections
on 127.0.0.1:5672): ``hot_app`` worker nodes (prefork, Celery's default
prefetch) on a queue of their own, a lock redis-server of their own, and a
lock TTL of ``backlog_ttl`` seconds.

1. **Idle queue.** hotkeys.drain: N deductions on one key published at once;
   the median gap between consecutive bodies of the key is the baseline.
2. **Busy queue.** A feeder keeps the same queue at least 2 x the lock TTL
   deep with ``hot.filler`` tasks (no lock, ``backlog_filler`` seconds each)
   the whole time; the depth in seconds is the depth in tasks over the rate
   at which the nodes eat fillers (measured just before). Then the same
   drain: the deductions queue once behind the backlog, park, and each turn
   then comes through the turns queue.

Goals: wall <= 1.15 x the serial ideal + the backlog's depth in seconds + 2 s;
the median gap <= 3 x the idle one; 0 lost, 0 run twice, 0 overlaps, >= 99 %
in park order.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import BenchWorker, stop_all
from hotkeys import HotCluster, drain

from celery_singleton_lock.testing.servers import wait_until

AMQP_URL = os.environ.get("BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")
TURNS = ".singleton_turns"


def rabbit_up() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 5672), timeout=2):
            return True
    except OSError:
        return False


class _Send:
    """``apply_async`` by task name through the run's own client app (hotkeys.drain calls it)."""

    def __init__(self, client: Any, name: str, queue: str) -> None:
        self.client, self.name, self.queue = client, name, queue

    def apply_async(self, args: Any, task_id: str | None = None, queue: str | None = None) -> Any:
        return self.client.send_task(self.name, args, task_id=task_id, queue=queue or self.queue,
                                     ignore_result=True)


class BacklogCluster(HotCluster):
    """HotCluster on a queue of its own, on the Redis broker or RabbitMQ, with its own lock TTL."""

    def __init__(self, out_dir: Path, nodes: int, concurrency: int, broker: str, ttl: float,
                 prefetch: int = 4) -> None:
        super().__init__(out_dir, nodes, concurrency)
        self.kind, self.ttl, self.prefetch = broker, ttl, prefetch
        self.queue = f"bench-backlog-{broker}-{uuid.uuid4().hex[:8]}"
        self.client: Any = None

    def __enter__(self) -> BacklogCluster:
        from celery import Celery

        try:
            self.broker.start()
            self.locks.start()
            url = AMQP_URL if self.kind == "amqp" else self.broker.url(0)
            self.env = {"BENCH_HOT_BROKER_URL": url, "BENCH_HOT_LOCK_URL": self.locks.url(0),
                        "BENCH_HOT_QUEUE": self.queue, "BENCH_HOT_LOCK_TTL": str(self.ttl)}
            self.client = Celery(f"backlog-{self.kind}", broker=url, set_as_current=False)
            self.client.conf.update(task_ignore_result=True, broker_heartbeat=0)
            self.app = type("Client", (), {
                f"hot_{v}": _Send(self.client, f"hot.{v}", self.queue) for v in ("ours", "backoff", "rlock", "plain",
                                                                                   "filler")
            })()
            self.start_nodes()
        except BaseException:
            self.__exit__()
            raise
        return self

    def start_nodes(self) -> None:
        self.nodes = []
        for i in range(self.n_nodes):
            self.nodes.append(BenchWorker("prefork", self.concurrency, self.env, self.out_dir, app="hot_app",
                                          name=f"backlog-{self.kind}-node{i + 1}",
                                          extra=["-Q", self.queue, "--prefetch-multiplier", str(self.prefetch)]))
        for node in self.nodes:
            node.launch()
        for node in self.nodes:
            node.wait_ready()
        self.records.dirs = [n.record_dir for n in self.nodes]
        sku, seqs = f"warm-{uuid.uuid4().hex[:6]}", list(range(10_000_000, 10_000_000 + 8 * self.n_nodes))
        for s in seqs:
            self.app.hot_ours.apply_async((sku, s, 0.005), task_id=f"warm-backlog-{s}")

        def done() -> bool:
            self.records.poll()
            return all(("ours", s) in self.records.bodies for s in seqs)

        wait_until(done, 60, 0.05, "the backlog run's warm-up tasks")

    def depth(self, conn: Any = None) -> int:
        if self.kind == "redis":
            with self.broker.client() as c:
                return int(c.llen(self.queue))
        return int(conn.default_channel.queue_declare(self.queue, passive=True).message_count)

    def __exit__(self, *exc: object) -> None:
        try:
            stop_all(self.nodes)
            if self.kind == "amqp" and self.client is not None:
                with self.client.connection_for_write() as conn:
                    for q in (self.queue, self.queue + TURNS):
                        try:
                            conn.default_channel.queue_delete(q)
                        except Exception:
                            pass
        finally:
            self.broker.__exit__()
            self.locks.__exit__()


class Feeder:
    """Keeps the cluster's queue at least ``target`` fillers deep until stopped; samples the depth."""

    def __init__(self, cluster: BacklogCluster, target: int, filler_s: float) -> None:
        self.cluster, self.target, self.filler_s = cluster, target, filler_s
        self.sent = 0
        self.samples: list[tuple[float, int]] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._feed, daemon=True, name="backlog-feeder")

    def _feed(self) -> None:
        conn = self.cluster.client.connection_for_write() if self.cluster.kind == "amqp" else None
        try:
            while not self.stopping.is_set():
                depth = self.cluster.depth(conn)
                self.samples.append((time.monotonic(), depth))
                for _ in range(max(0, self.target + self.target // 4 - depth)):
                    self.cluster.app.hot_filler.apply_async((self.filler_s,))
                    self.sent += 1
                self.stopping.wait(0.05)
        finally:
            if conn is not None:
                conn.release()

    def __enter__(self) -> Feeder:
        self.thread.start()
        wait_until(lambda: bool(self.samples) and self.samples[-1][1] >= self.target, 60, 0.05, "the backlog")
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.thread.join(10)

    def rate(self, seconds: float) -> float:
        """Fillers eaten per second over the next ``seconds`` (sent minus what is still queued)."""
        sent0, depth0, t0 = self.sent, self.samples[-1][1], time.monotonic()
        time.sleep(seconds)
        eaten = (self.sent - sent0) - (self.samples[-1][1] - depth0)
        return eaten / (time.monotonic() - t0)

    def depth_between(self, t0: float, t1: float) -> list[int]:
        return [d for t, d in self.samples if t0 <= t <= t1]


def one_broker(out_dir: Path, p: dict[str, Any], broker: str, prefetch: int,
               progress: Callable[[str], None]) -> dict[str, Any]:
    n, body, ttl, filler = p["backlog_n"], p["backlog_body"], p["backlog_ttl"], p["backlog_filler"]
    with BacklogCluster(out_dir, p["hot_nodes"], p["hot_concurrency"], broker, ttl, prefetch) as cluster:
        slots = p["hot_nodes"] * p["hot_concurrency"]
        progress(f"  {broker}: idle queue, {n} deductions x {body * 1000:g} ms on one key")
        idle = drain(cluster, "ours", n, body, p["hot_cap_ours"], progress)
        # 2 x the TTL at the rate all slots eat fillers, and a quarter more: never shallower than 2 x TTL
        target = int(2 * ttl * slots / filler * 1.25)
        with Feeder(cluster, target, filler) as feeder:
            rate = feeder.rate(2.0)
            depth_tasks = feeder.samples[-1][1]
            depth_s = depth_tasks / rate if rate > 0 else float("inf")
            progress(f"  {broker}: busy queue, {depth_tasks} fillers deep ({depth_s:.1f} s at {rate:.0f}/s, "
                     f"lock TTL {ttl:g} s); the same drain")
            t0 = time.monotonic()
            busy = drain(cluster, "ours", n, body, p["hot_cap_ours"] + depth_s, progress)
            during = feeder.depth_between(t0, time.monotonic())
    return {
        "broker": broker, "ttl": ttl, "filler_s": filler, "prefetch": prefetch, "filler_rate": rate,
        "depth_tasks": depth_tasks,
        "depth_s": depth_s, "min_depth_s": (min(during) / rate) if during and rate > 0 else None,
        "idle": idle, "busy": busy,
    }


def run(out_dir: Path, p: dict[str, Any], progress: Callable[[str], None]) -> dict[str, Any]:
    """Every broker at every prefetch multiplier (Celery's default 4 first); keyed "redis", "amqp-p1", ..."""
    out: dict[str, Any] = {}
    for prefetch in p["backlog_prefetch"]:
        for broker in p["backlog_brokers"]:
            if broker == "amqp" and not rabbit_up():
                progress("  amqp: RabbitMQ does not accept connections on 127.0.0.1:5672: left out")
                continue
            name = broker if prefetch == 4 else f"{broker}-p{prefetch}"
            out[name] = one_broker(out_dir, p, broker, prefetch, progress)
            progress("    " + line(out[name]))
    return out


def _judge(r: dict[str, Any]) -> dict[str, Any]:
    busy, idle = r["busy"], r["idle"]
    bound = 1.15 * busy["ideal_s"] + r["depth_s"] + 2
    gap, gap0 = busy["gap_ms"]["p50"], idle["gap_ms"]["p50"]
    return {
        "bound_s": bound,
        "wall_ok": bool(busy["finished"] and busy["wall_s"] is not None and busy["wall_s"] <= bound),
        "gap_ok": gap is not None and gap0 is not None and gap <= 3 * gap0,
        "exact_ok": busy["lost"] == 0 and busy["ran_twice"] == 0 and busy["overlaps"] == 0,
        "order_ok": busy["in_order"] is not None and busy["in_order"] >= 0.99,
    }


def line(r: dict[str, Any]) -> str:
    busy, j = r["busy"], _judge(r)
    wall = f"{busy['wall_s']:.1f} s" if busy["finished"] else f"did not finish ({busy['completed']} of {busy['n']})"
    return (f"{r['broker']}, prefetch multiplier {r.get('prefetch', 4)}: wall {wall} (bound {j['bound_s']:.1f} s); "
            f"median gap "
            f"{busy['gap_ms']['p50'] or 0:.1f} ms (idle {r['idle']['gap_ms']['p50'] or 0:.1f} ms); lost "
            f"{busy['lost']}, twice {busy['ran_twice']}, overlaps {busy['overlaps']}, in order "
            f"{(busy['in_order'] or 0) * 100:.1f} %")


LABELS = {"redis": "Redis broker", "amqp": "RabbitMQ"}


def render(results: dict[str, Any], table: Callable[[list[str], list[list[str]]], str]) -> str:
    if not results:
        return ""
    rows = []
    for r in results.values():
        busy, idle, j = r["busy"], r["idle"], _judge(r)
        rows.append([
            LABELS.get(r["broker"], r["broker"]), str(r.get("prefetch", 4)),
            f"{r['depth_tasks']:,} ({r['depth_s']:.1f} s; at least {r['min_depth_s'] or 0:.1f} s during the drain)",
            f"{busy['wall_s']:.1f}" if busy["finished"] else f"did not finish ({busy['completed']:,} done)",
            f"{j['bound_s']:.1f}", f"{idle['wall_s']:.1f}" if idle["finished"] else "–",
            f"{busy['gap_ms']['p50'] or 0:.1f} / {idle['gap_ms']['p50'] or 0:.1f}",
            f"{busy['lost']} / {busy['ran_twice']} / {busy['overlaps']}",
            f"{(busy['in_order'] or 0) * 100:.1f} %", f"{busy['publishes_per_duplicate'] or 0:.2f}",
        ])
    first = next(iter(results.values()))
    b = first["busy"]
    return (
        f"**Hot key under a backlog** ({b['n']:,} deductions × {b['body_s'] * 1000:g} ms on ONE key, published at "
        f"once, {b['nodes']} nodes × prefork -c {b['concurrency']}, with Celery's default "
        f"`worker_prefetch_multiplier` (4) and with 1, lock TTL "
        f"{first['ttl']:g} s, while a feeder keeps the same queue at least 2 × the TTL deep with "
        f"{first['filler_s'] * 1000:g} ms tasks of no lock. Depth in seconds = fillers queued / the rate the nodes "
        "eat them. Goal: wall ≤ 1.15 × the serial ideal + the depth in seconds + 2 s; median gap between "
        "consecutive bodies of the key ≤ 3 × the idle queue's. Under a saturated queue a turn still waits for "
        "a worker slot: behind the prefetched backlog tasks of the worker that takes it.)\n\n"
        + table(["broker", "worker_prefetch_multiplier", "backlog, fillers (seconds)", "wall s", "goal s",
                 "idle-queue wall s",
                 "median gap ms, busy / idle", "lost / twice / overlaps", "in park order",
                 "worker publishes per duplicate"], rows))


def goals(results: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for r in results.values():
        j, idle = _judge(r), r["idle"]
        name = LABELS.get(r["broker"], r["broker"]) + f", prefetch multiplier {r.get('prefetch', 4)}"
        out.append({
            "goal": f"Hot key under a backlog, {name} (wall ≤ 1.15 × ideal + backlog depth + 2 s; median gap ≤ 3 × "
                    "idle; 0 lost / twice / overlaps; ≥ 99 % in order)",
            "met": j["wall_ok"] and j["gap_ok"] and j["exact_ok"] and j["order_ok"],
            "figure": (line(r) + f"; backlog {r['depth_s']:.1f} s deep, the wall's bound {j['bound_s']:.1f} s; "
                       f"3 × the idle gap = {3 * (idle['gap_ms']['p50'] or 0):.1f} ms."),
        })
    return out
