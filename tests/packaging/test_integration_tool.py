"""tools/celery_integration.py's pure parts: which sdist files it takes, how it splits tests, how it compares.

The run itself (Celery's integration suite, twice) takes ~10 minutes and is not part of
this suite: see tools/README.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import celery_integration as tool  # noqa: E402


@pytest.mark.parametrize(
    "rel, wanted",
    [
        ("pyproject.toml", True),
        ("t/__init__.py", True),
        ("t/canvas_helpers.py", True),
        ("t/integration/conftest.py", True),
        ("t/integration/tasks.py", True),
        ("t/unit/conftest.py", False),
        ("t/smoke/tests/test_worker.py", False),
        ("celery/app/task.py", False),
        ("setup.py", False),
    ],
)
def test_takes_only_the_integration_suite_from_the_sdist(rel: str, wanted: bool) -> None:
    assert tool._wanted(rel) is wanted


def test_shards_cover_every_test_once_and_split_alike_each_time() -> None:
    ids = [f"t/integration/test_x.py::test_{i}" for i in range(50)]
    weights = {ids[3]: 170.0, ids[7]: 120.0, ids[20]: 60.0}
    owner = tool.shard_of(ids, 3, weights)
    assert len(owner) == len(ids) and set(owner) == {0, 1, 2}
    assert tool.shard_of(ids, 3, weights) == owner  # both modes get the same split
    # the three longest tests land in three different shards
    assert len({owner[3], owner[7], owner[20]}) == 3


def test_shards_are_balanced_by_weight() -> None:
    ids = [f"t{i}" for i in range(10)]
    weights = {"t0": 100.0}  # one long test; the nine others default to DEFAULT_WEIGHT
    owner = tool.shard_of(ids, 2, weights)
    assert [i for i, s in enumerate(owner) if s == owner[0]] == [0]  # the long one alone


def test_one_shard_takes_everything_and_zero_shards_is_an_error() -> None:
    assert tool.shard_of(["a", "b"], 1, {}) == [0, 0]
    assert tool.shard_of([], 2, {}) == []
    with pytest.raises(ValueError, match="got 0"):
        tool.shard_of(["a"], 0, {})


def _run(**outcomes: str) -> dict:
    return {"tests": {name: {"outcome": o, "longrepr": f"E   {name} broke", "when": "call"}
                      for name, o in outcomes.items()}}


def test_compare_names_regressions_and_honours_the_allow_list(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(tool, "ALLOWED_REGRESSIONS", {"allowed": "starts two identical calls at once"})
    plain = _run(ok="passed", broke="passed", allowed="passed", xf="xfailed", gone="passed",
                 fixed="failed", both="failed", skip="skipped")
    lock = _run(ok="passed", broke="failed", allowed="error", xf="failed",
                fixed="passed", both="failed", skip="skipped")
    lines, unexpected = tool.compare(plain, lock, tmp_path)
    assert unexpected == ["broke", "gone", "xf"]  # "gone": not run with the lock at all
    text = "\n".join(lines)
    assert "regressions (pass without LockedTask, fail with it): 4" in text
    assert "allowed: starts two identical calls at once" in text
    assert "fail without LockedTask, pass with it: ['fixed']" in text
    assert "E   broke broke" in (tmp_path / "regressions.txt").read_text()


def test_compare_with_nothing_changed(tmp_path: Path) -> None:
    lines, unexpected = tool.compare(_run(a="passed", b="failed"), _run(a="passed", b="failed"), tmp_path)
    assert unexpected == [] and lines[0].endswith(": 0")
    assert (tmp_path / "regressions.txt").read_text() == "none\n"
