"""Footprint: what each lock leaves in its Redis after N tasks on distinct keys.

Every variant gets a lock redis-server of its own (so ``INFO memory`` and
``DBSIZE`` count that variant only), a broker database of its own, a solo
worker (bench_app) and a publishing subprocess (celery-once and
celery-singleton lock at publish, so the publisher must point at the same lock
server). All variants run at once; each one's clock starts when its last task
has finished. Then its worker is stopped (its connections closed) and the
server is looked at: at once, and after each of ``waits`` seconds, all
variants' waits overlapping (one clock for the whole phase, so the 2-minute
wait costs 2 minutes in all, and other phases run meanwhile).

A look (:func:`snapshot`): ``used_memory`` and ``used_memory_scripts``
(INFO memory), ``DBSIZE``, and ``MEMORY USAGE`` of up to 200 leftover keys
(SCAN), scaled to all of them when there are more.

    python footprint.py publish --variant ours --n 20000    # the publishing side (bench_app's env)
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent

VARIANTS = ("ours", "ours_late", "ours_quorum", "celery-once", "celery-singleton", "cookbook")
LABELS = {
    "ours": "ours (early ack, Celery's default)",
    "ours_quorum": "ours, quorum of 3 masters (early ack; the busiest member)",
    "ours_late": "ours (acks_late)",
    "celery-once": "celery-once (QueueOnce)",
    "celery-singleton": "celery-singleton (Singleton)",
    "cookbook": "cookbook (SET NX EX + token release)",
}
EXPIRY = {
    "ours": "lock PX 30 s (lock_ttl), deleted at release",
    "ours_late": "lock PX 30 s; done record kept for the redelivery window",
    "ours_quorum": "lock PX 30 s on each member, deleted at release; fencing floor PX 60 s",
    "celery-once": "SET NX PX 3600 s (default_timeout), DEL after the task",
    "celery-singleton": "SET NX, no expiry, DEL on success",
    "cookbook": "SET NX EX 60 s, token-checked DEL",
}
SAMPLE = 200
QUORUM = 3
"""Members of the quorum variant (each a redis-server of its own; each looked at, the busiest shown)."""


class _Members:
    """The lock server(s) of one variant: one, or a quorum's members, looked at as the busiest of them."""

    def __init__(self, clients: list[Any]) -> None:
        self.clients = clients

    def busiest(self) -> Any:
        return max(self.clients, key=lambda c: int(c.dbsize()))

    def close(self) -> None:
        for c in self.clients:
            c.close()


def snapshot(members: _Members) -> dict[str, Any]:
    """Memory and keys of one lock server now (of a quorum: the member with the most keys)."""
    client = members.busiest()
    info = client.info("memory")
    keys = int(client.dbsize())
    names: list[bytes] = []
    for name in client.scan_iter(count=1000):
        names.append(name)
        if len(names) >= SAMPLE:
            break
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.execute_command("MEMORY", "USAGE", name)
    sizes = [s for s in pipe.execute(raise_on_error=False) if isinstance(s, int)]
    shapes: dict[str, int] = {}
    for name in names:  # what the leftovers are: names with their ids blanked out
        shape = re.sub(r"[0-9a-f]{8,}|\d+", "#", name.decode(errors="replace"))
        shapes[shape] = shapes.get(shape, 0) + 1
    sampled = sum(sizes)
    return {
        "t": time.monotonic(), "used_memory": int(info["used_memory"]),
        "scripts": int(info.get("used_memory_scripts", 0)), "keys": keys,
        "sampled": len(sizes), "sample_bytes": sampled,
        "key_bytes": sampled / len(sizes) * keys if sizes else 0.0,
        "shapes": shapes,
    }


