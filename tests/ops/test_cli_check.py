"""``celery -A proj locks check``, the deploy pipeline's check, run as the real command line against an
app written to a temporary directory and private redis-servers: a good app passes (one warning: the
test server keeps no data on disk), and each kind of problem is one line and exit status 1."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from celery_singleton_lock.testing.servers import RedisServer, free_port

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(120)

APP = '''
import os
from celery import Celery
from celery_singleton_lock import LockedTask

app = Celery("proj", broker=os.environ["PROJ_URL"])
app.conf.singleton_lock_url = os.environ["PROJ_URL"]
app.conf.singleton_lock_min_replicas = int(os.environ.get("PROJ_MIN_REPLICAS", "0"))
if os.environ.get("PROJ_TYPO"):
    app.conf.singleton_lock_tll = 5
if os.environ.get("PROJ_BAD_SETTING"):
    app.conf.singleton_lock_eager_timeout = "soon"
app.conf.imports = ["proj_tasks"]
'''

TASKS = '''
import os
from proj import app
from celery_singleton_lock import LockedTask

@app.task(base=LockedTask)
def deduct(sku):
    return sku

if os.environ.get("PROJ_LEFTOVER"):
    @app.task(base=LockedTask, once={"graceful": True})  # a celery-once option left behind
    def leftover(sku):
        return sku
'''


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("proj")
    (home / "proj.py").write_text(textwrap.dedent(APP))
    (home / "proj_tasks.py").write_text(textwrap.dedent(TASKS))
    return home


def check(project: Path, url: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "proj", "locks", "check"], cwd=project, capture_output=True,
        text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(project), str(ROOT)]), "PROJ_URL": url, **env},
    )


def lines_of(proc: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in proc.stdout.splitlines() if line.startswith(("error: ", "warning: "))]


def test_a_good_app_passes_with_a_warning_for_a_server_that_keeps_no_data(project, redis_server):
    proc = check(project, redis_server.url(2))
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    [warning] = lines_of(proc)
    assert warning.startswith("warning: ") and "keeps no data on disk" in warning
    assert "0 error(s), 1 warning(s)" in proc.stdout


def test_a_leftover_peer_option_fails_the_check_naming_it(project, redis_server):
    """Importing the tasks module alone would pass: the option is checked when the app finalizes."""
    proc = check(project, redis_server.url(2), PROJ_LEFTOVER="1")
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    errors = [line for line in lines_of(proc) if line.startswith("error: ")]
    assert len(errors) == 1 and "once" in errors[0] and "lock_publish" in errors[0], proc.stdout


def test_an_unknown_setting_is_a_warning_with_the_closest_name(project, redis_server):
    proc = check(project, redis_server.url(2), PROJ_TYPO="1")
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert any("singleton_lock_tll" in line and "did you mean singleton_lock_ttl" in line for line in lines_of(proc))


def test_an_evicting_server_is_an_error(project):
    server = RedisServer(extra_args=["--maxmemory-policy", "allkeys-lru"]).start()
    try:
        proc = check(project, server.url(0))
    finally:
        server.stop()
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    errors = [line for line in lines_of(proc) if line.startswith("error: ")]
    assert len(errors) == 1 and "maxmemory-policy allkeys-lru" in errors[0] and "noeviction" in errors[0]


def test_an_unreachable_server_is_an_error(project):
    proc = check(project, f"redis://127.0.0.1:{free_port()}/0")
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    errors = [line for line in lines_of(proc) if line.startswith("error: ")]
    assert len(errors) == 1 and "does not answer" in errors[0], proc.stdout


def test_too_few_replicas_for_min_replicas_is_an_error(project, redis_server):
    proc = check(project, redis_server.url(2), PROJ_MIN_REPLICAS="1")
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    errors = [line for line in lines_of(proc) if line.startswith("error: ")]
    assert len(errors) == 1 and "0 connected replica(s)" in errors[0], proc.stdout


def test_a_bad_setting_is_an_error_naming_it_and_no_server_is_looked_at(project, redis_server):
    proc = check(project, redis_server.url(2), PROJ_BAD_SETTING="1")
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    errors = [line for line in lines_of(proc) if line.startswith("error: ")]
    assert errors and all("singleton_lock_eager_timeout" in e and "'soon'" in e for e in errors), proc.stdout
    assert not any("keeps no data" in line for line in lines_of(proc)), "the server was looked at without settings"
