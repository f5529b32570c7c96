"""Logging of bad input at a bounded rate.

A flood of bad datagrams or connections must not become a flood of log lines (disk, CPU,
and a log nobody can read). Every event is still counted by its caller; this only decides
which ones are written: at most ``burst`` lines per ``period`` seconds, then one line saying
how many were left out.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class RateLimitedLog:
    def __init__(self, write: Callable[[str], None], burst: int = 5,
                 period: float = 60.0) -> None:
        self.write, self.burst, self.period = write, burst, period
        self._start = -float("inf")
        self._written = 0
        self.suppressed = 0  # lines left out in the current period

    def __call__(self, line: str) -> None:
        now = time.monotonic()
        if now - self._start >= self.period:
            if self.suppressed:
                self.write(f"{self.suppressed} more like it in the last "
                           f"{self.period:.0f}s not logged")
            self._start, self._written, self.suppressed = now, 0, 0
        if self._written < self.burst:
            self._written += 1
            self.write(line)
        else:
            self.suppressed += 1
