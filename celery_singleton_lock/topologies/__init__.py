"""Where the locks live: one Redis, Sentinel, Redis Cluster, a quorum of independent masters.

``servers.from_settings`` is the one factory (a URL and settings -> a LockServer), ``plain``
the registry of servers for code outside Celery; ``urls`` reads Celery's URL forms. Each
topology is a class behind the engine's interface, never an ``if cluster:`` branch.
"""
