"""Live re-seed of a partition while training runs (GoCkpt-style: slices rolled forward).

A shadow that cannot be repaired (restarted empty or from an old disk checkpoint, fell
behind what the trainers retain, or new in place of a dead one) is re-seeded by one trainer
without stopping training. The trainer sends the partition's state in ``slices`` pieces,
one piece per iteration, each captured right after that iteration's optimizer step (so
piece j holds the state at iteration t_j, t_0 < t_1 < ...). Meanwhile the replicated
gradients keep arriving and the shadow keeps assembling complete iterations from t_0 + 1 on.
Each complete iteration steps every piece that is exactly one iteration behind it, with the
piece's own step count (a FlatOptimizer over the piece's range: the kernels are elementwise,
so a piece steps bit-identically to the whole partition). Iterations are kept until every
piece has arrived, so a piece that arrives late is rolled forward through them at once. When
the pieces cover the partition and all stand at the same iteration L, their concatenation is
the partition's state at L, bit-identical to the trainers', and the shadow commits L and
continues as usual.

Bound: the shadow commits at the first complete iteration after the last piece's, i.e.
``slices`` + 1 iterations after t_0, plus whatever the transfer and the repair of gradients
that raced the start take. Memory while it runs: the pieces (one partition of state) plus
one gradient copy per iteration since t_0, at most ``limit`` of them.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from checkmate.errors import CheckmateError
from checkmate.shadow.control_message import Control
from checkmate.shadow.intervals import IntervalSet
from checkmate.spec.model import ModelSpec


@dataclass
class _Piece:
    start: int  # flat offset
    end: int
    iteration: int  # the iteration whose state the piece holds now
    opt: Any  # FlatOptimizer over [start, end)


class Reseed:
    """Collects the pieces of one re-seed and rolls them forward (called under the state's
    lock by the service thread for pieces and by the stepper for iterations)."""

    def __init__(self, spec: ModelSpec, start: int, end: int, t0: int, reason: str,
                 limit: int = 64) -> None:
        self.spec, self.start, self.end, self.t0 = spec, start, end, t0
        self.reason = reason
        self.limit = limit
        self.pieces: list[_Piece] = []
        self.cov = IntervalSet()
        self.history: OrderedDict[int, tuple[np.ndarray, Control]] = OrderedDict()
        self.last = t0  # newest iteration consumed
        self.last_control: Control | None = None

    @property
    def size(self) -> int:
        return self.end - self.start

    def add_piece(self, iteration: int, step: int, offset: int, count: int,
                  arrays: dict[str, np.ndarray]) -> None:
        """Take the state of [offset, offset+count) at ``iteration`` and roll it forward."""
        from checkmate.shadow.kernels import make_optimizer

        if iteration < self.t0:
            raise CheckmateError(f"re-seed piece of iteration {iteration} predates the "
                                 f"re-seed's start {self.t0}")
        if offset < self.start or offset + count > self.end or count <= 0:
            raise CheckmateError(f"re-seed piece [{offset}, {offset + count}) is outside "
                                 f"the partition [{self.start}, {self.end})")
        a = offset - self.start
        if self.cov.missing(a, a + count) != [(a, a + count)]:
            raise CheckmateError(f"re-seed piece [{offset}, {offset + count}) overlaps a "
                                 "piece already received")
        if iteration < self.last and iteration + 1 not in self.history:
            raise CheckmateError(f"re-seed piece of iteration {iteration} is older than the "
                                 "gradients kept to roll it forward")
        opt = make_optimizer(self.spec, offset, offset + count)
        opt.load(arrays, step)
        piece = _Piece(offset, offset + count, iteration, opt)
        for it in range(iteration + 1, self.last + 1):
            grad, ctl = self.history[it]
            self._step(piece, it, grad, ctl)
        self.cov.add(a, a + count)
        self.pieces.append(piece)

    def _step(self, piece: _Piece, it: int, grad: np.ndarray, ctl: Control) -> None:
        if not ctl.skip:
            piece.opt.step(ctl.step_gradient(grad[piece.start - self.start:
                                                  piece.end - self.start]),
                           ctl.lrs, ctl.clip_coef, ctl.hyper)
        piece.iteration = it

    def on_iteration(self, it: int, grad: np.ndarray, ctl: Control) -> None:
        """A complete iteration (gradient of the whole partition and its control message).

        Iterations up to ``last`` are stale (dispatched before the re-seed began): ignored.
        """
        if it <= self.last:
            return
        if it != self.last + 1:
            raise CheckmateError(f"re-seed got iteration {it} after {self.last}")
        for p in self.pieces:
            if p.iteration == it - 1:
                self._step(p, it, grad, ctl)
        self.last, self.last_control = it, ctl
        if self.cov.total < self.size:
            if len(self.history) >= self.limit:
                raise CheckmateError(f"re-seed pieces stopped arriving: {len(self.pieces)} "
                                     f"received, {self.limit} iterations since")
            self.history[it] = (grad.copy(), ctl)
        else:
            self.history.clear()

    def done(self) -> bool:
        return (self.cov.total == self.size and self.last_control is not None
                and all(p.iteration == self.last for p in self.pieces))

    def result(self) -> tuple[int, int, dict[str, np.ndarray], Control]:
        """(iteration, step count, slot arrays over the partition, that iteration's control)."""
        assert self.done() and self.last_control is not None
        steps = {p.opt.step_count for p in self.pieces}
        if len(steps) != 1:
            raise CheckmateError(f"re-seed pieces disagree on the optimizer step: "
                                 f"{sorted(steps)}")
        arrays = {s: np.empty(self.size, np.float32) for s in self.spec.slots}
        for p in self.pieces:
            for s in self.spec.slots:
                arrays[s][p.start - self.start:p.end - self.start] = p.opt.state[s]
        return self.last, steps.pop(), arrays, self.last_control

    def status(self) -> dict[str, Any]:
        return {"t0": self.t0, "pieces": len(self.pieces),
                "covered": self.cov.total, "size": self.size, "at": self.last,
                "reason": self.reason}
