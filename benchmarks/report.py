"""Turning the measurements into the printed table, RESULTS.md, the chart and the goal verdicts."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import platform
import re
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from harness import Spread

ALL_VARIANTS = ["plain", "ours", "ours-join", "celery-once", "celery-singleton", "cookbook"]
PEERS = ["celery-once", "celery-singleton", "cookbook"]
LABELS = {
    "plain": "plain (no lock)",
    "ours": "ours (LockedTask)",
    "ours-join": 'ours, `lock_publish="join"` (checked at publish)',
    "celery-once": "celery-once (QueueOnce)",
    "celery-singleton": "celery-singleton (Singleton)",
    "cookbook": "cookbook (SET NX EX + token release)",
}


def importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def machine_meta(args: Any) -> dict[str, Any]:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = f"{int(line.split()[1]) / 1024 / 1024:.0f} GiB"
    except OSError:
        pass
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(["python3", "benchmarks/run.py", *args.argv]),
        "platform": platform.platform(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory": mem,
        "loadavg_start": os.getloadavg(),
        "python": platform.python_version(),
        "versions": {d: _version(d) for d in (
            "celery-singleton-lock", "celery", "kombu", "redis", "celery-once", "celery-singleton",
            "python-redis-lock", "matplotlib", "py-spy")},
    }


# -- summaries --------------------------------------------------------------------------


def summarize_interleaved(rounds: list[dict[str, Any]], variants: list[str]) -> dict[str, Any]:
    def spread(fn) -> dict[str, Any]:
        return Spread.of([fn(r) for r in rounds]).as_dict()

    out: dict[str, Any] = {"rounds": rounds, "per_variant": {}}
    for v in variants:
        out["per_variant"][v] = {
            "worker_us": spread(lambda r, v=v: r["worker_us"][v]),
            "extra_worker_us": spread(lambda r, v=v: r["worker_us"][v] - r["worker_us"]["plain"]),
            "publish_p50_us": spread(lambda r, v=v: r["publish_p50_us"][v]),
            "publish_p99_us": spread(lambda r, v=v: r["publish_p99_us"][v]),
            "extra_publish_us": spread(lambda r, v=v: r["publish_p50_us"][v] - r["publish_p50_us"]["plain"]),
            "extra_total_us": spread(lambda r, v=v: _total(r, v)),
            "worker_ratio": spread(lambda r, v=v: r["worker_us"][v] / r["worker_us"]["plain"]),
        }
    peers = [p for p in PEERS if p in variants]
    if peers and "ours" in variants:
        out["ours_vs_cheapest_peer"] = spread(
            lambda r: _total(r, "ours") / min(_total(r, p) for p in peers))
        out["cheapest_peer_per_round"] = [min(peers, key=lambda p, r=r: _total(r, p)) for r in rounds]
    return out


def _total(r: dict[str, Any], v: str) -> float:
    return (r["worker_us"][v] - r["worker_us"]["plain"]) + (r["publish_p50_us"][v] - r["publish_p50_us"]["plain"])


def scale_line(s: dict[str, Any]) -> str:
    return (f"held {s['held']}/{s['n']}, {s['threads']} threads, {s['cpu_core'] * 100:.1f}% of a core, "
            f"RSS {s['rss_mb']:.0f} MB, {s['round_trips_per_s']:.1f} renewal round trips/s "
            f"({s['evalsha_per_s']:.1f} EVALSHA/s)")


# -- profiling (run.py --profile) -----------------------------------------------------------

_Q = r"(?:^|;)(?:[\w<>]+\.)*"  # a frame's start: "Class.method (file:line)" or "func (file:line)"
PROFILE_FRAMES = [
    ("whole traced task (celery trace_task)", r"(?:^|;)[\w<>.]*trace_task \(celery/app/trace\.py"),
    ("LockedTask.before_start", _Q + r"before_start \(celery_singleton_lock/task\.py"),
    ("  keys.derive", _Q + r"derive \(celery_singleton_lock/keys\.py"),
    ("  config.server_for", _Q + r"server_for \(celery_singleton_lock/config\.py"),
    ("  LockServer.acquire", _Q + r"acquire \(celery_singleton_lock/lock\.py"),
    ("    socket wait", _Q + r"acquire \(celery_singleton_lock/lock\.py.*;SocketBuffer\._read_from_socket"),
    ("  Watchdog.track", _Q + r"track \(celery_singleton_lock/watchdog\.py"),
    ("  lock_acquired.send", _Q + r"before_start \(celery_singleton_lock/task\.py[^;]*;Signal\.send \("),
    ("LockedTask.release_lock", _Q + r"release_lock \(celery_singleton_lock/task\.py"),
    ("  Watchdog.forget", _Q + r"forget \(celery_singleton_lock/watchdog\.py"),
    ("  LockServer.release", _Q + r"release \(celery_singleton_lock/lock\.py"),
    ("    socket wait", _Q + r"release \(celery_singleton_lock/lock\.py.*;SocketBuffer\._read_from_socket"),
    ("  lock_released.send", _Q + r"release_lock \(celery_singleton_lock/task\.py[^;]*;Signal\.send \("),
]


def profile_worker(worker: Any, variants: dict[str, Any], n: int, out_dir: Path) -> dict[str, Any]:
    """Sample the solo worker (py-spy, idle included) while it drains n tasks of plain, then of ours.

    Per-task figures are normalised by the main thread's busy samples (all but
    the idle ``epoll.poll``): while the queue is full the worker is never idle,
    so busy samples cover exactly the drain, whatever py-spy's real rate.
    """
    spy = Path(sys.executable).parent / "py-spy"
    if not spy.exists():
        return {"error": "py-spy is not installed in this environment"}
    out: dict[str, Any] = {}
    for name in ("plain", "ours"):
        task = variants[name]
        worker.run_batch([(name, task)] * 20)  # warm
        raw = out_dir / f"profile-{name}.txt"
        spy_proc = subprocess.Popen(
            [str(spy), "record", "--pid", str(worker.pid), "--rate", "1000", "--format", "raw", "--idle",
             "--threads", "-o", str(raw)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        time.sleep(2.0)  # let py-spy attach while the worker idles
        records, _ = worker.run_batch([(name, task)] * n)
        time.sleep(0.2)
        spy_proc.send_signal(signal.SIGINT)
        spy_proc.wait(60)
        wall_per_task = (records[-1][2] - records[0][2]) / 1e3 / max(1, len(records) - 1)
        out[name] = _analyse_profile(raw, wall_per_task)
    return out


def _analyse_profile(raw: Path, wall_per_task_us: float) -> dict[str, Any]:
    if not raw.exists():
        return {"error": f"py-spy wrote no profile ({raw})"}
    stacks: list[tuple[str, str, int]] = []
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        thread, _, rest = stack.partition(";")
        stacks.append((thread, rest, int(count)))
    main_stacks = [(s, c) for t, s, c in stacks if t.endswith("MainThread")]
    busy = [(s, c) for s, c in main_stacks if not s.rsplit(";", 1)[-1].startswith("_epoll.poll ")]
    total = sum(c for _, c in busy)
    if not total:
        return {"error": "no busy samples of the main thread"}
    rows = []
    for label, pattern in PROFILE_FRAMES:
        rx = re.compile(pattern)
        hit = sum(c for s, c in busy if rx.search(s))
        rows.append({"what": label, "share": hit / total, "us_per_task": hit / total * wall_per_task_us})
    # the leaf functions inside our package's frames, by samples
    leaves: dict[str, int] = {}
    for s, c in busy:
        if "celery_singleton_lock/" in s:
            leaf = re.sub(r":\d+\)$", ")", s.rsplit(";", 1)[-1])  # per function, not per line
            leaves[leaf] = leaves.get(leaf, 0) + c
    top = sorted(leaves.items(), key=lambda kv: -kv[1])[:12]
    return {
        "samples": total, "wall_per_task_us": wall_per_task_us, "rows": rows,
        "top_leaves": [{"frame": f, "us_per_task": c / total * wall_per_task_us} for f, c in top],
    }


# -- rendering ------------------------------------------------------------------------------


def _f(x: float | None, digits: int = 0) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:,.{digits}f}"


def _s(spread: dict[str, Any], digits: int = 0, sign: bool = False) -> str:
    """median [min–max]"""
    fmt = ("{:+,.%sf}" if sign else "{:,.%sf}").replace("%s", str(digits))
    m, lo, hi = spread["median"], spread["min"], spread["max"]
    if m != m:
        return "–"
    if len(spread.get("values", [])) <= 1:
        return fmt.format(m)
    return f"{fmt.format(m)} [{fmt.format(lo)}…{fmt.format(hi)}]"


def _indent(text: str, spaces: int | None = None) -> str:
    """Leading spaces as non-breaking ones, so markdown keeps the nesting."""
    if spaces is None:
        spaces = len(text) - len(text.lstrip())
        text = text.strip()
    return "&nbsp;&nbsp;" * spaces + text


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _cmds(d: dict[str, float]) -> str:
    if not d:
        return "0"
    return ", ".join(f"{k} {v:g}" for k, v in sorted(d.items(), key=lambda kv: (-kv[1], kv[0])))


def render(results: dict[str, Any], smoke: bool) -> dict[str, str]:
    variants = results["variants"]
    inter = results["interleaved"]
    n_rounds = len(inter["rounds"])
    sections: dict[str, str] = {}

    fl = floor_figures(results)
    rows = []
    for v in variants:
        pv = inter["per_variant"][v]
        rows.append([
            LABELS.get(v, v), _s(pv["worker_us"]),
            "—" if v == "plain" else _s(pv["extra_worker_us"], sign=True),
            _s(pv["publish_p50_us"]), _s(pv["publish_p99_us"]),
            "—" if v == "plain" else _s(pv["extra_publish_us"], sign=True),
            "—" if v == "plain" else _s(pv["extra_total_us"], sign=True),
        ] + ([_s(fl["times_floor"][v], 2)] if fl else []))
    if fl:
        rows.append([
            "*floor: plain + 2 raw loopback round trips*", _s(fl["floor_us"]), f"+{fl['pair_us']:,.0f}",
            "—", "—", "—", f"+{fl['pair_us']:,.0f}", "1.00"])
    floor_note = ""
    if fl and "ours" in variants:
        floor_note = (
            f"\n\nThe floor: a lock that asks Redis twice per task cannot cost a worker less than plain Celery "
            f"plus two loopback round trips. Two raw round trips (a pre-packed PING on a plain socket, twice, "
            f"no client library; {results['floor']['n']:,} pairs in a fresh process, in "
            f"{results['floor'].get('batches', 1)} batches) take {fl['pair_us']:.1f} µs (the lowest batch p50; "
            f"all pairs: p50 {results['floor'].get('all_p50_us', fl['pair_us']):.1f} µs, p99 "
            f"{results['floor']['pair_us_p99']:.1f} µs). Ours costs "
            f"{_s(fl['times_floor']['ours'], 2)}× the floor per task on the worker; its extra over plain, "
            f"{_s(inter['per_variant']['ours']['extra_worker_us'], sign=True)} µs, is "
            f"{_s(fl['extra_times_pair']['ours'], 1)}× the two raw round trips."
        )
    sections["cost"] = (
        f"**Per-task cost** (µs; interleaved run, one solo worker, {n_rounds} round(s); "
        "median over rounds [min…max]; extras against plain from the same round"
        + ("; × floor = worker per task / (plain's + two raw round trips), per round" if fl else "") + ")\n\n"
        + _table(["variant", "worker per task", "extra worker", "publish p50", "publish p99",
                  "extra publish (p50)", "extra total"] + (["× floor"] if fl else []), rows)
        + floor_note
    )

    tp = results["throughput"]
    header = ["variant"]
    for pool in tp:
        header += [f"{pool} tasks/s", f"{pool} ratio"]
    rows = []
    for v in variants:
        row = [LABELS.get(v, v)]
        for pool in tp:
            row += [_s(tp[pool]["rate"][v]), _s(tp[pool]["ratio"][v], 2)]
        rows.append(row)
    sections["throughput"] = (
        f"**Throughput** (worker side: a queue of {tp[next(iter(tp))]['n']} tasks of one variant drained at a time, "
        f"variants alternated, {len(tp[next(iter(tp))]['rounds'])} round(s); ratio against plain from the same "
        "round; median [min…max])\n\n" + _table(header, rows)
    )

    cmd = results["commands"]
    rows = []
    for v in variants:
        c = cmd[v]
        rows.append([
            LABELS.get(v, v), _f(c["publish_rt"], 2), _cmds(c["publish_sent"]),
            _f(c["exec_rt"], 2), _cmds(c["exec_sent"]),
            _cmds(c["publish_server"]) + " / " + _cmds(c["exec_server"]),
            _f(c["publish_server_us"], 1) + " / " + _f(c["exec_server_us"], 1),
        ])
    ren = results["renewals"]
    sections["commands"] = (
        f"**Lock-server traffic per task** ({cmd[variants[0]]['n']} tasks per variant; round trips and "
        "commands sent = what clients sent, seen by MONITOR, but for the sweeper's look at the waiting "
        "index (an EVALSHA once a second per worker process, whatever the tasks do: "
        f"{cmd['ours'].get('exec_background', '?') if 'ours' in cmd else '?'} during ours' pass); server-side = "
        "INFO commandstats delta, which also counts the commands scripts run, the sweeper's too)\n\n"
        + _table(["variant", "publish round trips", "publish: sent", "execution round trips", "execution: sent",
                  "server-side commands (publish / execution)", "Redis time µs (publish / execution)"], rows)
        + redis_time_note(cmd, variants)
        + f"\n\nRenewals (bench.ours_sleep, lock_ttl {ren['ttl']:g} s, so TTL/3 = {ren['ttl'] / 3:.2f} s): "
        f"{ren['short']['tasks']} task(s) of {ren['short']['seconds']:g} s sent "
        f"{ren['short']['renewals']} renewal(s); {ren['long']['tasks']} task(s) of {ren['long']['seconds']:g} s "
        f"sent {ren['long']['renewals']} ({ren['long']['renewals_per_task']:g} per task)."
    )

    rows = []
    for s in results["scale"]:
        bound = f" (bound {s['bound_per_period']})" if s.get("bound_per_period") else ""
        extra = ""
        if s["impl"] != "ours":
            died = s.get("thread_errors") or {}
            failed = s.get("acquire_errors") or {}
            if died:
                extra += "; renewal threads died: " + ", ".join(f"{k} ×{v}" for k, v in died.items())
            if failed:
                extra += "; acquire failed: " + ", ".join(f"{k} ×{v}" for k, v in failed.items())
        rows.append([
            s["impl"], f"{s['n']:,}", f"{s['held']:,} / {s['n']:,}", str(s["threads"]), str(s["renewal_threads"]),
            _f(s["cpu_core"] * 100, 1) + " %", _f(s["rss_mb"], 0) + f" (+{_f(s['rss_growth_mb'], 0)})",
            _f(s["round_trips_per_s"], 1), _f(s["evalsha_per_s"], 1),
            _f(s["round_trips_per_period"], 1) + bound + extra,
        ])
    sc = results["scale"][0]
    sections["scale"] = (
        f"**Watchdog at scale** (N locks held in one fresh process for {sc['seconds']:.0f} s, ttl {sc['ttl']:g} s; "
        f"ours: tick {sc['tick']:g} s, chunk {sc['chunk']}, renewal period TTL/3; python-redis-lock: "
        "auto_renewal, a thread per lock, renewal every 2/3 of its whole-second expire, redis-py's default "
        "client and pool of 100 connections)\n\n"
        + _table(["impl", "N", "held at end", "threads", "renewal threads", "CPU (one core)", "RSS MB (growth)",
                  "renewal round trips/s", "EVALSHA/s on lock server", "round trips per renewal period"], rows)
    )

    rows = []
    for lo in results["lost"]:
        rows.append([f"{lo['ttl']:g} s", f"{lo['detected']} / {lo['trials']}", _f(lo["median_s"] * 1000, 0),
                     _f(lo["min_s"] * 1000, 0) + "…" + _f(lo["max_s"] * 1000, 0), _f(lo["bound_s"] * 1000, 0),
                     "yes" if lo["max_s"] is not None and lo["max_s"] <= lo["bound_s"] else "no"])
    sections["lost"] = (
        "**Lost-lock detection** (an outside DEL at a random point of the renewal period, until `.lost` is True; "
        "ms)\n\n" + _table(["lock ttl", "detected", "median", "min…max", "bound TTL/3 + tick", "within bound"], rows)
    )

    bd = results.get("breakdown", {})
    if "pieces" in bd:
        sections["breakdown"] = (
            f"**Our worker path, instrumented** (a solo worker running {bd['tasks']:,} LockedTask tasks with "
            "timers around each piece; µs of wall time, mean; indented pieces are inside the one above)\n\n"
            + _table(["piece", "µs per task", "calls per task", "µs per call"],
                     [[_indent(f"`{_piece(k)[0]}`", _piece(k)[1]), _f(v["us_per_task"], 1),
                       _f(v["calls_per_task"], 2),
                       _f(v["us_per_call"], 1)] for k, v in bd["pieces"].items()])
            + "\n\nRows are paths of callers: a piece met on two paths (`LockServer.run` in the acquire and in "
            "the release) is two rows. The second `LockedTask.release_lock` at the top level is the "
            "`task_postrun` safety net, a no-op once `__call__` has released."
        )
    micro = results["micro"]["micro_us"]
    sections["micro"] = (
        f"**Our per-task pieces, in isolation** (µs per call, {results['micro']['n']} calls, no Celery)\n\n"
        + _table(["piece", "µs"], [[k, _f(v, 1)] for k, v in micro.items()])
    )

    if "profile" in results:
        prof = results["profile"]
        parts = []
        for name in ("plain", "ours"):
            pr = prof.get(name, {})
            if "rows" not in pr:
                parts.append(f"{name}: {pr.get('error', 'no profile')}")
                continue
            parts.append(
                f"{name}: {pr['samples']} samples of the main thread, {pr['wall_per_task_us']:.0f} µs wall per task\n\n"
                + _table(["frame (inclusive, wall time incl. waits)", "µs per task", "share"],
                         [[_indent(r["what"]), _f(r["us_per_task"], 1), f"{r['share'] * 100:.1f} %"] for r in pr["rows"]
                          if name == "ours" or r["what"].startswith("whole")])
            )
            if name == "ours":
                parts.append("Leaf frames under our package (µs per task):\n\n" + _table(
                    ["leaf frame", "µs per task"],
                    [[f"`{x['frame']}`", _f(x["us_per_task"], 1)] for x in pr["top_leaves"]]))
        sections["profile"] = (
            "**Profile of the worker** (py-spy sampling a solo worker at 1 kHz, idle included; each sample "
            "stops the worker, which slows it, so read the shares rather than the absolute µs)\n\n"
            + "\n\n".join(parts))

    if "hot" in results:
        sections["hot"] = render_hot(results["hot"])
    if results.get("backlog"):
        import backlog  # benchmarks/ is on sys.path wherever the report is made

        sections["backlog"] = backlog.render(results["backlog"], _table)
    if "plain_handoff" in results:
        sections["plain_handoff"] = render_plain_handoff(results["plain_handoff"])
    if "footprint" in results:
        sections["footprint"] = render_footprint(results["footprint"])
    if "quorum" in results:
        sections["quorum"] = render_quorum(results["quorum"])
    if "topologies" in results:
        sections["topologies"] = render_topologies(results["topologies"])
    if results.get("capacity"):
        import capacity  # benchmarks/ is on sys.path wherever the report is made

        sections["capacity"] = capacity.render(results["capacity"], _table)

    if results.get("etcd"):
        import etcd_bench

        sections["etcd"] = etcd_bench.render(results["etcd"], _table)

    goals = evaluate_goals(results)
    sections["goals"] = "\n".join(
        f"- **{g['goal']}: {'MET' if g['met'] else 'NOT MET'}.** {g['figure']}" for g in goals)
    results["goals"] = goals

    order = ("cost", "throughput", "commands", "capacity", "hot", "backlog", "plain_handoff", "footprint", "quorum",
             "topologies", "etcd",
             "scale",
             "lost",
             "breakdown",
             "micro", "profile", "goals")
    console = "\n\n".join(sections[k] for k in order if k in sections)
    return {**sections, "console": console}


# -- the floor, Redis time, the breakdown's paths -------------------------------------------


def floor_figures(results: dict[str, Any]) -> dict[str, Any] | None:
    """Per round: plain's worker time + two raw round trips, and every variant as a multiple of it."""
    fl = results.get("floor")
    if not fl:
        return None
    pair = fl["pair_us_p50"]
    rounds = results["interleaved"]["rounds"]
    variants = results["variants"]
    return {
        "pair_us": pair,
        "floor_us": Spread.of([r["worker_us"]["plain"] + pair for r in rounds]).as_dict(),
        "times_floor": {v: Spread.of([r["worker_us"][v] / (r["worker_us"]["plain"] + pair) for r in rounds]).as_dict()
                        for v in variants},
        "extra_times_pair": {v: Spread.of([(r["worker_us"][v] - r["worker_us"]["plain"]) / pair for r in rounds])
                             .as_dict() for v in variants},
    }


