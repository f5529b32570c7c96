"""One optimizer step on flat arrays: torch's scalar arithmetic, then the Numba kernel.

Hyperparameters become float32 scalars exactly as torch 2.13's single-tensor path makes
them: Python-float (double) arithmetic for ``1 - beta1**step``, ``lr / bc1``,
``bc2 ** 0.5`` and ``1 - lr*wd``, then one rounding to float32 where ATen takes the value
as a scalar operand of a float32 kernel.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from checkmate.errors import CheckmateError
from checkmate.optim import kernels

#: below this many elements one thread does the work (a parallel launch costs more).
PARALLEL_MIN = 1 << 17

_EMPTY = np.zeros(0, np.float32)



def _f32(x: float) -> np.float32:
    return np.float32(x)


def _check_slot(name: str, a: np.ndarray, n: int) -> None:
    if a.dtype != np.float32 or a.ndim != 1 or a.shape[0] != n:
        raise CheckmateError(
            f"{name} must be a 1-D float32 array of {n} elements, got {a.dtype} {a.shape}")
    if not a.flags.c_contiguous or not a.flags.writeable:
        raise CheckmateError(f"{name} must be contiguous and writeable")


def _check_grad(grad: np.ndarray, n: int) -> None:
    if grad.dtype not in (np.float32, np.uint16, np.int16) or grad.ndim != 1:
        raise CheckmateError(
            f"gradient must be 1-D float32, uint16 (bfloat16 bits) or int16 (float16 bits), "
            f"got {grad.dtype} {grad.shape}")
    if grad.shape[0] != n or not grad.flags.c_contiguous:
        raise CheckmateError(f"gradient must be contiguous with {n} elements, got {grad.shape}")


#: Output arrays of an into-step, slot by slot (None for a slot the step does not use).
OutSlots = Sequence["np.ndarray | None"]


def _check_out(names: tuple[str, ...], src: tuple[np.ndarray, ...], out: OutSlots, n: int,
               used: tuple[bool, ...]) -> tuple[np.ndarray, ...]:
    """The output arrays of an into-step, checked like the inputs and against overlapping
    any input (the kernel reads an element after writing others)."""
    if len(out) != len(names):
        raise CheckmateError(f"out needs {len(names)} arrays ({', '.join(names)}), got "
                             f"{len(out)}")
    dst = []
    for name, a, want in zip(names, out, used, strict=True):
        if not want:
            dst.append(_EMPTY)
            continue
        if a is None:
            raise CheckmateError(f"out lacks the {name} array")
        _check_slot(f"out {name}", a, n)
        if any(np.may_share_memory(a, b) for b in src):
            raise CheckmateError(f"out {name} overlaps an input array")
        dst.append(a)
    return tuple(dst)


def gscale_of(clip_coef: float | None, maximize: bool) -> np.float32:
    """The float32 factor every gradient element is multiplied by (clip, then sign)."""
    c = np.float32(1.0) if clip_coef is None else _f32(clip_coef)
    return -c if maximize else c


def adam_scalars(*, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                 decoupled: bool, step: int, gscale: np.float32) -> np.ndarray:
    """Kernel scalars for Adam (``decoupled=False``) or AdamW at the 1-based ``step``."""
    w = _f32(1 - beta1)  # lerp weight, taken as float by ATen
    small = abs(w) < np.float32(0.5)
    coeff = w if small else w - np.float32(1.0)
    bias_correction1 = 1 - beta1 ** float(step)
    bias_correction2 = 1 - beta2 ** float(step)
    step_size = lr / bias_correction1
    bc2_sqrt = bias_correction2 ** 0.5
    decay = _f32(1 - lr * weight_decay) if decoupled and weight_decay != 0 else np.float32(1.0)
    l2 = 1.0 if (not decoupled and weight_decay != 0) else 0.0
    return np.array([gscale, decay, weight_decay, l2, coeff, 1.0 if small else 0.0,
                     1 - beta2, beta2, bc2_sqrt, eps, -step_size], dtype=np.float32)


def adam_step(param: np.ndarray, grad: np.ndarray, exp_avg: np.ndarray,
              exp_avg_sq: np.ndarray, max_exp_avg_sq: np.ndarray | None, *, lr: float,
              beta1: float, beta2: float, eps: float, weight_decay: float, decoupled: bool,
              amsgrad: bool, step: int, clip_coef: float | None = None,
              maximize: bool = False, out: OutSlots | None = None) -> None:
    """Adam/AdamW step ``step`` (1-based, already counted) on flat float32 arrays: in place,
    or, with ``out`` = (param, exp_avg, exp_avg_sq, max_exp_avg_sq or None), read from the
    given arrays and written into ``out``'s, which must not overlap them (the inputs are
    left as they were).

    ``grad`` is float32, or 16-bit patterns (see :mod:`checkmate.optim.grads`). ``clip_coef``
    multiplies the gradient first, as ``clip_grad_norm_`` does on the trainer.
    """
    n = param.shape[0] if param.ndim == 1 else -1
    _check_slot("param", param, n)
    _check_grad(grad, n)
    _check_slot("exp_avg", exp_avg, n)
    _check_slot("exp_avg_sq", exp_avg_sq, n)
    if amsgrad:
        if max_exp_avg_sq is None:
            raise CheckmateError("amsgrad needs a max_exp_avg_sq array")
        _check_slot("max_exp_avg_sq", max_exp_avg_sq, n)
    else:
        max_exp_avg_sq = _EMPTY
    if step < 1:
        raise CheckmateError(f"Adam step must be >= 1, got {step}")
    s = adam_scalars(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                     decoupled=decoupled, step=step, gscale=gscale_of(clip_coef, maximize))
    if out is not None:
        src = (param, exp_avg, exp_avg_sq, max_exp_avg_sq)
        dst = _check_out(("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"), src, out,
                         n, (True, True, True, bool(amsgrad)))
        into = kernels._adam_parallel_into if n >= PARALLEL_MIN else kernels._adam_serial_into
        into(src, grad, dst, s, bool(amsgrad))
    elif n >= PARALLEL_MIN:
        kernels._adam_parallel(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, s,
                               bool(amsgrad))
    else:
        kernels._adam_serial(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, s, bool(amsgrad))


def sgd_scalars(*, lr: float, momentum: float, dampening: float, weight_decay: float,
                gscale: np.float32) -> np.ndarray:
    """Kernel scalars for SGD."""
    return np.array([gscale, weight_decay, 1.0 if weight_decay != 0 else 0.0, momentum,
                     1 - dampening, -lr], dtype=np.float32)


def sgd_mode(momentum: float, nesterov: bool, first: bool) -> int:
    """Kernel variant: 0 no momentum, 1 first momentum step, 2 momentum, +4 nesterov."""
    if momentum == 0:
        return 0
    return (1 if first else 2) + (4 if nesterov else 0)


def sgd_step(param: np.ndarray, grad: np.ndarray, momentum_buffer: np.ndarray | None, *,
             lr: float, momentum: float = 0.0, dampening: float = 0.0,
             weight_decay: float = 0.0, nesterov: bool = False, first: bool,
             clip_coef: float | None = None, maximize: bool = False,
             out: OutSlots | None = None) -> None:
    """SGD step, in place or (``out`` = (param, momentum_buffer or None)) into other arrays
    as in :func:`adam_step`. ``first``: the momentum buffer does not exist yet (torch:
    None), so it is set to the gradient instead of being updated."""
    n = param.shape[0] if param.ndim == 1 else -1
    _check_slot("param", param, n)
    _check_grad(grad, n)
    if nesterov and (momentum <= 0 or dampening != 0):
        raise CheckmateError("Nesterov momentum requires a momentum and zero dampening")
    if momentum != 0:
        if momentum_buffer is None:
            raise CheckmateError("SGD with momentum needs a momentum_buffer array")
        _check_slot("momentum_buffer", momentum_buffer, n)
    else:
        momentum_buffer = _EMPTY
    mode = sgd_mode(momentum, nesterov, first)
    s = sgd_scalars(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                    gscale=gscale_of(clip_coef, maximize))
    if out is not None:
        src = (param, momentum_buffer)
        dst = _check_out(("param", "momentum_buffer"), src, out, n, (True, momentum != 0))
        into = kernels._sgd_parallel_into if n >= PARALLEL_MIN else kernels._sgd_serial_into
        into(src, grad, dst, s, mode)
    elif n >= PARALLEL_MIN:
        kernels._sgd_parallel(param, grad, momentum_buffer, s, mode)
    else:
        kernels._sgd_serial(param, grad, momentum_buffer, s, mode)


_WARM_LOCK = threading.Lock()


def warm_up(kinds: tuple[str, ...] = ("adam", "sgd"),
            grad_dtypes: tuple[type, ...] = (np.float32,)) -> None:
    """Compile (or load from Numba's on-disk cache) the serial and parallel kernels for
    ``kinds`` and gradient element types now, so that the first real step does not stall
    (first compile takes seconds; a cache load well under one). Idempotent, thread-safe.
    """
    with _WARM_LOCK:
        one = np.zeros(1, np.float32)
        for dt in grad_dtypes:
            g = np.zeros(1, dt)
            if any(k in ("adam", "adamw") for k in kinds):
                s = adam_scalars(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                                 decoupled=True, step=1, gscale=np.float32(1.0))
                for fn in (kernels._adam_serial, kernels._adam_parallel):
                    fn(one.copy(), g, one.copy(), one.copy(), _EMPTY, s, False)
                for into in (kernels._adam_serial_into, kernels._adam_parallel_into):
                    into((one.copy(), one.copy(), one.copy(), _EMPTY), g,
                         (one.copy(), one.copy(), one.copy(), _EMPTY), s, False)
                if dt is np.float32:  # the trainer's batched path (float32 gradients only)
                    kernels._adam_multi(np.zeros((0, 5), np.int64), np.zeros(0, np.int64),
                                        np.zeros((0, 11), np.float32), False)
            if "sgd" in kinds:
                s = np.zeros(6, np.float32)
                for fn in (kernels._sgd_serial, kernels._sgd_parallel):
                    fn(one.copy(), g, _EMPTY, s, 0)
                for into in (kernels._sgd_serial_into, kernels._sgd_parallel_into):
                    into((one.copy(), _EMPTY), g, (one.copy(), _EMPTY), s, 0)
                if dt is np.float32:
                    kernels._sgd_multi(np.zeros((0, 3), np.int64), np.zeros(0, np.int64),
                                       np.zeros((0, 6), np.float32), np.zeros(0, np.int64))
