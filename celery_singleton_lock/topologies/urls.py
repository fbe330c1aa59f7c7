"""Where the locks live: the lock URL from the app's settings, with Celery's URL spellings
translated for redis-py.

A lock URL names one Redis (``redis://``, ``rediss://``, ``unix://``, ``redis+socket://``), a
Sentinel-watched master in Celery's own form (``sentinel://[:password@]host:port/db;sentinel://...``;
the master name comes from the transport options), or a Redis Cluster
(``redis+cluster://host:port[,host:port...]``, ``rediss+cluster://``). Which client each gets is
:mod:`celery_singleton_lock.topologies.servers`' business.

Pure functions of the settings; the eviction-policy check, which asks the server, is in
:mod:`celery_singleton_lock.topologies.servers`.
"""

from __future__ import annotations

from typing import Any

from ..engine.addresses import split_url_list
from .url_parts import SSL_PATHS, cluster_url, one_redis_url, sentinel_part, shown_url


def _is_redis(url: Any) -> bool:
    """True for the URL of a Redis deployment the locks can use (after :func:`redis_url_for`).

    The schemes are spelled out: ``redis``, ``rediss`` and ``unix`` (redis-py's own),
    ``redis+socket`` (Celery's and kombu's spelling of a Unix socket), ``sentinel`` (one or
    several Sentinels, ``;``-separated or a list: they all name the same master) and
    ``redis+cluster`` / ``rediss+cluster``. Not a ``;``-separated or list failover of plain
    Redis URLs: hosts that fail over at different times would lock on different servers.
    """
    return _not_one_redis(url) is None


def lock_url(conf: Any) -> str:
    """The lock URL (see :func:`lock_source`)."""
    return lock_source(conf)[0]


def lock_source(conf: Any) -> tuple[str, str]:
    """``(url, the setting it came from)``: ``singleton_lock_url``, else a Redis result backend, else a
    Redis broker, else a ValueError.

    There is no ``localhost`` default: with an AMQP broker and no Redis anywhere in the
    config, each host would lock on its own local Redis and nothing would be exclusive
    across hosts. Every URL returned has been through :func:`redis_url_for`, so Celery's
    spellings (``ssl_cert_reqs=CERT_REQUIRED``, ``redis+socket://``) reach redis-py right.
    """
    url = conf.get("singleton_lock_url")
    if isinstance(url, str) and topology(url) == "etcd":  # an etcd cluster (etcd.py), parsed there
        return url.strip(), "singleton_lock_url"
    members = quorum_members(url)
    if members:  # N independent masters: a Redlock quorum (quorum.py)
        return ";".join(_translated("singleton_lock_url", m) for m in members), "singleton_lock_url"
    if url:
        reason = _not_one_redis(url)
        if reason is not None:
            raise ValueError(
                "setting singleton_lock_url must be the URL of one Redis server (redis://, rediss://, unix:// "
                "or redis+socket://), of its Sentinels (sentinel://h1:26379/0;sentinel://h2:26379/0) or of a "
                f"Redis Cluster (redis+cluster://h1:6379,h2:6379), got {shown_url(url)}: {reason}"
            )
        return _translated("singleton_lock_url", _joined(url)), "singleton_lock_url"
    looked = []
    for setting, ssl_setting in (("result_backend", "redis_backend_use_ssl"), ("broker_url", "broker_use_ssl")):
        candidate = _celery_url(conf, setting)
        reason = _not_one_redis(candidate)
        if reason is None:
            return _translated(setting, _with_use_ssl(_joined(candidate), conf.get(ssl_setting), ssl_setting)), setting
        looked.append(f"{setting} {shown_url(candidate)} is {reason}" if candidate else f"{setting} is unset")
    raise ValueError(
        "no Redis for the locks: set singleton_lock_url to the URL of the Redis every worker shares "
        "(e.g. redis://redis.example:6379/2). It is unset, and neither fallback can hold the locks: "
        + "; ".join(looked)
        + ". There is no localhost default: a Redis per host would not stop two hosts running the same task."
    )


# -- the lock URL: which settings may provide it, and how Celery's spellings reach redis-py ---------

_REDIS_SCHEMES = ("redis", "rediss", "unix", "redis+socket")
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
SENTINEL_SCHEME = "sentinel"
ETCD_SCHEMES = ("etcd", "etcds")