def redis_time_note(cmd: dict[str, Any], variants: list[str]) -> str:
    """Ours against the cookbook: the server's own time for the commands each sends per task."""
    ours, book = cmd.get("ours"), cmd.get("cookbook")
    if not ours or "exec_server_us_by_cmd" not in ours:
        return ""

    def per_call(c: dict[str, Any], name: str) -> float:
        calls = c["exec_sent"].get(name, 0)
        return c["exec_server_us_by_cmd"].get(name, 0.0) / calls if calls else float("nan")

    mine = ", ".join(f"{k} {v:.1f}" for k, v in sorted(ours["exec_server_us_by_cmd"].items()))
    text = (f"\n\n**Redis time per task** (the server's `usec` in INFO commandstats for the commands sent at "
            f"execution; a script's includes the commands it runs): ours {ours['exec_server_us']:.1f} µs ({mine}; "
            f"EVALSHA {per_call(ours, 'EVALSHA'):.1f} µs per call)")
    if book and "exec_server_us_by_cmd" in book:
        parts = ", ".join(f"{k} {v:.1f}" for k, v in sorted(book["exec_server_us_by_cmd"].items()))
        ratio = ours["exec_server_us"] / book["exec_server_us"] if book["exec_server_us"] else float("nan")
        text += (f"; the cookbook {book['exec_server_us']:.1f} µs ({parts}): ours is {ratio:.1f}× the "
                 f"cookbook's, {ours['exec_server_us'] - book['exec_server_us']:+.1f} µs per task of Redis time")
    return text + "."


