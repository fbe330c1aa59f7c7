#!/usr/bin/env python3
"""Capacity: how many locked tasks per second ONE Redis core sustains, ours beside the cookbook's.

    python3 benchmarks/capacity.py [--seconds 6] [--rounds 3] [--procs 3] [--conns 16]

Many client processes run a task's lock traffic (acquire, then release) on distinct keys as
fast as the server answers, against one private redis-server, until it is saturated; the
variants alternate, one at a time, over a few rounds. Per variant, the figure is tasks per
second of the server's own CPU time (utime + stime of the redis-server process, from
/proc/<pid>/stat): a lock server spends that much of its one core per task, whatever share
of the core the clients managed to fill on a small machine. The achieved rate and the
server's busy share are given beside it.

- **ours**: the bytes LockServer sends for a task's lock: a fresh delivery's acquire (an ACQUIRE
  EVALSHA that runs its fresh path: EXISTS line, TIME, SET NX PX) and then its release, a RELEASE
  EVALSHA that runs its fresh path: GET, EXISTS line, DEL (an early-ack task that succeeded), packed by the
  package itself (``wire.pack``, ``layout.lock_keys``, ``wire.meta``), so the server runs exactly what a
  worker makes it run.
- **cookbook**: Celery's recipe as the other benchmarks model it: ``SET key token NX EX 60``,
  then a token-checked ``DEL`` run as one script (GET, DEL) by EVALSHA.

Each client process keeps ``--conns`` connections, one command in flight on each (as that many
workers, each waiting for its reply): it sends on every connection, then reads every reply,
so the server sees one command per read, as from real workers, never a pipeline.

Prints ``RESULT <json>`` (run.py reads it). A Redis Cluster of N masters serves about N times
the per-core figure for keys spread over the slots (every key of one lock shares one slot, so
a lock is always one shard's work); that is on paper, from the measured per-shard figure.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import socket
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

VARIANTS = ("ours", "cookbook")
COOKBOOK_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""
CLUSTER_SHARDS = (1, 3, 6, 12)
POOL = 4096  # distinct tasks per client process, packed before the window (see _client)


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


class _Conn:
    """A raw socket with one command in flight and a tiny RESP reader (integers, strings, arrays)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def reply(self) -> Any:
        while True:
            parsed = _parse(self.buf, 0)
            if parsed is not None:
                value, end = parsed
                self.buf = self.buf[end:]
                return value
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("the server closed the connection")
            self.buf += data


def _parse(buf: bytes, at: int) -> tuple[Any, int] | None:
    end = buf.find(b"\r\n", at)
    if end < 0:
        return None
    kind, line = buf[at:at + 1], buf[at + 1:end]
    if kind in (b"+", b":"):
        return (int(line) if kind == b":" else line), end + 2
    if kind == b"-":
        raise RuntimeError(f"Redis error: {line.decode()}")
    if kind == b"$":
        n = int(line)
        if n < 0:
            return None, end + 2
        if len(buf) < end + 2 + n + 2:
            return None
        return buf[end + 2:end + 2 + n], end + 2 + n + 2
    if kind == b"*":
        items, pos = [], end + 2
        for _ in range(int(line)):
            parsed = _parse(buf, pos)
            if parsed is None:
                return None
            items.append(parsed[0])
            pos = parsed[1]
        return items, pos
    raise RuntimeError(f"unexpected reply {buf[at:at + 40]!r}")


def _commands(variant: str, shas: dict[str, str], tag: str, i: int) -> tuple[bytes, bytes]:
    """The acquire and the release of task ``i`` (distinct key), packed as the real clients pack them."""
    from celery_singleton_lock.engine import layout, wire

    owner = str(uuid.uuid4())
    token = uuid.uuid4().hex
    if variant == "ours":
        digest = hashlib.sha256(f"{tag}:{i}".encode()).hexdigest()[:32]
        keys = layout.lock_keys(f"singleton_lock:bench.ours:{{{digest}}}")
        # what LockServer.acquire sends for a fresh delivery, and its release for a success kept nowhere
        acquire = wire.pack(shas["acquire"], keys[:2], (token, wire.meta(owner), "30000"))  # ACQUIRE's fresh path
        release = wire.pack(shas["release"], keys[:2], (token + " ",))  # RELEASE's fresh path: 2 keys, 1 argument
        return acquire, release
    key = "cookbook-lock-" + hashlib.md5(f"{tag}:{i}".encode()).hexdigest()
    parts = [b"SET", key.encode(), owner.encode(), b"NX", b"EX", b"60"]
    acquire = b"*6\r\n" + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)
    return acquire, wire.pack(shas["cookbook"], (key,), (owner,))


