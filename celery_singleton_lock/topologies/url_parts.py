"""One Redis URL as redis-py reads it: Celery's spellings translated (``redis+socket://``,
``virtual_host``, ``ssl_cert_reqs=required``...), what cannot work refused with a clear error, and
a Sentinel or Cluster URL's parts checked. Pure functions; :mod:`.urls` decides which URL to use.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote, unquote, unquote_plus, urlsplit

from ..engine.addresses import redact_url

_CERT_REQS = {
    "CERT_REQUIRED": "required", "CERT_OPTIONAL": "optional", "CERT_NONE": "none",
    "required": "required", "optional": "optional", "none": "none",
}
"""Celery's (and kombu's) spellings of ``ssl_cert_reqs`` -> the ones redis-py's SSLConnection takes."""

SSL_PATHS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")


def shown_url(value: Any) -> str:
    """``value`` for an error message, every password masked."""
    if isinstance(value, (list, tuple)):
        return repr([redact_url(str(v)) for v in value])
    return repr(redact_url(value)) if isinstance(value, str) else repr(value)


def _split(url: str) -> tuple[str, Any]:
    """The URL as shown in errors (redacted), and its parts; a clear ValueError where a parser would
    misread it (a raw '#', or a port that is not a number)."""
    shown = shown_url(url)
    if "#" in url:
        raise ValueError(f"{shown} has a '#', which ends a URL: percent-encode a '#' in a password as %23")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:
        # not the parser's message: with a raw '/' or '?' in a password, the "port" it quotes is the password
        raise ValueError(
            f"{shown} is not a valid URL: its port is not a number (percent-encode '/', '?', '#' and '@' "
            "in a password)"
        ) from None
    return shown, parts


def sentinel_part(url: str) -> str:
    """One ``sentinel://[:password@]host:port[/db]``, checked: a host, a numeric port and db, no query."""
    shown, parts = _split(url)
    port = parts.port
    if not parts.hostname:
        raise ValueError(f"{shown} names no Sentinel host: sentinel://host:26379/db")
    if parts.query:
        raise ValueError(
            f"{shown}: a Sentinel URL takes no query string ({parts.query!r}); give client options in "
            "singleton_lock_redis_options and the Sentinels' own in singleton_lock_transport_options['sentinel_kwargs']"
        )
    db = parts.path.strip("/")
    if db and not (db.isascii() and db.isdigit()):
        raise ValueError(f"database {db!r} in {shown} is not a number (the path of a Sentinel URL is its database)")
    return f"sentinel://{parts.netloc}/{db or 0}" if port else f"sentinel://{parts.netloc}:26379/{db or 0}"


def cluster_url(url: str) -> str:
    """``redis+cluster://[user:password@]h1:p1[,h2:p2...][/0][?query]``, checked (the query as for one Redis)."""
    scheme, _, rest = url.partition("://")
    end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    authority, tail = rest[:end], rest[end:]
    userinfo, at, hosts = authority.rpartition("@")
    if not hosts:
        raise ValueError(f"{shown_url(url)} names no node: redis+cluster://host:6379[,host:6379...]")
    single = "rediss" if scheme == "rediss+cluster" else "redis"
    for node in hosts.split(","):
        host, colon, port = node.rpartition(":")
        if not colon or not host or not (port.isascii() and port.isdigit()):
            raise ValueError(f"node {node!r} in {shown_url(url)} is not host:port")
    checked = one_redis_url(f"{single}://{userinfo}{at}{hosts.split(',')[0]}{tail}")
    path, _, _query = tail.partition("?")
    if path.strip("/") not in ("", "0"):
        raise ValueError(f"{shown_url(url)}: a Redis Cluster has only database 0, the URL names {path.strip('/')!r}")
    _, _, checked_tail = checked.partition("://")
    query = checked_tail.partition("?")[2]
    return f"{scheme}://{userinfo}{at}{hosts}" + (f"?{query}" if query else "")


def one_redis_url(url: str) -> str:
    """:func:`redis_url_for` of one Redis server."""
    shown, parts = _split(url)
    query, virtual_host, db_in_query = _query_for_redis_py(parts.query, parts.scheme, shown)
    scheme, path = parts.scheme, parts.path
    if scheme in ("redis", "rediss"):
        db = unquote(path).strip("/")
        if db and not (db.isascii() and db.isdigit()):
            raise ValueError(f"database {db!r} in {shown} is not a number (the path of a Redis URL is its database)")
    elif scheme == "redis+socket":
        host = parts.netloc.rpartition("@")[2]
        if host or not path.strip("/"):
            raise ValueError(f"{shown} needs an absolute socket path: redis+socket:///path/to/redis.sock")
        if virtual_host is not None and not db_in_query and virtual_host.strip("/"):
            db = virtual_host.strip("/")
            if not (db.isascii() and db.isdigit()):
                raise ValueError(f"virtual_host={virtual_host!r} in {shown} is not a database number")
            query.append(f"db={db}")
        scheme = "unix"
    return f"{scheme}://{parts.netloc}{path}" + (f"?{'&'.join(query)}" if query else "")


def _query_for_redis_py(raw_query: str, scheme: str, shown: str) -> tuple[list[str], str | None, bool]:
    """A URL's query as redis-py reads it (Celery's spellings translated, what cannot work refused):
    the segments kept, a ``virtual_host`` found (a socket URL's database), whether ``db`` was given."""
    tls = scheme == "rediss"
    query: list[str] = []
    db_in_query = False
    virtual_host = None
    for segment in raw_query.split("&"):
        if not segment:
            continue
        raw_name, _, raw_value = segment.partition("=")
        name, value = unquote_plus(raw_name), unquote_plus(raw_value)
        if name.startswith("ssl_") and not tls:
            raise ValueError(f"{name} in {shown}: TLS settings need a rediss:// URL")
        if name == "ssl_cert_reqs" and value:
            mapped = _CERT_REQS.get(unquote(value))
            if mapped is None:
                raise ValueError(
                    f"ssl_cert_reqs={value!r} in {shown} is not one of CERT_REQUIRED, CERT_OPTIONAL, CERT_NONE "
                    "(or required, optional, none)"
                )
            segment = f"{raw_name}={mapped}"
        elif name in SSL_PATHS and value:
            segment = f"{raw_name}={quote(unquote(value), safe='/')}"
        elif name == "virtual_host":
            if scheme != "redis+socket":
                raise ValueError(
                    f"virtual_host={value!r} in {shown}: in a {scheme}:// URL the database is the path "
                    f"({scheme}://host:port/N)"
                )
            virtual_host = value
            continue
        elif name == "credential_provider":
            raise ValueError(
                f"credential_provider={value!r} in {shown} cannot reach redis-py through a URL: set "
                "singleton_lock_url without it and singleton_lock_redis_options={'credential_provider': ...}"
            )
        elif name == "db":
            db_in_query = True
        query.append(segment)
    return query, virtual_host, db_in_query
