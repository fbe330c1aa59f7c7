"""What the dedupe tests through real workers share (tests/features/test_dedupe.py,
test_dedupe_slot_wait.py, test_dedupe_faults.py): their deadline, and the prefork child running a
call. Their worker cluster (``env``) is in features/conftest.py."""

from __future__ import annotations

TIMEOUT = 60


def worker_child_of(env, task_id):
    """The pid of the prefork child running ``task_id`` now (``inspect active``), or None."""
    for tasks in (env.app.control.inspect(timeout=1.0).active() or {}).values():
        for t in tasks:
            if t["id"] == task_id:
                return t["worker_pid"]
    return None
