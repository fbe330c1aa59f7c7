"""The features' fixtures: ``env``, one worker cluster per module running tests/apps/dedupe_app.py
(two prefork nodes, tests/_clusters.py), for test_dedupe.py, test_dedupe_slot_wait.py and
test_dedupe_faults.py."""

from __future__ import annotations

import pytest
from _clusters import worker_cluster


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    with worker_cluster("dedupe_app", tmp_path_factory.mktemp("dedupe")) as module:
        yield module
