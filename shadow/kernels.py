"""The shadow's optimizer: one FlatOptimizer per partition, its Numba kernels compiled
before the first real step (a shadow that compiled on its first gradient would stall while
the trainers ran ahead of it).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from checkmate.spec.model import ModelSpec

_WARM: set[tuple[str, bool]] = set()
#: Numba compiles (or loads from its cache) a kernel once per process; two threads doing it
#: at the same time race inside Numba, so warm-ups are serialized.
_WARM_LOCK = threading.Lock()


def warm_up_kernels() -> None:
    """Compile every optimizer kernel (Adam/AdamW and SGD, float32 gradients) before any
    spec is known: an empty shadow does it at start. Serialized with :func:`warm_up`."""
    from checkmate.optim.ops import warm_up as ops_warm_up

    with _WARM_LOCK:
        ops_warm_up(("adam", "sgd"))


def warm_up(spec: ModelSpec) -> None:
    """Compile the optimizer kernels now (serial and parallel variants) on scratch arrays, so
    the first real step does not stall the shadow while trainers run ahead."""
    with _WARM_LOCK:
        _warm_up(spec)


def _warm_up(spec: ModelSpec) -> None:
    from checkmate.optim.ops import PARALLEL_MIN

    key = (spec.kind, any(g.amsgrad for g in spec.groups))
    if key in _WARM:
        return
    g0 = spec.groups[0]
    for n in (1, PARALLEL_MIN):
        hyper = {**g0.hyper(spec.kind), "amsgrad": key[1]} if spec.kind != "sgd" else {
            **g0.hyper(spec.kind), "momentum": 0.9}
        from checkmate.optim import FlatOptimizer

        opt = FlatOptimizer(spec.kind, [(0, n, hyper)], n)
        opt.step(np.zeros(n, np.float32), [g0.lr], None)
        opt.step(np.zeros(n, np.float32), [g0.lr], 0.5)
        # and the way apply steps: into the next version's arrays
        opt.step(np.zeros(n, np.float32), [g0.lr], 0.5,
                 out={s: np.zeros(n, np.float32) for s in opt.slots})
    _WARM.add(key)


def make_optimizer(spec: ModelSpec, start: int, end: int) -> Any:
    """The partition's FlatOptimizer; one (start, end, hyper) run per group piece."""
    from checkmate.optim import FlatOptimizer

    runs = []
    for a, b, gi in spec.group_ranges(start, end):
        runs.append((a, b, {**spec.groups[gi].hyper(spec.kind), "group": gi}))
    return FlatOptimizer(spec.kind, runs, end - start)
