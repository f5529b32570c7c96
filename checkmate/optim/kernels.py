"""Numba kernels: one optimizer step on flat float32 arrays, in place or into other arrays.

Trainer (through :mod:`checkmate.optim.torch_optim`) and shadow (through
:mod:`checkmate.optim.flat`) both call these functions, so their arithmetic is identical by
construction. The element formulas follow torch 2.13's single-tensor (``foreach=False``)
Adam/AdamW/SGD op by op, with a true fused multiply-add wherever ATen's vectorized code
fuses one (``lerp_``, ``addcmul_``, ``add(alpha=)``); see /work/shared/machine-facts.md.

Gradient element types (see :func:`checkmate.optim.grads.as_kernel_grad`):

- ``float32``: used as is;
- ``uint16``: bfloat16 bit patterns, widened exactly (``bits << 16``);
- ``int16``: float16 bit patterns, widened exactly by the CPU's half->float conversion.

Every gradient is first multiplied by ``gscale`` in float32: the clip coefficient
(``1.0`` for none), negated for ``maximize``. ``x * 1.0`` is exact and
``-(g * c) == g * (-c)`` in IEEE arithmetic, so this equals torch's ``grad.mul_(coef)``
followed by ``-grad``.

Large arrays are split into pieces that several threads take from a shared counter
(:mod:`checkmate.optim.pool`); the arithmetic is purely elementwise, so neither the
pieces nor the thread count change any result.
"""

from __future__ import annotations

import os

import numba
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core.errors import TypingError
from numba.extending import intrinsic, overload

from checkmate.optim import pool
from checkmate.optim.pool import fetch_add

# Our kernels run their threads themselves (checkmate.optim.pool) and use no Numba
# threading layer. For any prange code in the same process: Numba's default "omp" layer
# here is a second OpenMP runtime beside torch's; both spin on the same cores and each
# slows the other down (measured: torch's fused AdamW 23 ms -> 41 ms after one parallel
# Numba step). The workqueue layer does not spin. An explicit NUMBA_THREADING_LAYER wins.
if "NUMBA_THREADING_LAYER" not in os.environ:
    numba.config.THREADING_LAYER = "workqueue"

#: parallel pieces are whole multiples of this many elements (64 KiB of float32, a multiple
#: of every vector width), so every piece starts as aligned as the array does.
CHUNK = 16384
#: pieces per thread a parallel step is cut into (see grab_size).
GRABS_PER_THREAD = 16


