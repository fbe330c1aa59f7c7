"""The line's fault tests share one worker cluster per module: tests/apps/slot_faults_app.py on two
prefork nodes, the lock Redis behind the fault proxy (tests/_clusters.py)."""

import pytest
from _clusters import worker_cluster


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    with worker_cluster("slot_faults_app", tmp_path_factory.mktemp("line"), lock_proxy=True) as module:
        yield module
