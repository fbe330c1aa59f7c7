"""etcd's plumbing for the lock backend: the endpoints (:class:`Transport`) and the leases
(:class:`Session`, :class:`DoneLeases`).

The client is etcd3gw, which speaks etcd's gRPC-gateway JSON API over HTTP (requests): every
call here is one of its ``post`` calls on a documented gateway path (``/kv/txn``,
``/lease/grant``, ``/lease/keepalive``, ...). Several endpoints may be given: a call goes to the
one that last answered, and a member that does not answer (down, paused, without a leader) is
left for the next one at once, so a leader change costs one failed call, not a stall.

A :class:`Session` is etcd's concurrency Session: ONE lease per process (and lock TTL), on which
every lock of the process is put, and which the watchdog keeps alive with one keep-alive however
many locks hang on it. When the lease is gone, every lock on it is gone at once.
"""

from __future__ import annotations

import base64
import json
import math
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from ..engine.addresses import redact_url
from ..engine.lock import Backend, Lock, check_ttl
from ..exceptions import LockBackendRefused, LockBackendUnavailable, LockError

ETCD_SCHEMES = ("etcd", "etcds")
DEFAULT_TIMEOUT = 5.0
MIN_LEASE = 2
"""Seconds: the shortest lease asked for (etcd raises a shorter one to its own minimum anyway)."""


def parse_etcd_url(url: str) -> dict[str, Any]:
    """``etcd[s]://[user:password@]h1:p1[,h2:p2...][?timeout=s&ca_cert=..&cert_cert=..&cert_key=..]`` as
    Transport's arguments; a ValueError naming the bad part (the password never shown)."""
    shown = redact_url(url)
    parts = urlsplit(url)
    if parts.scheme not in ETCD_SCHEMES:
        raise ValueError(f"not an etcd URL (etcd:// or etcds://): {shown}")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    endpoints = []
    for item in hosts.split(","):
        host, sep, port = item.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"etcd URL {shown}: {item.strip() or '(empty)'!r} is not host:port")
        endpoints.append((host.strip("[]"), int(port)))
    if parts.path not in ("", "/"):
        raise ValueError(f"etcd URL {shown}: a path ({parts.path!r}) means nothing to etcd; the locks live under "
                         "their own key prefix")
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    unknown = set(query) - {"timeout", "ca_cert", "cert_cert", "cert_key"}
    if unknown:
        raise ValueError(f"etcd URL {shown}: unknown option(s) {', '.join(sorted(unknown))}")
    try:
        timeout = float(query.get("timeout", DEFAULT_TIMEOUT))
    except ValueError:
        raise ValueError(f"etcd URL {shown}: timeout={query['timeout']!r} is not a number of seconds") from None
    user, _, password = userinfo.partition(":")
    return {"endpoints": endpoints, "url": shown, "timeout": check_ttl(timeout, "etcd timeout"),
            "protocol": "https" if parts.scheme == "etcds" else "http", "ca_cert": query.get("ca_cert"),
            "cert_cert": query.get("cert_cert"), "cert_key": query.get("cert_key"),
            "user": unquote(user) or None, "password": unquote(password) or None}


def b64(data: str | bytes) -> str:
    """A key or value as the gateway's JSON wants it."""
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


