"""The message headers this package adds to Celery task messages: every name in one place.

A parked task's message, a turn, and a re-sent duplicate carry what the next delivery must know
about the ones before it (identity before policy). All start with ``singleton_lock_``, so
``LockedTask.signature_from_request`` can leave them out of a retry's or a chain's new message.
"""

from __future__ import annotations

PREFIX = "singleton_lock_"
"""What every header of ours starts with."""

ENTRY = PREFIX + "entry"
"""A turn or a parked copy: its entry in the key's line (it claims that entry's turn)."""
RECOVERED = PREFIX + "recovered"
"""A copy sent again by a sweeper (its first send may have been lost with the lock Redis's data)."""
EXPIRED = PREFIX + "expired"
"""The "you waited too long" copy: it fails with LockWaitTimeout without taking the lock."""
PARKED_AT = PREFIX + "parked_at"
"""When it FIRST parked (epoch seconds): its ``lock_max_wait`` counts from there, whatever re-parks
follow; also how long it waited, for metrics."""
QUEUE = PREFIX + "queue"
"""The queue it was first delivered from: its turn goes to that queue's turns queue."""
UNREACHABLE = PREFIX + "unreachable"
"""Re-sends because the lock Redis was unreachable, counted."""
BACKOFF = PREFIX + "backoff"
"""Re-sends of the "backoff" duplicate policy, counted."""
REDELIVERED = PREFIX + "redelivered"
"""On a re-send of a broker redelivery (a quorum has no line to park it in): the copy keeps its
identity, so it is dropped once the running task succeeded rather than run again as new work."""
TOKEN = PREFIX + "token"
"""The token of an acquire whose reply was lost (its lock, if taken, is taken back, not doubled)."""
MARKED = PREFIX + "marked"
"""Published under ``lock_publish``: its key's publish mark names it until its delivery starts."""
