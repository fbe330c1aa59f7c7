"""A virtualenv of its own beside the project's .venv, stdlib only: the benchmarks' (benchmarks/.venv,
with the peers) and the Celery integration suite's (tools/.venv-integ) are made the same way."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def python_of(venv_dir: Path) -> Path:
    return venv_dir / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def ensure(venv_dir: Path, requirements: Path, log_dir: Path, say: Callable[[str], None]) -> Path:
    """``venv_dir`` with this checkout (editable) and ``requirements`` installed; its python. Made again
    only when the requirements, pyproject.toml or the Python version changed (a stamp says which)."""
    py = python_of(venv_dir)
    stamp = venv_dir / ".installed"
    want = hashlib.sha256(
        requirements.read_bytes() + (ROOT / "pyproject.toml").read_bytes() + sys.version.encode()
    ).hexdigest()
    if stamp.exists() and stamp.read_text() == want and py.exists():
        return py
    if not py.exists():
        say(f"creating virtualenv {venv_dir}")
        venv.EnvBuilder(with_pip=True, clear=True).create(venv_dir)
    say(f"installing this checkout and {requirements.relative_to(ROOT)} into it")
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / "pip.log"
    with open(log, "w") as f:
        code = subprocess.call(
            [str(py), "-m", "pip", "install", "--disable-pip-version-check", "-e", str(ROOT), "-r", str(requirements)],
            cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
        )
    if code:
        sys.exit(f"pip install failed ({code}); see {log}:\n" + log.read_text()[-3000:])
    stamp.write_text(want)
    return py
