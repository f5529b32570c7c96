"""Ratios from alternated rounds, and whether the rounds resolve them.

The benches run their variants side by side in rounds whose order alternates, on a shared
and noisy machine. Round r of two variants saw the same machine state, so the ratio is taken
per round (paired) and summarised by its median; the spread of those per-round ratios says
whether a difference is real: a ratio whose rounds spread wider than its distance from the
value it is judged against (1.0 for "no difference", or a target) is unresolved.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def paired(a: Sequence[float | None], b: Sequence[float | None]) -> list[float]:
    """``a[r] / b[r]`` for every round both have (a zero ``b[r]``, and a round where either
    run failed, recorded as None, is left out)."""
    return [x / y for x, y in zip(a, b, strict=False) if x is not None and y]


def resolved(ratios: Sequence[float], against: float) -> bool:
    """Whether the rounds resolve the ratio against ``against``: their spread (max - min) is
    smaller than the median's distance from it. One round has no spread to judge by."""
    if len(ratios) < 2:
        return False
    return max(ratios) - min(ratios) < abs(statistics.median(ratios) - against)


def spread(ratios: Sequence[float]) -> str:
    """``min-max`` of the per-round ratios, for a table cell."""
    return f"{min(ratios):.3f}-{max(ratios):.3f}" if ratios else "-"


def verdict(ratios: Sequence[float], against: float = 1.0) -> str:
    """``median (min-max)`` and, where the rounds do not resolve it, ``unresolved``."""
    if not ratios:
        return "-"
    med = statistics.median(ratios)
    return f"{med:.3f} ({spread(ratios)})" + ("" if resolved(ratios, against)
                                               else " unresolved")
