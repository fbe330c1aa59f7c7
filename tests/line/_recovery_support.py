"""The line recovery tests' shared settings (tests/line/test_line_recovery.py, test_line_data_loss.py):
the workers' lock TTL, and their environment for acks_late + reject_on_worker_lost."""

from __future__ import annotations

LOCK_TTL = 3.0
LATE = {"CSL_LOCK_TTL": str(LOCK_TTL), "CSL_JOURNAL_HANDOFF": "1", "CSL_ACKS_LATE": "1", "CSL_REJECT_ON_LOST": "1"}
