"""The house rules, held by a test rather than by memory: no module of the package over 400 lines,
no function over 60 (a room or a function that big hides two jobs)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "celery_singleton_lock"
MODULES = sorted(PACKAGE.rglob("*.py"))

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("module", MODULES, ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_no_module_over_400_lines_and_no_function_over_60(module):
    text = module.read_text()
    assert text.count("\n") <= 400, f"{module.name} has {text.count(chr(10))} lines"
    long = [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(text))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60]
    assert not long, f"{module.name}: functions over 60 lines: {long}"
