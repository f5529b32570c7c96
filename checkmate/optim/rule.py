"""The optimizer update rules, defined once as sequences of IEEE float32 operations.

Every executor of an optimizer step follows these functions: the exact torch executor
(:mod:`checkmate.optim.exact_torch`, any device), the Triton kernel generated from them
(:mod:`checkmate.optim.triton_step`, CUDA) and, written out by hand in the same order, the
Numba kernels the shadows run (``_adam_range`` / ``_sgd_range`` in
:mod:`checkmate.optim.kernels`; the CPU suite proves them equal bit for bit). A rule is
written against an arithmetic object ``A`` whose operations are each one correctly rounded
float32 operation (round to nearest even, subnormals kept):

- ``A.mul(a, b)``, ``A.add(a, b)``, ``A.sub(a, b)``, ``A.div(a, b)``, ``A.sqrt(a)``;
- ``A.fma(a, b, c)``: ``a * b + c`` rounded once;
- ``A.maximum(a, b)``: ``a`` where ``a > b`` or ``a`` is NaN, else ``b`` (torch.maximum:
  NaN-propagating; on equal values, ``-0.0`` and ``+0.0`` included, it returns ``b``).

Branches on the :class:`AdamFlags` / :class:`SgdFlags` are decided before the step (per
parameter group), never per element, so each variant is one straight-line sequence.
NaN payloads are not part of the contract (devices differ in the NaN they produce); which
elements are NaN is.

Adam / AdamW, per element (``p`` param, ``g`` gradient widened to float32, ``m`` exp_avg,
``v`` exp_avg_sq, ``vmax`` max_exp_avg_sq; scalars from :func:`checkmate.optim.ops.
adam_scalars`, torch 2.13's single-tensor arithmetic with a true FMA wherever ATen fuses)::

    g = g * gscale                      # clip factor, negated for maximize
    p = p * decay                       # AdamW: 1 - lr*wd (flag decay)
    g = fma(p, wd, g)                   # Adam L2: grad + wd*param (flag l2)
    m = fma(coeff, g - m, m or g)       # exp_avg.lerp_(g, 1-beta1): base m if |w| < 0.5
    v = fma(c2 * g, g, v * b2)          # exp_avg_sq.mul_(b2).addcmul_(g, g, 1-b2)
    vmax = maximum(vmax, v)             # amsgrad (flag); the denominator then uses vmax
    denom = sqrt(v) / bc2_sqrt + eps
    p = p + (neg_step * m) / denom      # param.addcdiv_(m, denom, value=-lr/bc1)

SGD, per element (``b`` momentum_buffer; scalars from :func:`checkmate.optim.ops.
sgd_scalars`)::

    g = g * gscale
    g = fma(p, wd, g)                   # weight decay (flag l2)
    b = g                               # first momentum step (torch: buffer is None)
    b = fma(g, damp1, b * momentum)     # later steps: buf.mul_(m).add_(g, alpha=1-d)
    g = fma(b, momentum, g)  or  g = b  # nesterov, or plain momentum
    p = fma(g, neg_lr, p)               # param.add_(g, alpha=-lr)

How each executor makes every operation correctly rounded is in docs/architecture.md
("One update rule, exact on CPU and GPU").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

#: names of the Adam kernel scalars, in the order of ops.adam_scalars' array.
ADAM_SCALARS = ("gscale", "decay", "wd", "l2", "coeff", "base_is_avg", "c2", "b2", "bc2_sqrt",
                "eps", "neg_step")
#: names of the SGD kernel scalars, in the order of ops.sgd_scalars' array.
SGD_SCALARS = ("gscale", "wd", "l2", "momentum", "damp1", "neg_lr")

#: every operation a rule may use (the tracer checks a generated kernel against these).
OPS = ("mul", "add", "sub", "div", "sqrt", "fma", "maximum")


class Arith(Protocol):
    """One correctly rounded float32 operation per method (see the module docstring)."""

    def mul(self, a: Any, b: Any) -> Any: ...
    def add(self, a: Any, b: Any) -> Any: ...
    def sub(self, a: Any, b: Any) -> Any: ...
    def div(self, a: Any, b: Any) -> Any: ...
    def sqrt(self, a: Any) -> Any: ...
    def fma(self, a: Any, b: Any, c: Any) -> Any: ...
    def maximum(self, a: Any, b: Any) -> Any: ...


@dataclass(frozen=True)
class AdamFlags:
    """Which straight-line variant of the Adam rule a parameter group runs."""

    decay: bool  # AdamW decoupled weight decay (decay != 1)
    l2: bool  # Adam L2 weight decay folded into the gradient
    base_is_avg: bool  # lerp's vector form: base exp_avg (weight < 0.5) or grad
    amsgrad: bool

    @classmethod
    def of(cls, s: np.ndarray, amsgrad: bool) -> AdamFlags:
        """The flags the kernel scalars ``s`` (ops.adam_scalars) imply."""
        return cls(decay=bool(s[1] != np.float32(1.0)), l2=bool(s[3] != 0),
                   base_is_avg=bool(s[5] != 0), amsgrad=bool(amsgrad))

    @property
    def tag(self) -> str:
        return "adam_" + "".join("1" if x else "0" for x in
                                 (self.decay, self.l2, self.base_is_avg, self.amsgrad))


#: SGD momentum variants (ops.sgd_mode & 3).
NO_MOMENTUM, FIRST_MOMENTUM, MOMENTUM = 0, 1, 2


@dataclass(frozen=True)
class SgdFlags:
    """Which straight-line variant of the SGD rule a parameter group runs."""

    l2: bool
    momentum: int  # NO_MOMENTUM, FIRST_MOMENTUM or MOMENTUM
    nesterov: bool

    @classmethod
    def of(cls, s: np.ndarray, mode: int) -> SgdFlags:
        """The flags of kernel scalars ``s`` (ops.sgd_scalars) and ``mode`` (ops.sgd_mode)."""
        return cls(l2=bool(s[2] != 0), momentum=mode & 3, nesterov=bool(mode & 4))

    @property
    def tag(self) -> str:
        return f"sgd_{int(self.l2)}{self.momentum}{int(self.nesterov)}"


class Scalars:
    """Named scalars of one step (attribute access by the names above)."""

    def __init__(self, names: tuple[str, ...], values: Any) -> None:
        for name, value in zip(names, values, strict=True):
            setattr(self, name, value)


def adam(A: Arith, p: Any, g: Any, m: Any, v: Any, vmax: Any, s: Scalars,
         f: AdamFlags) -> tuple[Any, Any, Any, Any]:
    """One Adam/AdamW step of every element: returns new ``(p, m, v, vmax)``.

    ``g`` is already float32 (bf16/fp16 widened exactly); ``vmax`` is unused (returned as
    given) unless ``f.amsgrad``.
    """
    g = A.mul(g, s.gscale)
    if f.decay:
        p = A.mul(p, s.decay)
    if f.l2:
        g = A.fma(p, s.wd, g)
    m = A.fma(s.coeff, A.sub(g, m), m if f.base_is_avg else g)
    v = A.fma(A.mul(s.c2, g), g, A.mul(v, s.b2))
    v_used = v
    if f.amsgrad:
        vmax = A.maximum(vmax, v)
        v_used = vmax
    denom = A.add(A.div(A.sqrt(v_used), s.bc2_sqrt), s.eps)
    p = A.add(p, A.div(A.mul(s.neg_step, m), denom))
    return p, m, v, vmax


def sgd(A: Arith, p: Any, g: Any, buf: Any, s: Scalars, f: SgdFlags) -> tuple[Any, Any]:
    """One SGD step of every element: returns new ``(p, buf)`` (``buf`` untouched
    without momentum)."""
    g = A.mul(g, s.gscale)
    if f.l2:
        g = A.fma(p, s.wd, g)
    if f.momentum != NO_MOMENTUM:
        buf = g if f.momentum == FIRST_MOMENTUM else A.fma(g, s.damp1, A.mul(buf, s.momentum))
        g = A.fma(buf, s.momentum, g) if f.nesterov else buf
    p = A.fma(g, s.neg_lr, p)
    return p, buf


# ------------------------------------------------------------------------------ tracing


class Tracer:
    """An arithmetic object that records the rule instead of computing it: each operation
    appends ``(name, op, operands)`` and returns the new value's name. Kernel generators
    (Triton) turn the record into source; tests compare it with the rule's text."""

    def __init__(self) -> None:
        self.ops: list[tuple[str, str, tuple[str, ...]]] = []

    def _emit(self, op: str, *args: str) -> str:
        name = f"t{len(self.ops)}"
        self.ops.append((name, op, tuple(args)))
        return name

    def mul(self, a: str, b: str) -> str:
        return self._emit("mul", a, b)

    def add(self, a: str, b: str) -> str:
        return self._emit("add", a, b)

    def sub(self, a: str, b: str) -> str:
        return self._emit("sub", a, b)

    def div(self, a: str, b: str) -> str:
        return self._emit("div", a, b)

    def sqrt(self, a: str) -> str:
        return self._emit("sqrt", a)

    def fma(self, a: str, b: str, c: str) -> str:
        return self._emit("fma", a, b, c)

    def maximum(self, a: str, b: str) -> str:
        return self._emit("maximum", a, b)


def trace_adam(f: AdamFlags) -> tuple[Tracer, tuple[str, str, str, str]]:
    """The Adam rule's operations for ``f``; inputs are named p, g, m, v, vmax and the
    scalars by their ADAM_SCALARS names. Returns the tracer and the output names."""
    t = Tracer()
    out = adam(t, "p", "g", "m", "v", "vmax", Scalars(ADAM_SCALARS, ADAM_SCALARS), f)
    return t, out


def trace_sgd(f: SgdFlags) -> tuple[Tracer, tuple[str, str]]:
    """The SGD rule's operations for ``f`` (inputs p, g, buf and the SGD_SCALARS names)."""
    t = Tracer()
    out = sgd(t, "p", "g", "buf", Scalars(SGD_SCALARS, SGD_SCALARS), f)
    return t, out
