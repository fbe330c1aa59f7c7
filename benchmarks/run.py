#!/usr/bin/env python3
"""The benchmarks: what the lock costs per task, and what the watchdog costs at scale, beside the peers;
hot keys (many tasks on one key), hand-off latency, the round-trip floor, and what is left in Redis.

    python3 benchmarks/run.py            # full run (about 10 min): the table, benchmarks/RESULTS.md and cost.png
    python3 benchmarks/run.py --smoke    # about half a minute, small N, no peers needed (CI runs this)
    python3 benchmarks/run.py --profile  # also profile the worker's LockedTask path with py-spy
    python3 benchmarks/run.py --param scale_ours=100,1000 ...   # other sizes; results in benchmarks/out/custom
    python3 benchmarks/run.py --rerender benchmarks/results.json  # rewrite RESULTS.md (e.g. after editing NOTES.md)
    python3 benchmarks/run.py --backlog  # only the hot key under a backlog (Redis broker and RabbitMQ)

Only a full run with no --param replaces benchmarks/RESULTS.md, benchmarks/cost.png and
benchmarks/results.json (its raw figures); raw results and worker logs also go to benchmarks/out/.

The full run does all of its own set-up: it makes a virtualenv in
benchmarks/.venv, installs this checkout (pip install -e ..) and the peers from
benchmarks/requirements.txt into it (re-done when either file changes), and
runs itself again with that interpreter. The peers are never dependencies of
the package. The smoke run uses the interpreter it is started with, and
measures the peers only if they happen to be importable.

Everything runs on this machine's loopback: two private redis-servers on free
ports (the broker's, and the lock server that every variant's locks live on,
so its INFO commandstats counts lock traffic only), and real ``celery worker``
subprocesses, all stopped by PID. The hot-key phases (hotkeys.py) and the
footprint (footprint.py) start private redis-servers of their own. The
machine's own Redis is never touched.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import subprocess
import sys
import time
import venv
from contextlib import ExitStack
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
VENV = BENCH_DIR / ".venv"
VENV_PY = VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
REQUIREMENTS = BENCH_DIR / "requirements.txt"


_T0 = time.monotonic()


def say(msg: str) -> None:
    print(f"[bench +{time.monotonic() - _T0:.0f}s] {msg}", flush=True)


# -- set-up: the benchmark's own virtualenv (stdlib only up to here) ---------------------


def ensure_venv(out_dir: Path) -> Path:
    stamp = VENV / ".installed"
    want = hashlib.sha256(
        REQUIREMENTS.read_bytes() + (ROOT / "pyproject.toml").read_bytes() + sys.version.encode()
    ).hexdigest()
    if stamp.exists() and stamp.read_text() == want and VENV_PY.exists():
        return VENV_PY
    if not VENV_PY.exists():
        say(f"creating virtualenv {VENV}")
        venv.EnvBuilder(with_pip=True, clear=True).create(VENV)
    say("installing the package and the peers into it (benchmarks/requirements.txt)")
    out_dir.mkdir(parents=True, exist_ok=True)
    log = out_dir / "pip.log"
    with open(log, "w") as f:
        code = subprocess.call(
            [str(VENV_PY), "-m", "pip", "install", "--disable-pip-version-check",
             "-e", str(ROOT), "-r", str(REQUIREMENTS)],
            cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
        )
    if code:
        sys.exit(f"pip install failed ({code}); see {log}:\n" + log.read_text()[-3000:])
    stamp.write_text(want)
    return VENV_PY


def in_venv(path: Path) -> bool:
    try:
        return Path(sys.prefix).resolve() == path.resolve()
    except OSError:
        return False


# -- the run ---------------------------------------------------------------------------


FULL = dict(
    rounds=5, blocks=160, per_block=2, skip_blocks=5,
    tp_rounds=5, tp_n=400, pools=(("solo", 1), ("prefork", 2)),
    cmd_n=100, renew_short=0.2, renew_long=1.3, renew_count=2,
    scale_ours=(100, 1000, 10000), scale_rlock=(100, 1000, 5000), scale_seconds=30.0, scale_ttl=3.0,
    lost_ttls=(1.0, 3.0), lost_trials=20, micro_n=2000, profile_n=3000, breakdown_n=2000,
    floor_n=5000, quorum_n=2000, topo_n=10000, topo_seconds=15.0,
    hot_nodes=2, hot_concurrency=2, hot_n=2000, hot_body=0.001, hot_cap_ours=90.0, hot_cap=45.0,
    handoff_n=200, handoff_body=0.02,
    backlog_n=300, backlog_body=0.05, backlog_ttl=5.0, backlog_filler=0.05, backlog_brokers=("redis", "amqp"),
    backlog_prefetch=(4, 1),
    plain_procs=8, plain_rounds=20, plain_hold=0.002,
    fp_n=20000, fp_waits=(30.0, 120.0), fp_window=60.0,
    cap_seconds=6.0, cap_rounds=3, cap_procs=3, cap_conns=16, cap_counted=2000,
    etcd_ops=2000, etcd_locks=10_000, etcd_handoffs=200,
)
SMOKE = dict(
    rounds=1, blocks=8, per_block=1, skip_blocks=1,
    tp_rounds=1, tp_n=20, pools=(("solo", 1), ("prefork", 2)),
    cmd_n=5, renew_short=0.1, renew_long=0.8, renew_count=1,
    scale_ours=(100,), scale_rlock=(50,), scale_seconds=1.0, scale_ttl=3.0,
    lost_ttls=(1.0,), lost_trials=4, micro_n=100, profile_n=300, breakdown_n=50,
    floor_n=200, quorum_n=50, topo_n=300, topo_seconds=1.0,
    hot_nodes=2, hot_concurrency=2, hot_n=20, hot_body=0.01, hot_cap_ours=30.0, hot_cap=3.0,
    handoff_n=10, handoff_body=0.01,
    backlog_n=20, backlog_body=0.01, backlog_ttl=2.0, backlog_filler=0.02, backlog_brokers=("redis",),
    backlog_prefetch=(4,),
    plain_procs=4, plain_rounds=2, plain_hold=0.002,
    fp_n=200, fp_waits=(), fp_window=60.0,
    cap_seconds=1.0, cap_rounds=1, cap_procs=2, cap_conns=4, cap_counted=100,
    etcd_ops=50, etcd_locks=200, etcd_handoffs=20,
)


def _exit_on_signal(signum: int, _frame) -> None:
    raise SystemExit(128 + signum)  # unwinds the with-blocks: workers and redis-servers are stopped


def run(args: argparse.Namespace) -> int:
    import random
    import signal

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit_on_signal)

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

    p = dict(SMOKE if args.smoke else FULL)
    for item in args.param:
        key, _, value = item.partition("=")
        if key not in p:
            sys.exit(f"--param {key}: unknown; known: {', '.join(p)}")
        p[key] = _parse_param(value, p[key])
    out_dir = Path(args.out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    meta = report.machine_meta(args)
    rng = random.Random(args.seed)
    results: dict = {"meta": meta, "params": {k: list(v) if isinstance(v, tuple) else v for k, v in p.items()}}
    if args.backlog:
        return backlog_only(results, p, out_dir)
    if args.hot:
        return hot_only(results, p, out_dir)

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

        workers: list[harness.BenchWorker] = []
        try:
            solo = harness.BenchWorker("solo", 1, env, out_dir)
            workers.append(solo.start())
            say(f"solo worker ready (pid {solo.pid}); warming up")
            solo.run_batch(harness.blocks_schedule(variants, 10, 1, rng))

            say(f"1. interleaved run: {p['rounds']} rounds x {p['blocks']} blocks x "
                f"{p['per_block']} per variant, one solo worker")
            rounds = []
            for r in range(p["rounds"]):
                rr = harness.interleaved_round(solo, variants, p["blocks"], p["per_block"], p["skip_blocks"], rng)
                rounds.append(rr)
                say(f"  round {r + 1}: " + ", ".join(f"{v} {rr['worker_us'][v]:.0f}" for v in variants)
                    + f" µs/task ({rr['tasks']} tasks in {rr['seconds']:.1f}s)")
            results["interleaved"] = report.summarize_interleaved(rounds, list(variants))

            say(f"2. lock-server commands per task ({p['cmd_n']} tasks per variant, MONITOR + commandstats)")
            results["commands"] = server_commands.commands(solo, locks, variants, p["cmd_n"])
            results["renewals"] = server_commands.renewal_check(
                solo, locks, p["renew_short"], p["renew_long"], p["renew_count"])

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
            results["throughput"] = tp

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
            say(f"7. plain-code hand-off: {p['plain_procs']} processes on one key, {p['plain_rounds']} rounds")
            plain_impls = ["ours", "redis-py"] + (["python-redis-lock"] if report.importable("redis_lock") else [])
            results["plain_handoff"] = []
            for impl in plain_impls:
                r = scale_run("handoff", locks.url(0), impl=impl, procs=p["plain_procs"], rounds=p["plain_rounds"],
                              hold=p["plain_hold"])
                results["plain_handoff"].append(r)
                say(f"  {impl}: p50 {r['p50_ms']:.2f} ms, p99 {r['p99_ms']:.2f} ms ({r['handoffs']} hand-offs)")
            if p["fp_waits"]:
                say(f"  footprint: waiting for the looks after {waits}")
        except BaseException:
            fp.close()
            raise
        results["footprint"] = fp.finish()

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

    say(f"10. capacity: locked tasks per Redis core, ours and the cookbook's ({p['cap_rounds']} rounds x "
        f"{p['cap_seconds']:g} s each, {p['cap_procs']} client processes x {p['cap_conns']} connections)")
    results["capacity"] = capacity_run(p)
    say(f"  ours / cookbook per core: {results['capacity']['ratio']:.2f}")

    say(f"11. etcd against Redis: per-task cost, keep-alive cost with {p['etcd_locks']:,} locks held, hand-off")
    results["etcd"] = etcd_run(p)
    if results["etcd"]:
        say(f"  etcd keep-alive: {results['etcd']['etcd']['keepalive']['cpu_percent_of_a_core']:.2f} % of a core")

    results["meta"]["duration_s"] = time.time() - started
    results["meta"]["loadavg_end"] = os.getloadavg()
    text = report.render(results, smoke=args.smoke)
    print(text["console"], flush=True)
    # only an unmodified full run replaces benchmarks/RESULTS.md and benchmarks/cost.png
    official = not args.smoke and not args.param
    report.write_outputs(results, text, out_dir, official=official, bench_dir=BENCH_DIR)
    say(f"done in {results['meta']['duration_s']:.0f}s")
    return 0


def backlog_only(results: dict, p: dict, out_dir: Path) -> int:
    """``--backlog``: only the hot key under a backlog; prints it, writes out_dir/backlog.json (never RESULTS.md)."""
    import json

    import backlog
    import report

    started = time.time()
    results["backlog"] = backlog.run(out_dir, p, say)
    print(backlog.render(results["backlog"], report._table), flush=True)
    for goal in backlog.goals(results["backlog"]):
        print(f"- {goal['goal']}: {'MET' if goal['met'] else 'NOT MET'}. {goal['figure']}", flush=True)
    (out_dir / "backlog.json").write_text(json.dumps(results, indent=1, default=str))
    say(f"done in {time.time() - started:.0f}s; raw figures in {out_dir / 'backlog.json'}")
    return 0


def hot_only(results: dict, p: dict, out_dir: Path) -> int:
    """``--hot``: only the hot keys (hand-off latency and the drains); prints them, writes out_dir/hot.json
    (never RESULTS.md): a quick look after a change to the line, between full runs."""
    import json

    import hotkeys

    started = time.time()
    results["hot"] = hotkeys.run(out_dir, p, say)
    (out_dir / "hot.json").write_text(json.dumps(results, indent=1, default=str))
    say(f"done in {time.time() - started:.0f}s; raw figures in {out_dir / 'hot.json'}")
    return 0


def rerender(path: Path) -> int:
    import json

    sys.path.insert(0, str(BENCH_DIR))
    import report

    results = json.loads(path.read_text())
    meta = results["meta"]
    official = "--smoke" not in meta["command"] and "--param" not in meta["command"]
    text = report.render(results, smoke=not official)
    print(text["console"], flush=True)
    report.write_outputs(results, text, path.parent, official=official, bench_dir=BENCH_DIR)
    return 0


def _parse_param(value: str, like):
    if isinstance(like, tuple):
        if like and isinstance(like[0], tuple):  # pools: solo:1,prefork:2
            return tuple((name, int(c)) for name, c in (x.split(":") for x in value.split(",") if x))
        kind = type(like[0]) if like else float
        return tuple(kind(x) for x in value.split(",") if x)
    return type(like)(value)


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


def etcd_run(p: dict) -> dict | None:
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="small N, a few seconds, no peers needed; "
                        "writes only to --out (never RESULTS.md)")
    parser.add_argument("--profile", action="store_true", help="also profile our worker path with py-spy")
    parser.add_argument("--out", default=None, help="directory for raw results and logs "
                        "(default benchmarks/out, or benchmarks/out/smoke)")
    parser.add_argument("--seed", type=int, default=20240601)
    parser.add_argument("--no-venv", action="store_true", help="run in the current interpreter")
    parser.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                        help="override one size, e.g. --param rounds=3 --param scale_ours=100,1000 "
                        "(for trying things out; RESULTS.md records the overrides in the command)")
    parser.add_argument("--backlog", action="store_true", help="only the hot key under a backlog (about two "
                        "minutes with RabbitMQ; never RESULTS.md)")
    parser.add_argument("--hot", action="store_true", help="only the hot keys (hand-off latency and the "
                        "drains); never writes RESULTS.md")
    parser.add_argument("--rerender", metavar="RESULTS_JSON",
                        help="only write RESULTS.md and the chart again from a run's results.json "
                        "(e.g. after editing benchmarks/NOTES.md); measures nothing")
    args = parser.parse_args()
    if args.out is None:  # an official run (full, no --param) keeps its own directory
        custom = args.param or args.rerender or args.backlog or args.hot
        kind = "smoke" if args.smoke else ("custom" if custom else "full")
        args.out = str(BENCH_DIR / "out" / kind)
    if not args.smoke and not args.no_venv and not in_venv(VENV):
        py = ensure_venv(Path(args.out))
        say(f"running in {VENV}")
        os.execv(str(py), [str(py), str(Path(__file__).resolve()), *sys.argv[1:]])
    if args.rerender:
        return rerender(Path(args.rerender))
    if args.smoke and importlib.util.find_spec("celery_singleton_lock") is None:
        # the smoke run wants the package and Celery, nothing more: the project's own venv has them
        project_py = ROOT / ".venv" / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
        if not project_py.exists() or in_venv(ROOT / ".venv"):
            sys.exit("the smoke run needs celery-singleton-lock installed: run `python3 dev.py test` once "
                     "(it makes .venv), or use .venv/bin/python")
        os.execv(str(project_py), [str(project_py), str(Path(__file__).resolve()), *sys.argv[1:]])
    args.command = "python3 dev.py bench" if os.environ.get("CSL_DEV_PY") else "python3 benchmarks/run.py"
    args.argv = sys.argv[1:]
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
