"""The benches' per-thread CPU reading from /proc: total and system time apart."""

from __future__ import annotations

import subprocess
import sys

from checkmate.testbed.bench.training import SYS, _cpu

# Spends its CPU in user time (arithmetic, no system call), then waits on stdin.
SPIN = "x = 0\nfor i in range(6_000_000):\n    x += i & 7\nprint(x > 0, flush=True)\ninput()\n"


def test_system_time_is_read_apart_from_the_total() -> None:
    p = subprocess.Popen([sys.executable, "-c", SPIN], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "True"
        total, kernel = sum(_cpu([p.pid]).values()), sum(_cpu([p.pid], SYS).values())
    finally:
        p.stdin.close()
        p.wait(10)
    assert total >= 0.2, total
    assert kernel < total / 2, (kernel, total)
