"""The task hooks' fixtures: ``rec``, for the modules whose ``env`` runs one in-process worker for its
app (``env.app``), shared by the module's tests."""

import pytest
from _task_support import TaskEvents


@pytest.fixture
def rec(env):
    """What the module's tasks signalled during the test (tests/_task_support.py's TaskEvents)."""
    with TaskEvents(env.app) as r:
        yield r
