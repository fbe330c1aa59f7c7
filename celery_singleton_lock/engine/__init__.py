"""The engine: exclusion on one Redis, knowing nothing of Celery.

The lock handle (``lock``), what every backend offers (``backend``: the protocol the layers above
are written against), one server's operations, one round trip each (``server``, on
``plumbing``, whose bytes ``exchange`` writes and reads; a fresh task's path: ``fresh``),
every Lua script (``scripts``), the waiting line and its sweeper (``line``, ``sweeper``,
``line_ops``), and the small rooms they share (``layout``, ``wire``, ``timing``, ``notify``,
``refusals``, ``reentry``, ``persistence``, ``addresses``). Nothing here imports celery or
kombu (an import-linter contract checks it).
"""