def _client(variant: str, port: int, conns: int, shas: dict[str, str], start: float, stop: float,
            tag: str, out: Any) -> None:
    """One client process: ``conns`` connections, each running tasks back to back; counts the tasks
    whose release came back within [start, stop)."""
    socks = [_Conn(port) for _ in range(conns)]
    # Every task's bytes are packed before the window, so that both variants' clients do the same
    # (least) work per task: a client that packs more would send fewer tasks a second to the server
    # it shares the cores with, and a server that reads fewer commands per wake-up spends more of its
    # CPU per task on the wake-ups: the figure would charge the server for the client's packing.
    # A key is used again only POOL tasks later, long after its release deleted it.
    pool = [_commands(variant, shas, tag, n) for n in range(POOL)]
    i = 0
    done = 0
    unexpected = 0
    pending = []
    for _ in socks:
        pending.append(pool[i % POOL])
        i += 1
    step = [0] * conns  # 0: acquire next, 1: release next
    while True:
        now = time.monotonic()
        if now >= stop:
            break
        for c, conn in enumerate(socks):
            conn.sock.sendall(pending[c][step[c]])
        for c, conn in enumerate(socks):
            reply = conn.reply()
            if step[c] == 0:
                ok = reply == b"OK" if variant == "cookbook" else isinstance(reply, int) and reply > 0  # (its fence)
                unexpected += not ok
                step[c] = 1
            else:
                unexpected += reply != 1
                step[c] = 0
                if now >= start:
                    done += 1
                pending[c] = pool[i % POOL]
                i += 1
    out.put((done, unexpected))


def measure(port: int, pid: int, variant: str, shas: dict[str, str], procs: int, conns: int, seconds: float,
            warmup: float, tag: str) -> dict[str, Any]:
    """One window of one variant: tasks done, the server's CPU seconds, tasks per server CPU second."""
    import redis

    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    t0 = time.monotonic() + 0.3 + warmup  # time to start the processes, then warm up
    t1 = t0 + seconds
    workers = [ctx.Process(target=_client, args=(variant, port, conns, shas, t0, t1, f"{tag}-{p}", out))
               for p in range(procs)]
    for w in workers:
        w.start()
    time.sleep(max(0.0, t0 - time.monotonic()))
    client = redis.Redis(port=port)
    before = client.info("commandstats")
    cpu0, wall0 = _cpu_seconds(pid), time.monotonic()
    time.sleep(max(0.0, t1 - time.monotonic()))
    cpu1, wall1 = _cpu_seconds(pid), time.monotonic()
    after = client.info("commandstats")
    results = [out.get(timeout=30) for _ in workers]
    for w in workers:
        w.join(10)
    tasks = sum(r[0] for r in results)
    cpu = cpu1 - cpu0
    usec = sum(after[k]["usec"] - before.get(k, {"usec": 0})["usec"] for k in after if k not in (
        "cmdstat_info", "cmdstat_ping", "cmdstat_hello", "cmdstat_client"))
    calls = {k.split("_", 1)[1]: after[k]["calls"] - before.get(k, {"calls": 0})["calls"] for k in after}
    return {
        "variant": variant, "tasks": tasks, "unexpected": sum(r[1] for r in results), "seconds": wall1 - wall0,
        "server_cpu_s": cpu, "busy": cpu / (wall1 - wall0), "rate": tasks / (wall1 - wall0),
        "per_core": tasks / cpu if cpu > 0 else float("nan"),
        "redis_us_per_task": usec / tasks if tasks else float("nan"),
        "commands_per_task": {k: v / tasks for k, v in calls.items() if v and tasks and k not in (
            "info", "ping", "hello", "client", "script")},
    }