def server_work_goals(cmd: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 22's two rows of server work at execution: commands run (scripts' inner ones counted) and
    Redis time, ours against the cookbook's, from the commands pass."""
    ours, book = cmd.get("ours"), cmd.get("cookbook")
    if not ours or not book or "exec_server_us" not in ours:
        return []
    def per_task(c: dict[str, Any]) -> dict[str, float]:  # (not the sweeper's once-a-second look)
        return {k: v for k, v in c["exec_server"].items() if v >= 0.5}

    ran = sum(per_task(ours).values())
    ratio = ours["exec_server_us"] / book["exec_server_us"] if book["exec_server_us"] else float("nan")
    return [{
        "goal": "Commands per task at execution (≤ 5, counting those run inside scripts)",
        "met": ran <= 5.0 + 1e-9,
        "figure": (f"ours {ran:g} ({_cmds(per_task(ours))}); the cookbook {sum(per_task(book).values()):g} "
                   "(INFO commandstats over the pass, less the sweeper's looks at the waiting index, "
                   f"{ours.get('exec_server_background', '?')} in ours' pass; commands run at least every other "
                   "task)."),
    }, {
        "goal": "Redis time per task (≤ 1.5× the cookbook's)",
        "met": ratio <= 1.5,
        "figure": (f"ours {ours['exec_server_us']:.1f} µs, the cookbook {book['exec_server_us']:.1f} µs: "
                   f"{ratio:.2f}× (INFO commandstats usec of the commands sent at execution)."),
    }]


