"""The benchmarks' smoke run, so they do not rot: every phase, small N, about half a minute, no peers.

CI never runs the full benchmarks (`python3 dev.py bench`); this runs
`benchmarks/run.py --smoke` in this interpreter and checks that it measured
something sensible and wrote its report, into a temporary directory only
(never benchmarks/RESULTS.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.long  # (dev.py test --all and CI run it)

ROOT = Path(__file__).resolve().parents[2]


def _check_the_new_phases(results: dict, stdout: str) -> None:
    """The new phases ran; what they must show does not depend on the machine."""
    assert results["floor"]["pair_us_p50"] > 0
    assert "**Redis time per task**" in stdout
    drain = results["hot"]["drain"]["ours"]
    assert drain["finished"] and drain["lost"] == 0 and drain["overlaps"] == 0 and drain["ran_twice"] == 0
    assert drain["publishes_by_why"].get("entry", 0) == drain["duplicates"] > 0  # one hand-off per parked task
    fast = results["hot"]["drain"]["ours-slot"]  # lock_wait_in_slot: woken in the worker slot
    assert fast["finished"] and fast["lost"] == 0 and fast["overlaps"] == 0 and fast["ran_twice"] == 0
    assert drain["in_order"] == 1.0  # first come, first served
    assert fast["in_order"] is None or fast["in_order"] >= 0.9  # (read from its PARKs now; few in a smoke run)
    assert fast["sustained"] and fast["sustained"] >= fast["rate"]  # (the publishing is not in the sustained rate)
    assert set(results["hot"]["drain"]) == {"ours-slot", "ours", "rlock", "backoff", "plain"}
    handoff = results["hot"]["handoff"]
    assert handoff["latency_ms"]["n"] == handoff["n"] and handoff["overlaps"] == 0 and handoff["on_one_node"]
    assert {r["impl"] for r in results["plain_handoff"]} >= {"ours", "redis-py"}
    busy = results["backlog"]["redis"]["busy"]  # the hot key under a backlog: exact, in order, one turn each
    assert busy["finished"] and busy["lost"] == 0 and busy["overlaps"] == 0 and busy["ran_twice"] == 0
    assert busy["in_order"] == 1.0 and busy["publishes_by_why"].get("entry", 0) == busy["duplicates"] > 0
    assert all(r["overlaps"] == 0 and r["handoffs"] > 0 for r in results["plain_handoff"])


def _check_the_footprint(results: dict) -> None:
    """What each variant leaves in Redis: nothing of ours but the sweeper's epoch, a done record per
    acks_late task, and a quorum's SINCE keys and fencing floors."""
    fp = results["footprint"]["variants"]
    n = results["footprint"]["n"]
    assert fp["ours"]["snapshots"][0]["keys"] <= 1  # at most the sweeper's epoch key
    assert fp["ours_late"]["snapshots"][0]["keys"] >= n  # one done record per acks_late task, for the window
    assert fp["cookbook"]["snapshots"][0]["keys"] == 0
    # a quorum of 3: each member keeps its SINCE key, and the fencing floors for 60 s
    assert "error" not in fp["ours_quorum"] and fp["ours_quorum"]["completed"] == n
    assert 1 <= fp["ours_quorum"]["snapshots"][0]["keys"] <= n + 1


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_benchmarks_smoke_run(tmp_path: Path) -> None:
    before = {p: p.stat().st_mtime for p in (ROOT / "benchmarks").glob("RESULTS.md")}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--smoke", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=280,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert "| variant | worker per task |" in proc.stdout  # the printed table
    assert (tmp_path / "RESULTS.md").exists()
    results = json.loads((tmp_path / "results.json").read_text())

    # at least plain, ours and the cookbook (which needs no peer) were measured side by side
    assert {"plain", "ours", "cookbook"} <= set(results["variants"])
    per_variant = results["interleaved"]["per_variant"]
    assert all(per_variant[v]["worker_us"]["median"] > 0 for v in results["variants"])
    for pool in results["throughput"].values():
        assert all(pool["rate"][v]["median"] > 0 for v in results["variants"])

    # the exact counts do not depend on the machine: per locked task the acquire's EVALSHA and the
    # release's (2 round trips); nothing at publish
    ours = results["commands"]["ours"]
    assert ours["exec_sent"] == {"EVALSHA": 2.0}, ours["exec_sent"]
    assert ours["exec_rt"] == 2 and ours["publish_rt"] == 0
    assert results["commands"]["plain"]["exec_rt"] == 0
    assert results["renewals"]["short"]["renewals"] == 0

    scale = [s for s in results["scale"] if s["impl"] == "ours"]
    assert scale and all(s["held"] == s["n"] and s["renewal_threads"] == 1 for s in scale)
    assert all(lo["detected"] == lo["trials"] for lo in results["lost"])
    assert "LockedTask.before_start" in results["breakdown"]["pieces"]
    assert any(k.endswith("LockServer._call (pack, send, read the reply)") for k in results["breakdown"]["pieces"])
    assert {g["goal"].split(" (")[0] for g in results["goals"]} >= {
        "Round trips", "Throughput", "Hot key", "Hand-off latency", "Footprint, early ack"}

    _check_the_new_phases(results, proc.stdout)
    _check_the_footprint(results)

    # the smoke run never overwrites the committed results
    assert before == {p: p.stat().st_mtime for p in (ROOT / "benchmarks").glob("RESULTS.md")}