def instructions(variant: str, tasks: int = 2000, warmup: int = 300) -> float | None:
    """The server's instructions per task (user space), counted by callgrind: a redis-server of its
    own under valgrind, one connection running ``tasks`` tasks back to back after ``warmup`` more.
    Unlike CPU seconds, the count is the same from run to run whatever else the machine does, so it
    shows the work a variant makes the server do apart from the noise; the kernel's share (the
    socket reads and writes, the same two round trips per task for both) is not in it. None where
    valgrind is not installed."""
    import shutil
    import subprocess
    import tempfile

    import redis

    from celery_singleton_lock.engine import scripts
    from celery_singleton_lock.testing.servers import RedisServer

    if not (shutil.which("valgrind") and shutil.which("callgrind_control")):
        return None
    out = tempfile.mkdtemp(prefix="csl-callgrind-")

    class Counted(RedisServer):
        def args(self) -> list[str]:
            return ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}/cg.%p", *super().args()]

    with Counted().start(timeout=120) as server:
        client = redis.Redis(port=server.port)
        shas = {"acquire": client.script_load(scripts.ACQUIRE), "release": client.script_load(scripts.RELEASE),
                "cookbook": client.script_load(COOKBOOK_RELEASE)}
        conn = _Conn(server.port)

        def run_tasks(count: int, tag: str) -> None:
            for i in range(count):
                acquire, release = _commands(variant, shas, tag, i)
                conn.sock.sendall(acquire)
                conn.reply()
                conn.sock.sendall(release)
                if conn.reply() != 1:
                    raise RuntimeError(f"{variant}: a release was not a delete")

        run_tasks(warmup, "warm")
        pid = str(server.pid)
        subprocess.run(["callgrind_control", "-z", pid], check=True, capture_output=True, timeout=60)
        run_tasks(tasks, "count")
        subprocess.run(["callgrind_control", "-d", pid], check=True, capture_output=True, timeout=60)
    dump = Path(out) / f"cg.{pid}.1"
    total = next(int(line.split()[1]) for line in dump.read_text().splitlines() if line.startswith("summary:"))
    shutil.rmtree(out, ignore_errors=True)
    return total / tasks


def run(seconds: float, rounds: int, procs: int, conns: int, warmup: float, counted: int = 2000) -> dict[str, Any]:
    import redis

    from celery_singleton_lock.engine import scripts
    from celery_singleton_lock.testing.servers import RedisServer

    windows: list[dict[str, Any]] = []
    with RedisServer() as server:
        client = redis.Redis(port=server.port)
        shas = {"acquire": client.script_load(scripts.ACQUIRE), "release": client.script_load(scripts.RELEASE),
                "cookbook": client.script_load(COOKBOOK_RELEASE)}
        pid = server.proc.pid
        version = client.info("server")["redis_version"]
        for r in range(rounds):
            order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
            for variant in order:
                w = measure(server.port, pid, variant, shas, procs, conns, seconds, warmup, f"r{r}")
                windows.append(w)
                print(f"  round {r + 1} {variant}: {w['rate']:,.0f} tasks/s at {w['busy'] * 100:.0f}% of a core "
                      f"-> {w['per_core']:,.0f} per core-second; {w['redis_us_per_task']:.1f} µs Redis time",
                      file=sys.stderr, flush=True)
    per = {}
    for v in VARIANTS:
        mine = [w for w in windows if w["variant"] == v]
        per[v] = {
            "per_core": statistics.median(w["per_core"] for w in mine),
            "per_core_min": min(w["per_core"] for w in mine), "per_core_max": max(w["per_core"] for w in mine),
            "rate": statistics.median(w["rate"] for w in mine),
            "busy": statistics.median(w["busy"] for w in mine),
            "redis_us_per_task": statistics.median(w["redis_us_per_task"] for w in mine),
            "commands_per_task": mine[-1]["commands_per_task"],
            "unexpected": sum(w["unexpected"] for w in mine),
        }
    ratios = [a["per_core"] / b["per_core"] for a, b in zip(
        (w for w in windows if w["variant"] == "ours"), (w for w in windows if w["variant"] == "cookbook"),
        strict=False)]
    for v in VARIANTS:
        per[v]["instructions"] = instructions(v, counted, warmup=min(300, counted)) if counted else None
        print(f"  {v}: {per[v]['instructions'] or float('nan'):,.0f} server instructions per task (callgrind)",
              file=sys.stderr, flush=True)
    return {"variants": per, "ratio": statistics.median(ratios), "ratios": ratios, "windows": windows,
            "seconds": seconds, "rounds": rounds, "procs": procs, "conns": conns, "redis_server": version,
            "cores": os.cpu_count()}


