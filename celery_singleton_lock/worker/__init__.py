"""What runs beside a worker's pool: the worker's signals (``workers``: the watchdog, the
sweeper, the exchange set up per process) and revokes of waiting tasks (``revoke``)."""
