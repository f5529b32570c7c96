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


def iteration_lines(names: tuple[str, str], a: Sequence[float], b: Sequence[float]
                    ) -> tuple[str, str]:
    """The two lines a whole-run bench prints for variants ``names`` whose per-round mean
    iteration times (seconds) are ``a`` and ``b``: each round's pair and ratio, then the
    medians and the ratio's verdict."""
    x, y = names
    rounds = ", ".join(f"{1000 * p:.1f}/{1000 * q:.1f} ({p / q:.3f})"
                       for p, q in zip(a, b, strict=True))
    return (f"per round, mean ms/it {x} / {y} (ratio): {rounds}",
            f"{x} {1000 * statistics.median(a):.1f} ms/it, {y} "
            f"{1000 * statistics.median(b):.1f} ms/it (medians); ratio {verdict(paired(a, b))}")
