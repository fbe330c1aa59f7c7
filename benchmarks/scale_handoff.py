"""scale.py's mode ``handoff``: hand-off latency for plain code, processes queueing on one key.

    python scale.py handoff --lock-url URL --impl ours|redis-py|python-redis-lock[-renewed] --procs 8 --rounds 20
    python scale.py handoff --lock-url etcd://127.0.0.1:PORT --impl etcd-mutex|ours-etcd --procs 8 --rounds 20

The Redis impls take a Redis URL, the etcd impls an etcd one (run_phases.py starts a private
one-member etcd that fsyncs its log: tests/_etcd_servers.py's ``EtcdCluster(fsync=True)``).
"""

from __future__ import annotations

import argparse
import base64
import os
import random
import time

import redis


def plain_handoff(args: argparse.Namespace) -> dict:
    """Hand-off latency for plain code: processes queue on one key, each takes it once per round.

    Per round, ``--procs`` processes start at a barrier, each one a random 0-100 ms
    later (so redis-py's 0.1 s polls do not all fall in step) blocks on the key; the
    first to get it holds it until all the others are waiting (then 20 ms more, so
    they are parked / blocked / polling), every later one holds it ``--hold`` s.
    Latency = the previous holder's exit from its block (just before its release)
    -> the next holder's entry, in entry order.
    """
    import multiprocessing as mp

    etcd_version = _check_url(args)
    ctx = mp.get_context("fork")
    procs, rounds = args.procs, args.rounds
    barrier = ctx.Barrier(procs)
    waiting = ctx.Array("i", rounds)
    entered = ctx.Array("i", rounds)
    out = ctx.Queue()
    tag = f"{os.getpid()}-{random.getrandbits(32):08x}"
    workers = [ctx.Process(target=_handoff_proc, args=(args, tag, i, barrier, waiting, entered, out))
               for i in range(procs)]
    for w in workers:
        w.start()
    rows = []
    try:
        for _ in range(procs * rounds):
            row = out.get(timeout=300)
            if row[0] == "error":
                raise RuntimeError(f"{args.impl}, process {row[3]}: {row[1]}")
            rows.append(row)
    finally:
        for w in workers:
            w.join(10)
            if w.is_alive():
                w.kill()
    gaps = []
    for r in range(rounds):
        entries = sorted((t_in, t_out) for rr, t_in, t_out, _ in rows if rr == r)
        gaps += [(entries[i][0] - entries[i - 1][1]) / 1e6 for i in range(1, len(entries))]
    gaps.sort()
    return {
        **({"etcd_version": etcd_version} if etcd_version else {}),
        "impl": args.impl, "procs": procs, "rounds": rounds, "hold_s": args.hold, "handoffs": len(gaps),
        "overlaps": sum(1 for g in gaps if g < 0),
        "p50_ms": gaps[len(gaps) // 2] if gaps else None,
        "p99_ms": gaps[min(len(gaps) - 1, int(len(gaps) * 0.99))] if gaps else None,
        "max_ms": gaps[-1] if gaps else None,
        "mean_ms": sum(gaps) / len(gaps) if gaps else None,
    }


def _check_url(args: argparse.Namespace) -> str | None:
    """The etcd server's version for the etcd impls (None for the others); an error for a URL of the wrong kind."""
    on_etcd = args.lock_url.startswith(("etcd://", "etcds://"))
    if on_etcd != (args.impl in ETCD_IMPLS):
        raise SystemExit(f"--impl {args.impl} wants {'an etcd' if args.impl in ETCD_IMPLS else 'a Redis'} URL, "
                         f"not {args.lock_url}")
    if not on_etcd:
        return None
    import requests  # (etcd3gw's own HTTP client)

    from celery_singleton_lock.topologies.etcd_session import parse_etcd_url

    url = parse_etcd_url(args.lock_url)
    (host, port), scheme = url["endpoints"][0], url["protocol"]
    version: str = requests.get(f"{scheme}://{host}:{port}/version", timeout=10).json()["etcdserver"]
    return version


def _handoff_proc(args, tag, index, barrier, waiting, entered, out) -> None:
    """One process of plain_handoff: take the key once per round, the way ``args.impl`` blocks."""
    rng = random.Random(index)
    try:
        hold = _holder(args)
        for r in range(args.rounds):
            name = f"bench:handoff:{tag}:{r}"
            barrier.wait(120)
            time.sleep(rng.uniform(0, 0.1))  # start at a random phase of redis-py's 0.1 s polling
            with waiting.get_lock():
                waiting[r] += 1

            def body(r=r):
                t_in = time.monotonic_ns()
                with entered.get_lock():
                    first = entered[r] == 0
                    entered[r] += 1
                if first:  # hold until every other process is blocked on the key
                    deadline = time.monotonic() + 60
                    while waiting[r] < args.procs and time.monotonic() < deadline:
                        time.sleep(0.001)
                    time.sleep(0.02)
                else:
                    time.sleep(args.hold)
                return t_in, time.monotonic_ns()

            t_in, t_out = hold(name, body)
            out.put((r, t_in, t_out, index))
    except Exception as exc:
        out.put(("error", f"{type(exc).__name__}: {exc}", 0, index))
    finally:
        out.close()
        out.join_thread()
        os._exit(0)


def _holder(args):
    """``hold(name, body)``: run ``body`` holding the key ``name``, waiting for it the way ``args.impl`` does."""
    return HOLDERS[args.impl](args)


def _hold_ours(args):
    """Ours, ``held(..., wait=...)``: on one Redis it parks in the key's line and BLPOPs its wake-up list;
    on etcd (``ours-etcd``, an ``etcd://`` URL) no line holds plain code: it watches the lock key and tries
    again when it changes."""
    from celery_singleton_lock import held

    def hold(name, body):
        with held(args.lock_url, name, 30.0, wait=120.0):
            return body()
    return hold


def _hold_redis_py(args):
    client = redis.Redis.from_url(args.lock_url)

    def hold(name, body):  # redis-py's blocking Lock: SET NX, else sleep 0.1 s and try again
        lock = client.lock(name, timeout=30, sleep=0.1, blocking_timeout=120)
        if not lock.acquire():
            raise RuntimeError("redis-py Lock: blocking_timeout ran out")
        try:
            return body()
        finally:
            lock.release()
    return hold


def _hold_python_redis_lock(args, renewed: bool = False):
    """python-redis-lock: SET NX, else BLPOP on its signal key. ``renewed`` (impl
    ``python-redis-lock-renewed``): with ``auto_renewal=True``, the service ours gives (a hold longer
    than the expiry keeps its lock); it starts a renewal thread per acquire and stops it at release."""
    import redis_lock

    client = redis.StrictRedis.from_url(args.lock_url)

    def hold(name, body):
        lock = redis_lock.Lock(client, name, expire=30, auto_renewal=renewed)
        lock.acquire(blocking=True)  # its timeout may not exceed expire; the parent has one
        try:
            return body()
        finally:
            lock.release()
    return hold


def _hold_etcd_mutex(args):
    """etcd's own mutex, served by etcd itself (v3lock, through its HTTP/JSON gateway, with etcd3gw's client).

    ``POST /v3/lock/lock {name, lease}`` blocks until the lock is held: the server runs
    ``concurrency.Mutex.Lock`` on the given lease, which puts ``name/<lease id in hex>`` and waits for
    the key created just before its own to be deleted; ``POST /v3/lock/unlock {key}`` deletes that key.
    The key is named after the lease, so each process has a lease of its own (its "session"), 30 s
    like the others' locks, kept alive here every 10 s (v3lock orphans the session: it never renews).
    """
    import threading

    from etcd3gw.client import Etcd3Client

    from celery_singleton_lock.topologies.etcd_session import parse_etcd_url

    url = parse_etcd_url(args.lock_url)
    (host, port), scheme = url["endpoints"][0], url["protocol"]
    client = Etcd3Client(host=host, port=port, protocol=scheme, timeout=120, api_path="/v3/")  # a waiter's POST blocks
    lease = client.lease(30)
    lock_url, unlock_url = client.get_url("/lock/lock"), client.get_url("/lock/unlock")

    def keep_alive() -> None:  # its own client: the lock's POST may be blocked on the other one
        renewer = Etcd3Client(host=host, port=port, protocol=scheme, timeout=10, api_path="/v3/")
        while True:
            time.sleep(10)
            renewer.post(renewer.get_url("/lease/keepalive"), json={"ID": lease.id})

    threading.Thread(target=keep_alive, daemon=True).start()

    def hold(name, body):
        got = client.post(lock_url, json={"name": base64.b64encode(name.encode()).decode(), "lease": lease.id})
        try:
            return body()
        finally:
            client.post(unlock_url, json={"key": got["key"]})
    return hold


HOLDERS = {"ours": _hold_ours, "redis-py": _hold_redis_py, "python-redis-lock": _hold_python_redis_lock,
           "python-redis-lock-renewed": lambda args: _hold_python_redis_lock(args, renewed=True),
           "etcd-mutex": _hold_etcd_mutex, "ours-etcd": _hold_ours}
"""Each impl's ``hold`` maker; ``etcd-mutex`` and ``ours-etcd`` take an ``etcd://`` lock URL."""
ETCD_IMPLS = ("etcd-mutex", "ours-etcd")