TRANSPORT_OPTIONS_OF = {
    "singleton_lock_url": "singleton_lock_transport_options",
    "result_backend": "result_backend_transport_options",
    "broker_url": "broker_transport_options",
}
"""Where the Sentinel options (``master_name``, ``sentinel_kwargs``, ``min_other_sentinels``) of each
source of the lock URL are read from: Celery's own settings for its result backend and broker."""
SENTINEL_OPTIONS = ("master_name", "sentinel_kwargs", "min_other_sentinels")


def topology(url: str) -> str:
    """``"sentinel"``, ``"cluster"``, ``"quorum"``, ``"etcd"`` or ``"redis"``, for a URL :func:`lock_url` returned."""
    scheme = url.partition("://")[0].strip().lower()
    if scheme in ETCD_SCHEMES:
        return "etcd"
    if scheme == SENTINEL_SCHEME:
        return "sentinel"
    if scheme in CLUSTER_SCHEMES:
        return "cluster"
    if len(split_url_list(url)) > 1:
        return "quorum"
    return "redis"


def quorum_members(url: Any) -> list[str] | None:
    """The members of ``singleton_lock_url`` when it names several plain Redis servers (a list, or
    ``;``-separated): a quorum of independent masters. None otherwise; a ValueError if it names
    fewer than 3, or anything but plain Redis."""
    if isinstance(url, (list, tuple)):
        parts = [str(u) for u in url]
    elif isinstance(url, str):
        parts = split_url_list(url)
    else:
        return None
    if len(parts) < 2 or any(p.strip().partition("://")[0] == SENTINEL_SCHEME for p in parts):
        return None
    if len(parts) < 3:
        raise ValueError(
            "setting singleton_lock_url names 2 Redis servers: a quorum of independent masters needs at least 3 "
            "(a majority of 2 is both), got " + ", ".join(shown_url(p) for p in parts)
        )
    for part in parts:
        reason = _not_one_redis(part)
        if reason is not None or part.partition("://")[0] in CLUSTER_SCHEMES:
            raise ValueError(
                f"setting singleton_lock_url: every member of a quorum must be one plain Redis server, "
                f"got {shown_url(part)}: {reason or 'a Redis Cluster'}"
            )
    return [p.strip() for p in parts]


def transport_options(conf: Any, source: str) -> dict[str, Any]:
    """The lock server's transport options: those of the setting the URL came from (Celery's
    ``result_backend_transport_options`` / ``broker_transport_options``, Sentinel keys only), overridden
    by ``singleton_lock_transport_options``."""
    own = conf.get("singleton_lock_transport_options") or {}
    if not isinstance(own, dict):
        raise ValueError(f"setting singleton_lock_transport_options must be a dict, got {own!r}")
    options: dict[str, Any] = {}
    inherited_from = TRANSPORT_OPTIONS_OF.get(source)
    if inherited_from and inherited_from != "singleton_lock_transport_options":
        inherited = conf.get(inherited_from) or {}
        if isinstance(inherited, dict):
            options.update({k: v for k, v in inherited.items() if k in SENTINEL_OPTIONS})
    options.update(own)
    return options


def _joined(url: Any) -> str:
    """A list of Sentinel URLs (kombu's failover list) as Celery's ``;``-separated string."""
    if isinstance(url, (list, tuple)):
        return ";".join(str(u) for u in url)
    return str(url)

def _not_one_redis(url: Any) -> str | None:
    """Why ``url`` cannot be the locks' Redis (None when it can): the reason ends up in the error."""
    if isinstance(url, (list, tuple)):
        if len(url) == 1:
            return _not_one_redis(url[0])
        if url and all(isinstance(u, str) and u.partition("://")[0] == SENTINEL_SCHEME for u in url):
            return _not_one_redis(";".join(url))
        return "several URLs (a failover list), but the locks need one server" if url else "unset"
    if url is None or url == "":
        return "unset"
    if not isinstance(url, str):
        return f"not a URL but a {type(url).__name__}"
    scheme, sep, _ = url.partition("://")
    if not sep:
        return "not a URL"
    parts = split_url_list(url)
    if scheme == SENTINEL_SCHEME:
        others = [p for p in parts if p.strip().partition("://")[0] != SENTINEL_SCHEME]
        if others:
            return f"a mix of Sentinel and other URLs ({shown_url(others[0])})"
        return None
    if len(parts) > 1:
        return "several URLs (a failover list), but the locks need one server"
    if scheme in CLUSTER_SCHEMES:
        return None
    if scheme not in _REDIS_SCHEMES:
        return "not Redis" + (" (Sentinel is spelt sentinel://)" if "sentinel" in scheme else "")
    return None


