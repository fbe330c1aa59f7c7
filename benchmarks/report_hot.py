"""The report's hot-key sections and goals: the drains of one hot key, the hand-off latency
(release to the next waiter's body start), and the plain-code hand-off (processes queueing on one key)."""

from __future__ import annotations

from typing import Any

from report_common import _f, _table

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
        parts.append(_render_drains(drains))
    for name in ("handoff_slot", "handoff"):
        h = hot.get(name)
        if not h:
            continue
        parts.append(_render_handoff(h))
    return "\n\n".join(parts)


def _render_drains(drains: dict[str, Any]) -> str:
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
    return (
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


def _render_handoff(h: dict[str, Any]) -> str:
    lat = h["latency_ms"]
    how = HOT_LABELS.get(h.get("variant", "ours"), "")
    return (
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


PLAIN_HOW = {
    "ours": "`held(..., wait=…)`: parks in the key's line, BLPOP on its own wake-up list; the release hands it the key",
    "redis-py": "`Lock(sleep=0.1)`: SET NX, else sleep 0.1 s and try again",
    "python-redis-lock": "`redis_lock.Lock(expire=30)`: SET NX, else BLPOP on the lock's signal list (one "
                         "waiter woken per release); nothing renews the lock: a hold past 30 s loses it",
    "python-redis-lock-renewed": "the same with `auto_renewal=True`, the service ours gives (the lock kept "
                                 "while the block runs): a renewal thread started at each acquire, stopped "
                                 "at its release",
    "etcd-mutex": "etcd's mutex: `POST /v3/lock/lock` (v3lock: the server's concurrency.Mutex on the waiter's "
                  "lease; it puts `name/<lease id>` and watches the key created just before its own, first come "
                  "first served by create revision); `POST /v3/lock/unlock` deletes the holder's key, the next "
                  "waiter's watch sees the delete, and it reads its own key before it answers",
    "ours-etcd": "ours on etcd, `held(..., wait=…)`: no line holds plain code on etcd (its line holds parked "
                 "task messages, handed on by the release): the acquire's txn, else a watch on the lock key and "
                 "the txn again at its first change; every waiter wakes at a release, and one takes the key",
}


def render_plain_handoff(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    r0 = rows[0]
    etcd = next((r["etcd_version"] for r in rows if r.get("etcd_version")), None)
    servers = "" if etcd is None else (
        f"; {_and(r['impl'] for r in rows if not r.get('etcd_version'))} on one private redis-server, "
        f"{_and(r['impl'] for r in rows if r.get('etcd_version'))} on a private one-member etcd {etcd} "
        "that fsyncs its log (each take and release of the key is a Raft write, fsynced)")
    return (
        f"**Plain-code hand-off** ({r0['procs']} processes queue on one key, each takes it once per round, "
        f"{r0['rounds']} rounds, {r0['hold_s'] * 1000:g} ms holds; from the holder leaving its block (just before "
        f"its release) to the next holder entering its block{servers}; ms)\n\n"
        + _table(["lock", "how a waiter waits", "hand-offs", "p50", "p99", "max", "mean", "overlaps"],
                 [[r["impl"], PLAIN_HOW.get(r["impl"], ""), str(r["handoffs"]), _f(r["p50_ms"], 2),
                   _f(r["p99_ms"], 2), _f(r["max_ms"], 2), _f(r["mean_ms"], 2), str(r["overlaps"])] for r in rows]))


def _and(names: Any) -> str:
    names = list(names)
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else "".join(names)


def _drain_wall(o: dict[str, Any]) -> str:
    return (f"{_f(o.get('sustained'), 0)} bodies/s sustained (wall {o['wall_s']:.2f} s, publishing included: "
            f"{_f(o.get('rate'), 0)} bodies/s)" if o["finished"]
            else f"did not finish in {o['cap_s']:g} s ({o['completed']:,} of {o['n']:,} done)")


def hot_goals(hot: dict[str, Any]) -> list[dict[str, Any]]:
    """The hot key's goals: the fast path (``ours-slot``) judged, the plain park shown beside it."""
    goals = []
    drains = hot.get("drain", {})
    d = drains.get("ours-slot") or drains.get("ours")
    others = "; ".join(f"{HOT_LABELS.get(v, v)}: {_drain_wall(o)}" + (
        f", {_f(o['slot_wait_s'], 1)} worker-slot seconds spent waiting" if v == "rlock" else "")
        for v, o in drains.items() if o is not d)
    if d is not None:
        goals += _drain_goals(drains, d, others)
    h, plain = hot.get("handoff_slot") or hot.get("handoff"), hot.get("handoff") if hot.get("handoff_slot") else None
    if h:
        goals.append(_handoff_goal(h, plain))
    return goals


def _drain_goals(drains: dict[str, Any], d: dict[str, Any], others: str) -> list[dict[str, Any]]:
    """The drain's four goals, judged on ``d`` (the fast path) and its exactness and order on every ours."""
    goals = []
    rate = d.get("sustained")
    goals.append({
        "goal": "Hot key (≥ 400 bodies/s sustained over 2,000 × 1 ms on one key, 2 nodes × prefork -c 2)",
        "met": bool(d["finished"] and rate is not None and rate >= 400),
        "figure": (f"{HOT_LABELS.get(d['variant'], d['variant'])}: {d['n']:,} deductions × "
                   f"{d['body_s'] * 1000:g} ms, {d['nodes']} nodes × prefork -c {d['concurrency']}: {_drain_wall(d)}, "
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
    return goals


def _handoff_goal(h: dict[str, Any], plain: dict[str, Any] | None) -> dict[str, Any]:
    lat = h["latency_ms"]
    return {
        "goal": "Hand-off latency (release → next waiter's body start, one node: p50 ≤ 1.5 ms, p99 ≤ 10 ms)",
        "met": lat["p50"] is not None and lat["p50"] <= 1.5 and lat["p99"] <= 10,
        "figure": (f"{HOT_LABELS.get(h.get('variant', 'ours'), '')}: p50 {_f(lat['p50'], 2)} ms, p99 "
                   f"{_f(lat['p99'], 2)} ms, max {_f(lat['max'], 2)} ms over {lat['n']:,} hand-offs"
                   + (f"; parking at once: p50 {_f(plain['latency_ms']['p50'], 2)} ms, p99 "
                      f"{_f(plain['latency_ms']['p99'], 2)} ms" if plain else "")
                   + (f"; Celery's own publish → body start on the same node: "
                      f"p50 {_f(h['celery_dispatch_ms']['p50'], 2)} ms" if h.get("celery_dispatch_ms") else "")
                   + "."),
    }
