"""The house rules, held by a test rather than by memory: no module of the package over 400 lines,
no function over 60 (a room or a function that big hides two jobs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "celery_singleton_lock"
MODULES = sorted(PACKAGE.rglob("*.py"))

pytestmark = pytest.mark.timeout(60)

# The functions' lengths are read by a child Python of their own: CPython 3.11's ast.parse can fail with
# "AST constructor recursion depth mismatch" when another thread of the same process parses at the
# same time (python/cpython#106905), and this suite's process runs workers' threads.
_MEASURE = """
import ast, json, sys
out = {}
for path in sys.argv[1:]:
    tree = ast.parse(open(path).read())
    out[path] = [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(tree)
                 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def function_lengths() -> dict[str, list[tuple[str, int]]]:
    done = subprocess.run([sys.executable, "-c", _MEASURE, *map(str, MODULES)], capture_output=True, text=True,
                          check=True, timeout=50)
    return {path: [tuple(pair) for pair in pairs] for path, pairs in json.loads(done.stdout).items()}


@pytest.mark.parametrize("module", MODULES, ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_no_module_over_400_lines_and_no_function_over_60(module, function_lengths):
    text = module.read_text()
    assert text.count("\n") <= 400, f"{module.name} has {text.count(chr(10))} lines"
    assert str(module) in function_lengths, f"{module} was not measured"
    long = [(name, length) for name, length in function_lengths[str(module)] if length > 60]
    assert not long, f"{module.name}: functions over 60 lines: {long}"
