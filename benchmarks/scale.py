"""Engine-level measurements, each run in a fresh process and printed as one JSON line.

    python scale.py ours  --lock-url URL --n 10000 --seconds 30 --ttl 3 [--chunk 500]
    python scale.py rlock --lock-url URL --n 1000  --seconds 30 --ttl 3
    python scale.py lost  --lock-url URL --ttl 1 --trials 20
    python scale.py micro --lock-url URL
    python scale.py floor --lock-url URL --n 2000
    python scale.py handoff --lock-url URL --impl ours|redis-py|python-redis-lock[-renewed] --procs 8 --rounds 20
    python scale.py handoff --lock-url etcd://127.0.0.1:PORT --impl etcd-mutex|ours-etcd --procs 8 --rounds 20

``ours`` holds N locks in this process with the one watchdog renewing them;
``rlock`` holds N python-redis-lock locks with ``auto_renewal`` (a thread per
lock) on redis-py's default client (its pool allows 100 connections). Both
report, over the holding window only: locks still held at the end (checked on
the server: the key still carries this holder's token), threads, CPU of the
whole process as a fraction of one core, RSS, and renewals on the lock server.

The modes ``handoff`` (scale_handoff.py) and ``quorum`` and ``topologies`` (scale_topologies.py)
live in modules of their own; this one runs every mode.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import sys
import threading
import time
from collections import Counter

import redis
from scale_handoff import HOLDERS, plain_handoff
from scale_topologies import quorum_cost, topology_cost


def proc_status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "Threads"):
                out[key] = int(value.split()[0])
    return out


def evalsha_calls(client: redis.Redis) -> int:
    stats = client.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


def hold_ours(args: argparse.Namespace) -> dict:
    from celery_singleton_lock.engine.server import LockServer
    from celery_singleton_lock.watchdog.process import get_watchdog

    logging.basicConfig(level=logging.WARNING)
    server = LockServer.from_url(args.lock_url)
    wd = get_watchdog(chunk=args.chunk)
    lost_at: dict[str, float] = {}

    def on_lost(lock, reason):
        lost_at[lock.key] = time.monotonic()

    base = proc_status()
    t_acq = time.monotonic()
    locks = []
    tag = f"{os.getpid()}-{random.getrandbits(32):08x}"
    for i in range(args.n):
        lock = server.acquire(f"bench:scale:{tag}:{i}", args.ttl, owner_id=f"holder-{i}")
        wd.track(lock, on_lost)
        locks.append(lock)
    acquire_s = time.monotonic() - t_acq
    time.sleep(min(args.ttl, args.seconds))  # let the renewals settle into their rhythm before measuring
    probe = redis.Redis.from_url(args.lock_url)
    e0, b0, c0, t0 = evalsha_calls(probe), wd.batches, time.process_time(), time.monotonic()
    time.sleep(args.seconds)
    e1, b1, c1, t1 = evalsha_calls(probe), wd.batches, time.process_time(), time.monotonic()
    status = proc_status()
    threads = threading.enumerate()
    held = _still_held(probe, [lk.key for lk in locks], [lk.prefix for lk in locks])
    wall = t1 - t0
    period = args.ttl / 3
    result = {
        "impl": "ours", "n": args.n, "ttl": args.ttl, "seconds": wall, "chunk": args.chunk, "tick": wd.tick,
        "acquire_seconds": acquire_s,
        "held": held, "lost_flags": sum(1 for lk in locks if lk.lost),
        "threads": status["Threads"], "renewal_threads": sum(1 for t in threads if "watchdog" in t.name),
        "cpu_core": (c1 - c0) / wall,
        "rss_mb": status["VmRSS"] / 1024, "rss_growth_mb": (status["VmRSS"] - base["VmRSS"]) / 1024,
        "round_trips_per_s": (b1 - b0) / wall,
        "evalsha_per_s": (e1 - e0) / wall,
        "round_trips_per_period": (b1 - b0) / wall * period,
        "evalsha_per_period": (e1 - e0) / wall * period,
        "bound_per_period": math.ceil(args.n / args.chunk),
    }
    wd.shutdown()
    _cleanup(probe, [lk.key for lk in locks])
    return result


def hold_rlock(args: argparse.Namespace) -> dict:
    import redis_lock

    logging.getLogger("redis_lock").setLevel(logging.CRITICAL)
    errors: Counter[str] = Counter()

    def hook(exc_args):  # a renewal thread that dies takes its lock with it, silently
        errors[type(exc_args.exc_value).__name__] += 1

    threading.excepthook = hook
    client = redis.StrictRedis.from_url(args.lock_url)  # redis-py's default pool: 100 connections
    base = proc_status()
    tag = f"{os.getpid()}-{random.getrandbits(32):08x}"
    locks = []
    t_acq = time.monotonic()
    start_errors = Counter()
    for i in range(args.n):
        lock = redis_lock.Lock(client, f"bench:rlock:{tag}:{i}", expire=int(args.ttl), auto_renewal=True)
        try:
            if lock.acquire(blocking=False):
                locks.append(lock)
        except Exception as exc:  # e.g. the pool's "Too many connections" while renewals run
            start_errors[type(exc).__name__] += 1
    acquire_s = time.monotonic() - t_acq
    time.sleep(min(args.ttl, args.seconds))
    probe = redis.Redis.from_url(args.lock_url)
    e0, c0, t0 = evalsha_calls(probe), time.process_time(), time.monotonic()
    time.sleep(args.seconds)
    e1, c1, t1 = evalsha_calls(probe), time.process_time(), time.monotonic()
    status = proc_status()
    names = [f"lock:bench:rlock:{tag}:{i}" for i in range(args.n)]
    ids = {lk._name: lk.id.encode() if isinstance(lk.id, str) else lk.id for lk in locks}
    values = _get_many(probe, names)
    held = sum(1 for name, value in zip(names, values, strict=False) if value is not None and ids.get(name) == value)
    wall = t1 - t0
    period = 2 * int(args.ttl) / 3  # python-redis-lock renews every expire * 2/3
    result = {
        "impl": "python-redis-lock", "n": args.n, "ttl": args.ttl, "seconds": wall, "chunk": None, "tick": None,
        "acquire_seconds": acquire_s,
        "acquired": len(locks), "acquire_errors": dict(start_errors),
        "held": held, "lost_flags": None,
        "threads": status["Threads"], "renewal_threads": sum(1 for t in threading.enumerate()
                                                             if t is not threading.main_thread()),
        "cpu_core": (c1 - c0) / wall,
        "rss_mb": status["VmRSS"] / 1024, "rss_growth_mb": (status["VmRSS"] - base["VmRSS"]) / 1024,
        "round_trips_per_s": (e1 - e0) / wall,  # one EVALSHA per extend, each its own round trip
        "evalsha_per_s": (e1 - e0) / wall,
        "round_trips_per_period": (e1 - e0) / wall * period,
        "evalsha_per_period": (e1 - e0) / wall * period,
        "bound_per_period": None,
        "thread_errors": dict(errors),
    }
    _cleanup(probe, names)
    # daemon threads: the process exits without joining them
    return result


def _get_many(client: redis.Redis, keys: list[str]) -> list:
    values = []
    for i in range(0, len(keys), 1000):
        values.extend(client.mget(keys[i: i + 1000]))
    return values


def _still_held(client: redis.Redis, keys: list[str], prefixes: list[str]) -> int:
    values = _get_many(client, keys)
    return sum(1 for v, p in zip(values, prefixes, strict=False) if v is not None and v.decode().startswith(p))


def _cleanup(client: redis.Redis, keys: list[str]) -> None:
    for i in range(0, len(keys), 1000):
        client.delete(*keys[i: i + 1000])


def lost_latency(args: argparse.Namespace) -> dict:
    """From an outside DEL to ``.lost`` True, for locks deleted at random points of their renewal period."""
    from celery_singleton_lock.engine.server import LockServer
    from celery_singleton_lock.watchdog.process import get_watchdog

    logging.getLogger("celery_singleton_lock").setLevel(logging.CRITICAL)
    server = LockServer.from_url(args.lock_url)
    wd = get_watchdog()
    outside = redis.Redis.from_url(args.lock_url)
    lost_at: dict[str, float] = {}
    done = threading.Event()

    def on_lost(lock, reason):  # runs right after the watchdog sets lock.lost
        lost_at[lock.key] = time.monotonic()
        if len(lost_at) >= args.trials:
            done.set()

    tag = f"{os.getpid()}-{random.getrandbits(32):08x}"
    locks = []
    for i in range(args.trials):
        lock = server.acquire(f"bench:lost:{tag}:{i}", args.ttl)
        wd.track(lock, on_lost)
        locks.append(lock)
        time.sleep(random.uniform(0, args.ttl / 3 / args.trials))  # spread their renewal phases
    time.sleep(args.ttl / 3)
    rng = random.Random(7)
    plan = sorted((rng.uniform(0, args.ttl), lock) for lock in locks)  # DEL at random phases
    start = time.monotonic()
    deleted_at: dict[str, float] = {}
    for offset, lock in plan:
        delay = start + offset - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        deleted_at[lock.key] = time.monotonic()
        outside.delete(lock.key)
    done.wait(args.ttl * 3 + 2)
    latencies = [lost_at[k] - deleted_at[k] for k in deleted_at if k in lost_at]
    wd.shutdown()
    bound = args.ttl / 3 + wd.tick
    return {
        "ttl": args.ttl, "trials": args.trials, "detected": len(latencies), "tick": wd.tick,
        "median_s": sorted(latencies)[len(latencies) // 2] if latencies else None,
        "max_s": max(latencies) if latencies else None,
        "min_s": min(latencies) if latencies else None,
        "bound_s": bound,
        "latencies": latencies,
    }


def micro(args: argparse.Namespace) -> dict:
    """Where our per-task worker time goes, piece by piece, in µs per call."""
    import inspect

    from celery_singleton_lock.delivery import config, keys
    from celery_singleton_lock.engine.server import LockServer
    from celery_singleton_lock.watchdog.process import get_watchdog

    def run(i: int) -> int:
        return i

    sig = inspect.signature(run)
    server = LockServer.from_url(args.lock_url)
    raw = redis.Redis.from_url(args.lock_url)
    wd = get_watchdog()
    n = args.n

    counter = iter(range(10**9))  # every call gets a name never used before

    def timeit(fn, reps=n) -> float:
        fn(next(counter))
        t0 = time.perf_counter()
        for _ in range(reps):
            fn(next(counter))
        return (time.perf_counter() - t0) / reps * 1e6

    out = {}
    out["keys.derive"] = timeit(lambda i: keys.derive("singleton_lock", "bench.ours", sig, (i,), {}))
    maker = keys.KeyMaker("singleton_lock", "bench.ours", sig)
    out["keys.KeyMaker (derive, per task once: what before_start calls)"] = timeit(lambda i: maker((i,), {}))
    settings = config.LockSettings(
        url=args.lock_url, ttl=30.0, on_duplicate="skip", prefix="singleton_lock", max_wait=3600.0, max_retries=50,
        retry_backoff=1.0, retry_backoff_max=30.0, redis_options={}, redelivery_window=3600.0, release_timeout=2.0,
        index="singleton_lock:{waiting}",
    )
    out["config.server_for"] = timeit(lambda i: config.server_for(settings))
    out["redis PING (one round trip)"] = timeit(lambda i: raw.ping())
    out["redis SET NX EX + DEL (2 round trips)"] = timeit(
        lambda i: (raw.set(f"bench:micro:raw:{i}", "x", nx=True, ex=30), raw.delete(f"bench:micro:raw:{i}")))

    def ours(i: int) -> None:
        lock = server.acquire(f"bench:micro:ours:{i}", 30.0, owner_id=f"t{i}")
        server.release(lock, succeeded=True)

    out["LockServer.acquire + release (2 round trips)"] = timeit(ours)
    locks = [server.acquire(f"bench:micro:wd:{i}", 30.0) for i in range(200)]

    def track_forget(i: int) -> None:
        lock = locks[i % len(locks)]
        wd.track(lock)
        wd.forget(lock)

    out["watchdog.track + forget"] = timeit(track_forget)
    for lock in locks:
        server.release(lock)
    wd.shutdown()
    return {"micro_us": out, "n": n}


def floor(args: argparse.Namespace) -> dict:
    """The physical floor of a lock that asks Redis twice per task: two raw loopback round trips.

    A raw socket (TCP_NODELAY) to the lock server, a pre-packed PING sent and its
    +PONG read, twice in a row; no client library at all.
    """
    import socket
    from urllib.parse import urlsplit

    url = urlsplit(args.lock_url)
    sock = socket.create_connection((url.hostname or "127.0.0.1", url.port or 6379))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ping, pong = b"*1\r\n$4\r\nPING\r\n", b"+PONG\r\n"
    send, recv, clock = sock.sendall, sock.recv, time.perf_counter_ns

    def round_trip() -> None:
        send(ping)
        got = recv(64)
        while len(got) < len(pong):
            got += recv(64)

    for _ in range(200):
        round_trip()
    # ten batches 50 ms apart: on a shared machine one busy moment would otherwise set "the floor"
    batches = 10
    pairs: list[int] = []
    batch_p50s: list[float] = []
    for _ in range(batches):
        batch = []
        for _ in range(max(1, args.n // batches)):
            t0 = clock()
            round_trip()
            round_trip()
            batch.append(clock() - t0)
        batch.sort()
        batch_p50s.append(batch[len(batch) // 2] / 1000)
        pairs += batch
        time.sleep(0.05)
    sock.close()
    pairs.sort()
    us = [p / 1000 for p in pairs]
    return {"n": len(us), "batches": batches, "pair_us_p50": min(batch_p50s), "batch_p50s_us": batch_p50s,
            "all_p50_us": us[len(us) // 2], "pair_us_p99": us[min(len(us) - 1, int(len(us) * 0.99))],
            "pair_us_min": us[0], "pair_us_mean": sum(us) / len(us)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["ours", "rlock", "lost", "micro", "floor", "handoff", "quorum", "topologies"])
    parser.add_argument("--sentinel_url", default="")
    parser.add_argument("--cluster_url", default="")
    parser.add_argument("--urls", default="", help="quorum: comma-separated Redis URLs (5)")
    parser.add_argument("--lock-url", required=True)
    parser.add_argument("--n", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--ttl", type=float, default=3.0)
    parser.add_argument("--chunk", type=int, default=500)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--impl", choices=list(HOLDERS), default="ours")
    parser.add_argument("--procs", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--hold", type=float, default=0.002)
    args = parser.parse_args()
    fn = {"ours": hold_ours, "rlock": hold_rlock, "lost": lost_latency, "micro": micro, "floor": floor,
          "handoff": plain_handoff, "quorum": quorum_cost, "topologies": topology_cost}[args.mode]
    result = fn(args)
    sys.stdout.write("RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()
    os._exit(0)  # python-redis-lock's renewal threads are daemons: do not wait for them


if __name__ == "__main__":
    main()