class Transport:
    """The etcd cluster's endpoints, each an etcd3gw client; calls go to the one that last answered.

    ``timeout`` is each HTTP request's (connect and read). ``user``/``password`` authenticate
    (etcd's ``/auth/authenticate``) and the token is sent with every call, fetched again when
    etcd says it expired.
    """

    def __init__(self, endpoints: Sequence[tuple[str, int]], url: str, *, timeout: float = 5.0,
                 protocol: str = "http", ca_cert: str | None = None, cert_key: str | None = None,
                 cert_cert: str | None = None, user: str | None = None, password: str | None = None) -> None:
        with warnings.catch_warnings():  # its watch module's futurist warns about eventlet when installed
            warnings.simplefilter("ignore")
            try:
                import etcd3gw
            except ImportError as exc:
                raise ImportError(
                    f"singleton_lock_url {url!r} needs the etcd client, which is not installed: "
                    'pip install "celery-singleton-lock[etcd]"'
                ) from exc

        if not endpoints:
            raise ValueError(f"an etcd URL needs at least one host:port, got {url}")
        self.url = url
        self.timeout = timeout
        self.options: dict[str, Any] = {"protocol": protocol, "ca_cert": ca_cert, "cert_key": cert_key,
                                        "cert_cert": cert_cert}
        self.endpoints = list(endpoints)
        self._client_class = etcd3gw.Etcd3Client
        self.clients = self._connect()
        self.user, self.password = user, password
        self._current = 0
        self._auth = threading.Lock()

    def _connect(self) -> list[Any]:
        """One etcd3gw client (its own requests session) per endpoint, for this process."""
        self._pid = os.getpid()
        return [self._client_class(host=h, port=p, timeout=self.timeout, api_path="/v3/", **self.options)
                for h, p in self.endpoints]

    def twin(self, timeout: float) -> Transport:
        """The same endpoints and credentials on new connections whose requests time out after ``timeout``."""
        return Transport(self.endpoints, self.url, timeout=timeout, user=self.user, password=self.password,
                         **self.options)

    def client(self) -> Any:
        """The etcd3gw client of the endpoint that answered last (a watch takes its TLS and auth)."""
        return self.clients[self._current]

    def close(self) -> None:
        for client in self.clients:
            client.session.close()

    def call(self, path: str, body: dict[str, Any], key: str = "") -> dict[str, Any]:
        """POST ``body`` to the gateway ``path`` on the current endpoint; on a connection failure, on the
        others in turn (each at most once). A timeout or an error reply is raised at once as ours:
        the request may have run, and only its caller knows whether sending it again is safe."""
        from etcd3gw import exceptions as ex

        if self._pid != os.getpid():  # a forked child never shares its parent's sockets
            self.clients = self._connect()
        first = self._current
        errors: list[str] = []
        for step in range(len(self.clients)):
            i = (first + step) % len(self.clients)
            client = self.clients[i]
            try:
                if self.user and "Authorization" not in client.session.headers:
                    self._authenticate(client)
                reply: dict[str, Any] = client.post(client.get_url(path), json=body)
                self._current = i
                return reply
            except ex.ConnectionFailedError as exc:  # refused, or the member has no leader (503)
                errors.append(f"{self.endpoints[i][0]}:{self.endpoints[i][1]}: {_short(exc)}")
                continue
            except ex.ConnectionTimeoutError as exc:
                self._current = (i + 1) % len(self.clients)  # the next call tries another member first
                raise LockBackendUnavailable(self.url, f"etcd did not answer in {self.timeout:g}s: "
                                             f"{_short(exc)}") from None
            except ex.Etcd3Exception as exc:
                raise self.refusal(exc, client, key) from None
        raise LockBackendUnavailable(self.url, "no etcd endpoint answered: " + "; ".join(errors))

    def refusal(self, exc: Exception, client: Any, key: str) -> LockError:
        text = _short(exc)
        if "token" in text and ("invalid" in text or "expired" in text):
            client.session.headers.pop("Authorization", None)  # fetched again on the next call
            return LockBackendUnavailable(self.url, f"etcd auth token expired: {text}")
        if "lease not found" in text:
            return LeaseGone(self.url, text)
        if "permission denied" in text or "authentication failed" in text or "user name" in text:
            return LockBackendRefused(self.url, f"etcd refused{f' key {key}' if key else ''}: {text}")
        return LockBackendUnavailable(self.url, f"etcd answered an error{f' for {key}' if key else ''}: {text}")

    def _authenticate(self, client: Any) -> None:
        with self._auth:
            if "Authorization" in client.session.headers:
                return
            body = {"name": self.user, "password": self.password}
            reply = client.post(client.get_url("/auth/authenticate"), json=body)
            client.session.headers["Authorization"] = reply["token"]

    def txn(self, compare: list[dict[str, Any]], success: list[dict[str, Any]],
            failure: list[dict[str, Any]], key: str = "") -> dict[str, Any]:
        return self.call("/kv/txn", {"compare": compare, "success": success, "failure": failure}, key)


class LeaseGone(LockBackendUnavailable):
    """etcd does not know the lease a put named: it expired (the session is then started again)."""


def _short(exc: Exception) -> str:
    """etcd's own words for an error (the gateway's JSON ``error``/``message``), else the HTTP reason."""
    detail = getattr(exc, "detail_text", None) or ""
    try:
        body = json.loads(detail) if detail else {}
    except ValueError:
        body = {}
    said = (body.get("error") or body.get("message")) if isinstance(body, dict) else None
    text = str(said) if said else " ".join([detail[:200], *(str(a) for a in exc.args)]).strip()
    return text[:300] or type(exc).__name__


Keeper = Callable[["Session", Sequence[Lock], float], tuple[bool | LockError, list[Lock]]]
"""What keeps a session alive for the watchdog (the server's ``keep_session``)."""


