"""The robustness run's one excuse for a body that ran to its end twice (tools/chaos_check.py): the
process of its first end was SIGKILLed after that end, while its release could still be on its way,
before the second; nothing else excuses it."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from chaos_check import RELEASE_WINDOW, Kill, _killed_after_first_end  # noqa: E402


def test_a_rerun_is_excused_only_when_the_first_ends_process_was_killed_between_the_two_ends():
    ends = [(10.0, 111), (12.0, 222)]
    assert _killed_after_first_end(ends, [Kill(11.0, 111)])
    assert not _killed_after_first_end(ends, [])
    assert not _killed_after_first_end(ends, [Kill(11.0, 222)])  # another process killed
    assert not _killed_after_first_end(ends, [Kill(9.0, 111)])  # killed before its body ended: no excuse
    assert not _killed_after_first_end(ends, [Kill(12.5, 111)])  # killed after the rerun ended
    assert not _killed_after_first_end([(10.0, 111)], [Kill(11.0, 111)])  # ran once: nothing to excuse
    assert not _killed_after_first_end([*ends, (13.0, 333)], [Kill(11.0, 111)])  # three ends: never
    late = [(10.0, 111), (30.0, 222)]
    assert _killed_after_first_end(late, [Kill(10.0 + RELEASE_WINDOW, 111)])
    assert not _killed_after_first_end(late, [Kill(10.5 + RELEASE_WINDOW, 111)])  # its release had had its time
