"""What a library user gets from ``pip install``: the wheel and the sdist, built and installed.

The source tree is copied (without .venv, caches and build leftovers) and built
there with ``python -m build``, so the checkout is not touched; build makes the
sdist first and the wheel from the sdist, so the sdist is proven complete enough
to build. The wheel is then installed, with its dependencies (from pip's cache),
into a new virtualenv that cannot see the checkout, and checked from a directory
outside it with ``python -I``: the package imports from site-packages, ships
``py.typed``, registers the ``pytest11`` entry point, and its plugin works in a
pytest session there (a private redis-server, an eager LockedTask recorded).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import textwrap
import venv
import zipfile
from pathlib import Path

import pytest

import celery_singleton_lock

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "celery_singleton_lock"
VERSION = celery_singleton_lock.__version__

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

LEFT_OUT = shutil.ignore_patterns(".venv", ".git", "__pycache__", "*.pyc", "*.egg-info", "build", "dist", "out", "site")


def run(args: list[str], cwd: Path, timeout: float = 300, env: dict[str, str] | None = None) -> str:
    """Run a command; fail the test with its output if it fails."""
    proc = subprocess.run(
        args, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(map(str, args))} exited with {proc.returncode}:\n{output[-5000:]}"
    return output


def package_files() -> set[str]:
    """Every file of the package in the checkout (what the wheel must hold)."""
    return {
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / PACKAGE).rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    }


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """(wheel, sdist, build log), built from a copy of the source tree."""
    tmp = tmp_path_factory.mktemp("dists")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=LEFT_OUT, symlinks=True)
    out = tmp / "dist"
    log = run([sys.executable, "-m", "build", "--outdir", str(out), str(src)], cwd=tmp)
    wheels, sdists = sorted(out.glob("*.whl")), sorted(out.glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, f"expected one wheel and one sdist, got {list(out.iterdir())}"
    return wheels[0], sdists[0], log


def test_the_build_is_clean(dists: tuple[Path, Path, str]) -> None:
    """No deprecation from setuptools about our configuration: each one is a future build failure."""
    _, _, log = dists
    flagged = [line for line in log.splitlines() if "deprecat" in line.lower()]
    assert not flagged, "\n".join(flagged)


def test_the_wheel_holds_the_package_and_its_metadata(dists: tuple[Path, Path, str]) -> None:
    wheel, _, _ = dists
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        dist_info = next(n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info"))
        metadata = zf.read(f"{dist_info}/METADATA").decode()
        entry_points = zf.read(f"{dist_info}/entry_points.txt").decode()
    shipped = {n for n in names if not n.startswith(dist_info)}
    assert shipped == package_files(), (
        f"missing: {sorted(package_files() - shipped)}; unexpected: {sorted(shipped - package_files())}"
    )
    assert f"{PACKAGE}/py.typed" in shipped
    # runtime code and what the pytest plugin needs, nothing else: the suite's Sentinel, Cluster and etcd
    # deployments stay in tests/
    assert not [n for n in shipped if n.endswith(("deployments.py", "etcd_servers.py"))], sorted(shipped)
    assert "[pytest11]" in entry_points and f"celery_singleton_lock = {PACKAGE}.pytest_plugin" in entry_points
    assert "Requires-Dist: celery[redis]" in metadata
    assert "Provides-Extra: pytest" in metadata
    assert "License-Expression: MIT" in metadata
    assert "License-File: LICENSE" in metadata and f"{dist_info}/licenses/LICENSE" in names
    assert "Project-URL: Repository, https://github.com/celery-singleton-lock/celery-singleton-lock" in metadata
    assert "Classifier: Development Status :: 3 - Alpha" in metadata
    assert f"Version: {VERSION}" in metadata
    for extra in ("etcd", "prometheus", "pytest"):  # each extra the docs name, published by that name
        assert f"Provides-Extra: {extra}" in metadata, extra
    # the contributors' tools are a dependency group, never a published extra
    assert "Provides-Extra: test" not in metadata and "mkdocs" not in metadata


def test_the_sdist_holds_readme_pyproject_and_the_package(dists: tuple[Path, Path, str]) -> None:
    _, sdist, _ = dists
    with tarfile.open(sdist) as tf:
        names = tf.getnames()
    top = names[0].split("/")[0]
    inside = {n[len(top) + 1:] for n in names if n.startswith(f"{top}/")}
    for wanted in ("README.md", "LICENSE", "pyproject.toml", "PKG-INFO", "CHANGELOG.md", "docs/index.md",
                   "examples/README.md", *package_files()):
        assert wanted in inside, f"{wanted} is not in {sdist.name}"
    junk = [n for n in inside if n.startswith((".venv/", ".git/")) or "__pycache__" in n or n.endswith(".pyc")]
    assert not junk, junk


@pytest.fixture(scope="module")
def clean_venv(dists: tuple[Path, Path, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new virtualenv with the wheel (and its dependencies, from pip's cache) and pytest installed."""
    wheel, _, _ = dists
    home = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=True, clear=True).create(home / "env")
    python = home / "env" / "bin" / "python"
    run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(wheel), "pytest"], cwd=home)
    return python


