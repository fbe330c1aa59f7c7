"""tools/celery_integration.py's set-up, stdlib only: its paths, its virtualenv (tools/.venv-integ)
and the suite (t/integration of the Celery sdist, extracted into tools/.integ-work/celery-<version>/)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import side_venv  # (beside this file: tools/)

TOOLS = Path(__file__).resolve().parent
ROOT = TOOLS.parent
VENV = TOOLS / ".venv-integ"
VENV_PY = side_venv.python_of(VENV)
REQUIREMENTS = TOOLS / "integ-requirements.txt"
WORK = TOOLS / ".integ-work"
DURATIONS = TOOLS / "integ-durations.json"
"""Each test's duration in an earlier baseline run: the shards are balanced with it."""


def say(msg: str) -> None:
    print(f"[integ] {msg}", flush=True)


# -- set-up: our own virtualenv (stdlib only up to here) ----------------------------------------


def ensure_venv() -> Path:
    return side_venv.ensure(VENV, REQUIREMENTS, WORK, say)


def in_venv() -> bool:
    try:
        return Path(sys.prefix).resolve() == VENV.resolve()
    except OSError:
        return False


# -- the suite: Celery's sdist, t/integration only ------------------------------------------------


def _wanted(rel: str) -> bool:
    """The sdist's files the integration run needs (paths relative to the sdist's top folder)."""
    return (
        rel == "pyproject.toml"
        or re.fullmatch(r"t/[^/]+\.py", rel) is not None
        or rel.startswith("t/integration/")
    )


def ensure_suite(version: str) -> Path:
    """tools/.integ-work/celery-<version>/ holding the sdist's t/integration (downloaded once)."""
    dest = WORK / f"celery-{version}"
    marker = dest / ".extracted"
    if marker.exists():
        return dest
    sdists = WORK / "sdist"
    sdists.mkdir(parents=True, exist_ok=True)
    tarball = sdists / f"celery-{version}.tar.gz"
    if not tarball.exists():
        say(f"downloading the celery=={version} sdist from PyPI")
        subprocess.check_call(
            [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps",
             "--no-binary", ":all:", f"celery=={version}", "-d", str(sdists)],
            stdout=subprocess.DEVNULL,
        )
        if not tarball.exists():
            found = sorted(p.name for p in sdists.iterdir())
            sys.exit(f"pip download did not leave {tarball.name} in {sdists} (found: {found})")
    if dest.exists():
        shutil.rmtree(dest)
    top = f"celery-{version}/"
    count = 0
    with tarfile.open(tarball) as tar:
        for member in tar.getmembers():
            if not member.isfile() or not member.name.startswith(top):
                continue
            rel = member.name[len(top):]
            if ".." in Path(rel).parts or not _wanted(rel):
                continue
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            source = tar.extractfile(member)
            assert source is not None
            target.write_bytes(source.read())
            count += 1
    if not (dest / "t/integration/conftest.py").exists():
        sys.exit(f"{tarball} has no t/integration/conftest.py: not a Celery sdist with its integration suite")
    marker.write_text(f"{count} files from {tarball.name}\n")
    say(f"extracted {count} files of the sdist's test suite into {dest}")
    return dest