def _celery_url(conf: Any, setting: str) -> Any:
    """A URL setting as Celery reads it: its properties put CELERY_BROKER_URL / CELERY_RESULT_BACKEND first."""
    try:
        return getattr(conf, setting)
    except AttributeError:  # a plain mapping
        return conf.get(setting)


def _translated(setting: str, url: str) -> str:
    try:
        return redis_url_for(url)
    except ValueError as exc:
        raise ValueError(f"setting {setting}: {exc}") from None


def _with_use_ssl(url: str, options: Any, setting: str) -> str:
    """Fold Celery's ``redis_backend_use_ssl`` / kombu's ``broker_use_ssl`` into an inherited URL.

    Celery and kombu take TLS settings from that dict as well as from the URL (the URL's
    query wins), and a dict makes even a ``redis://`` URL TLS. Inheriting the URL without
    them would verify against the wrong CA, or talk plain TCP to a TLS port.
    """
    import ssl
    from urllib.parse import parse_qsl, quote, urlsplit

    scheme, _, rest = url.partition("://")
    if not options or not isinstance(options, dict) or scheme not in ("redis", "rediss"):
        return url  # Celery and kombu ignore (or fail on) anything else: nothing to carry over
    query = urlsplit(url).query
    present = {name for name, _ in parse_qsl(query, keep_blank_values=True)}
    modes: dict[int | None, str] = {
        None: "none", int(ssl.CERT_NONE): "none", int(ssl.CERT_OPTIONAL): "optional",
        int(ssl.CERT_REQUIRED): "required",
    }
    extra = []
    for key, value in options.items():
        if key in present:
            continue
        if key == "ssl_cert_reqs" and not isinstance(value, str):
            text = modes.get(value) if isinstance(value, (int, type(None))) else None
            if text is None:
                raise ValueError(
                    f"setting {setting}: ssl_cert_reqs={value!r} is not ssl.CERT_REQUIRED, CERT_OPTIONAL or CERT_NONE"
                )
        elif value is None:
            continue
        elif isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, (str, int, float)):
            text = str(value)
        else:
            raise ValueError(
                f"setting {setting}: {key}={value!r} cannot be carried into the lock URL; set singleton_lock_url "
                "and pass it in singleton_lock_redis_options"
            )
        if key in SSL_PATHS:
            text = quote(text, safe="")  # redis_url_for decodes these twice, as Celery does with a URL's
        extra.append(f"{quote(str(key), safe='')}={quote(text, safe='')}")
    if not extra:
        return f"rediss://{rest}"
    joiner = "&" if query else ("" if url.endswith("?") else "?")
    return f"rediss://{rest}{joiner}{'&'.join(extra)}"


def redis_url_for(url: str) -> str:
    """The URL redis-py's ``Redis.from_url`` must get to reach the server Celery reaches with ``url``.

    Celery's Redis backend and kombu's transport read a few things redis-py does not:

    * ``ssl_cert_reqs=CERT_REQUIRED|CERT_OPTIONAL|CERT_NONE`` (redis-py wants
      ``required|optional|none`` and fails every connection on anything else);
    * ``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile`` are percent-decoded once more;
    * ``redis+socket:///path?virtual_host=N`` is a Unix socket (redis-py: ``unix:///path?db=N``).

    Everything else passes as written. What cannot reach redis-py through a URL, or would
    reach it silently wrong (redis-py reads ``redis://h/first`` as db 0), is a ValueError
    naming the parameter and its value. Sentinel URLs are checked part by part and a
    Cluster URL as its first node's (see :mod:`celery_singleton_lock.topologies.servers`).
    """

    reason = _not_one_redis(url)
    if reason is not None:
        raise ValueError(f"{shown_url(url)} is {reason}")
    scheme = url.partition("://")[0]
    if scheme == SENTINEL_SCHEME:
        return ";".join(sentinel_part(part.strip()) for part in split_url_list(url))
    if scheme in CLUSTER_SCHEMES:
        return cluster_url(url)
    return one_redis_url(url)


