"""The examples' demo scripts, run as a user runs them: each starts its own Redis and workers.

Slow (real worker subprocesses): select with ``-m slow``, skip with ``-m "not slow"``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_demo(name: str, timeout: float) -> str:
    script = ROOT / "examples" / name / "demo.py"
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{out}"
    return out


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_inventory_demo_locked_stock_is_exact():
    out = run_demo("inventory", timeout=80)
    assert "RESULT: locked stock exact on all 4 SKUs" in out, out
    assert "failed 0" in out, out


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.long
def test_beat_demo_runs_never_overlap():
    out = run_demo("beat", timeout=80)
    assert "RESULT: LockedTask runs never overlapped" in out, out
    assert "0 overlapping" in out, out
