#!/usr/bin/env python3
"""The robustness run: random traffic on a few hot keys through real workers, with random faults,
then a check of the whole history (in the manner of etcd's tests/robustness).

    python3 dev.py robustness --minutes 30 --seed 7          # a long run
    .venv/bin/python tools/line_chaos.py --seconds 60 --seed 7 --faults lost,reset,kill

Two real ``celery worker`` processes (prefork, 2 children each) run tools/chaos_app.py's tasks
while this script publishes calls on a few SKUs, all acks_late and reject_on_worker_lost:

* ``deduct(sku, order)`` (``on_duplicate="retry"``), some as two-link chains;
* ``peek(sku, order)`` (``on_duplicate="skip"``);
* ``refresh(sku, order)`` (``on_duplicate="coalesce"``: a duplicate that comes while one waits merges
  into it, and ends with that run's state and result);
* ``restock(sku, order)`` (``lock_publish="join"``, published with ``delay()``: a publish while the
  SKU has a call queued, waiting or running returns that call's AsyncResult).

The workers reach the lock Redis through a fault proxy. Faults, at random:

* ``lost``: the reply of the next call of a random script of the line (LINE_SCRIPTS) is lost after
  Redis ran it, and the client's connection reset (the client sends the call again);
* ``reset``: every connection to the lock Redis closed, and new ones refused for half a second;
* ``stop``: the lock Redis SIGSTOPped past the lock TTL, then resumed (holders' locks run out);
* ``kill``: SIGKILL of a random pool child (mid-body or mid-park; the broker redelivers);
* ``flush``: FLUSHALL of the lock Redis (a lock Redis that lost its data);
* ``restart``: the lock Redis stopped and started again on the same port WITH its data (a Redis with
  persistence restarted: ``SHUTDOWN SAVE`` to a dump in the server's private temp dir, loaded at
  start; see restart_keeping_data). Not a loss: nothing near it is excused;
* ``restart-empty``: the lock Redis stopped and started empty on the same port (a data loss);
* ``backlog``: the queue kept deeper than twice the lock TTL with other short tasks.

At the end tools/chaos_check.py checks every call's final state against a journal of bodies kept
in the broker Redis (which no fault touches): every call ended exactly once, in its final state
(coalesced and joined calls with the state and result of the run that covered them), no body of a
key overlapped another outside a TTL of a fault that took the running holder's lock (a data loss,
a stopped lock Redis: counted apart), none ran twice and none was lost. Exit 0 when all hold.
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
from collections.abc import Callable
from pathlib import Path

from redis.backoff import NoBackoff
from redis.retry import Retry

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "tests"))

from _fault_proxy import FaultProxy, sha_of  # noqa: E402
from chaos_check import Call, Kill, Loss, check  # noqa: E402

from celery_singleton_lock.engine import dedupe, line_scripts, scripts  # noqa: E402
from celery_singleton_lock.testing.servers import RedisServer, WorkerProcess  # noqa: E402

LINE_SCRIPTS = {
    "ACQUIRE": scripts.ACQUIRE, "RELEASE": scripts.RELEASE, "PARK": line_scripts.PARK,  # (PARK merges too)
    "SWEEP": line_scripts.SWEEP, "LEAVE": line_scripts.LEAVE, "UNBLOCK": line_scripts.UNBLOCK,
    "PUBLISH": dedupe.PUBLISH, "UNMARK": dedupe.UNMARK, "TAKE_MERGED": dedupe.TAKE_MERGED,
}
"""The scripts whose reply a ``lost`` fault drops (the line's calls that change it): the coalescing
waiter's read and drop of its merged calls (TAKE_MERGED) and the publish mark's delete at a joined
call's start (UNMARK) with the rest."""


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60.0, help="how long orders are published and faults injected")
    ap.add_argument("--orders", type=int, default=400)
    ap.add_argument("--skus", type=int, default=3)
    ap.add_argument("--ttl", type=float, default=3.0)
    ap.add_argument("--faults", default="lost,reset,stop,kill,flush,restart,restart-empty,backlog")
    ap.add_argument("--fault-every", type=float, default=6.0, help="mean seconds between two faults")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--settle", type=float, default=180.0, help="seconds to wait for every order to end")
    return ap.parse_args()


def main() -> int:
    args = parse_args()
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
        losses: list[Loss] = []
        kills: list[Kill] = []
        results: dict[str, Call] = {}
        try:
            sent = drive(args, rng, faults, chaos_app, broker.client(0), results,
                         lambda kind: inject(kind, workers, locks, proxy, rng, losses, args.ttl, kills))
            print(f"[chaos] {sent} orders sent; waiting up to {args.settle:.0f}s for them to end", flush=True)
            deadline = time.monotonic() + args.settle
            pending = dict(results)
            while pending and time.monotonic() < deadline:
                for order in list(pending):
                    if pending[order].result.state in ("SUCCESS", "FAILURE", "REVOKED"):
                        del pending[order]
                time.sleep(0.5)
            return check(results, broker.client(3), losses, args.ttl, logdir, kills)
        finally:
            results.clear()
            gc.collect()  # AsyncResult's __del__ unsubscribes: while the broker Redis still runs
            for w in workers:
                w.stop(10)
            proxy.close()