def outside_env() -> dict[str, str]:
    """The environment without anything that could point Python at the checkout."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def test_the_installed_wheel_imports_ships_py_typed_and_registers_the_plugin(clean_venv: Path, tmp_path: Path) -> None:
    probe = textwrap.dedent(f'''
        import json, sys
        import importlib.metadata as md
        import importlib.resources as res
        import {PACKAGE}
        eps = [(ep.name, ep.value) for ep in md.entry_points(group="pytest11")
               if ep.dist is not None and ep.dist.name == "celery-singleton-lock"]
        print(json.dumps({{
            "file": {PACKAGE}.__file__,
            "version": {PACKAGE}.__version__,
            "dist_version": md.version("celery-singleton-lock"),
            "py_typed": res.files("{PACKAGE}").joinpath("py.typed").is_file(),
            "entry_points": eps,
            "path": sys.path,
        }}))
    ''')
    out = run([str(clean_venv), "-I", "-c", probe], cwd=tmp_path, env=outside_env())
    found = json.loads(out.strip().splitlines()[-1])
    env_dir = clean_venv.parent.parent.resolve()
    assert Path(found["file"]).resolve().is_relative_to(env_dir), found["file"]
    assert not any(str(ROOT) in p for p in found["path"]), found["path"]
    assert found["version"] == found["dist_version"]
    assert found["py_typed"] is True
    assert found["entry_points"] == [["celery_singleton_lock", f"{PACKAGE}.pytest_plugin"]]


def test_the_installed_plugin_works_in_a_pytest_session(clean_venv: Path, tmp_path: Path) -> None:
    (tmp_path / "test_installed.py").write_text(textwrap.dedent('''
        import celery_singleton_lock
        from celery import Celery
        from celery_singleton_lock import LockedTask


        def test_plugin(request, singleton_lock_redis, singleton_lock_app, singleton_lock_events):
            assert request.config.pluginmanager.has_plugin("celery_singleton_lock")
            assert "site-packages" in celery_singleton_lock.__file__
            assert singleton_lock_redis.client(2).ping()
            app = singleton_lock_app(Celery("installed", set_as_current=False))

            @app.task(base=LockedTask, bind=True, shared=False)
            def double(self, x):
                return 2 * x

            assert double.apply(args=(4,)).get() == 8
            singleton_lock_events.wait_for("lock_released", task=double, state="SUCCESS")
    '''))
    out = run(
        [str(clean_venv), "-I", "-m", "pytest", "-p", "no:cacheprovider", "-q", "test_installed.py"],
        cwd=tmp_path, env=outside_env(), timeout=120,
    )
    assert "1 passed" in out, out


@pytest.fixture(scope="module")
def wheel_only_venv(dists: tuple[Path, Path, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new virtualenv holding only the wheel and what it depends on (celery, redis: from pip's cache)."""
    wheel, _, _ = dists
    home = tmp_path_factory.mktemp("wheel-only")
    venv.EnvBuilder(with_pip=True, clear=True).create(home / "env")
    python = home / "env" / "bin" / "python"
    run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(wheel)], cwd=home)
    return python


def test_the_readme_quick_start_runs_from_the_wheel_as_written(wheel_only_venv: Path, fresh_redis,
                                                                tmp_path: Path) -> None:
    """The README's quick start, pasted into a new virtualenv that holds only the wheel: tasks.py, the
    worker command as written (the venv's own ``celery`` first on PATH), the two calls, with what the
    README says they print; only redis://localhost:6379 is this test's private redis-server."""
    from test_docs_examples import checked, localise, start_worker, stop

    readme = (ROOT / "README.md").read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    tasks, calls = re.findall(r"```python\n(.*?)```", readme, re.S)
    command = re.search(r"```sh\n(celery -A tasks worker[^\n]*)\n```", readme)
    assert command, "the README's worker command"
    base = fresh_redis.url(0).rsplit("/", 1)[0]
    (tmp_path / "tasks.py").write_text(localise(tasks, base))
    (tmp_path / "calls.py").write_text(checked(localise(calls, base)))
    env = outside_env()
    env["PATH"] = f"{wheel_only_venv.parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(tmp_path)  # "from the directory holding tasks.py"
    worker = start_worker(command.group(1), tmp_path, env, exact=True)
    try:
        out = run([str(wheel_only_venv), "calls.py"], cwd=tmp_path, env=env, timeout=120)
    finally:
        stop(worker)
    assert "charged order 42: 10" in out and "REVOKED" in out, out
    log = (tmp_path / "worker0.log").read_text()
    celery = shutil.which("celery", path=env["PATH"])
    assert celery and Path(celery).parent == wheel_only_venv.parent, celery  # the venv's own celery ran
    where = run([str(wheel_only_venv), "-c", "import celery_singleton_lock as m; print(m.__file__)"], cwd=tmp_path,
                env=env)
    assert "site-packages" in where and str(ROOT) not in where, where
    assert "is a duplicate: lock singleton_lock:tasks.charge:" in log, log[-3000:]
    listed = run([str(wheel_only_venv), "-m", "pip", "list", "--format=freeze"], cwd=tmp_path, env=env)
    assert f"celery-singleton-lock=={VERSION}" in listed and "pytest" not in listed.lower(), listed
