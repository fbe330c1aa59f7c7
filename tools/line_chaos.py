#!/usr/bin/env python3
"""The robustness run: random traffic on a few hot keys through real workers, with random faults,
then a check of the whole history (in the manner of etcd's tests/robustness).

    python3 dev.py robustness --minutes 30 --seed 7          # a long run
    .venv/bin/python tools/line_chaos.py --seconds 60 --seed 7 --faults lost,reset,kill

Two real ``celery worker`` processes (prefork, 2 children each) run tools/chaos_app.py's tasks
while this script publishes calls on a few SKUs: ``deduct(sku, order)`` (``on_duplicate="retry"``,
acks_late, reject_on_worker_lost), some as two-link chains, and ``peek(sku, order)``
(``on_duplicate="skip"``). The workers reach the lock Redis through a fault proxy. Faults, at random:

* ``lost``: the reply of the next call of a random script of the line is lost after Redis ran it,
  and the client's connection reset (the client sends the call again);
* ``reset``: every connection to the lock Redis closed, and new ones refused for half a second;
* ``stop``: the lock Redis SIGSTOPped past the lock TTL, then resumed (holders' locks run out);
* ``kill``: SIGKILL of a random pool child (mid-body or mid-park; the broker redelivers);
* ``flush``: FLUSHALL of the lock Redis (a lock Redis that lost its data);
* ``restart``: the lock Redis stopped and started empty on the same port;
* ``backlog``: the queue kept deeper than twice the lock TTL with other short tasks.

At the end it checks, from a journal kept in the broker Redis (which no fault touches): every
``deduct`` ended SUCCESS and its body ran to its end exactly once; every ``peek`` ended SUCCESS or
REVOKED (skipped) and ran at most once; and no two bodies of one SKU overlapped, except within a TTL
of a fault that takes the running holder's lock (a data loss, a stopped lock Redis: the loss is
reported, and counted apart). Exit 0 when all hold.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "tests"))

from _fault_proxy import FaultProxy, sha_of  # noqa: E402

from celery_singleton_lock.engine import dedupe, line_scripts, scripts  # noqa: E402
from celery_singleton_lock.testing.servers import RedisServer, WorkerProcess  # noqa: E402

LINE_SCRIPTS = [scripts.ACQUIRE, scripts.RELEASE, line_scripts.PARK, line_scripts.SWEEP, line_scripts.LEAVE,
                line_scripts.UNBLOCK, dedupe.PUBLISH]
"""The scripts whose reply a ``lost`` fault drops (the line's calls that change it)."""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60.0, help="how long orders are published and faults injected")
    ap.add_argument("--orders", type=int, default=400)
    ap.add_argument("--skus", type=int, default=3)
    ap.add_argument("--ttl", type=float, default=3.0)
    ap.add_argument("--faults", default="lost,reset,stop,kill,flush,restart,backlog")
    ap.add_argument("--fault-every", type=float, default=6.0, help="mean seconds between two faults")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--settle", type=float, default=180.0, help="seconds to wait for every order to end")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    faults = [f for f in args.faults.split(",") if f]
    print(f"[chaos] seed {seed}; faults {faults}", flush=True)

    logdir = Path(tempfile.mkdtemp(prefix="csl-chaos-"))
    with RedisServer() as broker, RedisServer() as locks:
        proxy = FaultProxy(locks.port)  # the workers reach the lock Redis through it
        env = {
            "CSL_CHAOS_BROKER": f"redis://127.0.0.1:{broker.port}",
            "CSL_CHAOS_LOCK": proxy.url().rsplit("/", 1)[0],
            "CSL_CHAOS_TTL": str(args.ttl),
            "PYTHONPATH": f"{ROOT / 'tools'}:{os.environ.get('PYTHONPATH', '')}",
        }
        os.environ.update(env)
        import chaos_app

        workers = [
            WorkerProcess("chaos_app", concurrency=2, env=env, cwd=str(ROOT / "tools"),
                          logfile=str(logdir / f"worker{i}.log"), extra=["--loglevel", "INFO"])
            for i in range(2)
        ]
        for w in workers:
            w.start()
        for w in workers:
            w.wait_ready(60)
        journal = broker.client(3)
        bclient = broker.client(0)
        losses: list[float] = []
        results = {}
        started = time.monotonic()
        next_fault = started + rng.expovariate(1 / args.fault_every)
        per_tick = max(1, int(args.orders / max(1.0, args.seconds / 0.05)))
        sent = 0
        try:
            while time.monotonic() - started < args.seconds or sent < args.orders:
                if sent < args.orders:
                    for _ in range(per_tick):
                        sent += publish(chaos_app, results, rng, sent, f"sku{rng.randrange(args.skus)}")
                if "backlog" in faults and bclient.llen("celery") < 400:
                    for _ in range(200):
                        chaos_app.filler.delay(rng.choice((5, 10, 20)))
                now = time.monotonic()
                if now >= next_fault and now - started < args.seconds:
                    kind = rng.choice([f for f in faults if f != "backlog"] or ["none"])
                    inject(kind, workers, locks, proxy, rng, losses, args.ttl)
                    next_fault = now + rng.expovariate(1 / args.fault_every)
                time.sleep(0.05)
            print(f"[chaos] {sent} orders sent; waiting up to {args.settle:.0f}s for them to end", flush=True)
            deadline = time.monotonic() + args.settle
            pending = dict(results)
            while pending and time.monotonic() < deadline:
                for order in list(pending):
                    if pending[order][1].state in ("SUCCESS", "FAILURE", "REVOKED"):
                        del pending[order]
                time.sleep(0.5)
            return check(results, journal, losses, args.ttl, logdir)
        finally:
            results.clear()
            gc.collect()  # AsyncResult's __del__ unsubscribes: while the broker Redis still runs
            for w in workers:
                w.stop(10)
            proxy.close()


def publish(app, results: dict, rng: random.Random, sent: int, sku: str) -> int:
    """One call on ``sku``, of a random kind (``results`` maps each call's id to its AsyncResult and
    kind); how many calls it made."""
    kind = rng.choices(["deduct", "chain", "peek"], weights=[6, 2, 2])[0]
    order = f"o{sent:05d}-{uuid.uuid4().hex[:4]}"
    if kind == "peek":
        results[order] = ("peek", app.peek.apply_async((sku, order), task_id=order))
        return 1
    if kind == "chain":
        second = f"{order}-b"
        (app.deduct.si(sku, order).set(task_id=order) | app.deduct.si(sku, second).set(task_id=second)).apply_async()
        results[order] = ("deduct", app.deduct.AsyncResult(order))
        results[second] = ("deduct", app.deduct.AsyncResult(second))
        return 2
    results[order] = ("deduct", app.deduct.apply_async((sku, order), task_id=order))
    return 1


def inject(kind: str, workers: list[WorkerProcess], locks: RedisServer, proxy: FaultProxy, rng: random.Random,
           losses: list[float], ttl: float) -> None:
    if kind == "lost":
        script = rng.choice(LINE_SCRIPTS)
        print(f"[chaos] the next reply of a line script ({sha_of(script)[:8].decode()}) is lost", flush=True)
        proxy.arm(sha_of(script), 1)
    elif kind == "reset":
        print("[chaos] connections to the lock Redis reset, refused for 0.5 s", flush=True)
        proxy.blackout(0.5)
    elif kind == "stop":
        print(f"[chaos] the lock Redis SIGSTOPped for {ttl + 0.5:g} s", flush=True)
        losses.append(time.time())
        locks.pause()
        time.sleep(ttl + 0.5)  # (the fault itself: the server stays frozen past the lock TTL)
        locks.resume()
        losses.append(time.time())
    elif kind == "kill":
        w = rng.choice(workers)
        kids = w.children()
        if kids:
            pid = rng.choice(kids)
            print(f"[chaos] SIGKILL child {pid}", flush=True)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    elif kind == "flush":
        print("[chaos] FLUSHALL of the lock Redis", flush=True)
        losses.append(time.time())
        locks.client().flushall()
    elif kind == "restart":
        print("[chaos] lock Redis restarted empty", flush=True)
        losses.append(time.time())
        locks.restart()


def check(results: dict, journal, losses: list[float], ttl: float, logdir: Path) -> int:
    states: dict[str, int] = {}
    bad_state = []
    for order, (kind, res) in results.items():
        state = res.state
        states[f"{kind} {state}"] = states.get(f"{kind} {state}", 0) + 1
        if state not in (("SUCCESS", "REVOKED") if kind == "peek" else ("SUCCESS",)):
            bad_state.append((order, state))
    done = {k.decode(): int(v) for k, v in journal.hgetall("done").items()}
    never = [o for o, (kind, _) in results.items() if kind == "deduct" and done.get(o, 0) == 0]
    twice = {o: n for o, n in done.items() if n > 1}
    overlaps, near_loss = 0, 0
    for key in journal.scan_iter("start:*"):
        sku = key.decode().split(":", 1)[1]
        starts = [s.decode().split() for s in journal.lrange(key, 0, -1)]
        ends = {(e.decode().split()[0], e.decode().split()[2]): float(e.decode().split()[1])
                for e in journal.lrange(f"end:{sku}", 0, -1)}
        spans = sorted((float(t), ends[(o, pid)], o) for o, t, pid, _fence in starts if (o, pid) in ends)
        reach = None  # the body seen so far that ends last
        for s2, e2, o2 in spans:
            s1, e1, o1 = reach or (0.0, 0.0, "")
            if reach is None or e2 > e1:
                reach = (s2, e2, o2)
            if s2 < e1 - 1e-3:
                if any(loss - 1 <= s2 <= loss + ttl + 2 for loss in losses):
                    near_loss += 1
                else:
                    overlaps += 1
                    print(f"[chaos] OVERLAP on {sku}: {o1} {s1:.3f}-{e1:.3f} and {o2} {s2:.3f}-{e2:.3f}")
    print(f"[chaos] states: {states}")
    print(f"[chaos] never ran: {len(never)} {never[:10]}")
    print(f"[chaos] ran to the end more than once: {len(twice)} {list(twice.items())[:10]}")
    print(f"[chaos] overlaps: {overlaps} (and {near_loss} within a TTL of a lock-Redis data loss)")
    print(f"[chaos] worker logs: {logdir}")
    ok = not bad_state and not never and not twice and not overlaps
    print("[chaos] OK" if ok else f"[chaos] FAILED: {bad_state[:10]}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
