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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..engine import line as queue
from ..engine import timing
from ..engine.backend import LockBackend
from ..engine.lock import check_ttl
from ..engine.plumbing import DEFAULT_REPLICA_TIMEOUT
from ..engine.server import DEFAULT_TURN_TIMEOUT
from ..topologies import servers
from ..topologies.urls import lock_source, transport_options
from ..topologies.urls import lock_url as lock_url  # re-exported: callers and tests read config.lock_url
from .keys import KeySpec

logger = logging.getLogger(__name__)

POLICIES = ("skip", "retry", "raise", "backoff", "coalesce")
PUBLISH_MODES = ("join", "raise")
"""``lock_publish``: what a publish finds when a call of the same key is queued, waiting or running
(see publishing.py); None (the default) checks nothing at publish."""

# option on the task -> (app setting, default)
OPTIONS: dict[str, tuple[str, Any]] = {
    "lock_ttl": ("singleton_lock_ttl", 30.0),
    "on_duplicate": ("singleton_lock_on_duplicate", "skip"),
    "lock_prefix": ("singleton_lock_prefix", "singleton_lock"),
    "lock_max_wait": ("singleton_lock_max_wait", 3600.0),
    "lock_max_retries": ("singleton_lock_max_retries", 50),
    "lock_retry_backoff": ("singleton_lock_retry_backoff", 1.0),
    "lock_retry_backoff_max": ("singleton_lock_retry_backoff_max", 30.0),
    "lock_cooldown": ("singleton_lock_cooldown", 0.0),
    "lock_cooldown_on_failure": ("singleton_lock_cooldown_on_failure", False),
    "lock_publish": ("singleton_lock_publish", None),
    "lock_publish_ttl": ("singleton_lock_publish_ttl", 600.0),
    "lock_wait_in_slot": ("singleton_lock_wait_in_slot", 0.0),
}
DEFAULT_REDELIVERY_WINDOW = 3600.0
DEFAULT_EAGER_TIMEOUT = 5.0
"""Seconds an eager run tries to reach an unreachable lock Redis before it fails."""
"""Seconds a success is remembered for acks_late tasks, when the broker has no visibility timeout."""

# app setting -> the process watchdog's option
WATCHDOG_SETTINGS: dict[str, str] = {
    "singleton_lock_watchdog_tick": "tick",
    "singleton_lock_watchdog_chunk": "chunk",
    "singleton_lock_watchdog_socket_timeout": "socket_timeout",
}

SETTINGS: frozenset[str] = frozenset({
    *(setting for setting, _ in OPTIONS.values()),
    *WATCHDOG_SETTINGS,
    "singleton_lock_url", "singleton_lock_redis_options", "singleton_lock_transport_options",
    "singleton_lock_min_replicas", "singleton_lock_replica_timeout", "singleton_lock_release_timeout",
    "singleton_lock_turn_timeout", "singleton_lock_redelivery_window",
    "singleton_lock_beat_key", "singleton_lock_beat_poll", "singleton_lock_beat_ttl",
    "singleton_lock_spin", "singleton_lock_eager_timeout",
})
"""Every app setting read anywhere (options.py warns at worker start about any other
``singleton_lock_*``; tests/task/test_options.py checks this list against the code)."""


@dataclass(frozen=True)
class LockSettings:
    """Everything one task needs to lock, resolved once per task and process."""

    url: str
    ttl: float
    on_duplicate: str
    prefix: str
    max_wait: float
    max_retries: int
    retry_backoff: float
    retry_backoff_max: float
    redis_options: dict[str, Any]
    redelivery_window: float
    """Seconds an acks_late task's success is remembered, to drop its redeliveries."""
    release_timeout: float
    index: str
    """The sweeper's index of keys with waiting tasks (from the app's prefix, shared by its tasks)."""
    watchdog_options: dict[str, Any] = field(default_factory=dict)
    """Only what the app sets; the watchdog's own defaults fill the rest."""
    transport_options: dict[str, Any] = field(default_factory=dict)
    """Sentinel's ``master_name``, ``sentinel_kwargs``, ``min_other_sentinels`` (see urls.transport_options)."""
    min_replicas: int = 0
    """Replicas that must acknowledge an acquire or renewal (Redis WAIT); 0: none asked."""
    replica_timeout: float = DEFAULT_REPLICA_TIMEOUT
    """Seconds to wait for them."""
    turn_timeout: float = DEFAULT_TURN_TIMEOUT
    """Seconds the key stays reserved for a waiter whose turn was sent, until its copy arrives."""
    cooldown: float = 0.0
    """Seconds the key stays taken after a successful run (0: released at once)."""
    cooldown_on_failure: bool = False
    """Whether a failed run keeps the key for the cooldown too."""
    publish: str | None = None
    """``lock_publish``: "join", "raise", or None (no check at publish)."""
    publish_ttl: float = 600.0
    """Seconds a publish mark lives at most: how long a message lost in the broker blocks publishes."""
    wait_in_slot: float = 0.0
    eager_timeout: float = DEFAULT_EAGER_TIMEOUT
    """Seconds a "retry" duplicate waits for the hand-off in its worker slot before it parks (0: parks at once)."""


