"""When the state checks run (checkmate.train.check_schedule): every K iterations, or K
chosen from the measured cost of a check against an iteration (the launcher's default)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from checkmate.errors import CheckmateError
from checkmate.train import check_schedule
from checkmate.train.check_schedule import AUTO, BUDGET, FIRST, MAX_K, MIN_K, CheckSchedule


def test_parse_and_a_fixed_k():
    assert check_schedule.parse("auto") == AUTO and check_schedule.parse("7") == 7
    assert check_schedule.describe(AUTO) == "auto" and check_schedule.describe(0) == "0"
    for bad in ("-3", "x", "1.5", ""):
        with pytest.raises(CheckmateError, match="verify-every must be"):
            check_schedule.parse(bad)
    s = CheckSchedule(5, 3)
    assert [i for i in range(4, 21) if s.due(i)] == [5, 10, 15, 20]
    assert not any(CheckSchedule(0, 0).due(i) for i in range(1, 50))


def test_auto_chooses_k_from_the_slowest_check_and_the_fastest_iteration(monkeypatch):
    """One rank here (a gloo group of one): the all-reduce's answer is this rank's own."""
    clock = [100.0]
    monkeypatch.setattr(check_schedule.time, "perf_counter", lambda: clock[0])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        s = CheckSchedule(AUTO, 40)
        assert [i for i in range(41, 41 + FIRST) if s.due(i)] == [40 + FIRST]
        # 10 iterations in 1.01 s, of which the check took 0.01 s: 0.1 s an iteration
        clock[0] += 1.01
        s.checked(50, 0.01, None)
        k = round(0.01 / (BUDGET * 0.1))
        assert s.k == k == 20 and s.next_at == 50 + k and s.count == 1
        assert not s.due(50 + k - 1) and s.due(50 + k) and s.due(50 + k + 3)
        clock[0] += 2.0
        s.checked(70, 1e-6, None)  # a check that costs nothing: checked every MIN_K at most
        assert s.k == MIN_K
        clock[0] += 100.0
        s.checked(80, 99.0, None)  # one that costs more than the iterations: MAX_K
        assert s.k == MAX_K and s.last == 80
    finally:
        dist.destroy_process_group()
    with pytest.raises(CheckmateError, match="verify_every must be"):
        CheckSchedule(-2, 0)
