"""tools/celery_integration.py's runs: one pytest process per shard (a mode and a share of the tests),
each with a private redis-server, and one mode's results merged from its shards. Stdlib only at import."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from integ_setup import DURATIONS, TOOLS, say

IGNORED = {
    "t/integration/test_backend.py": "Azure Block Blob backend: needs the azure SDK at import and an "
    "AZUREBLOCKBLOB_URL service; both its tests skip without the service",
}
"""Test files left out of the run (pytest --ignore), each with its reason."""


def _end_group(proc: subprocess.Popen, grace: float = 20.0) -> None:
    """SIGTERM, then SIGKILL, to the process group we started (pytest, its worker pool, its subprocesses)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(grace)
            return
        except subprocess.TimeoutExpired:
            continue


def _read_counters(server) -> dict[str, dict[str, int]]:
    """The plugin's counters (db 3): executions as LockedTask / plain Task, locks acquired, duplicates met."""
    with server.client(db=3) as client:
        return {
            key: {k.decode(): int(v) for k, v in client.hgetall(f"csl_integ:{key}").items()}
            for key in ("locked", "plain", "acquired", "duplicates")
        }


def pytest_command(args: argparse.Namespace) -> list[str]:
    cmd = [
        sys.executable, "-m", "pytest", "t/integration", "-p", "csl_integ_plugin", "-p", "no:cacheprovider",
        "-v", "--tb=short", "-rfE", "--durations=15", f"--timeout={args.timeout}",
        *(f"--ignore={path}" for path in IGNORED),
    ]
    if args.k:
        cmd += ["-k", args.k]
    if args.no_reruns:
        cmd += ["-p", "no:rerunfailures"]
    return cmd + args.pytest_args


