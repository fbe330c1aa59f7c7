"""The measuring parts: a pausable worker, its completion records, and the worker-side phases
(phase 3, the lock-server commands per task, is in server_commands.py).

Every phase publishes while the worker is frozen (SIGSTOP, by PID), so the
publishing client and the worker never compete for the machine's two cores,
and the worker then drains a full queue at its own pace.
"""

from __future__ import annotations

import itertools
import os
import random
import signal
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from celery_singleton_lock.testing.servers import WorkerProcess, wait_until

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent

_seq = itertools.count(1)


def next_seq() -> int:
    """A number never used before in this run: every task gets distinct arguments."""
    return next(_seq)


# -- statistics -------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), nearest-rank on the sorted values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(round(q / 100.0 * len(ordered) + 0.5))))
    return ordered[rank - 1]


@dataclass
class Spread:
    """The median and the min–max of one figure over the rounds."""

    median: float
    low: float
    high: float
    values: list[float] = field(default_factory=list)

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        vals = [v for v in values if v == v]  # drop NaN
        if not vals:
            return cls(float("nan"), float("nan"), float("nan"), [])
        return cls(statistics.median(vals), min(vals), max(vals), list(vals))

    def as_dict(self) -> dict[str, Any]:
        return {"median": self.median, "min": self.low, "max": self.high, "values": self.values}


# -- a worker we can freeze ----------------------------------------------------------