def drive(args: argparse.Namespace, rng: random.Random, faults: list[str], app, bclient,
          results: dict[str, Call], fault: Callable[[str], None]) -> int:
    """Publish ``args.orders`` calls over ``args.seconds`` (and the backlog's fillers), with a random
    fault (``fault(kind)``) every ``args.fault_every`` seconds on average; how many calls were sent."""
    started = time.monotonic()
    next_fault = started + rng.expovariate(1 / args.fault_every)
    sent = 0
    while time.monotonic() - started < args.seconds or sent < args.orders:
        # paced over the whole run, so that every fault meets traffic (not all of it in the first seconds)
        due = args.orders * min(1.0, (time.monotonic() - started) / args.seconds)
        while sent < due:
            sent += publish(app, results, rng, sent, f"sku{rng.randrange(args.skus)}")
        if "backlog" in faults and bclient.llen("celery") < 400:
            for _ in range(200):
                app.filler.delay(rng.choice((5, 10, 20)))
        now = time.monotonic()
        if now >= next_fault and now - started < args.seconds:
            fault(rng.choice([f for f in faults if f != "backlog"] or ["none"]))
            next_fault = now + rng.expovariate(1 / args.fault_every)
        time.sleep(0.05)
    return sent


def publish(app, results: dict[str, Call], rng: random.Random, sent: int, sku: str) -> int:
    """One call on ``sku`` of a random kind, or a burst of 1 to 4 duplicates for the kinds that stop
    duplicates early (coalesce, join); ``results`` maps each call's order to its kind, its AsyncResult
    and when its publish began. How many calls it made."""
    kind = rng.choices(["deduct", "chain", "peek", "refresh", "restock"], weights=[5, 2, 2, 2, 2])[0]
    order = f"o{sent:05d}-{uuid.uuid4().hex[:4]}"
    if kind == "chain":
        second, now = f"{order}-b", time.time()
        (app.deduct.si(sku, order).set(task_id=order) | app.deduct.si(sku, second).set(task_id=second)).apply_async()
        results[order] = Call("deduct", app.deduct.AsyncResult(order), now)
        results[second] = Call("deduct", app.deduct.AsyncResult(second), now)
        return 2
    if kind in ("deduct", "peek"):
        results[order] = Call(kind, getattr(app, kind).apply_async((sku, order), task_id=order), time.time())
        return 1
    burst = rng.randint(1, 4)
    for i in range(burst):
        one, now = f"{order}-{i}", time.time()
        if kind == "restock":  # no task id of ours: lock_publish checks only such publishes, and may join
            results[one] = Call(kind, app.restock.delay(sku, one), now)
        else:
            results[one] = Call(kind, app.refresh.apply_async((sku, one), task_id=one), now)
    return burst


def inject(kind: str, workers: list[WorkerProcess], locks: RedisServer, proxy: FaultProxy, rng: random.Random,
           losses: list[Loss], ttl: float, kills: list[Kill]) -> None:
    if kind == "lost":
        name = rng.choice(sorted(LINE_SCRIPTS))
        sha = sha_of(LINE_SCRIPTS[name])
        say(f"the next reply of {name} ({sha[:8].decode()}) is lost")
        proxy.arm(sha, 1)
    elif kind == "reset":
        say("connections to the lock Redis reset, refused for 0.5 s")
        proxy.blackout(0.5)
    elif kind == "stop":
        say(f"the lock Redis SIGSTOPped for {ttl + 0.5:g} s")
        losses.append(Loss(time.time(), False))
        locks.pause()
        time.sleep(ttl + 0.5)  # (the fault itself: the server stays frozen past the lock TTL)
        locks.resume()
        losses.append(Loss(time.time(), False))
    elif kind == "kill":
        w = rng.choice(workers)
        kids = w.children()
        if kids:
            pid = rng.choice(kids)
            say(f"SIGKILL child {pid}")
            kills.append(Kill(time.time(), pid))
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    elif kind == "flush":
        say("FLUSHALL of the lock Redis")
        losses.append(Loss(time.time(), True))
        locks.client().flushall()
    elif kind == "restart":
        at = time.time()
        kept = restart_keeping_data(locks)
        say(f"lock Redis restarted with its data ({kept} keys kept, down {time.time() - at:.2f} s)", at)
    elif kind == "restart-empty":
        say("lock Redis restarted empty")
        losses.append(Loss(time.time(), True))
        locks.restart()


def say(what: str, at: float | None = None) -> None:
    """A fault, with the wall-clock time it began (the worker logs' clock: to find what it met there)."""
    at = time.time() if at is None else at
    stamp = time.strftime("%H:%M:%S", time.localtime(at)) + f".{int(at % 1 * 1000):03d}"
    print(f"[chaos] {stamp} {what}", flush=True)


def restart_keeping_data(server: RedisServer) -> int:
    """Stop the lock Redis and start it again on its port with its data, as a Redis with persistence
    restarts; how many keys it came back with.

    ``SHUTDOWN SAVE`` writes every key (with its expiry, an absolute time) to ``dump.rdb`` in the
    server's own private temp dir (``RedisServer.dir``, its ``--dir``) as the server stops, so no
    write falls between the save and the stop. The new process loads it at start; the file is then
    deleted, so a later ``restart-empty`` is empty. The server's options are not changed (no save
    points, no AOF): nothing persists anywhere else. The port stays the loopback one it was started
    on, and the old process is waited for by its PID.
    """
    assert server.proc is not None
    with server.client(socket_timeout=5, retry=Retry(NoBackoff(), 0)) as c:  # (no retries: they back off for seconds)
        c.shutdown(save=True)  # (its reply is the connection closing)
    server.proc.wait(10)
    server.stop()  # (already exited: only forgets the process)
    server.start()
    dump = Path(server.dir) / "dump.rdb"
    dump.unlink()
    with server.client() as c:
        return int(c.dbsize())


if __name__ == "__main__":
    sys.exit(main())
