"""When the state checks run (issue 35): every K iterations, or every K chosen by measurement.

A check (replica agreement, then the shadows' state digests) costs one pass over each rank's
state and share; what that is against an iteration depends on the model, the machine and
the batch, so no fixed K keeps it under 1% everywhere. ``auto`` (the launcher's default)
measures instead: the first check comes after ``FIRST`` iterations; after each, every rank
of the group takes the longest check and the shortest mean iteration time of the ranks
(one all-reduce of two numbers), and the next check comes ``K = check / (BUDGET x
iteration)`` iterations later, between ``MIN_K`` and ``MAX_K``. Every rank computes the
same K from the same reduced numbers, so the ranks check the same iterations without
asking each other. The budget is half the 1% the checks may cost: a machine's noise moves
both numbers.
"""

from __future__ import annotations

import math
import time
from typing import Any

from checkmate.errors import CheckmateError

#: ``verify_every`` that means "chosen by measurement".
AUTO = -1
#: auto: iterations before the first check, and the bounds of K.
FIRST = 10
MIN_K, MAX_K = 10, 10_000
#: auto: the share of the training time the checks may take.
BUDGET = 0.005


def parse(text: str) -> int:
    """``K`` (0: never) or ``auto`` as given on a command line or in the environment."""
    if text == "auto":
        return AUTO
    if not text.isdigit():
        raise CheckmateError(f"verify-every must be a whole number of iterations or auto, "
                             f"got {text!r}")
    return int(text)


def describe(every: int) -> str:
    return "auto" if every == AUTO else str(every)


class CheckSchedule:
    """Which iterations a session checks; ``last`` is the newest it checked (or began at)."""

    def __init__(self, every: int, start: int) -> None:
        if every < AUTO:
            raise CheckmateError(f"verify_every must be >= 0 or AUTO, got {every}")
        self.every, self.last = every, start
        self.next_at = start + FIRST if every == AUTO else None
        self.k: int | None = every if every > 0 else None
        self.count = 0  # checks made
        self._mark = time.perf_counter()  # the end of the last check (or the start)

    def due(self, iteration: int) -> bool:
        if self.every == AUTO:  # at or past it: checks paused meanwhile (a bench) resume
            return self.next_at is not None and iteration >= self.next_at
        return self.every > 0 and iteration % self.every == 0

    def checked(self, iteration: int, seconds: float, group: Any) -> None:
        """A check of ``iteration`` took ``seconds`` here; auto: the next K, from every
        rank's numbers (a collective of ``group``)."""
        now = time.perf_counter()
        iters = max(1, iteration - self.last)
        per_iteration = max(1e-6, (now - self._mark - seconds) / iters)
        self.last = iteration
        self.count += 1
        if self.every == AUTO:
            import torch
            import torch.distributed as dist

            both = torch.tensor([seconds, -per_iteration], dtype=torch.float64)
            dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
            check, step = float(both[0]), -float(both[1])
            self.k = min(MAX_K, max(MIN_K, math.ceil(check / (BUDGET * step))))
            self.next_at = iteration + self.k
        self._mark = time.perf_counter()
