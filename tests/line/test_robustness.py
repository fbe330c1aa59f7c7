"""The robustness run, seeded, in CI: a minute of random traffic on three hot keys through two real
worker nodes, with retry, skip, coalesce and publish-join calls, and random faults (a lost reply at
a random script of the line, a connection reset, the lock Redis stopped past the TTL, flushed,
restarted with its data or empty, a worker child killed and its message redelivered), then the
whole history checked: every call ended once, in its final state (coalesced and joined calls with
the run that covered them), no body of a key overlapped another outside a reported loss, and none
ran twice (tools/line_chaos.py, tools/chaos_check.py).
``python3 dev.py robustness --minutes N --seed S`` runs it longer."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.long  # (dev.py test --all and CI run it)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_seeded_minute_of_random_traffic_and_faults_keeps_every_guarantee(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "line_chaos.py"), "--seconds", "60", "--orders", "300",
         "--seed", "7", "--fault-every", "4", "--faults", "lost,reset,stop,kill,restart,restart-empty,flush"],
        cwd=ROOT, capture_output=True, text=True, timeout=400, env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    report = [line for line in out.stdout.splitlines() if line.startswith("[chaos]")]
    assert any("orders sent" in line for line in report), out.stdout[-3000:] + out.stderr[-3000:]
    assert out.returncode == 0, "\n".join(report[-12:]) + "\n" + out.stderr[-2000:]