class Session:
    """One lease, kept alive for every lock put on it (etcd's concurrency Session): the watchdog's
    :class:`~celery_singleton_lock.engine.lock.Shared`.

    ``confirmed_at`` is the monotonic send time of the grant or of the last keep-alive that
    etcd answered with a live TTL: the lease lives at least ``ttl`` seconds past it."""

    def __init__(self, ttl: int, keeper: Keeper) -> None:
        self.ttl = ttl
        self.keeper = keeper
        self.lease = 0
        self.confirmed_at = 0.0
        self.locks: weakref.WeakSet[Lock] = weakref.WeakSet()
        self.lost_reason: str | None = None
        self.guard = threading.Lock()
        self.keepalives = 0
        """Keep-alives sent on this session (tests and the benchmark count them)."""

    def keep(self, locks: Sequence[Lock], timeout: float) -> tuple[bool | LockError, list[Lock]]:
        return self.keeper(self, locks, timeout)

    def new_lock(self, server: Backend, key: str, token: str, revision: int, owner_id: str | None,
                 confirmed: float) -> Lock:
        """The handle of a lock just put on this session's lease (confirmed with it from now on)."""
        lock = SessionLock(server, key, token, revision, float(self.ttl), owner_id, confirmed_at=confirmed,
                           lease=self.lease, shared=self)
        self.locks.add(lock)
        return lock

    def ensure(self, transport: Transport, fresh_for: float) -> None:
        """Grant the lease if there is none; keep it alive first if its confirmation is older than
        ``fresh_for`` (an idle session: a lock put on it must live as long as its handle says)."""
        with self.guard:
            if self.lease and time.monotonic() - self.confirmed_at < fresh_for:
                return
            if self.lease and self.keepalive(transport):
                return
            sent = time.monotonic()
            reply = transport.call("/lease/grant", {"TTL": str(self.ttl), "ID": "0"})
            if reply.get("error"):
                raise LockBackendUnavailable(transport.url, f"etcd granted no lease: {reply['error']}")
            self.lease, self.confirmed_at, self.lost_reason = int(reply["ID"]), sent, None

    def keepalive(self, transport: Transport) -> bool:
        """One keep-alive of the lease: True alive (``confirmed_at`` moved to the send time), False gone
        (every lock on it is marked lost, and the next acquire starts a new lease)."""
        lease = self.lease
        if not lease:
            return False
        sent = time.monotonic()
        self.keepalives += 1
        reply = transport.call("/lease/keepalive", {"ID": str(lease)})
        ttl = int((reply.get("result") or {}).get("TTL", 0) or 0)
        if ttl > 0:
            if self.lease == lease:
                self.confirmed_at = max(self.confirmed_at, sent)
            return True
        self.drop(lease, "its etcd lease expired (the session's keep-alive found it gone)")
        return False

    def drop(self, lease: int, reason: str) -> None:
        """The lease is gone: every lock on it is lost at once, and the session starts afresh."""
        if self.lease != lease:
            return
        self.lease, self.confirmed_at, self.lost_reason = 0, 0.0, reason
        for lock in list(self.locks):
            if not lock.released:
                lock.mark_lost(reason, defer=True)
        self.locks = weakref.WeakSet()

    def revoke(self, transport: Transport) -> None:
        """Give the lease back (its locks go with it): at exit, a clean stop frees them at once."""
        lease, self.lease = self.lease, 0
        if lease:
            try:
                transport.call("/kv/lease/revoke", {"ID": str(lease)})
            except LockError:
                pass  # it expires within its TTL


def lease_ttl(ttl: float) -> int:
    """The lease (whole seconds, at least MIN_LEASE) that holds a lock of ``ttl`` seconds."""
    return max(MIN_LEASE, math.ceil(ttl))


class DoneLeases:
    """Leases for done records, shared by every record of one lifetime granted within a window.

    A record kept ``remember`` seconds is put on a lease of ``remember + window`` seconds granted
    at most ``window`` seconds earlier (window: a tenth of ``remember``, 1 s to 60 s): one grant per
    window instead of one per task, and every record lives between ``remember`` and
    ``remember + window`` seconds."""

    def __init__(self) -> None:
        self._leases: dict[int, tuple[int, float]] = {}  # remember s -> (lease id, reusable until)
        self._guard = threading.Lock()
        self._pid = os.getpid()

    def lease_for(self, transport: Transport, remember: float) -> int:
        seconds = max(1, math.ceil(remember))
        window = min(60.0, max(1.0, seconds / 10))
        now = time.monotonic()
        with self._guard:
            if self._pid != os.getpid():
                self._leases, self._pid = {}, os.getpid()
            lease, until = self._leases.get(seconds, (0, 0.0))
            if lease and now < until:
                return lease
            reply = transport.call("/lease/grant", {"TTL": str(seconds + math.ceil(window)), "ID": "0"})
            lease = int(reply["ID"])
            self._leases[seconds] = (lease, now + window)
            return lease


class SessionLock(Lock):
    """A lock put on a session's lease. It is confirmed whenever its lease is (while the session
    still has that lease), so keeping the session alive keeps it alive: the watchdog renews the
    session, once per period, and never the lock itself."""

    _confirmed = 0.0

    @property
    def confirmed_at(self) -> float:
        session = self.shared
        if session is not None and session.lease == self.lease and session.confirmed_at > self._confirmed:
            return session.confirmed_at
        return self._confirmed

    @confirmed_at.setter
    def confirmed_at(self, value: float) -> None:
        self._confirmed = value


class Sessions:
    """The process's sessions by lease TTL; a forked child starts with none (its parent's leases are not its)."""

    def __init__(self, keeper: Keeper) -> None:
        self.keeper = keeper
        self._by_ttl: dict[int, Session] = {}
        self._pid = os.getpid()
        self._guard = threading.Lock()

    def get(self, seconds: int) -> Session:
        with self._guard:
            if self._pid != os.getpid():
                self._by_ttl, self._pid = {}, os.getpid()
            found = self._by_ttl.get(seconds)
            if found is None:
                found = self._by_ttl[seconds] = Session(seconds, self.keeper)
            return found

    def all(self) -> list[Session]:
        with self._guard:
            return list(self._by_ttl.values()) if self._pid == os.getpid() else []
