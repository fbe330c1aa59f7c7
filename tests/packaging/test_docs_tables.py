"""Every Markdown table renders as a table: a row cut off from its table (a blank line before it, say)
renders as a paragraph of literal pipes, which neither mkdocs --strict nor a reader's eye catches."""

from __future__ import annotations

from pathlib import Path

import pytest
from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]

pytestmark = pytest.mark.timeout(30)


def stray_rows(text: str) -> list[str]:
    """The lines of ``text`` that look like table rows but render outside any table."""
    md = MarkdownIt("commonmark").enable("table")
    tokens = md.parse(text)
    stray = []
    for i, token in enumerate(tokens):
        if token.type == "inline" and i > 0 and tokens[i - 1].type == "paragraph_open":
            stray += [line for line in token.content.splitlines()
                      if line.strip().startswith("|") and line.strip().endswith("|") and line.count("|") >= 3]
    return stray


def test_a_row_after_a_blank_line_is_found_and_a_whole_table_is_not():
    whole = "| a | b |\n|---|---|\n| 1 | 2 |\n| 3 | 4 |\n"
    assert stray_rows(whole) == []
    assert stray_rows("| a | b |\n|---|---|\n| 1 | 2 |\n\n| 3 | 4 |\n") == ["| 3 | 4 |"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_table_row_renders_inside_its_table(page):
    assert stray_rows(page.read_text()) == [], f"{page.relative_to(ROOT)}: rows rendered as text, not in a table"
