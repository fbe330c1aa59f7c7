"""The report's sections on what the lock costs a task, in RESULTS.md's order: the per-task cost,
throughput, lock-server traffic, the watchdog at scale, lost-lock detection, and where our time goes
(the instrumented worker, the pieces in isolation, the profile)."""

from __future__ import annotations

from typing import Any

from report_common import LABELS, _cmds, _f, _indent, _piece, _s, _table, floor_figures


def render_cost(results: dict[str, Any]) -> str:
    variants = results["variants"]
    inter = results["interleaved"]
    n_rounds = len(inter["rounds"])
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
    return (
        f"**Per-task cost** (µs; interleaved run, one solo worker, {n_rounds} round(s); "
        "median over rounds [min…max]; extras against plain from the same round"
        + ("; × floor = worker per task / (plain's + two raw round trips), per round" if fl else "") + ")\n\n"
        + _table(["variant", "worker per task", "extra worker", "publish p50", "publish p99",
                  "extra publish (p50)", "extra total"] + (["× floor"] if fl else []), rows)
        + floor_note
    )


def render_throughput(results: dict[str, Any]) -> str:
    variants = results["variants"]
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
    return (
        f"**Throughput** (worker side: a queue of {tp[next(iter(tp))]['n']} tasks of one variant drained at a time, "
        f"variants alternated, {len(tp[next(iter(tp))]['rounds'])} round(s); ratio against plain from the same "
        "round; median [min…max])\n\n" + _table(header, rows)
    )


def render_commands(results: dict[str, Any]) -> str:
    variants = results["variants"]
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
    return (
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


def render_scale(results: dict[str, Any]) -> str:
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
    return (
        f"**Watchdog at scale** (N locks held in one fresh process for {sc['seconds']:.0f} s, ttl {sc['ttl']:g} s; "
        f"ours: tick {sc['tick']:g} s, chunk {sc['chunk']}, renewal period TTL/3; python-redis-lock: "
        "auto_renewal, a thread per lock, renewal every 2/3 of its whole-second expire, redis-py's default "
        "client and pool of 100 connections)\n\n"
        + _table(["impl", "N", "held at end", "threads", "renewal threads", "CPU (one core)", "RSS MB (growth)",
                  "renewal round trips/s", "EVALSHA/s on lock server", "round trips per renewal period"], rows)
    )


def render_lost(results: dict[str, Any]) -> str:
    rows = []
    for lo in results["lost"]:
        rows.append([f"{lo['ttl']:g} s", f"{lo['detected']} / {lo['trials']}", _f(lo["median_s"] * 1000, 0),
                     _f(lo["min_s"] * 1000, 0) + "…" + _f(lo["max_s"] * 1000, 0), _f(lo["bound_s"] * 1000, 0),
                     "yes" if lo["max_s"] is not None and lo["max_s"] <= lo["bound_s"] else "no"])
    return (
        "**Lost-lock detection** (an outside DEL at a random point of the renewal period, until `.lost` is True; "
        "ms)\n\n" + _table(["lock ttl", "detected", "median", "min…max", "bound TTL/3 + tick", "within bound"], rows)
    )


def render_breakdown(results: dict[str, Any]) -> str | None:
    bd = results.get("breakdown", {})
    if "pieces" not in bd:
        return None
    return (
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


def render_micro(results: dict[str, Any]) -> str:
    micro = results["micro"]["micro_us"]
    return (
        f"**Our per-task pieces, in isolation** (µs per call, {results['micro']['n']} calls, no Celery)\n\n"
        + _table(["piece", "µs"], [[k, _f(v, 1)] for k, v in micro.items()])
    )


def render_profile(prof: dict[str, Any]) -> str:
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
    return (
        "**Profile of the worker** (py-spy sampling a solo worker at 1 kHz, idle included; each sample "
        "stops the worker, which slows it, so read the shares rather than the absolute µs)\n\n"
        + "\n\n".join(parts))