def grab_size(n: int, threads: int) -> int:
    """Elements a thread takes from the shared counter at a time: whole CHUNKs, about
    GRABS_PER_THREAD pieces per thread (few jumps for the hardware prefetcher, yet a thread
    slowed by other processes still leaves work to the others)."""
    return max(1, n // (GRABS_PER_THREAD * max(1, threads) * CHUNK)) * CHUNK


@intrinsic
def fma32(typingctx, a, b, c):
    """``a * b + c`` rounded once (llvm.fma.f32)."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        fnty = ir.FunctionType(f32, [f32, f32, f32])
        fn = builder.module.declare_intrinsic("llvm.fma", [f32], fnty)
        return builder.call(fn, args)

    return sig, codegen


@intrinsic
def _half_bits_to_f32(typingctx, bits):
    """Widen float16 bits (int16) to float32, exactly (fpext half -> float)."""
    sig = types.float32(types.int16)

    def codegen(context, builder, signature, args):
        half = builder.bitcast(args[0], ir.HalfType())
        return builder.fpext(half, ir.FloatType())

    return sig, codegen


@intrinsic
def _bf16_bits_to_f32(typingctx, bits):
    """Widen bfloat16 bits (uint16) to float32, exactly (the bits become the high half)."""
    sig = types.float32(types.uint16)

    def codegen(context, builder, signature, args):
        wide = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
        return builder.bitcast(wide, ir.FloatType())

    return sig, codegen


def to_f32(x):  # pragma: no cover - replaced by the overload inside jitted code
    """Widen one gradient element to float32 (jitted code only)."""
    raise NotImplementedError


@overload(to_f32, inline="always")
def _to_f32_impl(x):
    if x == types.float32:
        return lambda x: x
    if x == types.uint16:
        return lambda x: _bf16_bits_to_f32(x)
    if x == types.int16:
        return lambda x: _half_bits_to_f32(x)
    raise TypingError(f"unsupported gradient element type {x}")


@njit(inline="always", error_model="numpy")
def _maximum(a, b):
    """torch.maximum for float32: NaN if either input is NaN."""
    m = a if a > b else b
    if a != a:
        m = a
    return m


# ---------------------------------------------------------------------------- Adam / AdamW


@njit(inline="always", error_model="numpy")
def _adam_elem(p, g, m, v, vmax, gscale, decay, wd, l2, coeff, base_is_avg, c2, b2, bc2_sqrt,
               eps, neg_step, amsgrad):
    """One element's Adam/AdamW step: the new (param, exp_avg, exp_avg_sq, max_exp_avg_sq).
    Every Adam loop (in place or into other arrays) calls this, so all share one arithmetic."""
    g = to_f32(g) * gscale
    # AdamW: param.mul_(1 - lr*wd); decay is 1.0 (exact no-op) for Adam or wd == 0.
    p = p * decay
    # Adam: grad = grad.add(param, alpha=wd), only when wd != 0 (fma(p, wd, g)).
    g2 = fma32(p, wd, g)
    g = g2 if l2 else g
    # exp_avg.lerp_(grad, 1 - beta1), ATen's vector form.
    base = m if base_is_avg else g
    m = fma32(coeff, g - m, base)
    # exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    v = fma32(c2 * g, g, v * b2)
    vd = v
    if amsgrad:
        vmax = _maximum(vmax, v)
        vd = vmax
    # denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
    denom = np.sqrt(vd) / bc2_sqrt + eps
    # param.addcdiv_(exp_avg, denom, value=-step_size)
    return p + (neg_step * m) / denom, m, v, vmax


@njit(inline="always", error_model="numpy")
def _adam_range(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, s, amsgrad):
    """Adam/AdamW on whole (sliced) arrays, in place; ``s`` holds the float32 scalars
    (ops.adam_step).

    Loops start at 0 so the indices are provably non-negative: with a variable start,
    Numba's negative-index wraparound makes the access non-affine and LLVM refuses to
    vectorize.
    """
    gscale, decay, wd, l2, coeff, base_is_avg, c2, b2, bc2_sqrt, eps, neg_step = (
        s[0], s[1], s[2], s[3] != 0, s[4], s[5] != 0, s[6], s[7], s[8], s[9], s[10])
    for i in range(param.shape[0]):
        vmax = max_exp_avg_sq[i] if amsgrad else np.float32(0)
        p, m, v, vmax = _adam_elem(param[i], grad[i], exp_avg[i], exp_avg_sq[i], vmax, gscale,
                                   decay, wd, l2, coeff, base_is_avg, c2, b2, bc2_sqrt, eps,
                                   neg_step, amsgrad)
        exp_avg[i] = m
        exp_avg_sq[i] = v
        if amsgrad:
            max_exp_avg_sq[i] = vmax
        param[i] = p


@njit(inline="always", error_model="numpy")
def _adam_range_into(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, out_param, out_avg,
                     out_avg_sq, out_max, s, amsgrad):
    """Adam/AdamW reading one set of arrays and writing the step's result into another
    (the shadow's next retained version: no copy pass after the step). Same element code
    as :func:`_adam_range`."""
    gscale, decay, wd, l2, coeff, base_is_avg, c2, b2, bc2_sqrt, eps, neg_step = (
        s[0], s[1], s[2], s[3] != 0, s[4], s[5] != 0, s[6], s[7], s[8], s[9], s[10])
    for i in range(param.shape[0]):
        vmax = max_exp_avg_sq[i] if amsgrad else np.float32(0)
        p, m, v, vmax = _adam_elem(param[i], grad[i], exp_avg[i], exp_avg_sq[i], vmax, gscale,
                                   decay, wd, l2, coeff, base_is_avg, c2, b2, bc2_sqrt, eps,
                                   neg_step, amsgrad)
        out_avg[i] = m
        out_avg_sq[i] = v
        if amsgrad:
            out_max[i] = vmax
        out_param[i] = p


@njit(cache=True, nogil=True, error_model="numpy")
def _adam_chunk(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, lo, hi, s, amsgrad):
    """Elements [lo, hi), compiled on its own so LLVM vectorizes it (the same loop inlined
    into a prange body was not); amsgrad and plain Adam are separate loops."""
    p, g, m, v = param[lo:hi], grad[lo:hi], exp_avg[lo:hi], exp_avg_sq[lo:hi]
    if amsgrad:
        _adam_range(p, g, m, v, max_exp_avg_sq[lo:hi], s, True)
    else:
        _adam_range(p, g, m, v, max_exp_avg_sq, s, False)


@njit(cache=True, nogil=True, error_model="numpy")
def _adam_worker(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, s, amsgrad, grab, ctl):
    """One thread's share of a parallel step (checkmate.optim.pool): pieces of ``grab``
    elements from the shared counter until none are left."""
    n = param.shape[0]
    fetch_add(ctl, 1, 1)
    while True:
        lo = fetch_add(ctl, 0, grab)
        if lo >= n:
            break
        _adam_chunk(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, lo, min(lo + grab, n), s,
                    amsgrad)
    fetch_add(ctl, 1, -1)


def _adam_parallel(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, s, amsgrad):
    """The Adam step on all of Numba's threads (numba.get_num_threads(), the caller
    included); returns when every element is done."""
    threads = numba.get_num_threads()
    pool.run(_adam_worker, (param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, s, amsgrad,
                            grab_size(param.shape[0], threads)), threads)


@njit(cache=True, nogil=True, error_model="numpy")
def _adam_serial(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, s, amsgrad):
    _adam_chunk(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, 0, param.shape[0], s, amsgrad)


@njit(cache=True, nogil=True, error_model="numpy")
def _adam_chunk_into(src, grad, dst, lo, hi, s, amsgrad):
    """Elements [lo, hi) of an into-step; ``src`` and ``dst`` are (param, exp_avg,
    exp_avg_sq, max_exp_avg_sq) tuples of distinct arrays (see _adam_chunk)."""
    p, m, v, mx = src
    op, om, ov, omx = dst
    if amsgrad:
        _adam_range_into(p[lo:hi], grad[lo:hi], m[lo:hi], v[lo:hi], mx[lo:hi], op[lo:hi],
                         om[lo:hi], ov[lo:hi], omx[lo:hi], s, True)
    else:
        _adam_range_into(p[lo:hi], grad[lo:hi], m[lo:hi], v[lo:hi], mx, op[lo:hi], om[lo:hi],
                         ov[lo:hi], omx, s, False)


@njit(cache=True, nogil=True, error_model="numpy")
def _adam_worker_into(src, grad, dst, s, amsgrad, grab, ctl):
    """One thread's share of a parallel into-step (see _adam_worker)."""
    n = grad.shape[0]
    fetch_add(ctl, 1, 1)
    while True:
        lo = fetch_add(ctl, 0, grab)
        if lo >= n:
            break
        _adam_chunk_into(src, grad, dst, lo, min(lo + grab, n), s, amsgrad)
    fetch_add(ctl, 1, -1)


def _adam_parallel_into(src, grad, dst, s, amsgrad):
    """The into-step on all of Numba's threads (see _adam_parallel)."""
    threads = numba.get_num_threads()
    pool.run(_adam_worker_into, (src, grad, dst, s, amsgrad,
                                 grab_size(grad.shape[0], threads)), threads)


@njit(cache=True, nogil=True, error_model="numpy")
def _adam_serial_into(src, grad, dst, s, amsgrad):
    _adam_chunk_into(src, grad, dst, 0, grad.shape[0], s, amsgrad)


# ---------------------------------------------------------------------------------- SGD


@njit(inline="always", error_model="numpy")
def _sgd_elem(p, g, b, gscale, wd, l2, mom, damp1, neg_lr, kind, nesterov):
    """One element's SGD step: the new (param, momentum buffer). Every SGD loop calls this.
    kind: 0 no momentum, 1 first momentum step, 2 momentum."""
    g = to_f32(g) * gscale
    g2 = fma32(p, wd, g)
    g = g2 if l2 else g
    if kind != 0:
        if kind == 1:
            b = g  # buf = grad.detach().clone()
        else:
            b = fma32(g, damp1, b * mom)  # buf.mul_(m).add_(grad, alpha=1-d)
        if nesterov:
            g = fma32(b, mom, g)  # grad.add(buf, alpha=momentum)
        else:
            g = b
    return fma32(g, neg_lr, p), b  # param.add_(grad, alpha=-lr)


@njit(inline="always", error_model="numpy")
def _sgd_range(param, grad, buf, s, mode):
    """SGD on whole (sliced) arrays, in place (loop from 0: see _adam_range).

    mode: 0 no momentum, 1 first momentum step, 2 momentum, +4 nesterov.

    ``s`` = (gscale, wd, l2, momentum, 1 - dampening, -lr) as float32.
    """
    gscale, wd, l2, mom, damp1, neg_lr = s[0], s[1], s[2] != 0, s[3], s[4], s[5]
    kind = mode & 3
    nesterov = (mode & 4) != 0
    for i in range(param.shape[0]):
        b = buf[i] if kind == 2 else np.float32(0)
        p, b = _sgd_elem(param[i], grad[i], b, gscale, wd, l2, mom, damp1, neg_lr, kind,
                         nesterov)
        if kind != 0:
            buf[i] = b
        param[i] = p


@njit(inline="always", error_model="numpy")
def _sgd_range_into(param, grad, buf, out_param, out_buf, s, mode):
    """SGD reading one set of arrays and writing into another (see _adam_range_into)."""
    gscale, wd, l2, mom, damp1, neg_lr = s[0], s[1], s[2] != 0, s[3], s[4], s[5]
    kind = mode & 3
    nesterov = (mode & 4) != 0
    for i in range(param.shape[0]):
        b = buf[i] if kind == 2 else np.float32(0)
        p, b = _sgd_elem(param[i], grad[i], b, gscale, wd, l2, mom, damp1, neg_lr, kind,
                         nesterov)
        if kind != 0:
            out_buf[i] = b
        out_param[i] = p


@njit(cache=True, nogil=True, error_model="numpy")
def _sgd_chunk(param, grad, buf, lo, hi, s, mode):
    """One work item (compiled on its own, see _adam_chunk), calling _sgd_range with a
    constant mode so each variant compiles to its own loop."""
    p, g = param[lo:hi], grad[lo:hi]
    if mode == 0:
        _sgd_range(p, g, buf[lo:hi], s, 0)
    elif mode == 1:
        _sgd_range(p, g, buf[lo:hi], s, 1)
    elif mode == 2:
        _sgd_range(p, g, buf[lo:hi], s, 2)
    elif mode == 5:
        _sgd_range(p, g, buf[lo:hi], s, 5)
    else:
        _sgd_range(p, g, buf[lo:hi], s, 6)


@njit(cache=True, nogil=True, error_model="numpy")
def _sgd_worker(param, grad, buf, s, mode, grab, ctl):
    """One thread's share of a parallel SGD step (see _adam_worker)."""
    n = param.shape[0]
    fetch_add(ctl, 1, 1)
    while True:
        lo = fetch_add(ctl, 0, grab)
        if lo >= n:
            break
        _sgd_chunk(param, grad, buf, lo, min(lo + grab, n), s, mode)
    fetch_add(ctl, 1, -1)


def _sgd_parallel(param, grad, buf, s, mode):
    """The SGD step on all of Numba's threads (see _adam_parallel)."""
    threads = numba.get_num_threads()
    pool.run(_sgd_worker, (param, grad, buf, s, mode, grab_size(param.shape[0], threads)),
             threads)


@njit(cache=True, nogil=True, error_model="numpy")
def _sgd_serial(param, grad, buf, s, mode):
    _sgd_chunk(param, grad, buf, 0, param.shape[0], s, mode)


@njit(cache=True, nogil=True, error_model="numpy")
def _sgd_chunk_into(src, grad, dst, lo, hi, s, mode):
    """One work item of an SGD into-step; ``src``/``dst`` = (param, momentum buffer)."""
    p, b = src
    op, ob = dst
    if mode == 0:
        _sgd_range_into(p[lo:hi], grad[lo:hi], b, op[lo:hi], ob, s, 0)
    elif mode == 1:
        _sgd_range_into(p[lo:hi], grad[lo:hi], b[lo:hi], op[lo:hi], ob[lo:hi], s, 1)
    elif mode == 2:
        _sgd_range_into(p[lo:hi], grad[lo:hi], b[lo:hi], op[lo:hi], ob[lo:hi], s, 2)
    elif mode == 5:
        _sgd_range_into(p[lo:hi], grad[lo:hi], b[lo:hi], op[lo:hi], ob[lo:hi], s, 5)
    else:
        _sgd_range_into(p[lo:hi], grad[lo:hi], b[lo:hi], op[lo:hi], ob[lo:hi], s, 6)


@njit(cache=True, nogil=True, error_model="numpy")
def _sgd_worker_into(src, grad, dst, s, mode, grab, ctl):
    """One thread's share of a parallel SGD into-step (see _adam_worker)."""
    n = grad.shape[0]
    fetch_add(ctl, 1, 1)
    while True:
        lo = fetch_add(ctl, 0, grab)
        if lo >= n:
            break
        _sgd_chunk_into(src, grad, dst, lo, min(lo + grab, n), s, mode)
    fetch_add(ctl, 1, -1)


def _sgd_parallel_into(src, grad, dst, s, mode):
    threads = numba.get_num_threads()
    pool.run(_sgd_worker_into, (src, grad, dst, s, mode, grab_size(grad.shape[0], threads)),
             threads)


@njit(cache=True, nogil=True, error_model="numpy")
def _sgd_serial_into(src, grad, dst, s, mode):
    _sgd_chunk_into(src, grad, dst, 0, grad.shape[0], s, mode)


# ------------------------------------------------------------------- many small tensors


@intrinsic
def _f32_ptr(typingctx, addr):
    """The float32 pointer at integer address ``addr`` (a torch tensor's data_ptr())."""
    sig = types.CPointer(types.float32)(types.int64)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], ir.PointerType(ir.FloatType()))

    return sig, codegen