class Shard:
    """One pytest process: one mode, one share of the tests, its own private redis-server."""

    def __init__(self, mode: str, index: int, count: int, suite: Path, run_dir: Path, args: argparse.Namespace):
        self.mode, self.index, self.count = mode, index, count
        self.name = f"{mode} {index + 1}/{count}"
        self.suite, self.args = suite, args
        self.out = run_dir / (mode if count == 1 else f"{mode}-{index + 1}")
        self.returncode: int | None = None
        self.elapsed = 0.0
        self.timed_out = False
        self.summary: list[str] = []
        self.executions: dict[str, dict[str, int]] = {}
        self.data: dict | None = None
        self.failure: str | None = None
        self.proc: subprocess.Popen | None = None

    def done(self) -> int:
        """How many tests have finished so far (results.json is rewritten after each)."""
        try:
            return len(json.loads((self.out / "results.json").read_text())["tests"])
        except (OSError, ValueError, KeyError):
            return 0

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # reported, never lost in a thread
            self.failure = f"{type(exc).__name__}: {exc}"

    def _run(self) -> None:
        from celery_singleton_lock.testing.servers import RedisServer

        self.out.mkdir(parents=True, exist_ok=True)
        args = self.args
        server = RedisServer().start()
        say(f"{self.name}: private redis-server {'.'.join(map(str, server.version()))} pid {server.pid} "
            f"on 127.0.0.1:{server.port}; log {self.out / 'pytest.log'}")
        env = self._env(server)
        started = time.monotonic()
        tail: list[str] = []
        try:
            with open(self.out / "pytest.log", "w") as log:
                proc = self.proc = subprocess.Popen(
                    pytest_command(args), cwd=self.suite, env=env,
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                )
                try:
                    for raw in iter(proc.stdout.readline, b""):
                        text = raw.decode("utf-8", "replace")
                        log.write(text)
                        log.flush()
                        tail.append(text)
                        del tail[:-100]
                        if args.echo:
                            sys.stdout.write(f"[{self.name}] {text}")
                            sys.stdout.flush()
                        if time.monotonic() - started > args.max_minutes * 60 and not self.timed_out:
                            self._time_out(proc)
                    proc.wait(max(1.0, args.max_minutes * 60 - (time.monotonic() - started)))
                except subprocess.TimeoutExpired:
                    self._time_out(proc)
                finally:
                    if proc.poll() is None:
                        _end_group(proc)
            self.executions = _read_counters(server)
            (self.out / "counters.json").write_text(json.dumps(self.executions, indent=1, sort_keys=True))
        finally:
            server.stop()
            shutil.rmtree(server.dir, ignore_errors=True)
        self.returncode = proc.returncode
        self.elapsed = time.monotonic() - started
        self.summary = [ln.strip().strip("=").strip() for ln in tail if re.match(r"=+ .*\bin [\d.]+s", ln)]
        results = self.out / "results.json"
        self.data = json.loads(results.read_text()) if results.exists() else None
        say(f"{self.name}: pytest exited {self.returncode} after {self.elapsed / 60:.1f} min: "
            f"{'; '.join(self.summary) or '(no summary line)'}")

    def _env(self, server) -> dict[str, str]:
        """The pytest process's environment: ours less any CELERY_/TEST_/REDIS_/... of the caller, then the
        suite's servers (all on ``server``), our plugin's settings and the venv's PATH."""
        args = self.args
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("CELERY_", "CSL_INTEG_", "TEST_", "REDIS_", "DJANGO_"))}
        env.update(
            # as Celery's tox.ini for its redis run (TEST_BROKER=redis://, TEST_BACKEND=redis://: one db,
            # which tests also read through REDIS_HOST/REDIS_PORT; trace-log tests need INFO records)
            TEST_BROKER=server.url(0), TEST_BACKEND=server.url(0), WORKER_LOGLEVEL="INFO",
            REDIS_HOST="127.0.0.1", REDIS_PORT=str(server.port),
            # the suite runs the `celery` command (test_serialization, test_worker): the venv's
            PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
            CSL_INTEG_MODE=self.mode, CSL_INTEG_LOCK_URL=server.url(2), CSL_INTEG_POLICY=args.policy,
            CSL_INTEG_STATS_URL=server.url(3), CSL_INTEG_OUT=str(self.out),
            CSL_INTEG_SHARD=f"{self.index}/{self.count}" if self.count > 1 else "",
            CSL_INTEG_WEIGHTS=str(DURATIONS),
            PYTHONPATH=os.pathsep.join([str(TOOLS), *filter(None, [os.environ.get("PYTHONPATH")])]),
            PYTHONUNBUFFERED="1",
        )
        return env

    def abort(self) -> None:
        """From the main thread, on a signal: end our pytest's process group; _run then stops the server."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            _end_group(proc, grace=10.0)

    def _time_out(self, proc: subprocess.Popen) -> None:
        self.timed_out = True
        say(f"{self.name}: still running after {self.args.max_minutes} min: ending pytest's process group")
        _end_group(proc)


def merge(shards: list[Shard]) -> dict:
    """One mode's results, from its shards."""
    tests: dict[str, dict] = {}
    executions: dict[str, dict[str, int]] = {}
    registries, problems = [], []
    for shard in shards:
        if shard.failure:
            problems.append(f"{shard.name}: the driver failed: {shard.failure}")
        if shard.data is None:
            problems.append(f"{shard.name}: no results (pytest crashed or was ended): see {shard.out}/pytest.log")
            continue
        if shard.timed_out or not shard.data.get("finished"):
            problems.append(f"{shard.name}: did not finish; its results cover the tests run until then")
        if shard.returncode not in (0, 1):  # interrupted, collection error, usage error, no test
            problems.append(f"{shard.name}: pytest exited {shard.returncode}: see {shard.out}/pytest.log")
        tests.update(shard.data["tests"])
        if shard.data.get("registry"):
            registries.append(shard.data["registry"])
        for key, per_task in shard.executions.items():
            into = executions.setdefault(key, {})
            for name, n in per_task.items():
                into[name] = into.get(name, 0) + n
    return {"tests": tests, "executions": executions, "registries": registries, "problems": problems,
            "shards": shards, "elapsed": max((s.elapsed for s in shards), default=0.0)}
