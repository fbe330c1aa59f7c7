"""MkDocs hooks (mkdocs.yml ``hooks:``): the reference tables generated from the code.

``<!-- generated: settings -->`` in a page becomes the table of every app setting in
``config.SETTINGS``, in both spellings (``singleton_lock_*`` and Django's
``CELERY_SINGLETON_LOCK_*`` through ``namespace="CELERY"``), with the task option that
overrides it and its default from ``config.OPTIONS``. The meanings are below; a setting
without one, or a meaning for a setting the code no longer reads, fails the build.
"""

from __future__ import annotations

import re
from typing import Any

from celery_singleton_lock.delivery import config

MEANINGS: dict[str, tuple[str, str]] = {
    # setting: (default as shown, meaning)
    "singleton_lock_url": (
        "the result backend's Redis, else the broker's",
        "where the locks live: one Redis (`redis://`, `rediss://`, `unix://`, `redis+socket://`), Sentinels "
        "(`sentinel://h1:26379;sentinel://h2:26379`), a Cluster (`redis+cluster://h1:7000,h2:7001`) or a quorum "
        "(a list of N >= 3 URLs); see [Topologies](../operations/topologies.md). No localhost default",
    ),
    "singleton_lock_ttl": ("", "the lock's TTL without renewal: how long a crashed worker can keep the key"),
    "singleton_lock_on_duplicate": ("", "`skip`, `retry` (wait in line), `raise`, `backoff` or `coalesce`: see "
                                        "[Choosing](../how-to/choosing.md)"),
    "singleton_lock_cooldown": ("", "seconds the key stays taken after a successful run: at most one run per key "
                                    "per cooldown; see [Stopping duplicates early](../how-to/dedupe.md)"),
    "singleton_lock_cooldown_on_failure": ("", "whether a failed run keeps the key for the cooldown too"),
    "singleton_lock_publish": ("", "`join` or `raise`: `delay()` of a call whose key has a call queued, waiting "
                                   "or running returns that call's `AsyncResult`, or raises `AlreadyQueued`; "
                                   "`None` checks nothing at publish"),
    "singleton_lock_publish_ttl": ("", "the longest a publish mark lives: how long a message lost in the "
                                       "broker can block publishes of its key"),
    "singleton_lock_wait_in_slot": ("", "seconds a `retry` duplicate first waits for the hand-off in its worker "
                                        "slot, woken by the release (the hot-key fast path), before it parks"),
    "singleton_lock_prefix": ("", "the first part of every key (the app setting also names the sweepers' index)"),
    "singleton_lock_max_wait": ("", "how long a `retry` duplicate may wait in line, from its first park, before "
                                    "it fails with `LockWaitTimeout`"),
    "singleton_lock_max_retries": ("", "re-sends allowed for `backoff`, and, counted apart, for an unreachable "
                                       "Redis"),
    "singleton_lock_retry_backoff": ("", "the first back-off step, in seconds"),
    "singleton_lock_retry_backoff_max": ("", "the back-off cap; delay = `min(max, backoff * 2**attempt) * "
                                             "uniform(0.5, 1)`"),
    "singleton_lock_transport_options": ("`{}`", "for `sentinel://` URLs: `master_name` and `sentinel_kwargs`, "
                                                 "as in Celery's `result_backend_transport_options`"),
    "singleton_lock_redis_options": ("`{}`", "keyword arguments for `redis.Redis.from_url` (defaults: 5 s "
                                             "connect timeout, 10 s socket timeout)"),
    "singleton_lock_min_replicas": ("`0`", "replicas that must acknowledge an acquire and every renewal (Redis "
                                           "`WAIT`, in the same round trip) before it counts"),
    "singleton_lock_replica_timeout": ("`1.0` s", "how long the acquire waits for those replicas; too few in "
                                                  "time counts as an unreachable Redis"),
    "singleton_lock_release_timeout": ("`2.0` s", "the socket timeout of a release (tried twice)"),
    "singleton_lock_spin": (
        "`True`",
        "each worker process waits for the lock Redis's reply by trying the socket again and again for up to "
        "150 µs before it sleeps (a loopback Redis answers within that); `False` sleeps at once. A connection "
        "whose replies keep coming later than that stops trying for a while by itself, so on a busy host "
        "(eight pool processes on two cores) with a Redis 230 µs away the two tie, in throughput and in CPU "
        "per task (the benchmarks' spin A/B)",
    ),
    "singleton_lock_eager_timeout": ("`5.0` s", "how long an eager run (`apply()`, `task_always_eager`) waits in "
                                                "place for an unreachable lock Redis before it fails with "
                                                "`LockBackendUnavailable` naming the URL (a worker re-sends the "
                                                "task instead, `lock_max_retries` times)"),
    "singleton_lock_turn_timeout": ("`300.0` s", "how long the key stays reserved for a waiter whose turn was "
                                                 "sent, until its message arrives"),
    "singleton_lock_redelivery_window": ("the broker's `visibility_timeout`, else `3600.0` s",
                                         "how long an `acks_late` task's success is remembered, to drop its "
                                         "redeliveries"),
    "singleton_lock_watchdog_tick": ("`0.1` s", "the watchdog's tick"),
    "singleton_lock_watchdog_chunk": ("`500`", "locks per EVALSHA in a batched renewal"),
    "singleton_lock_watchdog_socket_timeout": ("`0.25` s", "the watchdog's own socket timeouts (part of every "
                                                           "lock's deadline margin)"),
    "singleton_lock_beat_key": ("`<prefix>:beat-leader`", "the beat leader's lock (see [beat](../how-to/beat.md))"),
    "singleton_lock_beat_ttl": ("`10.0` s", "seconds the beat leader's lock lives without renewal: a standby "
                                            "takes over within it"),
    "singleton_lock_beat_poll": ("`min(1, ttl / 4)` s", "seconds between two tries of a standby beat"),
}


def settings_table() -> str:
    missing = sorted(config.SETTINGS - set(MEANINGS))
    stale = sorted(set(MEANINGS) - config.SETTINGS)
    if missing or stale:
        raise ValueError(f"tools/docs_hooks.py MEANINGS: no meaning for {missing}; not a setting: {stale}")
    option_of = {setting: (option, default) for option, (setting, default) in config.OPTIONS.items()}
    rows = ["| app setting | Django (`namespace=\"CELERY\"`) | task option | default | meaning |",
            "|---|---|---|---|---|"]
    for setting in sorted(config.SETTINGS):
        default, meaning = MEANINGS[setting]
        option, code_default = option_of.get(setting, ("", None))
        if option:
            default = f"`{code_default!r}`".replace("'", '"')
        django = "CELERY_" + setting.upper()
        rows.append(f"| `{setting}` | `{django}` | {f'`{option}`' if option else '—'} | {default} | {meaning} |")
    return "\n".join(rows)


def on_page_markdown(markdown: str, **_: Any) -> str:
    return markdown.replace("<!-- generated: settings -->", settings_table())


SPHINX_ROLE = re.compile(r":(?:class|func|meth|attr|data|mod|exc|obj):(?=<code>)")
"""The package's docstrings use Sphinx's roles (``:class:`X```); mkdocstrings shows the name as code
and leaves the role's text before it, which only says what Sphinx would have linked."""


def on_page_content(html: str, **_: Any) -> str:
    return SPHINX_ROLE.sub("", html)
