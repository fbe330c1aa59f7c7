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

This module sets up and sequences the run; the phases themselves, and the
runners of scale.py, capacity.py and etcd_bench.py, are in run_phases.py.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
sys.path.insert(0, str(ROOT / "tools"))
import side_venv  # noqa: E402 (tools/: the stdlib-only virtualenv maker)

VENV = BENCH_DIR / ".venv"
REQUIREMENTS = BENCH_DIR / "requirements.txt"


_T0 = time.monotonic()


def say(msg: str) -> None:
    print(f"[bench +{time.monotonic() - _T0:.0f}s] {msg}", flush=True)


# -- set-up: the benchmark's own virtualenv (stdlib only up to here) ---------------------


def ensure_venv(out_dir: Path) -> Path:
    return side_venv.ensure(VENV, REQUIREMENTS, out_dir, say)


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

    import report
    import run_phases

    p = _params(args)
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

    run_phases.on_lock_server(results, p, args, out_dir, rng, say)

    say(f"10. capacity: locked tasks per Redis core, ours and the cookbook's ({p['cap_rounds']} rounds x "
        f"{p['cap_seconds']:g} s each, {p['cap_procs']} client processes x {p['cap_conns']} connections)")
    results["capacity"] = run_phases.capacity_run(p)
    say(f"  ours / cookbook per core: {results['capacity']['ratio']:.2f}")

    say(f"11. etcd against Redis: per-task cost, keep-alive cost with {p['etcd_locks']:,} locks held, hand-off")
    results["etcd"] = run_phases.etcd_run(p, say)
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


def _params(args: argparse.Namespace) -> dict:
    """The run's sizes: SMOKE or FULL, with each --param KEY=VALUE applied."""
    p = dict(SMOKE if args.smoke else FULL)
    for item in args.param:
        key, _, value = item.partition("=")
        if key not in p:
            sys.exit(f"--param {key}: unknown; known: {', '.join(p)}")
        p[key] = _parse_param(value, p[key])
    return p


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