def _check_option(where: str, option: str, value: Any) -> Any:
    """Validate one option's value; the error names ``where`` (task or setting) and the option."""
    if option in ("lock_ttl", "lock_max_wait", "lock_retry_backoff", "lock_retry_backoff_max"):
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
    if option == "lock_cooldown":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 86400 * 365:
            raise ValueError(f"{where}: lock_cooldown must be a number of seconds >= 0, got {value!r}")
        return float(value)
    if option == "lock_wait_in_slot":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= queue.LONGEST_BLOCK:
            raise ValueError(f"{where}: lock_wait_in_slot must be a number of seconds >= 0 and <= "
                             f"{queue.LONGEST_BLOCK:g}, got {value!r}")
        return float(value)
    if option == "lock_cooldown_on_failure":
        if not isinstance(value, bool):
            raise ValueError(f"{where}: lock_cooldown_on_failure must be True or False, got {value!r}")
        return value
    if option == "lock_publish":
        if value is False:  # a task turning off the app's setting
            return None
        if value is not None and value not in PUBLISH_MODES:
            raise ValueError(f"{where}: lock_publish must be 'join', 'raise', or None/False (no check); got {value!r}")
        return value
    if option == "lock_publish_ttl":
        try:
            return check_ttl(value, option)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
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
    """Fail at definition time on a ``lock_key`` that could never key a call right.

    A name must be a named parameter, or, on a task that takes ``**kw``, a name
    that may come through it (a call that leaves it out then fails in
    keys.derive()). The ``*args`` or ``**kw`` parameter itself is no name to key
    on: it used to key every call on None, so all calls shared one key.
    """
    if lock_key is None or callable(lock_key):
        return
    if isinstance(lock_key, str) or not isinstance(lock_key, (list, tuple)):
        raise ValueError(
            f"{where}: lock_key must be None, a list of argument names or a callable, got {lock_key!r}"
        )
    params = sig.parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for name in lock_key:
        if not isinstance(name, str):
            raise ValueError(f"{where}: lock_key names must be str, got {name!r}")
        param = params.get(name)
        if param is not None and param.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            star = "*" if param.kind is inspect.Parameter.VAR_POSITIONAL else "**"
            raise ValueError(
                f"{where}: lock_key names {name!r}, the task's {star}{name} parameter itself; "
                f"name the arguments to key on (or leave lock_key None to key on all of them)"
            )
        if param is None and not takes_any:
            raise ValueError(
                f"{where}: lock_key names {name!r}, which is not a parameter of the task "
                f"(parameters: {', '.join(params) or 'none'})"
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
    app_prefix = _check_option("setting singleton_lock_prefix", "lock_prefix",
                               conf.get("singleton_lock_prefix") or OPTIONS["lock_prefix"][1])
    url, source = lock_source(conf)
    min_replicas = conf.get("singleton_lock_min_replicas") or 0
    if isinstance(min_replicas, bool) or not isinstance(min_replicas, int) or min_replicas < 0:
        raise ValueError(f"setting singleton_lock_min_replicas must be an int >= 0, got {min_replicas!r}")
    replica_timeout = check_ttl(conf.get("singleton_lock_replica_timeout") or DEFAULT_REPLICA_TIMEOUT,
                                "setting singleton_lock_replica_timeout (seconds)")
    return LockSettings(
        url=url,
        ttl=values["lock_ttl"],
        on_duplicate=values["on_duplicate"],
        prefix=values["lock_prefix"],
        max_wait=values["lock_max_wait"],
        max_retries=values["lock_max_retries"],
        retry_backoff=values["lock_retry_backoff"],
        retry_backoff_max=values["lock_retry_backoff_max"],
        redis_options=dict(redis_options),
        redelivery_window=redelivery_window(conf),
        release_timeout=check_ttl(conf.get("singleton_lock_release_timeout") or 2.0, "singleton_lock_release_timeout"),
        index=queue.index_key(app_prefix),
        watchdog_options=watchdog_options(conf),
        transport_options=transport_options(conf, source),
        min_replicas=min_replicas,
        replica_timeout=replica_timeout,
        turn_timeout=check_ttl(_or(conf.get("singleton_lock_turn_timeout"), DEFAULT_TURN_TIMEOUT),
                               "setting singleton_lock_turn_timeout"),
        cooldown=values["lock_cooldown"],
        cooldown_on_failure=values["lock_cooldown_on_failure"],
        publish=values["lock_publish"],
        publish_ttl=values["lock_publish_ttl"],
        wait_in_slot=values["lock_wait_in_slot"],
        eager_timeout=eager_timeout(conf),
    )


class _AppOnly:
    """What :func:`resolve` reads of a task, for the app as a whole (no task options)."""

    name = "the app"

    def __init__(self, app: Any) -> None:
        self.app = app


def app_settings(app: Any) -> LockSettings:
    """The settings of ``app`` as a whole (no task's options): what beat's leader lock and the operators'
    commands use, resolved exactly as a task's are."""
    return resolve(_AppOnly(app))


def _or(value: Any, default: Any) -> Any:
    """``value`` unless it is unset (None): a 0 is checked, and refused, rather than replaced."""
    return default if value is None else value


def watchdog_options(conf: Any) -> dict[str, Any]:
    """The app's ``singleton_lock_watchdog_*`` settings, checked (a bad one names the setting)."""
    options = {}
    for setting, option in WATCHDOG_SETTINGS.items():
        value = conf.get(setting)
        if value is None:
            continue
        if option == "chunk":
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"setting {setting} must be an int >= 1, got {value!r}")
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 3600:
            raise ValueError(f"setting {setting} must be a number of seconds > 0 (and < 3600), got {value!r}")
        options[option] = value
    return options


