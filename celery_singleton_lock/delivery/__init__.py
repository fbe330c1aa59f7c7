"""The Celery side of a locked task: one delivery from its arrival to its release.

The task hooks (``task``), who is asking (``headers``, ``identity``), the pure decision table
(``decide``), the actions (``policies``, ``arrival``, ``parked``, ``coalescing``, ``publishing``),
the release (``releasing``), the turn messages (``handoff``, ``turns``), and the key and settings
of a task (``keys``, ``config``, ``options``). Below it: topologies, the watchdog, the engine.
"""
