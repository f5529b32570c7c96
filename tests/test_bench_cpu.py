"""The benches' per-thread CPU reading from /proc: total and system time apart."""

from __future__ import annotations

import os

from checkmate.testbed.bench.training import SYS, _cpu, _diff


def test_system_time_is_read_apart_from_the_total() -> None:
    me = [os.getpid()]
    total0, sys0 = _cpu(me), _cpu(me, SYS)
    x = 0
    for i in range(4_000_000):  # user time only: arithmetic, no system call
        x += i & 7
    spent, spent_sys = _diff(total0, _cpu(me)), _diff(sys0, _cpu(me, SYS))
    assert x and sum(spent.values()) >= 0.1, spent
    assert sum(spent_sys.values()) < sum(spent.values()) / 2, (spent_sys, spent)