class Records:
    """Completion records (``variant seq t_ns pid``) appended by a worker's processes."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self._offsets: dict[Path, int] = {}
        self.by_seq: dict[int, tuple[str, int, int]] = {}

    def poll(self) -> None:
        for path in self.dir.glob("rec-*.txt"):
            offset = self._offsets.get(path, 0)
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read()
            end = data.rfind(b"\n") + 1  # only whole lines
            self._offsets[path] = offset + end
            for line in data[:end].decode().splitlines():
                variant, seq, t_ns, pid = line.split()
                self.by_seq[int(seq)] = (variant, int(t_ns), int(pid))

    def wait_for(self, seqs: Sequence[int], timeout: float) -> list[tuple[int, str, int, int]]:
        """Wait until every seq has finished; (seq, variant, t_ns, pid) sorted by completion time."""
        deadline = time.monotonic() + timeout
        missing = set(seqs)
        while True:
            self.poll()
            missing = {s for s in missing if s not in self.by_seq}
            if not missing:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(missing)} of {len(seqs)} tasks did not finish in {timeout}s")
            time.sleep(0.02)
        out = [(s, *self.by_seq[s]) for s in seqs]
        out.sort(key=lambda r: r[2])
        return out


class BenchWorker:
    """A real ``celery worker`` on bench_app, frozen with SIGSTOP while we publish."""

    def __init__(self, pool: str, concurrency: int, env: dict[str, str], out_dir: Path, *, app: str = "bench_app",
                 name: str | None = None, extra: Sequence[str] = ()) -> None:
        name = name or pool
        self.record_dir = Path(tempfile.mkdtemp(prefix=f"records-{name}-", dir=out_dir))
        self.records = Records(self.record_dir)
        self.pool = pool
        self.name = name
        worker_env = dict(env)
        worker_env["BENCH_RECORD_DIR"] = str(self.record_dir)
        worker_env["PYTHONPATH"] = os.pathsep.join([str(BENCH_DIR), str(ROOT), worker_env.get("PYTHONPATH", "")])
        self.proc = WorkerProcess(
            app,
            pool=pool,
            concurrency=concurrency,
            env=worker_env,
            cwd=BENCH_DIR,
            logfile=str(out_dir / f"worker-{name}.log"),
            # Celery's default log level: no per-task log lines
            extra=["--loglevel", os.environ.get("BENCH_LOGLEVEL", "WARNING"), "--prefetch-multiplier", "4", *extra],
        )
        self.paused = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def start(self, timeout: float = 60.0) -> BenchWorker:
        return self.launch().wait_ready(timeout)

    def launch(self) -> BenchWorker:
        """Start the process without waiting for it (start several, then wait_ready each)."""
        self.proc.start()
        return self

    def wait_ready(self, timeout: float = 60.0) -> BenchWorker:
        def ready() -> bool:
            if self.proc.proc is not None and self.proc.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.proc.returncode}:\n{self.proc.log()[-3000:]}")
            return any(self.record_dir.glob("ready-*"))

        wait_until(ready, timeout, 0.05, f"{self.pool} worker to be ready")
        return self

    def _pids(self) -> list[int]:
        return [self.proc.pid, *self.proc.children()]

    def pause(self) -> None:
        for pid in self._pids():
            os.kill(pid, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        for pid in reversed(self._pids()):
            os.kill(pid, signal.SIGCONT)
        self.paused = False

    def stop(self) -> None:
        if self.paused:
            self.resume()
        self.proc.stop()

    def run_batch(self, schedule: Sequence[tuple[str, Any]], *, timeout: float = 300.0) -> tuple[list, dict]:
        """Publish ``schedule`` [(variant, task)] while frozen, then let the worker drain it.

        Returns the completion records (sorted by time) and each variant's
        apply_async latencies in ns.
        """
        latencies: dict[str, list[int]] = {}
        seqs: list[int] = []
        self.pause()
        try:
            clock = time.perf_counter_ns
            for variant, task in schedule:
                seq = next_seq()
                t0 = clock()
                task.apply_async((seq,))
                latencies.setdefault(variant, []).append(clock() - t0)
                seqs.append(seq)
        finally:
            self.resume()
        return self.records.wait_for(seqs, timeout), latencies


def stop_all(workers: Sequence[BenchWorker]) -> None:
    """Stop several workers at once (each warm shutdown takes about a second)."""
    import threading

    threads = [threading.Thread(target=w.stop) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


# -- phase 1: the interleaved run -----------------------------------------------------


def blocks_schedule(variants: dict[str, Any], blocks: int, per_block: int, rng: random.Random) -> list:
    """``blocks`` small blocks, each holding every variant ``per_block`` times in random order."""
    schedule = []
    for _ in range(blocks):
        block = [(name, task) for name, task in variants.items() for _ in range(per_block)]
        rng.shuffle(block)
        schedule.extend(block)
    return schedule


def interleaved_round(worker: BenchWorker, variants: dict[str, Any], blocks: int, per_block: int,
                      skip_blocks: int, rng: random.Random) -> dict[str, Any]:
    """One round: per variant, the median gap before its completions and its publish p50/p99 (µs)."""
    schedule = blocks_schedule(variants, blocks, per_block, rng)
    records, latencies = worker.run_batch(schedule)
    # A completion's gap is the time since the one before it: on a solo worker, the whole
    # time the worker spent on that task. The first blocks only warm the worker up.
    skip = max(1, skip_blocks * per_block * len(variants))
    kept: dict[str, list[float]] = {name: [] for name in variants}
    for prev, cur in zip(records[skip - 1:], records[skip:], strict=False):
        kept[cur[1]].append((cur[2] - prev[2]) / 1000.0)
    span = (records[-1][2] - records[0][2]) / 1e9
    return {
        "worker_us": {name: statistics.median(kept[name]) for name in variants},
        "publish_p50_us": {name: percentile(latencies[name], 50) / 1000.0 for name in variants},
        "publish_p99_us": {name: percentile(latencies[name], 99) / 1000.0 for name in variants},
        "tasks": len(records),
        "seconds": span,
    }


# -- phase 2: throughput, alternated per-variant runs ---------------------------------


def throughput_run(worker: BenchWorker, variant: str, task: Any, n: int) -> float:
    """Tasks per second draining a queue of ``n`` tasks of one variant: (n-1) / (last - first)."""
    records, _ = worker.run_batch([(variant, task)] * n)
    span = (records[-1][2] - records[0][2]) / 1e9
    return (len(records) - 1) / span if span > 0 else float("nan")


def throughput(worker: BenchWorker, variants: dict[str, Any], rounds: int, n: int,
               progress: Callable[[str], None]) -> dict[str, Any]:
    names = list(variants)
    per_round: list[dict[str, float]] = []
    for r in range(rounds):
        # alternate: each round starts at a different variant, and every other round runs backwards
        order = names[r % len(names):] + names[: r % len(names)]
        if r % 2:
            order.reverse()
        rates = {name: throughput_run(worker, name, variants[name], n) for name in order}
        per_round.append(rates)
        progress(f"  {worker.pool} round {r + 1}/{rounds}: "
                 + ", ".join(f"{k} {rates[k]:.0f}/s" for k in names))
    return {
        "rate": {name: Spread.of([pr[name] for pr in per_round]).as_dict() for name in names},
        "ratio": {name: Spread.of([pr[name] / pr["plain"] for pr in per_round]).as_dict() for name in names},
        "rounds": per_round,
        "n": n,
    }


# -- where our worker time goes: the instrumented worker (bench_app, BENCH_BREAKDOWN=1) --------


def breakdown(env: dict[str, str], out_dir: Path, variants: dict[str, Any], n: int) -> dict[str, Any]:
    """Mean wall time per call of each piece of LockedTask's path, in a solo worker running n ours tasks.

    ``pieces`` is keyed by the piece's path of callers (``"a > b"``), in the order the first task met them.
    """
    import json

    worker = BenchWorker("solo", 1, dict(env, BENCH_BREAKDOWN="1"), out_dir)
    worker.start()
    try:
        worker.run_batch([("ours", variants["ours"])] * n)
    finally:
        worker.stop()
    files = list(worker.record_dir.glob("breakdown-*.json"))
    if not files:
        return {"error": "the worker wrote no breakdown"}
    data = json.loads(files[0].read_text())
    tasks = data.get("LockedTask.before_start", [0, 1])[1]
    return {
        "tasks": tasks,
        "pieces": {label: {"us_per_call": ns / calls / 1000 if calls else 0.0,
                           "calls_per_task": calls / tasks if tasks else 0.0,
                           "us_per_task": ns / tasks / 1000 if tasks else 0.0}
                   for label, (ns, calls) in data.items()},
    }
