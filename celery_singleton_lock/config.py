"""Settings and task options: defaults, resolution and validation.

A task option (a class attribute, which Celery fills from the decorator's
keyword arguments) beats the app setting ``singleton_lock_*``, which beats the
default below. :func:`resolve` is the one place that applies that rule.

Task options are checked when the task binds to its app (:func:`check_task_options`),
so a typo fails at import, not at the first execution. Settings are read on a
task's first execution in a process, when ``app.conf`` is complete.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .keys import KeySpec
from .lock import LockServer, check_ttl, redact_url

logger = logging.getLogger(__name__)

POLICIES = ("skip", "retry", "raise")

# option on the task -> (app setting, default)
OPTIONS: dict[str, tuple[str, Any]] = {
    "lock_ttl": ("singleton_lock_ttl", 30.0),
    "on_duplicate": ("singleton_lock_on_duplicate", "skip"),
    "lock_prefix": ("singleton_lock_prefix", "singleton_lock"),
    "lock_max_retries": ("singleton_lock_max_retries", 50),
    "lock_retry_backoff": ("singleton_lock_retry_backoff", 1.0),
    "lock_retry_backoff_max": ("singleton_lock_retry_backoff_max", 30.0),
}
# app-wide only
APP_SETTINGS: dict[str, Any] = {
    "singleton_lock_url": None,
    "singleton_lock_redis_options": {},
    "singleton_lock_state_ttl": 24 * 3600.0,
}
# app setting -> the process watchdog's option (used when a process creates its watchdog)
WATCHDOG_SETTINGS: dict[str, str] = {
    "singleton_lock_watchdog_tick": "tick",
    "singleton_lock_watchdog_chunk": "chunk",
    "singleton_lock_watchdog_socket_timeout": "socket_timeout",
}


@dataclass(frozen=True)
class LockSettings:
    """Everything one task needs to lock, resolved once per task and process."""

    url: str
    ttl: float
    on_duplicate: str
    prefix: str
    max_retries: int
    retry_backoff: float
    retry_backoff_max: float
    redis_options: dict[str, Any]
    state_ttl: float
    watchdog_options: dict[str, Any] = field(default_factory=dict)
    """Only what the app sets; the watchdog's own defaults fill the rest."""


def _check_option(where: str, option: str, value: Any) -> Any:
    """Validate one option's value; the error names ``where`` (task or setting) and the option."""
    if option == "lock_ttl" or option == "lock_retry_backoff" or option == "lock_retry_backoff_max":
        try:
            return check_ttl(value, option)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    if option == "on_duplicate":
        if value not in POLICIES:
            raise ValueError(f"{where}: on_duplicate must be one of {', '.join(POLICIES)}; got {value!r}")
        return value
    if option == "lock_prefix":
        if not isinstance(value, str) or not value:
            raise ValueError(f"{where}: lock_prefix must be a non-empty str, got {value!r}")
        return value
    if option == "lock_max_retries":
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{where}: lock_max_retries must be an int >= 0, got {value!r}")
        return value
    return value


def check_task_options(task_name: str, task_cls: type, sig: inspect.Signature) -> None:
    """Fail at bind time on an invalid option set on the task itself."""
    where = f"task {task_name!r}"
    for option in OPTIONS:
        value = getattr(task_cls, option, None)
        if value is not None:
            _check_option(where, option, value)
    check_lock_key(where, getattr(task_cls, "lock_key", None), sig)


def check_lock_key(where: str, lock_key: KeySpec, sig: inspect.Signature) -> None:
    if lock_key is None or callable(lock_key):
        return
    if isinstance(lock_key, str) or not isinstance(lock_key, (list, tuple)):
        raise ValueError(
            f"{where}: lock_key must be None, a list of argument names or a callable, got {lock_key!r}"
        )
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
    for name in lock_key:
        if not isinstance(name, str):
            raise ValueError(f"{where}: lock_key names must be str, got {name!r}")
        if name not in sig.parameters and not takes_any:
            raise ValueError(
                f"{where}: lock_key names {name!r}, which is not a parameter of the task "
                f"(parameters: {', '.join(sig.parameters) or 'none'})"
            )


