"""The release metadata, read from the checkout (no build): the pieces a PyPI page and a packager need.

test_packaging.py checks the same facts in the built wheel; these fail in a second.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
from packaging.version import Version

import celery_singleton_lock

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
URL = "https://github.com/celery-singleton-lock/celery-singleton-lock"

pytestmark = pytest.mark.timeout(10)


def test_the_version_is_written_once() -> None:
    assert "version" not in PROJECT and "version" in PROJECT["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "celery_singleton_lock.__version__"}
    version = celery_singleton_lock.__version__
    written = [p for p in ROOT.glob("celery_singleton_lock/**/*.py") if f'"{version}"' in p.read_text()]
    assert written == [ROOT / "celery_singleton_lock" / "__init__.py"], written


def test_license_is_mit_and_shipped() -> None:
    assert PROJECT["license"] == "MIT" and PROJECT["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License") and "WITHOUT WARRANTY OF ANY KIND" in text


def test_urls_and_classifiers() -> None:
    urls = PROJECT["urls"]
    assert {"Homepage", "Documentation", "Repository", "Issues", "Changelog"} <= set(urls)
    assert all(u.startswith("https://") for u in urls.values())
    assert urls["Repository"] == URL
    classifiers = PROJECT["classifiers"]
    assert "Development Status :: 3 - Alpha" in classifiers
    tested = f"Programming Language :: Python :: {sys.version_info.major}.{sys.version_info.minor}"
    assert tested in classifiers, f"the suite runs on {tested}, not listed"


def test_contributor_tools_are_a_dependency_group_not_an_extra() -> None:
    assert "test" not in PROJECT["optional-dependencies"]
    assert {"pytest", "prometheus"} <= set(PROJECT["optional-dependencies"])
    groups = PYPROJECT["dependency-groups"]
    assert any(r.startswith("pytest-timeout") for r in groups["test"])
    assert any(r.startswith("mkdocs") for r in groups["docs"])


def _dev_module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("_dev", ROOT / "dev.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_dev_py_resolves_the_dev_group(tmp_path: Path) -> None:
    dev = _dev_module()
    wanted = dev.group_requirements("dev")
    groups = PYPROJECT["dependency-groups"]
    assert wanted == [*groups["test"], *groups["docs"]]
    (tmp_path / "pyproject.toml").write_text('[dependency-groups]\na = ["x"]\nb = [{include-group = "a"}, "y"]\n')
    assert dev.group_requirements("b", tmp_path / "pyproject.toml") == ["x", "y"]
    with pytest.raises(SystemExit, match="no dependency group 'c'"):
        dev.group_requirements("c", tmp_path / "pyproject.toml")


def test_changelog_is_dated_and_has_upgrade_notes() -> None:
    text = (ROOT / "CHANGELOG.md").read_text()
    releases = re.findall(r"^## \[(\d+\.\d+\.\d+)\] - (\d{4}-\d{2}-\d{2})$", text, re.M)
    # main carries the next version's dev release, whose changes stand under [Unreleased]
    newest, version = Version(releases[0][0]), Version(celery_singleton_lock.__version__)
    assert version == newest or (version.is_devrelease and version > newest and "## [Unreleased]" in text), \
        (releases[0], version)
    undated = re.findall(r"^## \[\d+\.\d+\.\d+\]$", text, re.M)
    assert not undated, undated
    upgrading = text.split("### Upgrading to 0.2", 1)[1].split("\n### ", 1)[0]
    for needed in ("**kwargs", "on_duplicate=\"retry\"", "both run it", "Drain", "one version at a time"):
        assert needed.lower() in upgrading.lower(), needed


def test_the_docs_settings_table_names_every_setting() -> None:
    """tools/docs_hooks.py generates the settings reference from config.SETTINGS, both spellings."""
    spec = importlib.util.spec_from_file_location("_docs_hooks", ROOT / "tools" / "docs_hooks.py")
    assert spec is not None and spec.loader is not None
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    from celery_singleton_lock.delivery import config

    table = hooks.settings_table()
    for setting in config.SETTINGS:
        assert f"| `{setting}` | `CELERY_{setting.upper()}` |" in table, setting
    assert "| `singleton_lock_ttl` | `CELERY_SINGLETON_LOCK_TTL` | `lock_ttl` | `30.0` |" in table
    page = hooks.on_page_markdown("before\n<!-- generated: settings -->\nafter")
    assert "<!-- generated" not in page and "singleton_lock_url" in page
