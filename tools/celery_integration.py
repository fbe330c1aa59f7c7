#!/usr/bin/env python3
"""Celery's own integration suite (t/integration of the Celery release sdist), with every task a LockedTask.

    python3 tools/celery_integration.py                  # --both: the baseline, then with the lock; compare
    python3 tools/celery_integration.py --with-lock      # only the run with LockedTask
    python3 tools/celery_integration.py --without-lock   # only the baseline
    python3 tools/celery_integration.py --both -k "test_chord and frozen" --policy skip
    python3 tools/celery_integration.py --with-lock -- -x --lf   # anything after -- goes to pytest

What it proves (see tools/README.md): Celery's suite, run with LockedTask as the task
class of every app (``on_duplicate`` = --policy, "retry" by default), passes every
test that it passes without it, except the tests in ALLOWED_REGRESSIONS below, each
with its reason. ``--both`` exits 0 only then; a single mode exits with pytest's status.

It does all of its own set-up, stdlib only up to the re-exec:

* a virtualenv in tools/.venv-integ with this checkout (pip install -e .) and what the
  suite needs for a Redis broker and backend (tools/integ-requirements.txt), re-done
  when either file changes; then it runs itself again with that interpreter;
* the sdist of the Celery version installed there, from PyPI (``pip download --no-deps
  --no-binary :all: celery==X``), of which it extracts t/integration, the modules it
  imports (t/__init__.py, t/canvas_helpers.py, t/skip.py) and pyproject.toml (the
  suite's pytest settings) into tools/.integ-work/celery-X/;
* per mode, a private redis-server on a free loopback port with no persistence
  (celery_singleton_lock.testing.RedisServer), stopped by PID at the end: db 0 the
  broker and the results (TEST_BROKER, TEST_BACKEND: one db, as in Celery's own redis
  run, since tests read result keys through their own client on REDIS_HOST/REDIS_PORT,
  which point at it too), db 2 the locks, db 3 the plugin's counters. The machine's
  Redis on 127.0.0.1:6379 is never used.

The suite runs as its upstream CI runs it (``pytest t/integration``, its own conftest,
its in-process prefork test worker), plus our plugin tools/csl_integ_plugin.py, which
in lock mode makes every task a LockedTask and checks that it did. Each pytest run
is a process group of its own, ended by its id if it outlives --max-minutes.
Logs and results go to tools/.integ-work/runs/<time>/<mode>/ (gitignored).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

# the set-up (integ_setup.py) and the shards' runs (integ_shard.py, with IGNORED) live beside this
# file, stdlib only like this module up to the re-exec; _wanted is named here for the tests of it
from integ_setup import DURATIONS, WORK, _wanted, ensure_suite, ensure_venv, in_venv, say  # noqa: F401
from integ_shard import Shard, merge, pytest_command

MODES = {"plain": "without LockedTask", "lock": "with LockedTask"}

ALLOWED_REGRESSIONS: dict[str, str] = {
    # "t/integration/test_x.py::test_class::test_name": "why it must fail with a lock: the two identical
    #     calls it starts at once, by design",
}
"""Tests that may pass without LockedTask and fail with it: only those that by design start
two identical calls (same task, same arguments) at once, which LockedTask exists to refuse.
Each entry names the test (pytest node id) and says why."""

GOOD = ("passed", "xfailed", "xpassed")
BAD = ("failed", "error", "missing")


# -- shards: both modes split the selected tests alike ----------------------------------------------

DEFAULT_WEIGHT = 2.0
"""Seconds assumed for a test that DURATIONS does not know."""


def shard_of(nodeids: list[str], count: int, weights: dict[str, float]) -> list[int]:
    """Each test's shard (0 .. count-1): longest first, each to the least loaded shard so far.

    Deterministic (ties go to the lower index), so the baseline and the run with
    LockedTask put every test in the same shard, after the same tests. Runs in the
    plugin, in each pytest process, over the tests that -k left.
    """
    if count < 1:
        raise ValueError(f"shard count must be >= 1, got {count}")
    loads = [0.0] * count
    owner = [0] * len(nodeids)
    weight = [float(weights.get(n, DEFAULT_WEIGHT)) for n in nodeids]
    for i in sorted(range(len(nodeids)), key=lambda i: (-weight[i], i)):
        shard = min(range(count), key=lambda s: (loads[s], s))
        loads[shard] += weight[i]
        owner[i] = shard
    return owner


# -- reading the results ----------------------------------------------------------------------------


def counts(tests: dict) -> dict[str, int]:
    c: dict[str, int] = {}
    for t in tests.values():
        c[t["outcome"]] = c.get(t["outcome"], 0) + 1
    return dict(sorted(c.items()))


def check_instrumentation(mode: str, merged: dict) -> list[str]:
    """What says the run did not test what it claims (LockedTask everywhere in lock mode; nowhere in plain)."""
    problems = list(merged["problems"])
    locked, plain = merged["executions"].get("locked", {}), merged["executions"].get("plain", {})
    if mode == "lock":
        for registry in merged["registries"]:
            if registry.get("not_locked"):
                problems.append(f"with LockedTask: the worker's app had plain tasks: {registry['not_locked']}")
        if plain:
            problems.append(f"with LockedTask: tasks executed as plain Task: {plain}")
        if merged["registries"] and not locked:
            problems.append("with LockedTask: no task execution was recorded as a LockedTask")
    elif locked:
        problems.append(f"without LockedTask: tasks executed as LockedTask: {locked}")
    return problems


def describe(mode: str, merged: dict) -> list[str]:
    lines = [f"{MODES[mode]}: {merged['elapsed'] / 60:.1f} min (its slowest shard)"]
    for shard in merged["shards"]:
        lines.append(f"  {shard.name}: pytest exit {shard.returncode}, {shard.elapsed / 60:.1f} min: "
                     f"{'; '.join(shard.summary) or '(no summary line)'}")
    lines.append(f"  outcomes: {counts(merged['tests'])}")
    for registry in merged["registries"][:1]:
        lines.append(
            f"  worker app: {registry.get('tasks')} tasks, {registry.get('locked')} of them LockedTask "
            f"(pool {registry.get('pool')}, concurrency {registry.get('concurrency')})"
        )
    ex = merged["executions"]
    dups = sorted(ex.get("duplicates", {}).items(), key=lambda kv: -kv[1])
    lines.append(
        f"  executions: {sum(ex.get('locked', {}).values())} as LockedTask, {sum(ex.get('plain', {}).values())} "
        f"as plain Task; locks acquired {sum(ex.get('acquired', {}).values())}; duplicates met "
        f"{sum(n for _, n in dups)}" + (": " + ", ".join(f"{name} x{n}" for name, n in dups) if dups else "")
    )
    return lines


def _error_lines(entry: dict, limit: int) -> list[str]:
    text = entry.get("longrepr") or ""
    found = [ln for ln in text.splitlines() if ln.startswith("E ")]
    return found[:limit] if found else text.splitlines()[-limit:]


def compare(plain: dict, lock: dict, out: Path) -> tuple[list[str], list[str]]:
    """(report lines, regressions not in the allow-list)."""
    p, k = plain["tests"], lock["tests"]
    regressions, fixed, changed = [], [], []
    for nodeid in sorted(set(p) | set(k)):
        a = p.get(nodeid, {"outcome": "missing"})["outcome"]
        b = k.get(nodeid, {"outcome": "missing"})["outcome"]
        if a in GOOD and b in BAD:
            regressions.append(nodeid)
        elif a in BAD and b in GOOD:
            fixed.append(nodeid)
        elif a != b:
            changed.append(f"{nodeid}: {a} -> {b}")
    lines = [f"regressions (pass without LockedTask, fail with it): {len(regressions)}"]
    unexpected, details = [], []
    for nodeid in regressions:
        entry = k.get(nodeid, {})
        reason = ALLOWED_REGRESSIONS.get(nodeid)
        if reason is None:
            unexpected.append(nodeid)
        lines.append(f"  {nodeid}  [{entry.get('outcome', 'missing')}, "
                     f"{f'allowed: {reason}' if reason else 'NOT in the allow-list'}]")
        for ln in _error_lines(entry, 8):
            lines.append(f"      | {ln}")
        details.append(f"==== {nodeid} ({entry.get('outcome')}, in {entry.get('when')})\n{entry.get('longrepr', '')}\n")
    stale = sorted(set(ALLOWED_REGRESSIONS) - set(regressions))
    if stale:
        lines.append(f"allow-listed but not failing now (remove them?): {stale}")
    if fixed:
        lines.append(f"fail without LockedTask, pass with it: {fixed}")
    if changed:
        lines.append("other differences: " + "; ".join(changed))
    (out / "regressions.txt").write_text("\n".join(details) or "none\n")
    return lines, unexpected


def failures(mode: str, merged: dict, limit: int = 3) -> list[str]:
    """The failing tests of a single-mode run (a --both run lists the regressions instead)."""
    bad = {n: t for n, t in merged["tests"].items() if t["outcome"] in BAD}
    lines = [f"failing {MODES[mode]}: {len(bad)}"]
    for nodeid, entry in sorted(bad.items()):
        lines.append(f"  {nodeid}  [{entry['outcome']}]")
        lines += [f"      | {ln}" for ln in _error_lines(entry, limit)]
    return lines


def save_durations(merged: dict, path: Path) -> int:
    """{node id: seconds} of the tests that passed: what the next run balances its shards with."""
    durations = {n: round(t["duration"], 2) for n, t in merged["tests"].items() if t["outcome"] in GOOD}
    path.write_text(json.dumps(durations, indent=0, sort_keys=True) + "\n")
    return len(durations)


# -- main -----------------------------------------------------------------------------------------


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--with-lock", dest="modes", action="store_const", const=["lock"], help="only with LockedTask")
    which.add_argument("--without-lock", dest="modes", action="store_const", const=["plain"], help="only the baseline")
    which.add_argument("--both", dest="modes", action="store_const", const=["plain", "lock"],
                       help="the baseline and the run with LockedTask, side by side, and compare (the default)")
    ap.add_argument("-k", help="pytest -k expression: only the tests it selects")
    ap.add_argument("--policy", choices=("retry", "skip", "raise"), default="retry",
                    help="on_duplicate of every LockedTask (default: retry)")
    ap.add_argument("--shards", type=int, default=3,
                    help="pytest processes per mode, run at once, each with its own redis-server and\n"
                         "test worker (default 3: the suite mostly waits, it uses ~3%% of a core)")
    ap.add_argument("--timeout", type=int, default=180,
                    help="pytest-timeout for each test the suite does not mark itself (default 180 s)")
    ap.add_argument("--max-minutes", type=float, default=20.0,
                    help="end a shard's pytest (its process group) after this long (default 20)")
    ap.add_argument("--no-reruns", action="store_true",
                    help="leave out pytest-rerunfailures: a @flaky test that fails is not run again")
    ap.add_argument("--save-durations", action="store_true",
                    help=f"store this run's test durations in {DURATIONS.name} (balances the shards)")
    ap.add_argument("--celery-version", help="the sdist to test (default: the celery installed in the venv)")
    ap.add_argument("--echo", action="store_true", help="also print pytest's output (prefixed by its shard)")
    ap.add_argument("pytest_args", nargs="*", help="after --: more pytest arguments")
    args = ap.parse_args(argv)
    args.modes = args.modes or ["plain", "lock"]
    if args.shards < 1:
        ap.error(f"--shards must be >= 1, got {args.shards}")
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    if not in_venv():
        py = ensure_venv()
        os.execv(str(py), [str(py), str(Path(__file__).resolve()), *argv])  # one process: signals reach it

    import celery

    version = args.celery_version or celery.__version__
    if version != celery.__version__:
        say(f"note: testing the celery {version} suite against the installed celery {celery.__version__}")
    suite = ensure_suite(version)
    run_dir = WORK / "runs" / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    say(f"celery {celery.__version__}; modes {args.modes}, {args.shards} shard(s) each, all at once; "
        f"policy {args.policy}; results in {run_dir}")
    say(f"each shard: cd {suite} && {shlex.join(['python', *pytest_command(args)[1:]])}")

    def stop(signum: int, _frame) -> None:
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)  # raised in the main thread, which then ends every shard (below)

    started = time.monotonic()
    shards = run_shards(args, suite, run_dir, started)
    return summarise(args, version, shards, run_dir, started)


def run_shards(args: argparse.Namespace, suite: Path, run_dir: Path, started: float) -> list[Shard]:
    """Every mode's shards at once, each in a thread; progress once a minute. On a signal or Ctrl-C,
    every shard's pytest is ended (then its redis-server), and the exception goes on."""
    shards = [Shard(mode, i, args.shards, suite, run_dir, args) for mode in args.modes for i in range(args.shards)]
    threads = [threading.Thread(target=shard.run, name=shard.name, daemon=True) for shard in shards]
    try:
        for thread in threads:
            thread.start()
            time.sleep(1)  # stagger the start-up (imports, the first worker fork)
        while any(t.is_alive() for t in threads):
            for thread in threads:
                thread.join(60)
                if not thread.is_alive():
                    continue
                progress = ", ".join(f"{m} {sum(s.done() for s in shards if s.mode == m)}" for m in args.modes)
                say(f"{(time.monotonic() - started) / 60:.0f} min: tests done: {progress}")
                break
    except BaseException:  # a signal or Ctrl-C: leave no pytest, worker or redis-server behind
        say("stopping: ending every shard's pytest, then its redis-server")
        for shard in shards:
            shard.abort()
        for thread in threads:
            thread.join(30)
        raise
    return shards