@njit(cache=True, nogil=True, error_model="numpy")
def _adam_multi(ptrs, lens, scal, amsgrad):
    """Adam/AdamW on many small float32 tensors in one call (the trainer's per-parameter
    Python overhead dominates otherwise). Row t: addresses of param, grad (float32),
    exp_avg, exp_avg_sq, max_exp_avg_sq (0 unless amsgrad), ``lens[t]`` elements, scalars
    ``scal[t]``. Same element code as every other path."""
    for t in range(lens.shape[0]):
        n = lens[t]
        p = numba.carray(_f32_ptr(ptrs[t, 0]), n)
        g = numba.carray(_f32_ptr(ptrs[t, 1]), n)
        m = numba.carray(_f32_ptr(ptrs[t, 2]), n)
        v = numba.carray(_f32_ptr(ptrs[t, 3]), n)
        if amsgrad:
            mx = numba.carray(_f32_ptr(ptrs[t, 4]), n)
            _adam_range(p, g, m, v, mx, scal[t], True)
        else:
            _adam_range(p, g, m, v, p, scal[t], False)


@njit(cache=True, nogil=True, error_model="numpy")
def _sgd_multi(ptrs, lens, scal, modes):
    """SGD on many small float32 tensors in one call (see _adam_multi). Row t: addresses
    of param, grad (float32), momentum buffer (0 for mode 0); mode as in _sgd_range."""
    for t in range(lens.shape[0]):
        n = lens[t]
        p = numba.carray(_f32_ptr(ptrs[t, 0]), n)
        g = numba.carray(_f32_ptr(ptrs[t, 1]), n)
        mode = modes[t]
        b = numba.carray(_f32_ptr(ptrs[t, 2 if mode != 0 else 0]), n)
        s = scal[t]
        if mode == 0:
            _sgd_range(p, g, b, s, 0)
        elif mode == 1:
            _sgd_range(p, g, b, s, 1)
        elif mode == 2:
            _sgd_range(p, g, b, s, 2)
        elif mode == 5:
            _sgd_range(p, g, b, s, 5)
        else:
            _sgd_range(p, g, b, s, 6)
