"""Sentinel and Redis Cluster deployments for tests, built from private redis-servers.

Every server is started on a free loopback port with no persistence and stopped by PID
(:class:`~celery_singleton_lock.testing.RedisServer`); the cluster is built with CLUSTER MEET /
ADDSLOTS from Python (no redis-cli needed). Nothing here touches a Redis it did not start.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import time
from functools import partial
from pathlib import Path
from typing import Any

import redis

from celery_singleton_lock.testing.servers import RedisServer, find_redis_server, wait_until


def _free_cluster_port() -> int:
    """A free loopback port whose cluster bus port (+10000) is free too (Redis 6.2 has no ``cluster-port``)."""
    for _ in range(200):
        port = random.randint(20000, 40000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port
    raise RuntimeError("no free pair of loopback ports (port, port + 10000) for a cluster node")


class SentinelServer(RedisServer):
    """A Redis Sentinel (``redis-server <conf> --sentinel``) watching one master, on a free loopback port.

    Sentinel rewrites its config file as it learns the deployment, so the file lives in the server's
    own temporary directory.
    """

    def __init__(self, master_port: int, *, master_name: str = "mymaster", quorum: int = 2,
                 down_after_ms: int = 1000, failover_timeout_ms: int = 3000, binary: str | None = None) -> None:
        super().__init__(binary=binary)
        self.master_port = master_port
        self.master_name = master_name
        self.quorum = quorum
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms

    def args(self) -> list[str]:
        conf = os.path.join(self.dir, "sentinel.conf")
        if not os.path.exists(conf):  # on a restart, Sentinel's own rewritten file is kept
            name = self.master_name
            Path(conf).write_text(
                f"port {self.port}\nbind 127.0.0.1\ndaemonize no\ndir {self.dir}\nloglevel warning\n"
                f"sentinel monitor {name} 127.0.0.1 {self.master_port} {self.quorum}\n"
                f"sentinel down-after-milliseconds {name} {self.down_after_ms}\n"
                f"sentinel failover-timeout {name} {self.failover_timeout_ms}\n"
                f"sentinel parallel-syncs {name} 1\n"
            )
        return [self.binary, conf, "--sentinel"]


class SentinelDeployment:
    """One master, ``replicas`` replicas and ``sentinels`` Sentinels, each a private process on a free
    loopback port with no persistence, stopped by PID.

        with SentinelDeployment(replicas=1, sentinels=3) as d:
            d.url(db=2)     # sentinel://127.0.0.1:p1/2;sentinel://127.0.0.1:p2/2;...  (Celery's form)
            d.master        # the RedisServer that is master now
            d.failover()    # SENTINEL FAILOVER; returns once every Sentinel names the new master
    """

    def __init__(self, replicas: int = 1, sentinels: int = 3, *, master_name: str = "mymaster",
                 binary: str | None = None, down_after_ms: int = 1000, failover_timeout_ms: int = 3000) -> None:
        if replicas < 1 or sentinels < 1:
            raise ValueError(f"a Sentinel deployment needs a replica and a Sentinel; got {replicas=}, {sentinels=}")
        self.binary = binary or find_redis_server()
        self.master_name = master_name
        self.n_replicas = replicas
        self.n_sentinels = sentinels
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.servers: list[RedisServer] = []
        """The data servers (the first one started as the master)."""
        self.sentinels: list[SentinelServer] = []

    def start(self, timeout: float = 30.0) -> SentinelDeployment:
        try:
            first = RedisServer(binary=self.binary).start()
            self.servers.append(first)
            for _ in range(self.n_replicas):
                replica = RedisServer(binary=self.binary, extra_args=["--replicaof", "127.0.0.1", str(first.port)])
                self.servers.append(replica.start())
            for replica in self.servers[1:]:
                wait_until(partial(_link_up, replica), timeout, 0.05, f"replica {replica.port} to sync")
            quorum = self.n_sentinels // 2 + 1
            for _ in range(self.n_sentinels):
                sentinel = SentinelServer(first.port, master_name=self.master_name, quorum=quorum,
                                          down_after_ms=self.down_after_ms,
                                          failover_timeout_ms=self.failover_timeout_ms, binary=self.binary)
                sentinel.start()
                self.sentinels.append(sentinel)
            wait_until(self._settled, timeout, 0.1, "the Sentinels to see every replica and each other")
        except BaseException:
            self.stop()
            raise
        return self

    def _settled(self) -> bool:
        for sentinel in self.sentinels:
            with sentinel.client(socket_timeout=2, decode_responses=True) as c:
                master = c.execute_command("SENTINEL", "MASTER", self.master_name)
                state = dict(zip(master[::2], master[1::2], strict=False)) if isinstance(master, list) else master
                if int(state.get("num-slaves", 0)) < self.n_replicas:
                    return False
                if int(state.get("num-other-sentinels", 0)) < self.n_sentinels - 1:
                    return False
                replicas = c.execute_command("SENTINEL", "REPLICAS", self.master_name)
                for rep in replicas:
                    info = dict(zip(rep[::2], rep[1::2], strict=False)) if isinstance(rep, list) else rep
                    if "s_down" in str(info.get("flags", "")) or info.get("master-link-status") != "ok":
                        return False
                    # what Sentinel last read of the replica (INFO every 10 s): a replica it still sees as a
                    # master, or as cut off from its master, is no candidate for a failover
                    if info.get("role-reported") != "slave" or int(info.get("master-link-down-time", 0)) != 0:
                        return False
        return True

    def url(self, db: int = 0, password: str | None = None) -> str:
        """Celery's Sentinel URL: ``sentinel://[:password@]host:port/db;sentinel://host:port/db;...``."""
        auth = f":{password}@" if password else ""
        return ";".join(f"sentinel://{auth}127.0.0.1:{s.port}/{db}" for s in self.sentinels)

    @property
    def transport_options(self) -> dict[str, Any]:
        return {"master_name": self.master_name}

    def master_address(self, sentinel: int = 0) -> tuple[str, int]:
        with self.sentinels[sentinel].client(socket_timeout=2, decode_responses=True) as c:
            host, port = c.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.master_name)
        return str(host), int(port)

    @property
    def master(self) -> RedisServer:
        port = self.master_address()[1]
        return next(s for s in self.servers if s.port == port)

    @property
    def replicas(self) -> list[RedisServer]:
        port = self.master_address()[1]
        return [s for s in self.servers if s.port != port]

    def failover(self, *, wait_demoted: bool = False, timeout: float = 30.0) -> RedisServer:
        """Force a failover (``SENTINEL FAILOVER``); return the new master once every Sentinel names it.

        ``wait_demoted`` also waits until the old master has turned replica (Sentinel does that a few
        seconds later: until then it still takes writes from clients that stayed connected to it).
        """
        old = self.master
        deadline = time.monotonic() + timeout
        wait_until(self._settled, timeout, 0.1, "the Sentinels to see a replica fit to promote")

        def ask() -> bool:
            with self.sentinels[0].client(socket_timeout=2) as c:
                try:
                    c.execute_command("SENTINEL", "FAILOVER", self.master_name)
                except redis.ResponseError as exc:  # INPROG, NOGOODSLAVE: not ready yet
                    if time.monotonic() > deadline:
                        raise
                    _ = exc
                    return False
            return True

        try:
            wait_until(ask, timeout, 0.2, "Sentinel to accept the failover")
            wait_until(lambda: all(self.master_address(i)[1] != old.port for i in range(len(self.sentinels))),
                       max(1.0, deadline - time.monotonic()), 0.05, "every Sentinel to name the new master")
            new = self.master
            wait_until(lambda: _role(new) == "master", max(1.0, deadline - time.monotonic()), 0.05, "the promotion")
            if wait_demoted:
                wait_until(lambda: _role(old) == "slave" and _link_up(old), max(1.0, deadline - time.monotonic()),
                           0.1, "the old master to turn replica")
        except TimeoutError as exc:
            views = [self.master_address(i) for i in range(len(self.sentinels))]
            roles = [(s.port, _role(s)) for s in self.servers]
            raise TimeoutError(f"{exc} (old master {old.port}; Sentinels name {views}; roles {roles})") from None
        return new

    def kill_master(self, timeout: float = 30.0) -> RedisServer:
        """An unplanned failover: SIGKILL the master (what it had not yet sent to a replica is gone)
        and return the replica the Sentinels promote, once every Sentinel names it and it took the
        role. The killed server stays down (its ``stop`` is then a no-op)."""
        old = self.master
        wait_until(self._settled, timeout, 0.1, "the Sentinels to see a replica fit to promote")
        proc, old.proc = old.proc, None
        if proc is None:
            raise RuntimeError(f"the master {old.port} is not a process of this deployment")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + timeout
        wait_until(lambda: all(self.master_address(i)[1] != old.port for i in range(len(self.sentinels))),
                   timeout, 0.05, "every Sentinel to name a new master")
        new = self.master
        wait_until(lambda: _role(new) == "master", max(1.0, deadline - time.monotonic()), 0.05, "the promotion")
        return new

    def failover_settle(self, old: RedisServer, timeout: float = 30.0) -> None:
        """Wait until ``old`` (a master before a failover) has turned replica and caught up."""
        wait_until(lambda: _role(old) == "slave" and _link_up(old), timeout, 0.1, "the old master to turn replica")

    def stop(self) -> None:
        for server in [*self.sentinels, *self.servers]:
            server.stop()
            shutil.rmtree(server.dir, ignore_errors=True)

    def __enter__(self) -> SentinelDeployment:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _role(server: RedisServer) -> str:
    with server.client(socket_timeout=2) as c:
        return str(c.info("replication")["role"])


