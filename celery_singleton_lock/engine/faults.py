"""TEST-ONLY fault injection: a process kills itself (SIGKILL) at a named point.

The suite's crash tests (tests/test_handoff.py, tests/test_line_identity.py) start workers with
``CSL_TEST_KILL_AT=<point>``; with ``CSL_TEST_KILL_ONCE=<path>`` only the first process to create
that file dies there (so a redelivery of the same message is not killed again). Read once at
import: a worker that does not set them pays one attribute test per point, nothing else.
"""

from __future__ import annotations

import os
import signal

KILL_AT = os.environ.get("CSL_TEST_KILL_AT") or None
KILL_ONCE = os.environ.get("CSL_TEST_KILL_ONCE") or None


def kill_at(point: str) -> None:
    """SIGKILL this process if the suite asked for a death at ``point``."""
    if KILL_AT != point:
        return
    if KILL_ONCE is not None:
        try:
            os.close(os.open(KILL_ONCE, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
    os.kill(os.getpid(), signal.SIGKILL)