def _piece(key: str) -> tuple[str, int]:
    """A breakdown row's name and indent: "a > b > c" (a path) or "    c" (older runs: leading spaces)."""
    if " > " in key:
        parts = key.split(" > ")
        return parts[-1], 2 * (len(parts) - 1)
    return key.strip(), len(key) - len(key.lstrip())


def _n(count: int, noun: str) -> str:
    return f"{count:,} {noun}" + ("" if count == 1 else "s")


def _bytes(n: float | None) -> str:
    if n is None or n != n:
        return "–"
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= size:
            return f"{sign}{n / size:,.1f} {unit}"
    return f"{sign}{n:,.0f} B"


# -- hot keys, plain-code hand-off, footprint -------------------------------------------------

HOT_LABELS = {
    "ours-slot": 'ours, `on_duplicate="retry", lock_wait_in_slot=0.05` (woken in its worker slot)',
    "ours": 'ours, `on_duplicate="retry"` (parks at once, handed the key as a message)',
    "backoff": 'ours, `on_duplicate="backoff"` (the old polling policy, its defaults)',
    "rlock": "redis-py `Lock(timeout=30, sleep=0.1, blocking_timeout=…)` in a plain task",
    "plain": "plain Celery, no lock (bodies side by side in every slot): this machine's ceiling",
}
HOT_ORDER = {"ours": "park order (PARK)", "ours-slot": "park order (PARK)", "backoff": "first busy ACQUIRE",
             "rlock": "first SET NX"}


def _hot_wall(d: dict[str, Any]) -> str:
    if d["finished"]:
        return f"{d['wall_s']:.1f}"
    return f"did not finish in {d['cap_s']:g} s: {d['completed']:,} of {d['n']:,} done"


def render_hot(hot: dict[str, Any]) -> str:
    parts = []
    drains = hot.get("drain", {})
    if drains:
        first = next(iter(drains.values()))
        rows = []
        for v, d in drains.items():
            why = ", ".join(f"{k} {n:,}" for k, n in sorted(d["publishes_by_why"].items())) or "none"
            gap = d["gap_ms"]
            rows.append([
                HOT_LABELS.get(v, v), _hot_wall(d), _f(d.get("sustained"), 0), _f(d.get("rate"), 0),
                f"{d['publishes_worker']:,} ({why})", f"{d['duplicates']:,}",
                _f(d["publishes_per_duplicate"], 2), _f(d["lost"]) if d["lost"] is not None else "–",
                "– (no lock)" if v == "plain" else str(d["overlaps"]), str(d["ran_twice"]),
                (f"{d['in_order'] * 100:.1f} % of {d['waiters_ran']:,} (by {HOT_ORDER.get(v, '?')})"
                 if d["in_order"] is not None else "–"),
                f"{_f(gap['p50'], 1)} / {_f(gap['p99'], 1)}",
                _f(d["slot_wait_s"], 1),
            ])
        bound = 1.15 * first["ideal_s"] + 2
        parts.append(
            f"**Draining one hot key** ({first['n']:,} deductions on ONE key published at once, a "
            f"{first['body_s'] * 1000:g} ms body, {first['nodes']} worker nodes × prefork -c {first['concurrency']}, "
            f"Celery's defaults; serial ideal {first['ideal_s']:g} s, goal ≤ 1.15 × ideal + 2 s = {bound:.2f} s. "
            f"Wall = first publish → last body end: it includes the client's publishing of all "
            f"{first['n']:,} (about {first.get('publish_s') or 0:.1f} s) while the nodes are paused. Sustained = "
            f"bodies / (first body start → last body end); the goal of 400 bodies/s is judged on it. Plain "
            f"Celery with no lock, on the same nodes, shows this machine's ceiling. "
            f"Worker publishes = messages the workers sent to the broker "
            f"(hand-offs, back-off re-sends, …), beside the client's own {first['n']:,}. Duplicates = tasks that "
            f"found the key held. Order = share of waiters whose body started in the order they reached the lock "
            f"(from MONITOR, longest in-order run: for ours, the order Redis gave them their place in the line, "
            f"their last PARK but a copy's re-park at the head (a PARK that found the key free gave none); for "
            f"the others, the order Redis ran their first attempt). Slot-seconds = worker "
            f"slot time spent waiting for the lock.)\n\n"
            + _table(["variant", "wall s", "bodies/s sustained", "bodies/s over the wall",
                      "worker publishes (why)", "duplicates",
                      "publishes per duplicate",
                      "lost", "overlapping bodies", "ran twice", "in order", "release → next start p50 / p99 ms",
                      "slot-seconds waiting"], rows))
    for name in ("handoff_slot", "handoff"):
        h = hot.get(name)
        if not h:
            continue
        lat = h["latency_ms"]
        how = HOT_LABELS.get(h.get("variant", "ours"), "")
        parts.append(
            f"**Hand-off latency, {how}** (one worker node, prefork -c {h['concurrency']}: a gate task holds the key "
            f"until {h['n']:,} duplicates have parked, then the key goes down the line; from "
            f"the holder's body end (its release) to the next waiter's body start; {h['body_s'] * 1000:g} ms "
            "bodies; ms)\n\n"
            + _table(["stretch", "hand-offs", "p50", "p99", "max", "mean"],
                     [[label, f"{x['n']:,}", _f(x["p50"], 2), _f(x["p99"], 2), _f(x["max"], 2), _f(x["mean"], 2)]
                      for label, x in (
                          ("**release → next body start**", lat),
                          ("&nbsp;&nbsp;release → hand-off published (releasing process)",
                           h.get("release_to_publish_ms")),
                          ("&nbsp;&nbsp;published → next body start (broker, worker, claim)",
                           h.get("publish_to_start_ms")),
                          ("*baseline: Celery alone, publish → body start of a task with no lock*",
                           h.get("celery_dispatch_ms")),
                      ) if x])
            + f"\n\n{h['overlaps']} overlapping bodies; all ran on the one node: "
            f"{'yes' if h['on_one_node'] else 'no'}. The split is at the `after_task_publish` signal of the "
            "hand-off's message in the releasing process. The baseline is Celery's own dispatch on the same node "
            "(a plain task published by the harness, one at a time, its `apply_async` included): no hand-off "
            "can start a body sooner after its release than Celery starts one after a publish.")
    return "\n\n".join(parts)


