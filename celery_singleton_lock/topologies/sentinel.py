"""Sentinel: a master watched by Sentinels, followed across a failover.

:class:`SentinelLockServer` is a :class:`~celery_singleton_lock.engine.server.LockServer` on
redis-py's ``Sentinel.master_for`` client, whose connections ask the Sentinels for the
master each time they (re)connect, plus a per-process listener of Sentinel's
``+switch-master`` that moves every held connection to the new master at once (redis-py
alone moves only on a READONLY reply, which leaves the old master granting locks for
seconds). See docs/operations/topologies.md for what holds across a failover.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import (
    RedisError,
)
from redis.retry import Retry
from redis.sentinel import Sentinel

from ..engine import exchange
from ..engine.addresses import redact_url
from ..engine.server import DEFAULT_CLIENT_OPTIONS, LockServer

logger = logging.getLogger("celery_singleton_lock")


# -- Sentinel ---------------------------------------------------------------------------------------


class _SwitchWatch:
    """Sentinel's ``+switch-master`` announcements for one master, heard by one thread per process.

    After a failover the old master stays a master until Sentinel demotes it (about ten
    seconds later), and a connection kept to it meanwhile still takes locks there while
    processes that connect anew lock on the new master. Hearing the switch lets every
    held connection move at once, to the address the announcement names. One
    subscription, to one Sentinel (the next one when it fails): any Sentinel announces
    a switch only once it adopted the new configuration.
    """

    def __init__(self, addresses: Sequence[tuple[str, int]], master_name: str,
                 sentinel_kwargs: dict[str, Any] | None) -> None:
        self.addresses = list(addresses)
        self.master_name = master_name
        self.sentinel_kwargs = dict(sentinel_kwargs or {})
        self.generation = 0
        """Switches heard so far in this process."""
        self.address: tuple[str, int] | None = None
        """Where the last announced master is."""
        self.pid = -1
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def ensure_running(self) -> None:
        if self.pid == os.getpid():
            return
        with self._lock:
            if self.pid == os.getpid():
                return
            self.pid = os.getpid()
            self._stop = stop = threading.Event()
            threading.Thread(target=self._run, args=(stop,), name="celery-singleton-lock-sentinel-watch",
                             daemon=True).start()

    def stop(self) -> None:
        with self._lock:
            self._stop.set()
            self.pid = -1

    def _run(self, stop: threading.Event) -> None:
        options = {k: v for k, v in self.sentinel_kwargs.items() if k not in ("socket_timeout",)}
        options.setdefault("socket_connect_timeout", 5.0)
        turn = 0
        while not stop.is_set():
            host, port = self.addresses[turn % len(self.addresses)]
            turn += 1
            client = redis.Redis(host=host, port=port, **options)
            try:
                pubsub = client.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe("+switch-master")
                while not stop.is_set():
                    message = pubsub.get_message(timeout=0.5)
                    if message is not None:
                        self._heard(message.get("data"))
            except (RedisError, OSError) as exc:
                logger.debug("listening for Sentinel switches on %s:%s failed: %s", host, port, exc)
                stop.wait(1.0)
            finally:
                try:
                    client.close()
                except Exception:
                    pass

    def _heard(self, data: Any) -> None:
        text = data.decode() if isinstance(data, bytes) else str(data)
        parts = text.split()  # "<master name> <old ip> <old port> <new ip> <new port>"
        if len(parts) == 5 and parts[0] == self.master_name and parts[4].isdigit():
            self.address = (parts[3], int(parts[4]))
            self.generation += 1
            logger.warning("Sentinel switched master %s from %s:%s to %s:%s: locks follow", *parts)


class SentinelLockServer(LockServer):
    """The lock operations against the master a set of Sentinels names (redis-py's ``master_for``).

    Celery's URL form, ``sentinel://[:password@]host:port/db;sentinel://host:port/db;...``: the
    password and db of the first part are the master's; the master's name and the Sentinels' own
    connection options come from the transport options (``master_name``, ``sentinel_kwargs``,
    ``min_other_sentinels``), as for Celery's ``result_backend_transport_options``.

    Both the hot path and the batched renewals run on connections each thread keeps. They
    move to the new master as soon as a Sentinel announces a switch (:class:`_SwitchWatch`),
    and in any case on a READONLY reply from a demoted master or a lost connection.
    """

    follow_switches = True
    """Listen for Sentinel's switch announcements (False: only READONLY / a lost connection move a
    connection, as with redis-py alone; kept for measuring what listening buys)."""

    def __init__(
        self,
        sentinels: Sequence[tuple[str, int]],
        master_name: str,
        *,
        url: str,
        connection_kwargs: dict[str, Any],
        sentinel_kwargs: dict[str, Any] | None = None,
        min_other_sentinels: int = 0,
        watch: _SwitchWatch | None = None,
    ) -> None:
        if not isinstance(master_name, str) or not master_name:
            raise ValueError(
                f"a Sentinel lock URL ({redact_url(url)}) needs the master's name: set "
                "singleton_lock_transport_options = {'master_name': 'mymaster'} (or the result backend's / "
                f"broker's transport options the URL comes from); got master_name={master_name!r}"
            )
        self.sentinel_addresses = [(str(h), int(p)) for h, p in sentinels]
        self.master_name = master_name
        self._connection_kwargs = dict(connection_kwargs)
        self._sentinel_kwargs = None if sentinel_kwargs is None else dict(sentinel_kwargs)
        self._min_other_sentinels = min_other_sentinels
        self.sentinel = Sentinel(
            self.sentinel_addresses, min_other_sentinels=min_other_sentinels, sentinel_kwargs=self._sentinel_kwargs,
            **self._connection_kwargs,
        )
        self._watch = watch or _SwitchWatch(self.sentinel_addresses, master_name, self._sentinel_kwargs)
        super().__init__(self.sentinel.master_for(master_name), url=url)

    def _held_conn(self) -> Any:
        """This thread's connection to the master: moved when a switch was announced, reconnected
        through the Sentinels when it was closed."""
        watch = self._watch
        if watch.pid != os.getpid() and self.follow_switches:
            watch.ensure_running()
        held = self._held
        conn = getattr(held, "conn", None)
        if conn is None or conn.pid != os.getpid():
            conn = held.conn = exchange.checkout(self.client.connection_pool)
            held.generation = watch.generation
        elif getattr(held, "generation", 0) != watch.generation:
            held.generation = watch.generation
            conn.disconnect()
            address = watch.address
            if address is not None:
                try:
                    conn.connect_to(address)  # where the announcement says, not a Sentinel that lags
                except RedisConnectionError:
                    conn.disconnect()
        if not conn.is_connected:
            conn.connect()  # asks the Sentinels (send_packed_command alone would not)
        return conn

    @classmethod
    def from_url(cls, url: str, transport_options: dict[str, Any] | None = None,
                 **client_options: Any) -> SentinelLockServer:
        options = dict(transport_options or {})
        unknown = set(options) - {"master_name", "sentinel_kwargs", "min_other_sentinels"}
        if unknown:
            raise ValueError(
                f"singleton_lock_transport_options: unknown option(s) {sorted(unknown)}; a Sentinel lock URL takes "
                "master_name, sentinel_kwargs and min_other_sentinels"
            )
        sentinel_kwargs = options.get("sentinel_kwargs")
        if sentinel_kwargs is not None and not isinstance(sentinel_kwargs, dict):
            raise ValueError(f"transport option sentinel_kwargs must be a dict, got {sentinel_kwargs!r}")
        min_other = options.get("min_other_sentinels", 0)
        if isinstance(min_other, bool) or not isinstance(min_other, int) or min_other < 0:
            raise ValueError(f"transport option min_other_sentinels must be an int >= 0, got {min_other!r}")
        parts = [p for p in url.split(";") if p.strip()]
        hosts: list[tuple[str, int]] = []
        for part in parts:
            split = urlsplit(part.strip())
            hosts.append((split.hostname or "localhost", split.port or 26379))
        first = urlsplit(parts[0].strip())
        kwargs: dict[str, Any] = dict(DEFAULT_CLIENT_OPTIONS)
        db = first.path.strip("/")
        kwargs["db"] = int(db) if db else 0
        if first.password is not None:
            kwargs["password"] = unquote(first.password)
        if first.username:
            kwargs["username"] = unquote(first.username)
        kwargs.update(client_options)
        name = options.get("master_name", "")
        return cls(hosts, name, url=f"{redact_url(url)} (master {name})", connection_kwargs=kwargs,
                   sentinel_kwargs=sentinel_kwargs, min_other_sentinels=min_other)

    def _twin(self, seconds: float) -> LockServer:
        """Its own Sentinel manager and master pool, every socket (the Sentinels' too) timing out in ``seconds``."""
        kwargs = dict(self._connection_kwargs)
        kwargs.update(socket_timeout=seconds, socket_connect_timeout=seconds, retry=Retry(NoBackoff(), 0))
        if self._sentinel_kwargs is None:
            sentinel_kwargs = None  # redis-py copies the socket_* options from kwargs
        else:
            sentinel_kwargs = dict(self._sentinel_kwargs)
            for name in ("socket_timeout", "socket_connect_timeout"):
                given = sentinel_kwargs.get(name)
                sentinel_kwargs[name] = seconds if given is None else min(float(given), seconds)
        twin = SentinelLockServer(
            self.sentinel_addresses, self.master_name, url=self.url, connection_kwargs=kwargs,
            sentinel_kwargs=sentinel_kwargs, min_other_sentinels=self._min_other_sentinels, watch=self._watch,
        )
        twin.follow_switches = self.follow_switches
        return twin

    def close(self) -> None:
        """Close the connections and stop listening for switches (both start again on the next operation)."""
        super().close()
        self.sentinel.close()
        self._watch.stop()


