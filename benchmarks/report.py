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

ALL_VARIANTS = ["plain", "ours", "celery-once", "celery-singleton", "cookbook"]
PEERS = ["celery-once", "celery-singleton", "cookbook"]
LABELS = {
    "plain": "plain (no lock)",
    "ours": "ours (LockedTask)",
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

    rows = []
    for v in variants:
        pv = inter["per_variant"][v]
        rows.append([
            LABELS.get(v, v), _s(pv["worker_us"]),
            "—" if v == "plain" else _s(pv["extra_worker_us"], sign=True),
            _s(pv["publish_p50_us"]), _s(pv["publish_p99_us"]),
            "—" if v == "plain" else _s(pv["extra_publish_us"], sign=True),
            "—" if v == "plain" else _s(pv["extra_total_us"], sign=True),
        ])
    sections["cost"] = (
        f"**Per-task cost** (µs; interleaved run, one solo worker, {n_rounds} round(s); "
        "median over rounds [min…max]; extras against plain from the same round)\n\n"
        + _table(["variant", "worker per task", "extra worker", "publish p50", "publish p99",
                  "extra publish (p50)", "extra total"], rows)
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
        "commands sent = what clients sent, seen by MONITOR; server-side = INFO commandstats delta, "
        "which also counts the commands scripts run)\n\n"
        + _table(["variant", "publish round trips", "publish: sent", "execution round trips", "execution: sent",
                  "server-side commands (publish / execution)", "Redis time µs (publish / execution)"], rows)
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
                     [[_indent(f"`{k.strip()}`", len(k) - len(k.lstrip())), _f(v["us_per_task"], 1),
                       _f(v["calls_per_task"], 2),
                       _f(v["us_per_call"], 1)] for k, v in bd["pieces"].items()])
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

    goals = evaluate_goals(results)
    sections["goals"] = "\n".join(
        f"- **{g['goal']}: {'MET' if g['met'] else 'NOT MET'}.** {g['figure']}" for g in goals)
    results["goals"] = goals

    order = ("cost", "throughput", "commands", "scale", "lost", "breakdown", "micro", "profile", "goals")
    console = "\n\n".join(sections[k] for k in order if k in sections)
    return {**sections, "console": console}


# -- the goals of issue 5 ------------------------------------------------------------------


def evaluate_goals(results: dict[str, Any]) -> list[dict[str, Any]]:
    goals = []
    variants = results["variants"]
    c = results["commands"]["ours"]
    ren = results["renewals"]
    exec_ok = c["exec_rt"] == 2 and c["exec_sent"] == {"EVALSHA": 2.0}
    pub_ok = c["publish_rt"] == 0
    renew_ok = ren["short"]["renewals"] == 0 and ren["long"]["renewals"] >= ren["long"]["tasks"]
    goals.append({
        "goal": "Round trips",
        "met": exec_ok and pub_ok and renew_ok,
        "figure": (f"ours sends {c['exec_rt']:g} lock-server commands per task at execution ({_cmds(c['exec_sent'])}), "
                   f"{c['publish_rt']:g} at publish; tasks shorter than TTL/3 sent {ren['short']['renewals']} "
                   f"renewals, tasks longer sent {ren['long']['renewals_per_task']:g} each."),
    })

    inter = results["interleaved"]
    if "ours_vs_cheapest_peer" in inter:
        ratio = inter["ours_vs_cheapest_peer"]
        ours_total = inter["per_variant"]["ours"]["extra_total_us"]
        peers = [p for p in PEERS if p in variants]
        cheapest = min(peers, key=lambda p: inter["per_variant"][p]["extra_total_us"]["median"])
        ct = inter["per_variant"][cheapest]["extra_total_us"]
        goals.append({
            "goal": "Total cost (at most half the cheapest peer's)",
            "met": ratio["median"] <= 0.5,
            "figure": (f"ours {_s(ours_total, sign=True)} µs per task (worker + publish p50) against the cheapest "
                       f"peer, {cheapest}, {_s(ct, sign=True)} µs: ours / cheapest peer per round = "
                       f"{_s(ratio, 2)} (median [min…max], target ≤ 0.50)."),
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

    fig, ax = plt.subplots(figsize=(9, 4.6), dpi=120)
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
    ax.set_title("Per-task cost of each lock, worker + publish (bars: medians; dot and whiskers: total, min–max)",
                 fontsize=10)
    ax.axvline(0, color="black", lw=0.8)
    right = max(max(t["max"] for t in total), 1) * 1.18 + 40
    ax.set_xlim(min(0, min(t["min"] for t in total)) * 1.1, right)
    ax.legend(handles=[Patch(color="#8d99ae", label="extra worker time (interleaved run, solo worker)"),
                       Patch(facecolor="#8d99ae", alpha=0.45, hatch="//",
                             label="extra publish time (apply_async p50)")],
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
        "## Goals (issue 5)",
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
