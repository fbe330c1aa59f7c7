"""The README is the front door (it is also the PyPI page): checked from the checkout, no Redis.

Its quick start is the documentation's, which test_docs_examples.py runs against a real
redis-server and worker; here, that the two are the same code, that every link is absolute (a
relative one breaks on PyPI) and points where [project.urls] says, and that the contributors'
two commands are the ones dev.py has.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
URLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]

pytestmark = pytest.mark.timeout(10)


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python(?: [^\n]*)?\n(.*?)```", text, re.S)


def test_the_quick_start_is_the_tested_one() -> None:
    guide = python_blocks((ROOT / "docs" / "getting-started.md").read_text())
    quick = python_blocks(README.split("## Quick start", 1)[1].split("\n## ", 1)[0])
    assert quick == guide[:2], "the README's quick start differs from docs/getting-started.md"
    assert "celery -A tasks worker --loglevel=INFO --concurrency=2" in README


def test_install_lines_are_quoted() -> None:
    assert 'pip install "celery-singleton-lock"' in README
    for line in re.findall(r"pip install [^\n`]*", README):
        assert re.match(r'pip install "celery-singleton-lock(\[\w+\])?"', line), line


def test_every_link_is_absolute_and_consistent() -> None:
    links = re.findall(r"\]\(([^)]+)\)", README)
    assert links
    relative = [link for link in links if not link.startswith("https://")]
    assert not relative, relative
    docs, repo = URLS["Documentation"].rstrip("/"), URLS["Repository"]
    for link in links:
        assert link.startswith((docs, repo)), link
        if link.startswith(docs):
            page = link[len(docs):].strip("/").split("#")[0]
            source = ROOT / "docs" / (f"{page}.md" if page else "index.md")
            assert source.exists(), f"{link}: no {source.relative_to(ROOT)}"
        else:
            path = link[len(repo):].removeprefix("/blob/main/").split("#")[0]
            assert (ROOT / path).exists(), f"{link}: no {path}"


def test_the_two_commands_for_contributors() -> None:
    for command in ("python3 dev.py demo", "python3 dev.py test"):
        assert f"\n{command}     # " in README, command
        assert f"\n{command}     # " in (ROOT / "CONTRIBUTING.md").read_text(), command
    assert "python3 dev.py docs" in (ROOT / "dev.py").read_text()


def test_front_door_shape() -> None:
    lines = README.count("\n")
    assert 150 <= lines <= 300, lines
    for heading in ("## Install", "## Quick start", "## Choosing the key and the policy",
                    "## How it differs from celery-once and celery-singleton", "## Limits", "## Contributing"):
        assert heading in README, heading
    assert "coalesce" in README and "lock_publish" in README and "lock_cooldown" in README
