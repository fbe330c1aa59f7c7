"""The goals' verdicts (issues 5, 9 and 22, "Hot keys", "The cheapest lock per task"): each goal, met or
not, with the figure it was judged on; RESULTS.md lists them first."""

from __future__ import annotations

from typing import Any

from report_common import PEERS, _cmds, _f, _s, floor_figures
from report_hot import hot_goals
from report_servers import footprint_goals


def evaluate_goals(results: dict[str, Any]) -> list[dict[str, Any]]:
    goals = [_round_trip_goal(results)]
    goals += server_work_goals(results["commands"])
    goals += _cost_goals(results)
    goals.append(_throughput_goal(results))
    goals.append(_watchdog_goal(results))
    goals.append(_lost_goal(results))
    goals += _phase_goals(results)
    return goals


def _round_trip_goal(results: dict[str, Any]) -> dict[str, Any]:
    c = results["commands"]["ours"]
    ren = results["renewals"]
    # (MONITOR tells one write from two round trips by timing (Monitor.round_trips: 100 µs); a server
    # preempted between two commands of one write splits it in the count, so a split in 1 task in 100 or
    # fewer is taken as that, not as a round trip more)
    exec_ok = round(c["exec_rt"], 1) == 2
    split = c["exec_rt"] != 2 and exec_ok
    pub_ok = c["publish_rt"] == 0
    renew_ok = ren["short"]["renewals"] == 0 and ren["long"]["renewals"] >= ren["long"]["tasks"]
    return {
        "goal": "Round trips (still exactly 2 lock-server round trips per uncontended task, and 0 at publish)",
        "met": exec_ok and pub_ok and renew_ok,
        "figure": (f"ours takes {c['exec_rt']:g} lock-server round trips per task at execution (sent: "
                   f"{_cmds(c['exec_sent'])}"
                   + ("; MONITOR split a pipelined write in its count where the server paused between its "
                      "commands" if split else "") + "), "
                   f"{c['publish_rt']:g} at publish; tasks shorter than TTL/3 sent {ren['short']['renewals']} "
                   f"renewals, tasks longer sent {ren['long']['renewals_per_task']:g} each."),
    }


def _cost_goals(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Ours' extra cost per task against the cheapest peer's (issues 9 and 22), and against the floor."""
    goals = []
    variants = results["variants"]
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
    return goals


def _throughput_goal(results: dict[str, Any]) -> dict[str, Any]:
    tp = results["throughput"]
    parts, ok = [], True
    for pool, t in tp.items():
        r = t["ratio"]["ours"]
        ok = ok and r["median"] >= 0.90
        parts.append(f"{pool} {_s(r, 2)}")
    return {"goal": "Throughput (≥ 0.90x plain, median ratio)", "met": ok,
            "figure": "ours / plain: " + "; ".join(parts) + "."}


def _watchdog_goal(results: dict[str, Any]) -> dict[str, Any]:
    big = max((s for s in results["scale"] if s["impl"] == "ours"), key=lambda s: s["n"])
    per_period_ok = big["round_trips_per_period"] <= big["bound_per_period"]
    wd_ok = (big["held"] == big["n"] and big["renewal_threads"] == 1 and per_period_ok and big["cpu_core"] < 0.05)
    return {
        "goal": f"Watchdog at {big['n']:,} held locks for {big['seconds']:.0f} s",
        "met": wd_ok and big["n"] >= 10000,
        "figure": (f"{big['held']:,} of {big['n']:,} still held; {big['renewal_threads']} renewal thread "
                   f"({big['threads']} threads in the process); {big['round_trips_per_period']:.1f} round trips "
                   f"({big['evalsha_per_period']:.1f} EVALSHA) per renewal period of {big['ttl'] / 3:g} s, bound "
                   f"ceil({big['n']:,} / chunk {big['chunk']}) = {big['bound_per_period']}; "
                   f"{big['cpu_core'] * 100:.1f}% of one core on average (target < 5%)."),
    }


def _lost_goal(results: dict[str, Any]) -> dict[str, Any]:
    lost = results["lost"]
    return {
        "goal": "Lost-lock detection (within TTL/3 plus one tick)",
        "met": all(lo["max_s"] is not None and lo["max_s"] <= lo["bound_s"] and lo["detected"] == lo["trials"]
                   for lo in lost),
        "figure": "; ".join(
            f"TTL {lo['ttl']:g} s: max {_f(lo['max_s'] * 1000)} ms, median {_f(lo['median_s'] * 1000)} ms, "
            f"bound {_f(lo['bound_s'] * 1000)} ms" for lo in lost) + ".",
    }


def _phase_goals(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The goals of the later phases, each where its phase ran: hot keys, backlog, footprint, capacity, etcd."""
    goals: list[dict[str, Any]] = []
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
