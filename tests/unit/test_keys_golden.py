"""Key derivation's golden values: these strings must never change, by hand, in processes with other
hash seeds and settings, and on every supported Python. The cases and :func:`golden_keys` are in
_keys_support.py (pure stdlib, so another Python imports it)."""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import subprocess
import sys
from datetime import datetime, timezone
from decimal import Decimal, localcontext
from pathlib import Path

import pytest
from _keys_support import DIGITS_40, GOLDEN, TASK, golden_keys, key, var_key, var_keyword

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]


def test_golden_values():
    assert golden_keys() == GOLDEN
    # a value that arrives as its int or str keys like it, whatever its class
    assert GOLDEN["int_enum"] == GOLDEN["int"] == key(1)
    assert GOLDEN["int_subclasses"] == key(150, 6)
    assert GOLDEN["str_enum"] == key("small", "x")
    assert GOLDEN["datetime_subclass"] == key(datetime(2024, 3, 1, 12, tzinfo=timezone.utc))
    with localcontext() as ctx:
        ctx.prec = 5
        assert GOLDEN["decimal_precise"] == key(Decimal(DIGITS_40), Decimal("10000000"))


def test_golden_value_by_hand():
    """The documented recipe: sha256("<task>\\n<compact JSON of the tagged arguments>"), 32 hex digits."""
    blob = '[["a",["int","1"]],["b",["int","2"]]]'
    digest = hashlib.sha256(f"{TASK}\n{blob}".encode()).hexdigest()[:32]
    assert key(1) == f"csl:shop.deduct:{{{digest}}}" == GOLDEN["int"]
    # *args is a list under its name, **kw a dict under its name: no spelling of one call is another's
    blob = '[["a",["int","1"]],["args",["list",[]]],["b",["int","0"]],["kw",["dict",[["x",["int","2"]]]]]]'
    digest = hashlib.sha256(f"{TASK}\n{blob}".encode()).hexdigest()[:32]
    assert var_key((1,), {"x": 2}, sig=inspect.signature(var_keyword)) == f"csl:shop.deduct:{{{digest}}}"


# The golden cases, computed by another process: _keys_support imported with a stand-in for the
# package (keys.py and exceptions.py only: the package's __init__ imports Celery, which the other
# Python has not got).
GOLDEN_SCRIPT = r"""
import json, os, sys, types
root = sys.argv[1]
package = types.ModuleType("celery_singleton_lock")
package.__path__ = [os.path.join(root, "celery_singleton_lock")]
sys.modules["celery_singleton_lock"] = package
sys.path.insert(0, os.path.join(root, "tests", "unit"))
import _keys_support
assert "celery" not in sys.modules and "redis" not in sys.modules, "keys.py must stay pure stdlib"
print(json.dumps({"version": list(sys.version_info[:3]), "keys": _keys_support.golden_keys()}))
"""


def golden_keys_in(python: str, **env: str) -> dict[str, str]:
    out = subprocess.run(
        [python, "-c", GOLDEN_SCRIPT, str(ROOT)],
        env=dict(os.environ, PYTHONPATH=str(ROOT), **env), capture_output=True, text=True, timeout=50,
    )
    assert out.returncode == 0, f"{python} {env}: {out.stderr[-2000:]}"
    return json.loads(out.stdout)["keys"]


@pytest.mark.timeout(120)
def test_keys_equal_in_processes_with_other_hash_seeds_and_settings():
    """String hashing (and so set order) changes with PYTHONHASHSEED, the int digit limit with
    PYTHONINTMAXSTRDIGITS; the keys must not."""
    assert golden_keys() == GOLDEN
    for env in ({"PYTHONHASHSEED": "0"}, {"PYTHONHASHSEED": "4242", "PYTHONINTMAXSTRDIGITS": "640"}):
        assert golden_keys_in(sys.executable, **env) == GOLDEN, env


PYENV_VERSIONS = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv") / "versions"
OTHER_PYTHONS = ["3.10.13", "3.11.7", "3.12.1", "3.13.0"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("version", OTHER_PYTHONS)
def test_golden_values_on_other_python_versions(version):
    """The same keys on every supported Python: str(IntEnum), for one, changed in 3.11."""
    python = PYENV_VERSIONS / version / "bin" / "python"
    if not python.exists():
        pytest.skip(f"Python {version} is not installed (no {python})")
    if version.split(".")[:2] == [str(n) for n in sys.version_info[:2]]:
        pytest.skip(f"Python {version[:4]} is the one running these tests")
    assert golden_keys_in(str(python), PYTHONHASHSEED="1") == GOLDEN
