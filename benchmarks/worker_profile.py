"""Profiling the worker (``run.py --profile``): py-spy samples a solo worker while it drains tasks,
and the samples are read back per piece of LockedTask's path."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

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