PLAIN_HOW = {
    "ours": "`held(..., wait=…)`: parks in the key's line, BLPOP on its own wake-up list; the release hands it the key",
    "redis-py": "`Lock(sleep=0.1)`: SET NX, else sleep 0.1 s and try again",
    "python-redis-lock": "`redis_lock.Lock`: SET NX, else BLPOP on the lock's signal list (one waiter woken "
                         "per release)",
}


def render_plain_handoff(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    r0 = rows[0]
    return (
        f"**Plain-code hand-off** ({r0['procs']} processes queue on one key, each takes it once per round, "
        f"{r0['rounds']} rounds, {r0['hold_s'] * 1000:g} ms holds; from the holder leaving its block (just before "
        "its release) to the next holder entering its block; ms)\n\n"
        + _table(["lock", "how a waiter waits", "hand-offs", "p50", "p99", "max", "mean", "overlaps"],
                 [[r["impl"], PLAIN_HOW.get(r["impl"], ""), str(r["handoffs"]), _f(r["p50_ms"], 2),
                   _f(r["p99_ms"], 2), _f(r["max_ms"], 2), _f(r["mean_ms"], 2), str(r["overlaps"])] for r in rows]))


def _fp_cell(res: dict[str, Any], snap: dict[str, Any] | None) -> str:
    if snap is None:
        return "–"
    delta = snap["used_memory"] - res["baseline"]["used_memory"]
    return f"{_n(snap['keys'], 'key')}, {_bytes(snap['key_bytes'])}; Δ used_memory {_bytes(delta)}"


def footprint_line(res: dict[str, Any]) -> str:
    if "error" in res:
        return f"ERROR: {res['error']}"
    snap = res["snapshots"][0] if res["snapshots"] else None
    drain = f"{res.get('completed', 0):,} tasks drained in {_f(res.get('drain_s'), 1)} s"
    return drain + ("; at once: " + _fp_cell(res, snap) if snap else "")


def render_topologies(t: dict[str, Any]) -> str:
    """Issue 11: the lock per task on Sentinel and Cluster beside one Redis; the watchdog on the Cluster."""
    single = t["cost"].get("single", {}).get("p50_us")
    rows = [[name, f"{r['p50_us']:,.0f}", f"{r['p99_us']:,.0f}", f"{r['p50_us'] / single:.2f}x" if single else ""]
            for name, r in t["cost"].items()]
    sc = t["scale"]
    return (
        f"**Topologies** (µs of wall time of one acquire plus one release, what a task's lock costs, "
        f"{t['trials']:,} per setup, interleaved, in one client process; Sentinel: 1 master, 1 replica, 3 Sentinels; "
        "Cluster: 3 masters; all private redis-servers on this machine)\n\n"
        + _table(["setup", "p50", "p99", "against one Redis"], rows)
        + f"\n\n**The watchdog on the Cluster:** {sc['n']:,} locks (ttl {sc['ttl']:g} s) spread over "
        f"{sc['nodes']} masters, {sc['seconds']:.0f} s: {sc['held']:,} of {sc['n']:,} still held; "
        f"{sc['round_trips_per_period']:.1f} renewal round trips per period (one pipeline per node per round; "
        f"bound nodes × chunks = {sc['bound']}); {sc['cpu_core'] * 100:.1f}% of one core."
    )


def render_quorum(q: dict[str, Any]) -> str:
    """Quorum mode (issue 12): one server against Redlock quorums of 3 and 5 independent servers."""
    rows = [[name, f"{r['acquire_p50_us']:,.0f}", f"{r['acquire_p99_us']:,.0f}", f"{r['release_p50_us']:,.0f}",
             f"{r['release_p99_us']:,.0f}", f"{r['both_p50_us']:,.0f}"] for name, r in q["setups"].items()]
    single = q["setups"].get("single", {}).get("both_p50_us")
    goals = {"quorum N=3": 1.5, "quorum N=5": 2.0}  # issue 18

    def verdict(name: str, r: dict[str, Any]) -> str:
        ratio = r["both_p50_us"] / single
        goal = goals.get(name)
        met = "" if goal is None else f" (goal ≤ {goal:g}x: {'met' if ratio <= goal else 'NOT met'})"
        return f"{name}: {ratio:.2f}x the single server{met}"

    ratio = "; ".join(verdict(name, r) for name, r in q["setups"].items() if single and name != "single")
    return (
        f"**Quorum mode** (µs of wall time in one client process, {q['n']:,} acquire + release pairs per setup, "
        "interleaved; each server a private redis-server on this machine. Every operation goes to all members "
        "at once on one pipelined connection per member (no thread), and is decided as soon as a majority "
        "answered. An acquire is one fan-out when the members agree on the fencing token (they answer the "
        "client's proposal, kept within a second of their clocks, and keep it as their floor); only where they "
        "disagree is the token written back in a second fan-out. A release is one fan-out)\n\n"
        + _table(["setup", "acquire p50", "acquire p99", "release p50", "release p99", "both p50"], rows)
        + (f"\n\n{ratio}." if ratio else "")
    )


def render_footprint(fp: dict[str, Any]) -> str:
    labels = ["at once", *[f"after {w:g} s" for w in fp["waits"]]]
    rows = []
    for v, res in fp["variants"].items():
        snaps = {s["label"]: s for s in res["snapshots"]}
        last = res["snapshots"][-1] if res["snapshots"] else None
        left = ", ".join(f"`{k}` ×{n}" for k, n in sorted(last["shapes"].items(), key=lambda kv: -kv[1])[:3]) \
            if last and last["shapes"] else "nothing"
        per_k = f"{last['keys'] / res['n'] * 1000:.2f}" if last else "–"
        rows.append([LABELS.get(v, v) if v != "ours_late" else "ours (LockedTask, acks_late)",
                     res.get("expiry", ""), *[_fp_cell(res, snaps.get(lb)) for lb in labels], per_k, left]
                    + ([f"ERROR: {res['error']}"] if "error" in res else []))
    scripts = "; ".join(
        f"{v} {_bytes(res['snapshots'][-1]['scripts'] - res['baseline']['scripts'])}"
        for v, res in fp["variants"].items() if res["snapshots"])
    return (
        f"**Footprint** ({fp['n']:,} tasks per variant, each on a distinct key, early acks unless said; every "
        f"variant on a lock redis-server of its own, all at once; looked at when its worker had finished and "
        f"stopped, then after {', '.join(f'{w:g} s' for w in fp['waits']) or 'no wait (smoke run)'} on each "
        f"variant's own clock. Keys = DBSIZE; their bytes = MEMORY USAGE of up to {200} leftover keys, scaled to "
        f"all; Δ used_memory against the empty server before the run (it includes the scripts loaded, and "
        f"the 0.1–0.3 MB that Redis keeps after many commands and connections whatever is left: buffers and "
        f"allocator state; it means something only well above that). "
        f"ours (acks_late) runs with `singleton_lock_redelivery_window = {fp['window']:g}` s for this run, so its "
        f"done records are gone after that window.)\n\n"
        + _table(["variant", "what expires", *labels, "keys per 1,000 tasks at the end", "left at the end"], rows)
        + f"\n\nScript cache in used_memory at the end: {scripts}."
    )


# -- the goals (issues 5 and 9, "Hot keys", "The cheapest lock per task") ------------------


def evaluate_goals(results: dict[str, Any]) -> list[dict[str, Any]]:
    goals = []
    variants = results["variants"]
    c = results["commands"]["ours"]
    ren = results["renewals"]
    # (MONITOR tells one write from two round trips by timing (Monitor.round_trips: 100 µs); a server
    # preempted between two commands of one write splits it in the count, so a split in 1 task in 100 or
    # fewer is taken as that, not as a round trip more)
    exec_ok = round(c["exec_rt"], 1) == 2
    split = c["exec_rt"] != 2 and exec_ok
    pub_ok = c["publish_rt"] == 0
    renew_ok = ren["short"]["renewals"] == 0 and ren["long"]["renewals"] >= ren["long"]["tasks"]
    goals.append({
        "goal": "Round trips (still exactly 2 lock-server round trips per uncontended task, and 0 at publish)",
        "met": exec_ok and pub_ok and renew_ok,
        "figure": (f"ours takes {c['exec_rt']:g} lock-server round trips per task at execution (sent: "
                   f"{_cmds(c['exec_sent'])}"
                   + ("; MONITOR split a pipelined write in its count where the server paused between its "
                      "commands" if split else "") + "), "
                   f"{c['publish_rt']:g} at publish; tasks shorter than TTL/3 sent {ren['short']['renewals']} "
                   f"renewals, tasks longer sent {ren['long']['renewals_per_task']:g} each."),
    })

    goals += server_work_goals(results["commands"])

    inter = results["interleaved"]
    if "ours_vs_cheapest_peer" in inter:
        ratio = inter["ours_vs_cheapest_peer"]
        ours_total = inter["per_variant"]["ours"]["extra_total_us"]
        peers = [p for p in PEERS if p in variants]
        cheapest = min(peers, key=lambda p: inter["per_variant"][p]["extra_total_us"]["median"])
        ct = inter["per_variant"][cheapest]["extra_total_us"]
        goals.append({
            "goal": "Total cost (issue 9: extra cost per task, worker + publish, ≤ 0.75x the cheapest peer's, "
                    "in every round)",
            "met": ratio["max"] <= 0.75,
            "figure": (f"ours {_s(ours_total, sign=True)} µs per task (worker + publish p50) against the cheapest "
                       f"peer, {cheapest}, {_s(ct, sign=True)} µs: ours / cheapest peer per round = "
                       f"{_s(ratio, 2)} (median [min…max]; every round must be ≤ 0.75)."),
        })
        fl = floor_figures(results)
        if fl:
            times = fl["times_floor"]["ours"]
            goals.append({
                "goal": "Total cost (issue 22: ≤ 0.85x the cheapest peer's in every round, and × floor ≤ 1.25 "
                        "in every round)",
                "met": ratio["max"] <= 0.85 and times["max"] <= 1.25,
                "figure": (f"ours / {cheapest} per round = {_s(ratio, 2)}"
                           f" ({'every round ≤ 0.85' if ratio['max'] <= 0.85 else 'a round above 0.85'}); "
                           f"ours × floor per round = {_s(times, 2)}"
                           f" ({'every round ≤ 1.25' if times['max'] <= 1.25 else 'a round above 1.25'}); "
                           "median [min…max]."),
            })
    else:
        goals.append({"goal": "Total cost", "met": False, "figure": "no peer measured (smoke run?)"})

    tp = results["throughput"]
    parts, ok = [], True
    for pool, t in tp.items():
        r = t["ratio"]["ours"]
        ok = ok and r["median"] >= 0.90
        parts.append(f"{pool} {_s(r, 2)}")
    goals.append({"goal": "Throughput (≥ 0.90x plain, median ratio)", "met": ok,
                  "figure": "ours / plain: " + "; ".join(parts) + "."})

    big = max((s for s in results["scale"] if s["impl"] == "ours"), key=lambda s: s["n"])
    per_period_ok = big["round_trips_per_period"] <= big["bound_per_period"]
    wd_ok = (big["held"] == big["n"] and big["renewal_threads"] == 1 and per_period_ok and big["cpu_core"] < 0.05)
    goals.append({
        "goal": f"Watchdog at {big['n']:,} held locks for {big['seconds']:.0f} s",
        "met": wd_ok and big["n"] >= 10000,
        "figure": (f"{big['held']:,} of {big['n']:,} still held; {big['renewal_threads']} renewal thread "
                   f"({big['threads']} threads in the process); {big['round_trips_per_period']:.1f} round trips "
                   f"({big['evalsha_per_period']:.1f} EVALSHA) per renewal period of {big['ttl'] / 3:g} s, bound "
                   f"ceil({big['n']:,} / chunk {big['chunk']}) = {big['bound_per_period']}; "
                   f"{big['cpu_core'] * 100:.1f}% of one core on average (target < 5%)."),
    })

    lost = results["lost"]
    goals.append({
        "goal": "Lost-lock detection (within TTL/3 plus one tick)",
        "met": all(lo["max_s"] is not None and lo["max_s"] <= lo["bound_s"] and lo["detected"] == lo["trials"]
                   for lo in lost),
        "figure": "; ".join(
            f"TTL {lo['ttl']:g} s: max {_f(lo['max_s'] * 1000)} ms, median {_f(lo['median_s'] * 1000)} ms, "
            f"bound {_f(lo['bound_s'] * 1000)} ms" for lo in lost) + ".",
    })
    if "hot" in results:
        goals += hot_goals(results["hot"])
    if results.get("backlog"):
        import backlog

        goals += backlog.goals(results["backlog"])
    if "footprint" in results:
        goals += footprint_goals(results["footprint"])
    if results.get("capacity"):
        import capacity

        goals += capacity.goals(results["capacity"])
    if results.get("etcd"):
        import etcd_bench

        goals += etcd_bench.goals(results["etcd"])
    return goals


def hot_goals(hot: dict[str, Any]) -> list[dict[str, Any]]:
    """The hot key's goals: the fast path (``ours-slot``) judged, the plain park shown beside it."""
    goals = []
    drains = hot.get("drain", {})
    d = drains.get("ours-slot") or drains.get("ours")

    def wall(o: dict[str, Any]) -> str:
        return (f"{_f(o.get('sustained'), 0)} bodies/s sustained (wall {o['wall_s']:.2f} s, publishing included: "
                f"{_f(o.get('rate'), 0)} bodies/s)" if o["finished"]
                else f"did not finish in {o['cap_s']:g} s ({o['completed']:,} of {o['n']:,} done)")

    others = "; ".join(f"{HOT_LABELS.get(v, v)}: {wall(o)}" + (
        f", {_f(o['slot_wait_s'], 1)} worker-slot seconds spent waiting" if v == "rlock" else "")
        for v, o in drains.items() if o is not d)
    if d is not None:
        rate = d.get("sustained")
        goals.append({
            "goal": "Hot key (≥ 400 bodies/s sustained over 2,000 × 1 ms on one key, 2 nodes × prefork -c 2)",
            "met": bool(d["finished"] and rate is not None and rate >= 400),
            "figure": (f"{HOT_LABELS.get(d['variant'], d['variant'])}: {d['n']:,} deductions × "
                       f"{d['body_s'] * 1000:g} ms, {d['nodes']} nodes × prefork -c {d['concurrency']}: {wall(d)}, "
                       f"{d['slot_wait_s']:.1f} worker-slot seconds spent waiting"
                       + (f" (side by side: {others})." if others else ".")),
        })
        goals.append({
            "goal": "Hot-key exactness (0 lost, 0 overlapping bodies, 0 run twice)",
            "met": all(o["lost"] == 0 and o["overlaps"] == 0 and o["ran_twice"] == 0
                       for v, o in drains.items() if v.startswith("ours")),
            "figure": "; ".join(f"{v}: {o['completed']:,} of {o['n']:,} bodies ran ({o['lost']} lost, "
                                f"{o['ran_twice']} twice), {o['overlaps']} overlapping"
                                for v, o in drains.items() if v.startswith("ours")) + ".",
        })
        # the order is read over the waiters: those that parked (their duplicate_skipped record), and for
        # ours-slot every PARK (a wait in the worker slot is one too); a variant with none has no order here
        ordered = {v: o for v, o in drains.items() if v.startswith("ours") and o["waiters_ran"]}
        goals.append({
            "goal": "Hot-key order (≥ 99% of waiters start in the order they parked)",
            "met": bool(ordered) and all(o["in_order"] is not None and o["in_order"] >= 0.99
                                         for o in ordered.values()),
            "figure": "; ".join(f"{v}: {_f((o['in_order'] or 0) * 100, 1)} % of {o['waiters_ran']:,} waiters"
                                for v, o in ordered.items())
                      + " started in the order Redis ran their PARK (longest in-order run)"
                      + "".join(f"; {v}: no waiter parked (each was woken in its worker slot), so no order is "
                                "measured for it here" for v, o in drains.items()
                                if v.startswith("ours") and not o["waiters_ran"]) + ".",
        })
        ppd = d["publishes_worker"] / d["duplicates"] if d["duplicates"] else None
        goals.append({
            "goal": "Hot-key broker publishes (≤ 1.1 per duplicate)",
            "met": d["publishes_worker"] <= 1.1 * max(d["duplicates"], 1),
            "figure": (f"the workers published {d['publishes_worker']:,} messages for {d['duplicates']:,} parked "
                       f"duplicates" + (f" = {_f(ppd, 3)} per duplicate" if ppd is not None else "")
                       + f", beside the client's own {d['publishes_client']:,}."),
        })
    h, plain = hot.get("handoff_slot") or hot.get("handoff"), hot.get("handoff") if hot.get("handoff_slot") else None
    if h:
        lat = h["latency_ms"]
        goals.append({
            "goal": "Hand-off latency (release → next waiter's body start, one node: p50 ≤ 1.5 ms, p99 ≤ 10 ms)",
            "met": lat["p50"] is not None and lat["p50"] <= 1.5 and lat["p99"] <= 10,
            "figure": (f"{HOT_LABELS.get(h.get('variant', 'ours'), '')}: p50 {_f(lat['p50'], 2)} ms, p99 "
                       f"{_f(lat['p99'], 2)} ms, max {_f(lat['max'], 2)} ms over {lat['n']:,} hand-offs"
                       + (f"; parking at once: p50 {_f(plain['latency_ms']['p50'], 2)} ms, p99 "
                          f"{_f(plain['latency_ms']['p99'], 2)} ms" if plain else "")
                       + (f"; Celery's own publish → body start on the same node: "
                          f"p50 {_f(h['celery_dispatch_ms']['p50'], 2)} ms" if h.get("celery_dispatch_ms") else "")
                       + "."),
        })
    return goals


def footprint_goals(fp: dict[str, Any]) -> list[dict[str, Any]]:
    goals = []
    waits = fp["waits"]
    for v, goal in (("ours", "Footprint, early ack (≤ 1 key per 1,000 tasks after 2 minutes)"),
                    ("ours_late", "Footprint, acks_late (bounded by the redelivery window)")):
        res = fp["variants"].get(v)
        if res is None:
            continue
        snaps = res["snapshots"]
        end = snaps[-1] if snaps else None
        first = snaps[0] if snaps else None
        if "error" in res or end is None:
            goals.append({"goal": goal, "met": False, "figure": f"not measured: {res.get('error', 'no look')}."})
            continue
        if not waits or max(waits) < 120 or (v == "ours_late" and max(waits) <= fp["window"]):
            goals.append({"goal": goal, "met": False, "figure": (
                f"not measured: this run looked only {', '.join(s['label'] for s in snaps)} "
                f"({_n(end['keys'], 'key')} left for {res['n']:,} tasks then).")})
            continue
        per_k = end["keys"] / res["n"] * 1000
        if v == "ours":
            goals.append({"goal": goal, "met": per_k <= 1.0, "figure": (
                f"{_n(end['keys'], 'key')} left after {end['after_s']:g} s for {res['n']:,} tasks = {per_k:.2f} per "
                f"1,000 ({_bytes(end['key_bytes'])}); at once {first['keys']:,}.")})
        else:
            bounded = first["keys"] <= res["n"] + 5 and per_k <= 1.0
            goals.append({"goal": goal, "met": bounded, "figure": (
                f"at once {_n(first['keys'], 'key')} ({_bytes(first['key_bytes'])}) for {res['n']:,} tasks: one done "
                f"record per task, kept for the window of {fp['window']:g} s (set for this run); after "
                f"{end['after_s']:g} s {end['keys']:,} left = {per_k:.2f} per 1,000.")})
    return goals


# -- outputs -----------------------------------------------------------------------------------


def draw_chart(results: dict[str, Any], path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed here: no chart"
    inter = results["interleaved"]["per_variant"]
    names = [v for v in results["variants"] if v != "plain"]
    worker = [inter[v]["extra_worker_us"]["median"] for v in names]
    publish = [inter[v]["extra_publish_us"]["median"] for v in names]
    total = [inter[v]["extra_total_us"] for v in names]
    from matplotlib.patches import Patch

    fig, ax = plt.subplots(figsize=(9, 5.0), dpi=120)
    ys = list(range(len(names)))[::-1]
    colors = ["#2a9d8f" if v == "ours" else "#8d99ae" for v in names]
    ax.barh(ys, worker, color=colors)
    ax.barh(ys, publish, left=[max(w, 0) for w in worker], color=colors, alpha=0.45, hatch="//")
    for y, t in zip(ys, total, strict=False):
        lo, hi, m = t["min"], t["max"], t["median"]
        ax.errorbar([m], [y], xerr=[[m - lo], [hi - m]], fmt="o", color="black", ms=3, capsize=3, lw=1)
        ax.text(max(hi, m) + 8, y, f"{m:,.0f} µs", va="center", fontsize=9)
    ax.set_yticks(ys)
    ax.set_yticklabels([LABELS.get(v, v) for v in names])
    plain = inter["plain"]["worker_us"]["median"]
    ax.set_xlabel(f"extra µs per task over plain Celery (plain: {plain:,.0f} µs per task on the worker)")
    # two short lines: one long line ran past the figure's right edge
    ax.set_title("Extra cost per task of each lock, worker + publish\n"
                 "(bars: medians; dot and whiskers: total, min–max over the rounds)", fontsize=10)
    ax.axvline(0, color="black", lw=0.8)
    fl = results.get("floor")
    handles = []
    if fl:
        pair = fl["pair_us_p50"]
        ax.axvline(pair, color="#e76f51", lw=1, ls="--")
        from matplotlib.lines import Line2D

        handles.append(Line2D([0], [0], color="#e76f51", lw=1, ls="--",
                              label=f"floor: two raw loopback round trips ({pair:,.0f} µs)"))
    right = max(max(t["max"] for t in total), 1) * 1.18 + 40
    ax.set_xlim(min(0, min(t["min"] for t in total)) * 1.1, right)
    ax.legend(handles=[Patch(color="#8d99ae", label="extra worker time (interleaved run, solo worker)"),
                       Patch(facecolor="#8d99ae", alpha=0.45, hatch="//",
                             label="extra publish time (apply_async p50)"), *handles],
              loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=8, frameon=False)
    meta = results["meta"]
    fig.text(0.01, 0.01, f"{meta['date']}, {meta['cores']} cores, Celery {meta['versions']['celery']}, "
             f"redis-py {meta['versions']['redis']}, Redis {meta.get('redis_server', '?')}",
             fontsize=7, color="#555")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path)
    plt.close(fig)
    return None


def write_outputs(results: dict[str, Any], text: dict[str, str], out_dir: Path, official: bool,
                  bench_dir: Path) -> None:
    raw = json.dumps(results, indent=1, default=str)
    (out_dir / "results.json").write_text(raw)
    if official:  # kept beside RESULTS.md, so `run.py --rerender benchmarks/results.json` can redo it
        (bench_dir / "results.json").write_text(raw)
    chart = bench_dir / "cost.png" if official else out_dir / "cost.png"
    note = draw_chart(results, chart)
    md_path = bench_dir / "RESULTS.md" if official else out_dir / "RESULTS.md"
    md_path.write_text(results_markdown(results, text, chart_note=note, chart_name=chart.name))
    print(f"[bench] wrote {md_path}" + (f" and {chart}" if note is None else f" ({note})"), flush=True)


NOTES_FILE = "NOTES.md"


def results_markdown(results: dict[str, Any], text: dict[str, str], chart_note: str | None, chart_name: str) -> str:
    meta = results["meta"]
    v = meta["versions"]
    la0, la1 = meta["loadavg_start"], meta["loadavg_end"]
    parts = [
        "# Benchmark results",
        "",
        "Written by the benchmark run itself (`benchmarks/run.py`): do not edit by hand; re-run instead.",
        "",
        f"- **Date:** {meta['date']}; the run took {meta['duration_s']:.0f} s.",
        f"- **Command:** `{meta['command']}` (what `python3 dev.py bench` runs).",
        f"- **Machine:** {meta['cpu'] or 'unknown CPU'}, {meta['cores']} cores, {meta['memory']}; "
        f"{meta['platform']}; load average {la0[0]:.2f} at the start, {la1[0]:.2f} at the end"
        + (" (a shared machine: other jobs were running)." if max(la0[0], la1[0]) > 1.0 else "."),
        f"- **Versions:** Python {meta['python']}, celery-singleton-lock {v['celery-singleton-lock']}, "
        f"Celery {v['celery']}, kombu {v['kombu']}, redis-py {v['redis']}, Redis server {meta.get('redis_server')}; "
        f"peers: celery-once {v['celery-once']}, celery-singleton {v['celery-singleton']}, "
        f"python-redis-lock {v['python-redis-lock']}.",
        "",
        "## Goals",
        "",
        text["goals"],
        "",
        "## Per-task cost",
        "",
        f"![per-task cost by variant]({chart_name})" if chart_note is None else f"({chart_note})",
        "",
        text["cost"],
        "",
        "## Throughput (secondary)",
        "",
        text["throughput"],
        "",
        "## Lock-server commands and round trips",
        "",
        text["commands"],
        "",
    ]
    for key, title in (("capacity", "Capacity: locked tasks per Redis core"),
                       ("hot", "Hot keys: many tasks on one key"), ("backlog", "Hot key under a backlog"),
                       ("plain_handoff", "Plain-code hand-off"),
                       ("quorum", "Quorum mode"), ("topologies", "Sentinel and Redis Cluster"),
                       ("footprint", "Footprint: what is left in the lock Redis"),
                       ("etcd", "etcd against Redis")):
        if text.get(key):
            parts += [f"## {title}", "", text[key], ""]
    parts += [
        "## Watchdog at scale",
        "",
        text["scale"],
        "",
        "## Lost-lock detection",
        "",
        text["lost"],
        "",
        "## Where our per-task time goes",
        "",
        text.get("breakdown", ""),
        "",
        text["micro"],
    ]
    if "profile" in text:
        parts += ["", text["profile"]]
    notes = Path(__file__).resolve().parent / NOTES_FILE
    if notes.exists():
        parts += ["", notes.read_text().strip()]
    return "\n".join(parts) + "\n"
