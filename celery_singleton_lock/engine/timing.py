"""When a lock must count as lost: one rule, used by the handle and the watchdog alike.

Redis starts a lock's TTL when it runs the command, which is after we sent it,
so a lock whose acquire or last renewal was *sent* at ``confirmed_at`` (local
monotonic clock) lives in Redis at least until ``confirmed_at + ttl``. We stop
trusting it a margin earlier::

    deadline = confirmed_at + ttl - (socket timeout + 2 ticks + 2% of the ttl)

The margin covers what can keep the watchdog from noticing on time: one
renewal round blocked for a whole socket timeout, the tick it then waits for,
one more tick of scheduling slack, and clock-rate drift between us and Redis.
So a lock is flagged lost before Redis could have let it expire, whatever
Redis does. (A process that is stopped, or starved of CPU, cannot flag anything
while it is stopped; ``Lock.lost`` then turns True the moment it runs again.)
"""

from __future__ import annotations

DEFAULT_TICK = 0.1
"""Seconds between two ticks of the watchdog's wheel."""
DEFAULT_SOCKET_TIMEOUT = 0.25
"""Socket (and connect) timeout of the watchdog's own connections, in seconds."""
DRIFT = 0.02
"""Clock-rate drift allowed between this host and Redis, as a share of the TTL."""


def margin(ttl: float, tick: float = DEFAULT_TICK, socket_timeout: float = DEFAULT_SOCKET_TIMEOUT) -> float:
    """How long before ``confirmed_at + ttl`` a lock stops being trusted.

    Capped at two thirds of the TTL: a lock is always trusted until its first
    renewal is due (TTL/3 after the acquire was sent).
    """
    return min(socket_timeout + 2 * tick + DRIFT * ttl, ttl * 2 / 3)


def shortest_safe_ttl(tick: float = DEFAULT_TICK, socket_timeout: float = DEFAULT_SOCKET_TIMEOUT) -> float:
    """The shortest TTL for which the first renewal (due at TTL/3) has time for two tries
    (each up to a socket timeout plus a tick) before the deadline.

    TTL/3 + 2 (socket timeout + tick) <= TTL - margin(TTL): about 1.8 s with the defaults.
    """
    return (3 * socket_timeout + 4 * tick) / (2 / 3 - DRIFT)
