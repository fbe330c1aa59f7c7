"""Turning the measurements into the printed table, RESULTS.md, the chart and the goal verdicts.

The sections are made in report_sections.py (the per-task cost), report_hot.py (hot keys and
hand-offs) and report_servers.py (quorum, topologies, footprint); the verdicts in report_goals.py;
what they share in report_common.py. This module puts them together and writes the outputs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from harness import Spread
from report_common import LABELS, PEERS, _table
from report_goals import evaluate_goals
from report_hot import render_hot, render_plain_handoff
from report_sections import (
    render_breakdown,
    render_commands,
    render_cost,
    render_lost,
    render_micro,
    render_profile,
    render_scale,
    render_throughput,
)
from report_servers import render_footprint, render_quorum, render_topologies


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
            "python-redis-lock", "etcd3gw", "matplotlib", "py-spy")},
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



# -- rendering ------------------------------------------------------------------------------


def render(results: dict[str, Any], smoke: bool) -> dict[str, str]:
    sections: dict[str, str] = {
        "cost": render_cost(results),
        "throughput": render_throughput(results),
        "commands": render_commands(results),
        "scale": render_scale(results),
        "lost": render_lost(results),
    }
    breakdown = render_breakdown(results)
    if breakdown is not None:
        sections["breakdown"] = breakdown
    sections["micro"] = render_micro(results)
    if "profile" in results:
        sections["profile"] = render_profile(results["profile"])
    sections.update(_phase_sections(results))

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


def _phase_sections(results: dict[str, Any]) -> dict[str, str]:
    """The later phases' sections, each where its phase ran."""
    sections: dict[str, str] = {}
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
    return sections


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
    parts = [
        *_header(results["meta"]),
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


def _header(meta: dict[str, Any]) -> list[str]:
    """RESULTS.md's title and the run's facts: date, command, machine, versions."""
    v = meta["versions"]
    la0, la1 = meta["loadavg_start"], meta["loadavg_end"]
    return [
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
    ]