class Footprint:
    """The footprint phase: start() drains every variant; finish() waits for the last look."""

    def __init__(self, out_dir: Path, variants: Sequence[str], n: int, waits: Sequence[float], window: float,
                 progress: Callable[[str], None]) -> None:
        self.out_dir = out_dir
        self.variants = list(variants)
        self.n = n
        self.waits = sorted(waits)
        self.window = window
        self.say = progress
        self.servers: dict[str, Any] = {}
        self.broker: Any = None
        self.workers: dict[str, Any] = {}
        self.results: dict[str, dict[str, Any]] = {}
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()

    def start(self, timeout: float | None = None) -> None:
        from harness import BenchWorker

        from celery_singleton_lock.testing.servers import RedisServer

        self.broker = RedisServer().start()
        for v in self.variants:
            self.servers[v] = [RedisServer().start() for _ in range(QUORUM if v == "ours_quorum" else 1)]
        for i, v in enumerate(self.variants):
            members = self.servers[v]
            env = {"BENCH_BROKER_URL": self.broker.url(i), "BENCH_LOCK_URL": members[0].url(0),
                   "BENCH_REDELIVERY_WINDOW": str(self.window)}
            if not v.startswith("ours"):  # the worker app has our tasks too: their sweeper goes elsewhere
                env["BENCH_OURS_LOCK_URL"] = self.broker.url(15)
            if len(members) > 1:  # ours on a quorum: every member in the URL
                env["BENCH_OURS_LOCK_URL"] = ";".join(m.url(0) for m in members)
            probe = _Members([m.client() for m in members])
            self.results[v] = {"variant": v, "n": self.n, "expiry": EXPIRY.get(v, ""),
                               "baseline": snapshot(probe), "snapshots": []}
            self.results[v]["_probe"] = probe
            self.results[v]["_env"] = env
            self.workers[v] = BenchWorker("solo", 1, env, self.out_dir, name=f"footprint-{v}").launch()
        for w in self.workers.values():
            w.wait_ready()
        publishers = {}
        for v in self.variants:
            env = dict(os.environ, **self.results[v]["_env"],
                       PYTHONPATH=os.pathsep.join([str(BENCH_DIR), str(ROOT), os.environ.get("PYTHONPATH", "")]))
            publishers[v] = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "publish", "--variant", v, "--n", str(self.n)],
                env=env, cwd=BENCH_DIR, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        drained = {v: threading.Event() for v in self.variants}
        deadline = time.monotonic() + (timeout if timeout is not None else 120 + self.n / 50)
        for v in self.variants:
            t = threading.Thread(target=self._follow, args=(v, publishers[v], drained[v], deadline), daemon=True)
            self._threads.append(t)
            t.start()
        for v in self.variants:
            drained[v].wait(max(0.0, deadline - time.monotonic()) + 30)

    def _follow(self, v: str, publisher: subprocess.Popen, drained: threading.Event, deadline: float) -> None:
        """One variant: wait for its N completions, stop its worker, then look at its server on schedule."""
        res = self.results[v]
        worker = self.workers[v]
        try:
            while True:
                worker.records.poll()
                done = len(worker.records.by_seq)
                if done >= self.n:
                    break
                if time.monotonic() > deadline or self._stop.is_set():
                    res["error"] = f"{done} of {self.n} tasks finished before the deadline"
                    break
                if publisher.poll() not in (None, 0):
                    text = publisher.stdout.read() if publisher.stdout else ""
                    res["error"] = f"the publisher failed: {text[-2000:]}"
                    break
                time.sleep(0.1)
            ends = [r[1] for r in worker.records.by_seq.values()]
            res["completed"] = len(ends)
            if "error" in res and publisher.poll() is None:
                publisher.kill()
            out, _ = publisher.communicate(timeout=60)
            res["publisher"] = out.strip().splitlines()[-1:] if out else []
            worker.stop()
            clock = time.monotonic()  # this variant's clock: its worker is gone, its last task done
            res["drain_s"] = (max(ends) - min(ends)) / 1e9 if ends else None
            res["stopped_after_s"] = clock - max(ends) / 1e9 if ends else None
            probe = res["_probe"]
            res["snapshots"].append({"label": "at once", "after_s": 0.0, **snapshot(probe)})
            drained.set()
            for wait in self.waits:
                if self._stop.wait(max(0.0, clock + wait - time.monotonic())):
                    return
                res["snapshots"].append({"label": f"after {wait:g} s", "after_s": wait, **snapshot(probe)})
        except Exception as exc:  # reported in the results, never a hung phase
            res["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            drained.set()

    def finish(self) -> dict[str, Any]:
        """Wait for every scheduled look, stop everything, return the results."""
        for t in self._threads:
            t.join()
        return self.close()

    def close(self) -> dict[str, Any]:
        """Stop every worker and server this phase started (also after a failure half-way)."""
        self._stop.set()
        for t in self._threads:
            t.join(10)
        for w in self.workers.values():
            w.stop()
        for res in self.results.values():
            probe = res.pop("_probe", None)
            if probe is not None:
                probe.close()
            res.pop("_env", None)
        for members in self.servers.values():
            for server in members:
                server.__exit__()
        if self.broker is not None:
            self.broker.__exit__()
        return {"n": self.n, "waits": self.waits, "window": self.window, "variants": self.results}


def publish(args: argparse.Namespace) -> None:
    """The publishing side of one variant: its N tasks, as fast as apply_async goes."""
    import bench_app

    task = bench_app.ours_late if args.variant == "ours_late" else bench_app.VARIANTS[args.variant.split("_")[0]]
    t0 = time.monotonic()
    for seq in range(1, args.n + 1):
        task.apply_async((seq,))
    print(f"published {args.n} in {time.monotonic() - t0:.1f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["publish"])
    parser.add_argument("--variant", required=True)
    parser.add_argument("--n", type=int, required=True)
    publish(parser.parse_args())


if __name__ == "__main__":
    main()
