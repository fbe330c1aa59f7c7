"""The apps the tests drive, from any folder of tests/ (not a test module itself).

* ``celery_cli(*args)``: ``python -m celery -A apps.worker_app <args>``, run as the fixtures run
  the workers (cwd tests/, tests/ and the checkout on PYTHONPATH).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the checkout (this file is tests/_apps.py)
TESTS = ROOT / "tests"


def celery_cli(*args: str, env: dict[str, str] | None = None, input: str | None = None) -> subprocess.CompletedProcess:
    """``python -m celery -A apps.worker_app <args>`` as the fixtures run workers (cwd tests/); ``env`` is
    added to this process's environment."""
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "apps.worker_app", *args],
        cwd=TESTS, input=input, capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)]), **(env or {})},
    )