# -- the report (report.py calls these) ---------------------------------------------------


def render(cap: dict[str, Any], table: Any) -> str:
    rows = []
    for v, label in (("ours", "ours (EVALSHA of EXISTS, TIME, SET NX PX; EVALSHA of GET, EXISTS, DEL)"),
                     ("cookbook", "cookbook (SET NX EX + EVALSHA of GET, DEL)")):
        d = cap["variants"][v]
        cmds = ", ".join(f"{k.upper()} {n:.2f}" for k, n in sorted(d["commands_per_task"].items()))
        rows.append([label, f"{d['per_core']:,.0f} [{d['per_core_min']:,.0f}…{d['per_core_max']:,.0f}]",
                     f"{1e6 / d['per_core']:.1f}", f"{d['rate']:,.0f}", f"{d['busy'] * 100:.0f} %",
                     f"{d['redis_us_per_task']:.1f}",
                     f"{d['instructions']:,.0f}" if d.get("instructions") else "–", cmds])
    ours = cap["variants"]["ours"]["per_core"]
    cluster = ", ".join(f"{n} shard{'s' if n > 1 else ''} ≈ {n * ours:,.0f}/s" for n in CLUSTER_SHARDS)
    return (
        f"**Capacity of one Redis core** (`benchmarks/capacity.py`: {cap['procs']} client processes × "
        f"{cap['conns']} connections, one command in flight on each, distinct keys, against one private "
        f"redis-server {cap['redis_server']}; {cap['rounds']} rounds of {cap['seconds']:g} s per variant, "
        "alternated. Tasks per core-second = tasks completed / the server process's CPU seconds (utime + "
        "stime); the rate and the server's busy share beside it: on this "
        f"{cap['cores']}-core machine the clients share the cores with the server)\n\n"
        + table(["variant", "locked tasks per Redis core-second, median [min…max]",
                 "server CPU µs per task", "tasks/s reached",
                 "server busy", "Redis time µs per task (commandstats)",
                 "server instructions per task (callgrind, user space)", "commands per task (incl. in scripts)"],
                rows)
        + f"\n\nOurs / cookbook per core: {cap['ratio']:.2f} (median of the rounds' ratios: "
        + ", ".join(f"{r:.2f}" for r in cap["ratios"]) + "). " + _instructions_line(cap)
        + f"On paper, a Redis Cluster of N masters, one core each, with the keys spread over the slots (every key "
        f"of one lock shares a slot): {cluster} of ours."
    )


def _instructions_line(cap: dict[str, Any]) -> str:
    o, c = (cap["variants"][v].get("instructions") for v in VARIANTS)
    if not (o and c):
        return ""
    return (f"Counted by callgrind (within a fraction of a percent from run to run), ours makes the server run "
            f"{o / c:.2f}× the cookbook's instructions per task in user space ({o:,.0f} against {c:,.0f}): the "
            "acquire's script (Lua's call, TIME, the fence), the line's EXISTS, and a longer key and value. "
            "User-space instructions are not the server's time: its CPU per task is mostly the two round trips' "
            "reads and writes. ")


def goals(cap: dict[str, Any]) -> list[dict[str, Any]]:
    o, c = cap["variants"]["ours"], cap["variants"]["cookbook"]
    return [{
        "goal": "Capacity (locked tasks/s per Redis core ≥ the cookbook's: lock-server CPU per task ≤ the cookbook's)",
        "met": cap["ratio"] >= 1.0 and o["unexpected"] == 0,
        "figure": (f"ours {o['per_core']:,.0f} locked tasks per Redis core-second, the cookbook {c['per_core']:,.0f}: "
                   f"{cap['ratio']:.2f}× (median of {len(cap['ratios'])} rounds); server CPU per task "
                   f"{1e6 / o['per_core']:.1f} µs against {1e6 / c['per_core']:.1f} µs"
                   + (f"; {o['unexpected']} unexpected replies" if o["unexpected"] else "") + "."),
    }]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=6.0, help="measured window per variant and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--procs", type=int, default=3, help="client processes")
    parser.add_argument("--conns", type=int, default=16, help="connections per client process")
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--counted", type=int, default=2000,
                        help="tasks per variant whose server instructions callgrind counts (0: none)")
    args = parser.parse_args()
    result = run(args.seconds, args.rounds, args.procs, args.conns, args.warmup, args.counted)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
