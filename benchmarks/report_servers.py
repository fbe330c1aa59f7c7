"""The report's sections on the lock servers: quorum mode, Sentinel and Redis Cluster, and the
footprint (what is left in the lock Redis after the tasks), with the footprint's goals."""

from __future__ import annotations

from typing import Any

from report_common import LABELS, _bytes, _f, _n, _table


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
