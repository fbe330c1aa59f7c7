"""The full run's measuring phases, in the order run.py runs them, and the runners of the benchmarks that
run in processes of their own (scale.py, capacity.py, etcd_bench.py).

Phases 1 to 9 share one broker and one lock server (:func:`on_lock_server`); each phase writes its
figures into ``results`` and tells its progress through ``say`` (run.py's).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import backlog
import footprint
import harness
import hotkeys
import report
import report_common
import report_servers
import server_commands
import worker_profile

from celery_singleton_lock.testing.servers import RedisServer

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent

Say = Callable[[str], None]


def on_lock_server(results: dict, p: dict, args: Any, out_dir: Path, rng: random.Random, say: Say) -> None:
    """Phases 1 to 9: a broker and a lock server of their own (private redis-servers, stopped at the end)."""
    meta = results["meta"]
    with RedisServer() as broker, RedisServer() as locks:
        meta["redis_server"] = ".".join(map(str, locks.version()))
        env = {
            "BENCH_BROKER_URL": broker.url(0),
            "BENCH_LOCK_URL": locks.url(0),
        }
        os.environ.update(env)
        sys.path.insert(0, str(BENCH_DIR))
        import bench_app  # the client side: same app, same variants as the workers

        variants = dict(bench_app.VARIANTS)
        results["variants"] = list(variants)
        say(f"variants: {', '.join(variants)}; broker :{broker.port}, lock server :{locks.port}")
        missing = [v for v in report_common.ALL_VARIANTS if v not in variants]
        if missing and not args.smoke:
            say(f"WARNING: peers not importable, left out: {', '.join(missing)}")

        worker_phases(results, p, args, env, variants, locks, out_dir, rng, say)
        engine_phases(results, p, locks, say)
        footprint_phases(results, p, locks, variants, out_dir, say)
        watchdog_phases(results, p, locks, say)


def worker_phases(results: dict, p: dict, args: Any, env: dict[str, str], variants: dict[str, Any],
                  locks: RedisServer, out_dir: Path, rng: random.Random, say: Say) -> None:
    """Phases 1 to 3 on real worker processes, then the instrumented worker and (--profile) the profile."""
    workers: list[harness.BenchWorker] = []
    try:
        solo = harness.BenchWorker("solo", 1, env, out_dir)
        workers.append(solo.start())
        say(f"solo worker ready (pid {solo.pid}); warming up")
        solo.run_batch(harness.blocks_schedule(variants, 10, 1, rng))

        results["interleaved"] = _interleaved(solo, variants, p, rng, say)

        say(f"2. lock-server commands per task ({p['cmd_n']} tasks per variant, MONITOR + commandstats)")
        results["commands"] = server_commands.commands(solo, locks, variants, p["cmd_n"])
        results["renewals"] = server_commands.renewal_check(
            solo, locks, p["renew_short"], p["renew_long"], p["renew_count"])

        results["throughput"] = _throughput(solo, variants, p, env, out_dir, rng, workers, say)

        say("where our worker time goes: an instrumented solo worker")
        results["breakdown"] = harness.breakdown(env, out_dir, variants, p["breakdown_n"])

        if args.profile:
            say("profile: py-spy on a solo worker draining LockedTask tasks")
            prof = harness.BenchWorker("solo", 1, env, out_dir)
            workers.append(prof.start())
            results["profile"] = worker_profile.profile_worker(prof, variants, p["profile_n"], out_dir)
            prof.stop()
    finally:
        for w in workers:
            w.stop()


def _interleaved(solo: harness.BenchWorker, variants: dict[str, Any], p: dict, rng: random.Random,
                 say: Say) -> dict[str, Any]:
    """1. The interleaved run on the solo worker: every variant in random order, round after round."""
    say(f"1. interleaved run: {p['rounds']} rounds x {p['blocks']} blocks x "
        f"{p['per_block']} per variant, one solo worker")
    rounds = []
    for r in range(p["rounds"]):
        rr = harness.interleaved_round(solo, variants, p["blocks"], p["per_block"], p["skip_blocks"], rng)
        rounds.append(rr)
        say(f"  round {r + 1}: " + ", ".join(f"{v} {rr['worker_us'][v]:.0f}" for v in variants)
            + f" µs/task ({rr['tasks']} tasks in {rr['seconds']:.1f}s)")
    return report.summarize_interleaved(rounds, list(variants))


def _throughput(solo: harness.BenchWorker, variants: dict[str, Any], p: dict, env: dict[str, str], out_dir: Path,
                rng: random.Random, workers: list[harness.BenchWorker], say: Say) -> dict[str, Any]:
    """3. Throughput on the solo worker (stopped after), then on each other pool (appended to ``workers``)."""
    say(f"3. throughput: {p['tp_rounds']} alternated rounds x {p['tp_n']} tasks per variant")
    tp = {}
    tp["solo"] = harness.throughput(solo, variants, p["tp_rounds"], p["tp_n"], say)
    solo.stop()
    for pool, conc in p["pools"]:
        if pool == "solo":
            continue
        w = harness.BenchWorker(pool, conc, env, out_dir)
        workers.append(w.start())
        w.run_batch(harness.blocks_schedule(variants, 10, conc, rng))  # warm every child
        tp[f"{pool} -c {conc}"] = harness.throughput(w, variants, p["tp_rounds"], p["tp_n"], say)
        w.stop()
    return tp


def engine_phases(results: dict, p: dict, locks: RedisServer, say: Say) -> None:
    """4. The round-trip floor; 4b. quorum mode; 4c. Sentinel and Redis Cluster (the suite's deployments)."""
    say(f"4. the floor: two raw loopback round trips (pre-packed PING on a socket), {p['floor_n']} pairs")
    results["floor"] = scale_run("floor", locks.url(0), n=p["floor_n"])
    say(f"  {results['floor']['pair_us_p50']:.1f} µs per pair (lowest batch p50)")
    say(f"4b. quorum mode: acquire and release on 1, 3 and 5 independent redis-servers, {p['quorum_n']} each")
    with ExitStack() as stack:
        members = [stack.enter_context(RedisServer()) for _ in range(5)]
        results["quorum"] = scale_run("quorum", locks.url(0), n=p["quorum_n"],
                                      urls=",".join(m.url(0) for m in members))
    for name, row in results["quorum"]["setups"].items():
        say(f"  {name}: acquire p50 {row['acquire_p50_us']:.0f} µs, release p50 {row['release_p50_us']:.0f} µs")
    say(f"4c. topologies: the lock per task on one Redis, Sentinel and a 3-master Cluster; the watchdog at "
        f"{p['topo_n']:,} locks on the Cluster")
    sys.path.insert(0, str(ROOT / "tests"))  # the suite's Sentinel and Cluster deployments
    from _deployments import RedisClusterDeployment, SentinelDeployment

    with SentinelDeployment(replicas=1, sentinels=3) as sentinel, RedisClusterDeployment(masters=3) as cluster:
        results["topologies"] = scale_run(
            "topologies", locks.url(0), trials=p["quorum_n"], n=p["topo_n"], seconds=p["topo_seconds"],
            ttl=p["scale_ttl"], sentinel_url=sentinel.url(0), cluster_url=cluster.url(),
        )
    for name, row in results["topologies"]["cost"].items():
        say(f"  {name}: acquire + release p50 {row['p50_us']:.0f} µs")
    sc = results["topologies"]["scale"]
    say(f"  cluster watchdog: {sc['held']:,} of {sc['n']:,} held; {sc['round_trips_per_period']:.1f} round trips "
        f"per period (bound {sc['bound']}); {sc['cpu_core'] * 100:.1f}% of a core")


def footprint_phases(results: dict, p: dict, locks: RedisServer, variants: dict[str, Any], out_dir: Path,
                     say: Say) -> None:
    """5. The footprint, whose looks wait while 6. hot keys, 6b. the backlog and 7. the plain-code hand-off run."""
    fp_variants = ["ours", "ours_late", "ours_quorum", *[v for v in report_common.PEERS if v in variants]]
    waits = ", ".join(f"{w:g} s" for w in p["fp_waits"]) or "no wait"
    say(f"5. footprint: {p['fp_n']:,} tasks on distinct keys per variant, all at once, each on its own "
        f"lock server (looks: at once, {waits}; redelivery window {p['fp_window']:g} s)")
    fp = footprint.Footprint(out_dir, fp_variants, p["fp_n"], p["fp_waits"], p["fp_window"], say)
    try:
        fp.start()
        for v, res in fp.results.items():
            say(f"  {v}: " + report_servers.footprint_line(res))
        say("6. hot keys: tasks on ONE key, real prefork workers (their own broker and lock server)")
        results["hot"] = hotkeys.run(out_dir, p, say)
        say("6b. hot key under a backlog: the same drain while its queue is kept 2 x the lock TTL deep")
        results["backlog"] = backlog.run(out_dir, p, say)
        results["plain_handoff"] = plain_handoff_phase(p, locks, say)
        if p["fp_waits"]:
            say(f"  footprint: waiting for the looks after {waits}")
    except BaseException:
        fp.close()
        raise
    results["footprint"] = fp.finish()


def plain_handoff_phase(p: dict, locks: RedisServer, say: Say) -> list[dict[str, Any]]:
    """7. The plain-code hand-off: ours and the Redis peers on the lock server; then, where an etcd binary and
    etcd3gw exist, etcd's own mutex and ours on a private one-member etcd that fsyncs its log."""
    say(f"7. plain-code hand-off: {p['plain_procs']} processes on one key, {p['plain_rounds']} rounds")
    runs = [(impl, locks.url(0)) for impl in
            ["ours", "redis-py"] + (["python-redis-lock", "python-redis-lock-renewed"]
                                    if report.importable("redis_lock") else [])]
    sys.path.insert(0, str(ROOT / "tests"))  # the suite's private etcd (tests/_etcd_servers.py)
    from _etcd_servers import NO_ETCD, EtcdCluster, find_etcd

    etcd, missing = None, NO_ETCD if find_etcd() is None else None
    if missing is None and not report.importable("etcd3gw"):
        missing = "etcd3gw (the etcd client) is not importable"
    if missing:
        say(f"  etcd-mutex and ours-etcd skipped: {missing}")
    else:  # free loopback ports, a temporary data dir, stopped by PID
        etcd = EtcdCluster(members=1, fsync=True).start()
        runs += [(impl, etcd.url()) for impl in ("etcd-mutex", "ours-etcd")]
    rows = []
    try:
        for impl, url in runs:
            r = scale_run("handoff", url, impl=impl, procs=p["plain_procs"], rounds=p["plain_rounds"],
                          hold=p["plain_hold"])
            rows.append(r)
            say(f"  {impl}: p50 {r['p50_ms']:.2f} ms, p99 {r['p99_ms']:.2f} ms ({r['handoffs']} hand-offs)")
    finally:
        if etcd is not None:
            etcd.stop()
    return rows


def watchdog_phases(results: dict, p: dict, locks: RedisServer, say: Say) -> None:
    """8. The watchdog at scale; 9. lost-lock detection; and our per-task pieces in isolation."""
    say("8. watchdog at scale: N locks held in one process, ttl "
        f"{p['scale_ttl']:g}s, {p['scale_seconds']:g}s each (fresh process per run)")
    scale = []
    for n in p["scale_ours"]:
        scale.append(scale_run("ours", locks.url(0), n=n, seconds=p["scale_seconds"], ttl=p["scale_ttl"]))
        say(f"  ours N={n}: {report.scale_line(scale[-1])}")
    if report.importable("redis_lock"):
        for n in p["scale_rlock"]:
            scale.append(scale_run("rlock", locks.url(0), n=n, seconds=p["scale_seconds"], ttl=p["scale_ttl"]))
            say(f"  python-redis-lock N={n}: {report.scale_line(scale[-1])}")
    results["scale"] = scale

    say("9. lost-lock detection latency (outside DEL -> .lost)")
    results["lost"] = [
        scale_run("lost", locks.url(0), ttl=ttl, trials=p["lost_trials"]) for ttl in p["lost_ttls"]
    ]
    results["micro"] = scale_run("micro", locks.url(0), n=p["micro_n"])


def scale_run(mode: str, lock_url: str, **opts) -> dict:
    import json

    cmd = [sys.executable, str(BENCH_DIR / "scale.py"), mode, "--lock-url", lock_url]
    for k, v in opts.items():
        cmd += [f"--{k}", str(v)]
    timeout = 120 + float(opts.get("seconds", 0)) * 2
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(BENCH_DIR)])))
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"scale.py {mode} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")


def capacity_run(p: dict) -> dict:
    """benchmarks/capacity.py in a process of its own (it starts its own redis-server and clients)."""
    import json

    cmd = [sys.executable, str(BENCH_DIR / "capacity.py"), "--seconds", str(p["cap_seconds"]),
           "--rounds", str(p["cap_rounds"]), "--procs", str(p["cap_procs"]), "--conns", str(p["cap_conns"]),
           "--counted", str(p["cap_counted"])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240 + 4 * p["cap_rounds"] * p["cap_seconds"],
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(BENCH_DIR)])))
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"capacity.py failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")


def etcd_run(p: dict, say: Say) -> dict | None:
    """benchmarks/etcd_bench.py in a process of its own; None (said so) where no etcd binary exists."""
    import json

    cmd = [sys.executable, str(BENCH_DIR / "etcd_bench.py"), "--json", "--ops", str(p["etcd_ops"]),
           "--locks", str(p["etcd_locks"]), "--handoffs", str(p["etcd_handoffs"])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(BENCH_DIR)])))
    if proc.returncode == 2:
        say(f"  skipped: {proc.stderr.strip()[-300:]}")
        return None
    if proc.returncode != 0:
        raise RuntimeError(f"etcd_bench.py failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout)