def summarise(args: argparse.Namespace, version: str, shards: list[Shard], run_dir: Path, started: float) -> int:
    """The summary (printed, and run_dir/summary.txt) and the exit status: 0, 1 (a regression or, in a single
    mode, a failure) or 2 (the run is in doubt)."""
    merged = {mode: merge([s for s in shards if s.mode == mode]) for mode in args.modes}
    report = [f"celery {version}; policy {args.policy}; -k {args.k or '(all)'}; {args.shards} shard(s) per mode; "
              f"wall time {(time.monotonic() - started) / 60:.1f} min; results in {run_dir}"]
    problems = []
    for mode in args.modes:
        report += describe(mode, merged[mode])
        problems += check_instrumentation(mode, merged[mode])
    if len(args.modes) == 2:
        lines, unexpected = compare(merged["plain"], merged["lock"], run_dir)
        report += lines
        code = 1 if unexpected else 0
    else:
        mode = args.modes[0]
        report += failures(mode, merged[mode])
        code = 1 if any(t["outcome"] in BAD for t in merged[mode]["tests"].values()) else 0
    if problems:
        report += [f"PROBLEM: {p}" for p in problems]
        code = 2
    n = save_durations(merged[args.modes[0]], run_dir / "durations.json")
    if args.save_durations and not problems:
        shutil.copy(run_dir / "durations.json", DURATIONS)
        report.append(f"stored the durations of {n} tests in {DURATIONS}")
    report.append(f"exit status {code}")
    (run_dir / "summary.txt").write_text("\n".join(report) + "\n")
    print("\n" + "=" * 30 + " celery integration summary " + "=" * 30)
    print("\n".join(report), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
