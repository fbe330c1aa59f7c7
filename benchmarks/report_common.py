"""What every part of the report shares: the variants' names and labels, number formatting, tables,
and the floor figures (plain's worker time plus two raw round trips) that the cost table and the
goals both use."""

from __future__ import annotations

import math
from typing import Any

from harness import Spread

ALL_VARIANTS = ["plain", "ours", "ours-join", "celery-once", "celery-singleton", "cookbook"]
PEERS = ["celery-once", "celery-singleton", "cookbook"]
LABELS = {
    "plain": "plain (no lock)",
    "ours": "ours (LockedTask)",
    "ours-join": 'ours, `lock_publish="join"` (checked at publish)',
    "celery-once": "celery-once (QueueOnce)",
    "celery-singleton": "celery-singleton (Singleton)",
    "cookbook": "cookbook (SET NX EX + token release)",
}


def _f(x: float | None, digits: int = 0) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:,.{digits}f}"


def _s(spread: dict[str, Any], digits: int = 0, sign: bool = False) -> str:
    """median [min–max]"""
    fmt = ("{:+,.%sf}" if sign else "{:,.%sf}").replace("%s", str(digits))
    m, lo, hi = spread["median"], spread["min"], spread["max"]
    if m != m:
        return "–"
    if len(spread.get("values", [])) <= 1:
        return fmt.format(m)
    return f"{fmt.format(m)} [{fmt.format(lo)}…{fmt.format(hi)}]"


def _indent(text: str, spaces: int | None = None) -> str:
    """Leading spaces as non-breaking ones, so markdown keeps the nesting."""
    if spaces is None:
        spaces = len(text) - len(text.lstrip())
        text = text.strip()
    return "&nbsp;&nbsp;" * spaces + text


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _cmds(d: dict[str, float]) -> str:
    if not d:
        return "0"
    return ", ".join(f"{k} {v:g}" for k, v in sorted(d.items(), key=lambda kv: (-kv[1], kv[0])))


def _piece(key: str) -> tuple[str, int]:
    """A breakdown row's name and indent: "a > b > c" (a path) or "    c" (older runs: leading spaces)."""
    if " > " in key:
        parts = key.split(" > ")
        return parts[-1], 2 * (len(parts) - 1)
    return key.strip(), len(key) - len(key.lstrip())


def _n(count: int, noun: str) -> str:
    return f"{count:,} {noun}" + ("" if count == 1 else "s")


def _bytes(n: float | None) -> str:
    if n is None or n != n:
        return "–"
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= size:
            return f"{sign}{n / size:,.1f} {unit}"
    return f"{sign}{n:,.0f} B"


def floor_figures(results: dict[str, Any]) -> dict[str, Any] | None:
    """Per round: plain's worker time + two raw round trips, and every variant as a multiple of it."""
    fl = results.get("floor")
    if not fl:
        return None
    pair = fl["pair_us_p50"]
    rounds = results["interleaved"]["rounds"]
    variants = results["variants"]
    return {
        "pair_us": pair,
        "floor_us": Spread.of([r["worker_us"]["plain"] + pair for r in rounds]).as_dict(),
        "times_floor": {v: Spread.of([r["worker_us"][v] / (r["worker_us"]["plain"] + pair) for r in rounds]).as_dict()
                        for v in variants},
        "extra_times_pair": {v: Spread.of([(r["worker_us"][v] - r["worker_us"]["plain"]) / pair for r in rounds])
                             .as_dict() for v in variants},
    }
