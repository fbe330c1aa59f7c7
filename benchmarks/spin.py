"""The spin's A/B: ``singleton_lock_spin`` on and off, in one run, on a busy host with a Redis further away.

    python benchmarks/spin.py [--n 3000] [--rounds 3] [--concurrency 8] [--extra-us 150]

Each worker process waits for the lock Redis's replies either by spinning on the socket for up to
150 µs first (the spin) or by sleeping at once. This measures both where the spin is least likely to
pay: ``prefork -c 8`` on a 2-core host (more processes than cores), and the lock Redis behind a proxy
that adds about ``--extra-us`` to every round trip. The broker is a redis-server of its own, reached
directly.

Per round, for each setting in turn (ours with the spin, ours without, and a plain Celery task as the
baseline; the order alternates between rounds), one worker is started, ``--n`` tasks with distinct
arguments are published while it is frozen, and it drains them:

* throughput: tasks per second, from the resume to the last completion;
* CPU per task: user + system time of the worker's processes (the main one and its pool children),
  over the drain, divided by the tasks (µs); the pool children's split between their main threads
  (the tasks' own path) and their other threads (our watchdog and sweeper); the lock Redis's and the
  proxy's CPU apart.

The result is printed as JSON and, with ``--out``, written there (benchmarks/RESULTS.md quotes it).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH_DIR), str(BENCH_DIR.parent)]

from celery_singleton_lock.testing.servers import RedisServer  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


class LatencyProxy:
    """A TCP proxy that holds each reply ``extra`` seconds before passing it on (two threads per
    connection; it sleeps, never spins, so it takes no core from the workers while it waits)."""

    def __init__(self, target_port: int, extra: float) -> None:
        self.target, self.extra = ("127.0.0.1", target_port), extra
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._pipe, args=(client, upstream, 0.0), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, self.extra), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket, delay: float) -> None:
        try:
            while data := src.recv(65536):
                if delay:
                    time.sleep(delay)
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.close()
            except OSError:
                pass

    def close(self) -> None:
        self._listener.close()


def _ticks(path: str) -> int:
    try:
        with open(path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU of ``pids`` so far (processes gone since count nothing)."""
    return sum(_ticks(f"/proc/{pid}/stat") for pid in pids) / TICK


def thread_cpu_seconds(pids: list[int]) -> tuple[float, float]:
    """(the main threads', every other thread's) CPU of ``pids`` so far: in a pool child the other threads
    are ours (the watchdog and the sweeper), so this tells the tasks' own path from the background."""
    main = other = 0
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            ticks = _ticks(f"/proc/{pid}/task/{tid}/stat")
            if int(tid) == pid:
                main += ticks
            else:
                other += ticks
    return main / TICK, other / TICK


def round_trip_us(port: int, n: int = 2000) -> float:
    import redis

    client = redis.Redis(port=port)
    client.ping()
    start = time.perf_counter()
    for _ in range(n):
        client.ping()
    client.close()
    return (time.perf_counter() - start) / n * 1e6


def one_setting(variant: str, spin: bool, args: argparse.Namespace, broker: RedisServer, lock_port: int, lock_pid: int,
                proxy_pid: int, out_dir: Path) -> dict:
    os.environ["BENCH_SPIN"] = "1" if spin else "0"
    # (bench_app reads these at its import, on this side too)
    os.environ.update(BENCH_BROKER_URL=broker.url(0), BENCH_LOCK_URL=f"redis://127.0.0.1:{lock_port}/0")
    from harness import BenchWorker

    env = dict(os.environ)
    worker = BenchWorker("prefork", args.concurrency, env, out_dir, name=f"spin-{int(spin)}").start()
    try:
        import bench_app

        task = bench_app.VARIANTS[variant]
        worker.run_batch([(variant, task)] * 200, timeout=300)  # warm: every child connected
        pids = [worker.pid, *worker.proc.children()]
        children = worker.proc.children()
        worker.pause()
        from harness import next_seq

        seqs = []
        for _ in range(args.n):
            seq = next_seq()
            task.apply_async((seq,))
            seqs.append(seq)
        before = cpu_seconds(pids), cpu_seconds([lock_pid]), cpu_seconds([proxy_pid]), thread_cpu_seconds(children)
        start = time.perf_counter_ns()
        worker.resume()
        done = worker.records.wait_for(seqs, timeout=600)
        end = done[-1][2]
        after = cpu_seconds(pids), cpu_seconds([lock_pid]), cpu_seconds([proxy_pid]), thread_cpu_seconds(children)
    finally:
        worker.stop()
    seconds = (end - start) / 1e9
    return {
        "variant": variant,
        "spin": spin,
        "tasks_per_s": round(args.n / seconds, 1),
        "worker_cpu_us_per_task": round((after[0] - before[0]) / args.n * 1e6, 1),
        "lock_redis_cpu_us_per_task": round((after[1] - before[1]) / args.n * 1e6, 1),
        "proxy_cpu_us_per_task": round((after[2] - before[2]) / args.n * 1e6, 1),
        "children_main_threads_cpu_us_per_task": round((after[3][0] - before[3][0]) / args.n * 1e6, 1),
        "children_other_threads_cpu_us_per_task": round((after[3][1] - before[3][1]) / args.n * 1e6, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--extra-us", type=float, default=150.0, help="µs the proxy adds to each round trip")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    out_dir = Path(tempfile.mkdtemp(prefix="spin-"))
    broker, locks = RedisServer().start(), RedisServer().start()
    direct = round_trip_us(locks.port)
    # the proxy's own hop costs something: it sleeps only for what is left of the extra
    bare = LatencyProxy(locks.port, 0.0)
    hop = round_trip_us(bare.port) - direct
    bare.close()
    proxy = LatencyProxy(locks.port, max(0.0, (args.extra_us - hop) / 1e6))
    through = round_trip_us(proxy.port)
    results: list[dict] = []
    try:
        for r in range(args.rounds):
            settings = [("ours", True), ("ours", False), ("plain", True)]
            for variant, spin in (settings if r % 2 == 0 else settings[::-1]):
                got = one_setting(variant, spin, args, broker, proxy.port, locks.pid, os.getpid(), out_dir)
                got["round"] = r + 1
                print(json.dumps(got), flush=True)
                results.append(got)
    finally:
        proxy.close()
        broker.stop()
        locks.stop()
    summary = {
        "setup": {"pool": "prefork", "concurrency": args.concurrency, "cores": os.cpu_count(), "n": args.n,
                  "rounds": args.rounds, "round_trip_us_direct": round(direct, 1),
                  "round_trip_us_through_proxy": round(through, 1)},
        "runs": results,
    }
    named = (("spin_on", "ours", True), ("spin_off", "ours", False), ("plain_celery", "plain", True))
    for name, variant, spin in named:
        mine = [r for r in results if r["variant"] == variant and r["spin"] is spin]
        summary[name] = {
            key: round(statistics.median(r[key] for r in mine), 1)
            for key in ("tasks_per_s", "worker_cpu_us_per_task", "lock_redis_cpu_us_per_task",
                        "children_main_threads_cpu_us_per_task", "children_other_threads_cpu_us_per_task")
        }
    print(json.dumps(summary, indent=2))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
