#!/usr/bin/env python3
"""The inventory demo: the same stock deduction as a plain task and as a LockedTask.

    python3 dev.py demo                          # from the repository root
    .venv/bin/python examples/inventory/demo.py  # the same, with the venv set up

It starts a private redis-server (free loopback port, no persistence) and two
``celery worker`` nodes (prefork, 2 processes each), fires a few hundred
concurrent deductions on four SKUs, first as the plain task and then as the
LockedTask, and prints per SKU the expected stock and what each task left.
The plain task loses updates; the locked one must be exact, or this exits 1.
Workers and Redis are stopped by PID at the end; no other Redis is touched.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

from celery import group

from celery_singleton_lock.testing.servers import RedisServer, WorkerProcess

HERE = Path(__file__).resolve().parent
SKUS = ("apple", "pear", "plum", "fig")
ORDERS = 300  # per phase
INITIAL = 1000  # stock per SKU at the start of each phase
DEADLINE = 35.0  # seconds for both phases together


def run_phase(inventory, kind: str, orders: list[tuple[str, int]], deadline: float) -> dict:
    """Reset the stock, fire every order at once, wait for all results; return the outcome."""
    task = {"plain": inventory.deduct_plain, "locked": inventory.deduct_locked}[kind]
    store = inventory.store
    for sku in SKUS:
        store.set(inventory.stock_key(kind, sku), INITIAL)
    store.delete("duplicates")
    started = time.monotonic()
    result = group(task.s(sku, qty) for sku, qty in orders).apply_async()
    values = result.join_native(timeout=max(1.0, deadline - time.monotonic()), propagate=False)
    seconds = time.monotonic() - started
    failed = [v for v in values if isinstance(v, BaseException)]
    stock = {sku: int(store.get(inventory.stock_key(kind, sku))) for sku in SKUS}
    duplicates = {k.decode(): int(v) for k, v in store.hgetall("duplicates").items()}
    return {"stock": stock, "seconds": seconds, "failed": failed, "duplicates": duplicates}


def stop_all(workers: list[WorkerProcess]) -> None:
    """Warm-shut every worker down (by PID) at once rather than one after the other."""
    threads = [threading.Thread(target=w.stop) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def start_workers(base: str, tmp: str, workers: list[WorkerProcess]) -> None:
    """Two worker nodes (prefork, 2 processes each) on app.py, each added to ``workers`` once started."""
    env = {"INVENTORY_REDIS_URL": base}  # `celery -A app` imports app.py from its cwd, HERE
    for node in ("north", "south"):
        w = WorkerProcess(
            "app", pool="prefork", concurrency=2, name=f"{node}@%h", env=env, cwd=HERE,
            logfile=os.path.join(tmp, f"{node}.log"),
        )
        workers.append(w.start())


def report(orders: list[tuple[str, int]], expected: dict[str, int], plain: dict, locked: dict, began: float,
           ready_at: float) -> int:
    """Print the stock per SKU, what each task did and the RESULT line; 1 if the locked stock is wrong."""
    print(f"{'SKU':<8}{'orders':>8}{'expected':>10}{'plain':>8}{'locked':>8}")
    for sku in SKUS:
        n = sum(1 for s, _ in orders if s == sku)
        p, lk = plain["stock"][sku], locked["stock"][sku]
        print(
            f"{sku:<8}{n:>8}{expected[sku]:>10}{p:>8}{lk:>8}"
            f"{'' if lk == expected[sku] else '   <- WRONG'}"
        )
    lost = sum(plain["stock"][s] - expected[s] for s in SKUS)
    wrong = [s for s in SKUS if locked["stock"][s] != expected[s]]
    dup = locked["duplicates"]
    print()
    if lost:
        print(f"plain task:  lost {lost} units of deductions to overlapping read-modify-writes, as expected")
    else:
        print("plain task:  lost no update this time (the race depends on timing)")
    print(
        f"locked task: {dup.get('retry', 0)} duplicates waited their turn (one park and one hand-off each), "
        f"skipped {dup.get('skip', 0)}, "
        f"failed {len(locked['failed'])}"
    )
    print(
        f"wall time:   plain {plain['seconds']:.1f} s, locked {locked['seconds']:.1f} s; "
        f"start-up {ready_at - began:.1f} s; total {time.monotonic() - began:.1f} s"
    )
    for exc in locked["failed"][:3]:
        print(f"  failure: {exc!r}")
    if wrong or locked["failed"]:
        print(f"RESULT: locked stock WRONG on {', '.join(wrong) or 'no SKU'}; {len(locked['failed'])} failed")
        return 1
    print(f"RESULT: locked stock exact on all {len(SKUS)} SKUs")
    return 0


def main() -> int:
    began = time.monotonic()
    tmp = tempfile.mkdtemp(prefix="inventory-demo-")
    server = RedisServer()
    workers: list[WorkerProcess] = []
    crashed = False
    try:
        server.start()
        base = f"redis://127.0.0.1:{server.port}"
        os.environ["INVENTORY_REDIS_URL"] = base  # for `import app` below, and the workers
        start_workers(base, tmp, workers)
        print(f"redis-server {server.binary} on port {server.port} (private, no persistence)")
        nodes = ", ".join(w.nodename.replace("%h", socket.gethostname()) for w in workers)
        print(f"workers: {nodes} (prefork, 2 processes each)", flush=True)

        sys.path.insert(0, str(HERE))
        import app as inventory

        for w in workers:
            w.wait_ready(timeout=20)
        ready_at = time.monotonic()

        rng = random.Random(7)
        orders = [(rng.choice(SKUS), rng.randint(1, 3)) for _ in range(ORDERS)]
        expected = {sku: INITIAL - sum(q for s, q in orders if s == sku) for sku in SKUS}
        deadline = time.monotonic() + DEADLINE
        print(f"\n{ORDERS} concurrent deductions on {len(SKUS)} SKUs, each phase starting at {INITIAL} per SKU")
        print("plain task ...", end=" ", flush=True)
        plain = run_phase(inventory, "plain", orders, deadline)
        print(f"{plain['seconds']:.1f} s; locked task ...", end=" ", flush=True)
        locked = run_phase(inventory, "locked", orders, deadline)
        print(f"{locked['seconds']:.1f} s\n")

        return report(orders, expected, plain, locked, began, ready_at)
    except Exception as exc:
        crashed = True
        print(f"\ndemo failed: {type(exc).__name__}: {exc}")
        return 1
    finally:
        stopping = time.monotonic()
        stop_all(workers)
        server.stop()
        print(f"stopped workers and redis-server in {time.monotonic() - stopping:.1f} s")
        if crashed:
            for w in workers:
                print(f"--- last lines of {w.logfile}:\n{w.log()[-3000:]}")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(server.dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
