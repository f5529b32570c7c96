"""The aligned write schedule: partitions whose disks run at different speeds still write
common iterations, so a correlated failure finds one on disk (shadow/persist_schedule.py).

The writers are simulated in iteration time (the k-th write takes costs[k % len] iterations,
one commit per tick, the backlog flushed at the end as Persister.stop does): the schedule is
pure bookkeeping, and what matters is which iterations each partition ends up writing."""

from __future__ import annotations

import pytest

from checkmate.shadow.persist_schedule import PersistSchedule


def _simulate(costs: list[int], steps: int = 400, every: int = 5,
              backlog: int = 2) -> tuple[list[int], int]:
    """(iterations written, highest level reached) for one partition."""
    s = PersistSchedule(every, backlog)
    waiting: list[int] = []
    out: list[int] = []
    writing, busy_until = None, 0

    def next_write(now: int) -> None:
        nonlocal writing, busy_until
        if writing is None and waiting:
            writing, busy_until = waiting.pop(0), now + costs[len(out) % len(costs)]
        elif writing is None:
            s.drained()

    for it in range(1, steps + 1):
        if writing is not None and it >= busy_until:
            out.append(writing)
            writing = None
        next_write(it)
        take, drop = s.admit(it, waiting)
        waiting[:] = [w for w in waiting if w not in drop] + ([it] if take else [])
        next_write(it)
    out += ([writing] if writing is not None else []) + waiting
    return out, s.max_level


def test_levels_nest():
    s = PersistSchedule(5)
    assert [s.slot_level(i) for i in (3, 5, 10, 15, 20, 40, 60)] == [None, 0, 1, 0, 2, 3, 2]
    with pytest.raises(ValueError):
        PersistSchedule(0)


def test_a_disk_that_keeps_up_writes_every_due_iteration():
    written, level = _simulate([3])
    assert written == list(range(5, 401, 5)) and level == 0


@pytest.mark.parametrize("costs", [[7], [12, 3], [30, 1, 1], [4, 9, 2, 20], [45]])
def test_partitions_at_different_speeds_write_the_same_coarse_iterations(costs):
    """A partition whose writes keep up and one with slow, uneven writes: every multiple of
    every * 2**M (M the level the slow one reached) is written by both, and the slow one
    writes nothing the fast one lacks. The old rule (the newest due version replaces the
    waiting one) let the partitions keep different iterations."""
    fast, _ = _simulate([2])
    slow, level = _simulate(costs)
    assert level > 0  # the case thins the schedule
    assert set(slow) <= set(fast), sorted(set(slow) - set(fast))
    coarse = list(range(5 << level, 401, 5 << level))
    assert coarse and all(i in slow for i in coarse), (level, slow)


def test_two_slow_partitions_share_every_iteration_of_the_higher_level():
    a, la = _simulate([11, 2])
    b, lb = _simulate([3, 17, 6])
    coarse = set(range(5 << max(la, lb), 401, 5 << max(la, lb)))
    assert coarse <= set(a) & set(b), (la, lb, sorted(set(a) & set(b)))