def resolve(task: Any) -> LockSettings:
    """Task option, else app setting, else default; validated."""
    conf = task.app.conf
    where = f"task {task.name!r}"
    values: dict[str, Any] = {}
    for option, (setting, default) in OPTIONS.items():
        value = getattr(task, option, None)
        source = where
        if value is None:
            value, source = conf.get(setting), f"setting {setting}"
            if value is None:
                value = default
        values[option] = _check_option(source, option, value)
    redis_options = conf.get("singleton_lock_redis_options") or {}
    if not isinstance(redis_options, dict):
        raise ValueError(f"setting singleton_lock_redis_options must be a dict, got {redis_options!r}")
    state_ttl = conf.get("singleton_lock_state_ttl") or APP_SETTINGS["singleton_lock_state_ttl"]
    return LockSettings(
        url=lock_url(conf),
        ttl=values["lock_ttl"],
        on_duplicate=values["on_duplicate"],
        prefix=values["lock_prefix"],
        max_retries=values["lock_max_retries"],
        retry_backoff=values["lock_retry_backoff"],
        retry_backoff_max=values["lock_retry_backoff_max"],
        redis_options=dict(redis_options),
        state_ttl=check_ttl(state_ttl, "singleton_lock_state_ttl"),
        watchdog_options={
            option: conf.get(setting) for setting, option in WATCHDOG_SETTINGS.items() if conf.get(setting) is not None
        },
    )


def _is_redis(url: Any) -> bool:
    return isinstance(url, str) and url.split("://", 1)[0] in ("redis", "rediss", "unix")


def lock_url(conf: Any) -> str:
    """``singleton_lock_url``, else a Redis result backend, else a Redis broker, else localhost."""
    url = conf.get("singleton_lock_url")
    if url:
        if not _is_redis(url):
            raise ValueError(
                f"setting singleton_lock_url must be a redis://, rediss:// or unix:// URL, got {redact_url(str(url))!r}"
            )
        return url
    for candidate in (conf.get("result_backend"), conf.get("broker_url")):
        if _is_redis(candidate):
            return candidate
    return "redis://localhost:6379/0"


# -- one LockServer per URL and process ----------------------------------------

_servers: dict[tuple[str, str], LockServer] = {}
_servers_lock = threading.Lock()


_by_settings: dict[int, tuple[LockSettings, LockServer]] = {}
"""id(settings) -> (settings, its server): a task resolves its settings once, so every
execution after the first finds its server here without rebuilding the cache key."""


def server_for(settings: LockSettings) -> LockServer:
    """The process's shared LockServer for these settings (logs the URL on first use)."""
    hit = _by_settings.get(id(settings))
    if hit is not None and hit[0] is settings:
        return hit[1]
    cache_key = (settings.url, repr(sorted(settings.redis_options.items())) + repr(settings.state_ttl))
    server = _servers.get(cache_key)
    if server is None:
        with _servers_lock:
            server = _servers.get(cache_key)
            if server is None:
                server = LockServer.from_url(settings.url, state_ttl=settings.state_ttl, **settings.redis_options)
                logger.info("celery-singleton-lock: locks live at %s", redact_url(settings.url))
                _servers[cache_key] = server
    if len(_by_settings) >= 1024:  # settings made per call (not a task's): keep the cache small
        _by_settings.clear()
    _by_settings[id(settings)] = (settings, server)  # holds settings, so its id is not reused while cached
    return server


def signature_of(run: Callable[..., Any], bound: bool) -> inspect.Signature:
    """The task's call signature as callers see it (without ``self`` for bound tasks)."""
    sig = inspect.signature(run)
    if bound:
        params = list(sig.parameters.values())[1:]
        sig = sig.replace(parameters=params)
    return sig
