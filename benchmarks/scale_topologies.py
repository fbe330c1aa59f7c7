"""scale.py's modes ``quorum`` and ``topologies``: the lock's cost per task on other deployments.

    python scale.py quorum --lock-url URL --n 2000 --urls URL1,...,URL5
    python scale.py topologies --lock-url URL --sentinel_url URL --cluster_url URL --trials 2000 --n 10000

``quorum``: one server against Redlock quorums of 3 and 5 independent servers; ``topologies``: one
Redis, a Sentinel-watched master and a 3-master Redis Cluster, then the watchdog on the Cluster.
"""

from __future__ import annotations

import argparse
import math
import time


def quorum_cost(args: argparse.Namespace) -> dict:
    """Quorum mode (issue 12): wall time of an acquire, a release, and both, on one server and on
    quorums of the first 3 and all 5 of ``--urls`` (each a private redis-server), interleaved."""
    from celery_singleton_lock.engine.server import LockServer
    from celery_singleton_lock.topologies.quorum import QuorumLockServer

    urls = args.urls.split(",")
    setups = {"single": LockServer.from_url(urls[0]), "quorum N=3": QuorumLockServer.from_urls(urls[:3]),
              "quorum N=5": QuorumLockServer.from_urls(urls[:5])}
    clock = time.perf_counter_ns
    times: dict[str, dict[str, list[float]]] = {k: {"acquire": [], "release": []} for k in setups}
    import redis

    from celery_singleton_lock.topologies.quorum import SINCE

    for url in urls[:5]:  # a quorum that has run for a while: no member's data is young (see Q_ACQUIRE)
        redis.Redis.from_url(url).set(SINCE, int((time.time() - 3600) * 1000))
    for _ in range(50):  # warm: connections made, scripts loaded
        for name, server in setups.items():
            lock = server.acquire(f"bench:quorum:warm:{name}", 30.0)
            server.release(lock)
    for i in range(args.n):
        for name, server in setups.items():  # interleaved, so a busy moment hits every setup alike
            t0 = clock()
            lock = server.acquire(f"bench:quorum:{name}:{i}", 30.0, owner_id=f"t{i}")
            t1 = clock()
            server.release(lock)
            t2 = clock()
            times[name]["acquire"].append((t1 - t0) / 1000)
            times[name]["release"].append((t2 - t1) / 1000)
    out = {}
    for name, parts in times.items():
        row = {}
        for op, values in parts.items():
            values.sort()
            row[op + "_p50_us"] = values[len(values) // 2]
            row[op + "_p99_us"] = values[min(len(values) - 1, int(len(values) * 0.99))]
        row["both_p50_us"] = row["acquire_p50_us"] + row["release_p50_us"]
        out[name] = row
    return {"n": args.n, "setups": out}


def topology_cost(args: argparse.Namespace) -> dict:
    """Issue 11: the lock's cost per task (one acquire and one release) on one Redis, on a Sentinel-watched
    master and on a 3-master Redis Cluster, interleaved; then the watchdog with ``--n`` locks spread over
    the cluster's masters for ``--seconds``: all kept?, round trips (one pipeline per node) per period."""
    from celery_singleton_lock.topologies.servers import from_settings
    from celery_singleton_lock.watchdog.renewer import Watchdog

    setups = {
        "single": from_settings(args.lock_url),
        "sentinel": from_settings(args.sentinel_url, transport_options={"master_name": "mymaster"}),
        "cluster (3 masters)": from_settings(args.cluster_url),
    }
    clock = time.perf_counter_ns
    times: dict[str, list[float]] = {k: [] for k in setups}
    for i in range(50):
        for name, server in setups.items():
            server.release(server.acquire(f"bench:topo:warm:{name}:{i}", 30.0))
    for i in range(args.trials):
        for name, server in setups.items():
            t0 = clock()
            lock = server.acquire(f"bench:topo:{name}:{i}", 30.0, owner_id=f"t{i}")
            server.release(lock)
            times[name].append((clock() - t0) / 1000)
    cost = {}
    for name, values in times.items():
        values.sort()
        p99 = values[min(len(values) - 1, int(len(values) * 0.99))]
        cost[name] = {"p50_us": values[len(values) // 2], "p99_us": p99}

    cluster = setups["cluster (3 masters)"]
    dog = Watchdog()
    locks = []
    for i in range(args.n):  # each tracked as it is taken, as a task's is: taking 10,000 may outlast one TTL
        locks.append(cluster.acquire(f"bench:topo:scale:{i}", args.ttl, owner_id=f"s{i}"))
        dog.track(locks[-1])
    time.sleep(args.ttl)  # settle: every lock renewed at least once
    def pipelines() -> int:  # the watchdog renews through its short-timeout twin of the cluster server
        return sum(getattr(twin, "pipelines_sent", 0) for twin in cluster._twins.values())

    sent0, cpu0, t0s = pipelines(), time.process_time(), time.monotonic()
    time.sleep(args.seconds)
    seconds = time.monotonic() - t0s
    sent = pipelines() - sent0
    cpu = (time.process_time() - cpu0) / seconds
    held = sum(1 for lock in locks if not lock.lost)
    dog.shutdown()
    for lock in locks:
        cluster.release(lock)
    period = args.ttl / 3
    nodes = len({n.name for n in cluster.cluster.get_primaries()})
    return {"trials": args.trials, "cost": cost, "scale": {
        "n": args.n, "ttl": args.ttl, "seconds": seconds, "held": held, "nodes": nodes, "chunk": args.chunk,
        "round_trips_per_period": sent / (seconds / period), "bound": nodes * math.ceil(args.n / args.chunk),
        "cpu_core": cpu}}