def eager_timeout(conf: Any) -> float:
    """``singleton_lock_eager_timeout``: how long an eager run (``apply()``, ``task_always_eager``) waits
    in place for an unreachable lock Redis, in seconds (a worker re-sends the task instead)."""
    value = conf.get("singleton_lock_eager_timeout")
    if value is None:
        return DEFAULT_EAGER_TIMEOUT
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 3600:
        raise ValueError(f"setting singleton_lock_eager_timeout must be a number of seconds >= 0 (and < 3600), "
                         f"got {value!r}")
    return float(value)


def redelivery_window(conf: Any) -> float:
    """``singleton_lock_redelivery_window``, else the broker's visibility timeout, else an hour."""
    value = conf.get("singleton_lock_redelivery_window")
    if value is not None:
        return check_ttl(value, "setting singleton_lock_redelivery_window")
    visibility = (conf.get("broker_transport_options") or {}).get("visibility_timeout")
    if isinstance(visibility, (int, float)) and not isinstance(visibility, bool) and visibility > 0:
        return float(visibility)
    return DEFAULT_REDELIVERY_WINDOW


LONG_TTL = 300.0
"""A ``lock_ttl`` above this (seconds) is warned about: a crashed worker would block its key that long."""


def warn_long_ttl(task_name: str, ttl: float) -> None:
    """Warn about a TTL taken for the longest run (celery-once's ``timeout=3600``, say)."""
    if ttl > LONG_TTL:
        logging.getLogger("celery_singleton_lock").warning(
            "task %s: lock_ttl %gs is how long a lock lives without renewal (the watchdog renews it every third "
            "of that while the task runs), not how long the task may run: a worker that dies holding it blocks "
            "its key for up to %gs. 30 to 60 s suits most tasks", task_name, ttl, ttl,
        )


def warn_short_ttl(task_name: str, settings: LockSettings) -> None:
    """Warn once, when a task's settings are read, about a TTL the watchdog cannot keep safely."""
    shortest = timing.shortest_safe_ttl(**{
        k: v for k, v in settings.watchdog_options.items() if k in ("tick", "socket_timeout")
    })
    if settings.ttl < shortest:
        logging.getLogger("celery_singleton_lock").warning(  # the package's logger, as the task's other warnings
            "task %s: lock_ttl %gs is shorter than the watchdog can keep safely (%.1fs with its tick and "
            "socket timeout): a lock may be declared lost after one slow renewal", task_name, settings.ttl, shortest,
        )


def server_for(settings: LockSettings) -> LockBackend:
    """The process's shared LockServer for these settings (:func:`servers.shared`: one registry for
    tasks and ``held()``). A task keeps the one it got (``LockedTask.lock_server``)."""
    return servers.shared(settings.url, transport_options=settings.transport_options,
                          redis_options=settings.redis_options, min_replicas=settings.min_replicas,
                          replica_timeout=settings.replica_timeout)


def signature_of(run: Callable[..., Any], bound: bool) -> inspect.Signature:
    """The task's call signature as callers see it (without ``self`` for bound tasks)."""
    sig = inspect.signature(run)
    if bound:
        params = list(sig.parameters.values())[1:]
        sig = sig.replace(parameters=params)
    return sig
