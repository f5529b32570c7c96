"""The shadow's optimizer: one partition's float32 state in flat arrays.

A partition is a contiguous slice of the flat parameter space, possibly cutting
parameters; each element belongs to one param group. :class:`FlatOptimizer` holds the
slot arrays and steps them with the same kernels the trainer's
:mod:`checkmate.optim.torch_optim` optimizers use, so both sides stay bit-identical.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from checkmate.errors import CheckmateError
from checkmate.optim import hyper as H
from checkmate.optim import ops
from checkmate.optim.grads import as_kernel_grad
from checkmate.spec.partition import layout, partition_bounds, partition_pieces


class FlatOptimizer:
    """Optimizer state of one partition: ``size`` elements cut into group ranges.

    Args:
        kind: ``"adam"``, ``"adamw"`` or ``"sgd"``.
        groups: ``[(start, end, hyper), ...]`` half-open ranges of the local arrays with
            their hyperparameters (torch names: lr, betas, eps, weight_decay, amsgrad,
            momentum, dampening, nesterov, maximize). ``hyper["group"]``, if present, is
            the param-group index that selects this range's entry of ``lrs`` in
            :meth:`step`; otherwise the range's position in the list. The ranges must be
            disjoint and cover ``[0, size)``.
        size: elements in the partition.

    Attributes:
        slots: slot names in wire order (``param`` first).
        state: slot name -> float32 array of ``size`` elements.
        step_count: optimizer steps applied (Adam's ``step``; SGD: 0 = no momentum buffer
            yet).
    """

    def __init__(self, kind: str, groups: Sequence[tuple[int, int, Mapping[str, Any]]],
                 size: int) -> None:
        self.kind = H.check_kind(kind)
        if size < 0:
            raise CheckmateError(f"partition size must be >= 0, got {size}")
        self.size = size
        ranges = []
        for pos, (start, end, hp) in enumerate(groups):
            if not 0 <= start <= end <= size:
                raise CheckmateError(f"group range [{start}, {end}) outside [0, {size})")
            index = int(hp.get("group", pos))
            if start < end:
                ranges.append((start, end, index, H.resolve(kind, hp)))
        ranges.sort(key=lambda r: r[0])
        pos = 0
        for start, end, _, _ in ranges:
            if start != pos:
                what = "overlap" if start < pos else "leave a hole"
                raise CheckmateError(f"group ranges {what} at element {min(start, pos)}")
            pos = end
        if pos != size:
            raise CheckmateError(f"group ranges cover [0, {pos}) but the partition has {size}")
        self.ranges: list[tuple[int, int, int, dict[str, Any]]] = ranges
        self.groups = max((r[2] for r in ranges), default=-1) + 1
        self.slots = H.slots(kind, [r[3] for r in ranges])
        self.state = {name: np.zeros(size, np.float32) for name in self.slots}
        self.step_count = 0

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any], index: int) -> FlatOptimizer:
        """The optimizer for partition ``index`` of a model spec (docs/protocol.md).

        Raises:
            CheckmateError: the spec's params, groups or totals disagree.
        """
        try:
            params = [(p["name"], p["shape"]) for p in spec["params"]]
            opt = spec["optimizer"]
            kind, spec_groups = opt["kind"], opt["groups"]
            total, n = int(spec["total"]), int(spec["partitions"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckmateError(f"model spec lacks a field or has a bad one: {e}") from None
        slots = layout(params)
        if (slots[-1].end if slots else 0) != total:
            raise CheckmateError(f"model spec total {total} != sum of parameter sizes")
        for s, p in zip(slots, spec["params"], strict=True):
            if "offset" in p and int(p["offset"]) != s.offset:
                raise CheckmateError(f"parameter {s.name!r}: offset {p['offset']} != {s.offset}")
            if "numel" in p and int(p["numel"]) != s.numel:
                raise CheckmateError(f"parameter {s.name!r}: numel {p['numel']} != {s.numel}")
        if not 0 <= index < n:
            raise CheckmateError(f"partition {index} out of range for {n} partitions")
        group_of: dict[str, int] = {}
        for gi, g in enumerate(spec_groups):
            for name in g.get("params", []):
                if name in group_of:
                    raise CheckmateError(f"parameter {name!r} is in two param groups")
                group_of[name] = gi
        start, end = partition_bounds(total, n)[index]
        ranges: list[tuple[int, int, Mapping[str, Any]]] = []
        for piece in partition_pieces(slots, start, end):
            if piece.name not in group_of:
                raise CheckmateError(f"parameter {piece.name!r} is in no param group")
            gi = group_of[piece.name]
            lo, hi = piece.local_start, piece.local_start + piece.count
            if ranges and ranges[-1][2]["group"] == gi and ranges[-1][1] == lo:
                ranges[-1] = (ranges[-1][0], hi, ranges[-1][2])
            else:
                ranges.append((lo, hi, {**spec_groups[gi], "group": gi}))
        return cls(kind, ranges, end - start)

    # ------------------------------------------------------------------ state access

    def __getattr__(self, name: str) -> np.ndarray:
        state = self.__dict__.get("state", {})
        if name in state:
            return state[name]
        raise AttributeError(name)

    def snapshot(self) -> dict[str, np.ndarray]:
        """Copies of every slot (for retaining a committed version)."""
        return {k: v.copy() for k, v in self.state.items()}

    def load(self, arrays: Mapping[str, np.ndarray], step_count: int) -> None:
        """Replace the whole state (restore from a snapshot or from disk)."""
        missing = set(self.slots) - set(arrays)
        if missing:
            raise CheckmateError(f"state lacks slots {sorted(missing)}")
        for k in self.slots:
            a = np.asarray(arrays[k], dtype=np.float32).reshape(-1)
            if a.shape[0] != self.size:
                raise CheckmateError(f"slot {k}: {a.shape[0]} elements, expected {self.size}")
            self.state[k][:] = a
        self.step_count = int(step_count)

    # -------------------------------------------------------------------------- step

    def set_hyper(self, hyper: Sequence[Mapping[str, Any]]) -> None:
        """Take the per-group hyperparameters of this step (control message ``hyper``), so a
        change the trainer made mid-run (weight decay, betas, momentum...) is followed.

        Raises:
            CheckmateError: too few groups, a bad value, or a change the slots cannot follow
                (:func:`checkmate.optim.hyper.check_change`).
        """
        if len(hyper) < self.groups:
            raise CheckmateError(f"need hyperparameters for {self.groups} groups, got "
                                 f"{len(hyper)}")
        for n, (start, end, gi, hp) in enumerate(self.ranges):
            new = H.resolve(self.kind, {**hp, **hyper[gi], "lr": hp["lr"]})
            if new != hp:
                H.check_change(self.kind, hp, new, f"param group {gi}")
                self.ranges[n] = (start, end, gi, new)

    def step(self, grad: np.ndarray, lrs: Sequence[float],
             clip_coef: float | None = None,
             hyper: Sequence[Mapping[str, Any]] | None = None,
             out: Mapping[str, np.ndarray] | None = None) -> None:
        """Apply one step to every range.

        Args:
            grad: the partition's gradient (float32, or bf16/fp16 bits, see
                :func:`checkmate.optim.grads.as_kernel_grad`).
            lrs: learning rate per param group for this step (control message ``lrs``).
            clip_coef: factor the trainer's clip_grad_norm_ applied (None: no clipping).
            hyper: the other hyperparameters per group for this step (control message
                ``hyper``); None keeps the current ones.
            out: slot name -> float32 array of ``size`` elements, not overlapping the
                state: the step reads the current state and writes the new one there
                (every element of every slot, the ones a range's rule leaves alone
                copied), and ``out`` becomes the state; the old arrays are left as they
                were. The shadow steps straight into its next retained version this way,
                so no copy pass follows the step. None: in place.
        """
        if hyper is not None:
            self.set_hyper(hyper)
        g = as_kernel_grad(grad)
        if g.shape[0] != self.size:
            raise CheckmateError(f"gradient has {g.shape[0]} elements, expected {self.size}")
        if len(lrs) < self.groups:
            raise CheckmateError(f"need {self.groups} learning rates, got {len(lrs)}")
        if out is not None:
            missing = [k for k in self.slots if k not in out]
            if missing:
                raise CheckmateError(f"out lacks slots {missing}")
        step = self.step_count + 1
        st = self.state
        for start, end, gi, hp in self.ranges:
            sl = slice(start, end)
            lr = float(lrs[gi])
            if self.kind == "sgd":
                buf = st["momentum_buffer"][sl] if "momentum_buffer" in st else None
                written = {"param"} | ({"momentum_buffer"} if hp["momentum"] != 0 else set())
                o = None if out is None else (
                    out["param"][sl], out["momentum_buffer"][sl] if buf is not None else None)
                ops.sgd_step(st["param"][sl], g[sl], buf, lr=lr, momentum=hp["momentum"],
                             dampening=hp["dampening"], weight_decay=hp["weight_decay"],
                             nesterov=hp["nesterov"], first=self.step_count == 0,
                             clip_coef=clip_coef, maximize=hp["maximize"], out=o)
            else:
                mx = st["max_exp_avg_sq"][sl] if hp["amsgrad"] else None
                written = {"param", "exp_avg", "exp_avg_sq"} | (
                    {"max_exp_avg_sq"} if hp["amsgrad"] else set())
                o = None if out is None else (
                    out["param"][sl], out["exp_avg"][sl], out["exp_avg_sq"][sl],
                    out["max_exp_avg_sq"][sl] if mx is not None else None)
                b1, b2 = hp["betas"]
                ops.adam_step(st["param"][sl], g[sl], st["exp_avg"][sl], st["exp_avg_sq"][sl],
                              mx, lr=lr, beta1=b1, beta2=b2, eps=hp["eps"],
                              weight_decay=hp["weight_decay"], decoupled=self.kind == "adamw",
                              amsgrad=hp["amsgrad"], step=step, clip_coef=clip_coef,
                              maximize=hp["maximize"], out=o)
            if out is not None:  # a slot this range's rule does not touch keeps its value
                for k in self.slots:
                    if k not in written:
                        np.copyto(out[k][sl], st[k][sl])
        if out is not None:
            self.state = {k: out[k] for k in self.slots}
        self.step_count = step
