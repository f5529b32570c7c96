"""Coverage of a range by half-open intervals: which elements arrived, which are missing.

Gradient chunks arrive mostly in order per sender, so the set stays a handful of merged
runs and an insert is a bisect plus a short splice. ``add`` returns only the sub-ranges that
were not covered yet, which is exactly what must be placed (duplicates are ignored).
"""

from __future__ import annotations

from bisect import bisect_right


class IntervalSet:
    __slots__ = ("starts", "ends", "total")

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.total = 0  # number of covered elements

    def add(self, a: int, b: int) -> list[tuple[int, int]]:
        """Cover [a, b); return the newly covered sub-ranges in ascending order."""
        if a >= b:
            return []
        starts, ends = self.starts, self.ends
        n = len(starts)
        # Fast path: appending right after (or beyond) the last run.
        if n == 0 or a > ends[-1]:
            starts.append(a)
            ends.append(b)
            self.total += b - a
            return [(a, b)]
        if a == ends[-1]:
            ends[-1] = b
            self.total += b - a
            return [(a, b)]
        i = bisect_right(starts, a)
        if i > 0 and ends[i - 1] == a and (i == n or b < starts[i]):
            ends[i - 1] = b  # extends a run without reaching the next one
            self.total += b - a
            return [(a, b)]
        j = i - 1 if i > 0 and ends[i - 1] >= a else i
        new: list[tuple[int, int]] = []
        pos, lo, hi, k = a, a, b, j
        while k < n and starts[k] <= b:
            s, e = starts[k], ends[k]
            if s > pos:
                new.append((pos, s))
            if e > pos:
                pos = e
            if s < lo:
                lo = s
            if e > hi:
                hi = e
            k += 1
        if pos < b:
            new.append((pos, b))
        starts[j:k] = [lo]
        ends[j:k] = [hi]
        for s, e in new:
            self.total += e - s
        return new

    def free(self, a: int, b: int) -> bool:
        """Whether nothing of [a, b) is covered yet (a < b)."""
        starts, ends = self.starts, self.ends
        if not ends or a >= ends[-1]:
            return True
        i = bisect_right(starts, a)
        return (i == 0 or ends[i - 1] <= a) and (i == len(starts) or starts[i] >= b)

    def missing(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """Sub-ranges of [lo, hi) not covered."""
        out, pos = [], lo
        for s, e in zip(self.starts, self.ends, strict=True):
            if e <= pos:
                continue
            if s >= hi:
                break
            if s > pos:
                out.append((pos, min(s, hi)))
            pos = max(pos, e)
            if pos >= hi:
                break
        if pos < hi:
            out.append((pos, hi))
        return out

    def clear(self) -> None:
        self.starts.clear()
        self.ends.clear()
        self.total = 0
