"""The update rule (:mod:`checkmate.optim.rule`) executed exactly with plain torch ops, on
tensors of any device torch computes float64 on correctly (CPU, CUDA).

Why: torch's own float32 kernels are not all correctly rounded (its vectorized CPU float32
sqrt is about 1 ulp off in a fifth of the elements, measured) and a CUDA kernel may
contract a multiply and an add. Here every float32 operation is made exact independently of
the device's float32 kernels:

- ``+ - * /`` and ``sqrt``: computed in float64 and rounded once to float32. For p = 24,
  float64's 53 bits are at least 2p + 2, so the double rounding is innocuous and the
  result is the correctly rounded float32 one (Figueroa, 1995). Overflow to inf, NaN and
  subnormal results come out as IEEE float32 arithmetic gives them.
- ``fma(a, b, c)``: ``a * b`` is exact in float64 (48 significant bits, exponents within
  float64's normal range); the sum ``s = a*b + c`` is rounded to nearest in float64 and its
  exact error ``e`` found by TwoSum; where ``e != 0`` and ``s``'s last mantissa bit is even,
  ``s`` steps one float64 ulp toward ``e`` (``torch.nextafter``): that is ``a*b + c``
  rounded to odd in float64, and one rounding of it to float32 is the correctly rounded
  fma (Boldo and Melquiond, "Emulation of FMA and correctly rounded sums: proved
  algorithms using rounding to odd", 2008; 53 >= 24 + 2). Where ``s`` is not finite
  (an inf or NaN operand) the error term is ignored: the sum is then already IEEE's.

Only plain binary torch ops are used (no ``alpha=``, ``addcmul``, ``lerp``): each op is its
own kernel, so no compiler can fuse two roundings into one. Work proceeds in chunks so the
float64 temporaries stay small.
"""

from __future__ import annotations

from typing import Any

import torch

from checkmate.optim import rule

#: elements per chunk (float64 temporaries of a few MiB each).
CHUNK = 1 << 20

Value = torch.Tensor | float


def _wide(x: Value) -> Value:
    return x.to(torch.float64) if isinstance(x, torch.Tensor) else float(x)


def _round(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32)


class ExactTorch:
    """:class:`checkmate.optim.rule.Arith` on float32 tensors (scalars: Python floats that
    are exactly float32 values)."""

    def mul(self, a: Value, b: Value) -> torch.Tensor:
        return _round(_wide(a) * _wide(b))

    def add(self, a: Value, b: Value) -> torch.Tensor:
        return _round(_wide(a) + _wide(b))

    def sub(self, a: Value, b: Value) -> torch.Tensor:
        return _round(_wide(a) - _wide(b))

    def div(self, a: Value, b: Value) -> torch.Tensor:
        return _round(_wide(a) / _wide(b))

    def sqrt(self, a: torch.Tensor) -> torch.Tensor:
        return _round(torch.sqrt(a.to(torch.float64)))

    def fma(self, a: Value, b: Value, c: Value) -> torch.Tensor:
        prod = _wide(a) * _wide(b)  # exact
        cw = _wide(c)
        s = prod + cw
        if not isinstance(s, torch.Tensor):
            raise TypeError("fma needs at least one tensor operand")
        # TwoSum (Knuth): e = (prod + c) - s exactly, for finite operands.
        bv = s - prod
        e = (prod - (s - bv)) + (cw - bv)
        even = torch.bitwise_and(s.view(torch.int64), 1) == 0
        inexact = (e != 0) & even & torch.isfinite(s)
        toward = torch.where(e > 0, torch.full_like(s, float("inf")),
                             torch.full_like(s, float("-inf")))
        odd = torch.where(inexact, torch.nextafter(s, toward), s)
        return _round(odd)

    def maximum(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.where((a > b) | torch.isnan(a), a, b)


ARITH = ExactTorch()


def _widen_grad(g: torch.Tensor) -> torch.Tensor:
    """float32 view or exact widening of a float32/bfloat16/float16 gradient."""
    return g if g.dtype == torch.float32 else g.to(torch.float32)


def _floats(s: Any) -> list[float]:
    return [float(x) for x in s]


def adam(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
         exp_avg_sq: torch.Tensor, max_exp_avg_sq: torch.Tensor | None, s: Any,
         flags: rule.AdamFlags) -> None:
    """The Adam rule in place on flat (1-D, contiguous) tensors of one device; ``s`` are the
    kernel scalars of :func:`checkmate.optim.ops.adam_scalars`."""
    sc = rule.Scalars(rule.ADAM_SCALARS, _floats(s))
    n = param.shape[0]
    for lo in range(0, n, CHUNK):
        hi = min(n, lo + CHUNK)
        vmax = max_exp_avg_sq[lo:hi] if flags.amsgrad else None
        p, m, v, vm = rule.adam(ARITH, param[lo:hi], _widen_grad(grad[lo:hi]),
                                exp_avg[lo:hi], exp_avg_sq[lo:hi], vmax, sc, flags)
        param[lo:hi].copy_(p)
        exp_avg[lo:hi].copy_(m)
        exp_avg_sq[lo:hi].copy_(v)
        if flags.amsgrad:
            max_exp_avg_sq[lo:hi].copy_(vm)


def sgd(param: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor | None, s: Any,
        flags: rule.SgdFlags) -> None:
    """The SGD rule in place on flat tensors of one device; ``s`` from ops.sgd_scalars."""
    sc = rule.Scalars(rule.SGD_SCALARS, _floats(s))
    n = param.shape[0]
    for lo in range(0, n, CHUNK):
        hi = min(n, lo + CHUNK)
        b = buf[lo:hi] if buf is not None else None
        p, nb = rule.sgd(ARITH, param[lo:hi], _widen_grad(grad[lo:hi]), b, sc, flags)
        if flags.momentum != rule.NO_MOMENTUM:
            buf[lo:hi].copy_(nb)
        param[lo:hi].copy_(p)
