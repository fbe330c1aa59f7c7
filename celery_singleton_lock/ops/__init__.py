"""Operators' tools: ``celery locks`` (cli, cli_line), ``celery inspect locks`` (control), and
the survey of a Redis's locks that both read."""