def _link_up(server: RedisServer) -> bool:
    with server.client(socket_timeout=2) as c:
        info = c.info("replication")
    return bool(info.get("role") == "slave" and info.get("master_link_status") == "up")


class RedisClusterDeployment:
    """A Redis Cluster of ``masters`` masters (and ``replicas`` replicas each), built by hand
    (CLUSTER ADDSLOTS / MEET / REPLICATE, no redis-cli) from private redis-servers on free loopback
    ports with no persistence, stopped by PID.

        with RedisClusterDeployment(masters=3, replicas=1) as c:
            c.url()                       # redis+cluster://127.0.0.1:p1,127.0.0.1:p2,...
            c.node_for_key("{k}")         # the RedisServer serving that key's slot
            c.migrate_slot(slot, target)  # MIGRATING/IMPORTING + MIGRATE + SETSLOT NODE
            c.failover(server)            # CLUSTER FAILOVER on one of its replicas
    """

    def __init__(self, masters: int = 3, replicas: int = 0, *, binary: str | None = None,
                 node_timeout_ms: int = 2000) -> None:
        if masters < 1 or replicas < 0:
            raise ValueError(f"a cluster needs masters >= 1 and replicas >= 0; got {masters=}, {replicas=}")
        self.binary = binary or find_redis_server()
        self.n_masters = masters
        self.n_replicas = replicas
        self.node_timeout_ms = node_timeout_ms
        self.servers: list[RedisServer] = []
        self.ids: dict[int, str] = {}  # port -> node id

    def _node(self) -> RedisServer:
        server = RedisServer(binary=self.binary, port=_free_cluster_port())
        server.extra_args = [
            "--cluster-enabled", "yes", "--cluster-config-file", os.path.join(server.dir, "nodes.conf"),
            "--cluster-node-timeout", str(self.node_timeout_ms),
        ]
        return server.start()

    def start(self, timeout: float = 30.0) -> RedisClusterDeployment:
        try:
            masters = [self._node() for _ in range(self.n_masters)]
            replicas = [self._node() for _ in range(self.n_masters * self.n_replicas)]
            self.servers = masters + replicas
            for server in self.servers:
                with server.client() as c:
                    self.ids[server.port] = str(c.execute_command("CLUSTER", "MYID").decode())
            per = 16384 // self.n_masters
            for i, server in enumerate(masters):
                last = 16384 if i == self.n_masters - 1 else (i + 1) * per
                with server.client() as c:
                    for lo in range(i * per, last, 2000):
                        c.execute_command("CLUSTER", "ADDSLOTS", *range(lo, min(last, lo + 2000)))
            with self.servers[0].client() as c:
                for server in self.servers[1:]:
                    c.execute_command("CLUSTER", "MEET", "127.0.0.1", server.port)
            wait_until(self._all_known, timeout, 0.05, "every node to know every other")
            for j, replica in enumerate(replicas):
                master = masters[j % self.n_masters]
                with replica.client() as c:
                    c.execute_command("CLUSTER", "REPLICATE", self.ids[master.port])
            for replica in replicas:
                wait_until(partial(_link_up, replica), timeout, 0.05, f"cluster replica {replica.port} to sync")
            wait_until(self.is_ok, timeout, 0.05, "the cluster to be ok")
        except BaseException:
            self.stop()
            raise
        return self

    def _all_known(self) -> bool:
        for server in self.servers:
            with server.client() as c:
                lines = c.execute_command("CLUSTER", "NODES").decode().splitlines()
            if len(lines) != len(self.servers) or any("handshake" in line or "noaddr" in line for line in lines):
                return False
        return True

    def is_ok(self) -> bool:
        """Every node says the cluster is ok and every node agrees on who serves each slot."""
        views = set()
        for server in self.servers:
            with server.client() as c:
                if b"cluster_state:ok" not in c.execute_command("CLUSTER", "INFO"):
                    return False
                views.add(tuple(sorted((int(s[0]), int(s[1]), int(s[2][1])) for s in c.execute_command(
                    "CLUSTER", "SLOTS"))))
        return len(views) == 1

    def url(self, scheme: str = "redis+cluster") -> str:
        return f"{scheme}://" + ",".join(f"127.0.0.1:{s.port}" for s in self.servers[: self.n_masters])

    def client(self, **kwargs: Any) -> Any:
        from redis.cluster import ClusterNode, RedisCluster

        return RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", s.port) for s in self.servers], **kwargs)

    def server(self, port: int) -> RedisServer:
        return next(s for s in self.servers if s.port == port)

    @property
    def masters(self) -> list[RedisServer]:
        return [s for s in self.servers if _role(s) == "master"]

    @staticmethod
    def slot_of(key: str) -> int:
        from redis.crc import key_slot

        return int(key_slot(key.encode()))

    def node_for_slot(self, slot: int) -> RedisServer:
        with self.servers[0].client() as c:
            for lo, hi, primary, *_ in c.execute_command("CLUSTER", "SLOTS"):
                if int(lo) <= slot <= int(hi):
                    return self.server(int(primary[1]))
        raise LookupError(f"slot {slot} is not served")

    def node_for_key(self, key: str) -> RedisServer:
        return self.node_for_slot(self.slot_of(key))

    def migrate_slot(self, slot: int, target: RedisServer, *, pause: float = 0.0, batch: int = 10) -> None:
        """Move ``slot`` to ``target`` the way redis-cli does: IMPORTING on the target, MIGRATING on the
        source, MIGRATE its keys (``batch`` at a time, ``pause`` seconds before each batch and before the
        end, so clients meet ASK and TRYAGAIN), then SETSLOT NODE on every master."""
        source = self.node_for_slot(slot)
        if source.port == target.port:
            raise ValueError(f"slot {slot} is served by {target.port} already")
        with source.client() as src, target.client() as dst:
            dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", self.ids[source.port])
            src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", self.ids[target.port])
            while True:
                time.sleep(pause)
                keys = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, batch)
                if not keys:
                    break
                src.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys)
            time.sleep(pause)
            dst.execute_command("CLUSTER", "SETSLOT", slot, "NODE", self.ids[target.port])
            src.execute_command("CLUSTER", "SETSLOT", slot, "NODE", self.ids[target.port])
        for server in self.masters:
            if server.port not in (source.port, target.port):
                with server.client() as c:
                    c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", self.ids[target.port])
        wait_until(self.is_ok, 30, 0.05, "the cluster to agree on the moved slot")

    def failover(self, master: RedisServer, timeout: float = 30.0) -> RedisServer:
        """``CLUSTER FAILOVER`` on a replica of ``master`` (a coordinated manual failover); the new master."""
        with master.client() as c:
            info = c.info("replication")
        ports = [int(v["port"]) for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)]
        if not ports:
            raise ValueError(f"node {master.port} has no replica to fail over to")
        replica = self.server(ports[0])
        with replica.client() as c:
            c.execute_command("CLUSTER", "FAILOVER")
        wait_until(lambda: _role(replica) == "master" and _role(master) == "slave", timeout, 0.05,
                   "the cluster failover")
        wait_until(self.is_ok, timeout, 0.05, "the cluster to agree on the failover")
        return replica

    def stop(self) -> None:
        for server in self.servers:
            server.stop()
            shutil.rmtree(server.dir, ignore_errors=True)

    def __enter__(self) -> RedisClusterDeployment:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
