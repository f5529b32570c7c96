"""Optimizer steps on torch tensors of any device, by the one update rule.

Three executors follow :mod:`checkmate.optim.rule`:

- ``"numba"``: the shadows' Numba kernels (:mod:`checkmate.optim.kernels`), CPU tensors;
- ``"triton"``: the generated Triton kernels (:mod:`checkmate.optim.triton_step`), CUDA
  tensors (CPU tensors only under Triton's interpreter, ``TRITON_INTERPRET=1``);
- ``"torch"``: the exact torch executor (:mod:`checkmate.optim.exact_torch`), CPU or CUDA:
  slower, and exact on any device; forcing it on CPU tensors runs the device code path in
  the CPU test suite.

``"auto"`` picks numba for CPU tensors and, for CUDA tensors, triton where it is
installed, else the exact torch path (saying so once on stderr). Nothing falls back to an
inexact path: a tensor no executor can step exactly is one :class:`CheckmateError` line.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

import numpy as np
import torch

from checkmate.errors import CheckmateError
from checkmate.optim import exact_torch, ops, rule, triton_step

EXECUTORS = ("auto", "numba", "torch", "triton")
GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_warned_slow = False


def check_executor(name: str) -> str:
    if name not in EXECUTORS:
        raise CheckmateError(f"unknown optimizer executor {name!r} (use one of "
                             f"{', '.join(EXECUTORS)})")
    return name


def executor_for(requested: str, device: torch.device) -> str:
    """The executor that steps tensors on ``device`` when ``requested`` was asked for.

    Raises:
        CheckmateError: the requested executor cannot run there, or no exact one can.
    """
    global _warned_slow
    check_executor(requested)
    if device.type not in ("cpu", "cuda"):
        raise CheckmateError(f"no exact optimizer path for tensors on {device}: Checkmate "
                             "steps CPU and CUDA tensors only")
    if requested == "numba":
        if device.type != "cpu":
            raise CheckmateError(f"executor 'numba' steps CPU tensors only, got {device}")
        return "numba"
    if requested == "triton":
        if not triton_step.available(device):
            raise CheckmateError(f"executor 'triton' cannot step tensors on {device} here "
                                 "(needs triton and CUDA, or TRITON_INTERPRET=1 for CPU)")
        return "triton"
    if requested == "torch":
        return "torch"
    if device.type == "cpu":
        return "numba"
    if triton_step.available(device):
        return "triton"
    if not _warned_slow:
        _warned_slow = True
        print("checkmate.optim: triton is not available, so CUDA parameters step on the exact "
              "torch path (bit-identical to the shadows, tens of times slower)", file=sys.stderr)
    return "torch"


def _check(t: torch.Tensor | None, what: str, device: torch.device, n: int,
           dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> torch.Tensor:
    """``t`` if an exact executor can step it in place, else one CheckmateError line
    (cheap: this runs for every tensor of every step)."""
    if t is None:
        raise CheckmateError(f"{what} is missing")
    if t.layout != torch.strided:
        raise CheckmateError(f"{what} is {t.layout}: only dense tensors can be stepped exactly")
    if t.dtype not in dtypes:
        names = "/".join(str(d).removeprefix("torch.") for d in dtypes)
        raise CheckmateError(f"{what} must be {names}, got {t.dtype}: no exact optimizer path")
    if t.device != device:
        raise CheckmateError(f"{what} is on {t.device} but its parameter is on {device}")
    if not t.is_contiguous():
        raise CheckmateError(f"{what} must be contiguous (strides {tuple(t.stride())})")
    if t.numel() != n:
        raise CheckmateError(f"{what} has {t.numel()} elements, its parameter {n}")
    return t


@dataclass
class Row:
    """One tensor's slots (names as in triton_step: p, g, m, v, vmax, buf; checked: dense,
    contiguous, one device, equal sizes) and its kernel scalars."""

    slots: dict[str, torch.Tensor]
    scalars: np.ndarray


def check_pair(param: torch.Tensor, grad: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The parameter and its gradient, checked (one CheckmateError line otherwise)."""
    if param.layout != torch.strided:
        raise CheckmateError(f"parameter is {param.layout}: only dense tensors can be stepped "
                             "exactly")
    dev, n = param.device, param.numel()
    return {"p": _check(param, "parameter", dev, n),
            "g": _check(grad, "gradient", dev, n, GRAD_DTYPES)}


def adam_row(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
             exp_avg_sq: torch.Tensor, max_exp_avg_sq: torch.Tensor | None,
             scalars: np.ndarray, amsgrad: bool, pair_checked: bool = False) -> Row:
    """One Adam parameter's tensors, checked (the parameter and gradient already, if
    ``pair_checked``)."""
    dev, n = param.device, param.numel()
    slots = {"p": param, "g": grad} if pair_checked else check_pair(param, grad)
    slots |= {"m": _check(exp_avg, "state exp_avg", dev, n),
             "v": _check(exp_avg_sq, "state exp_avg_sq", dev, n)}
    if amsgrad:
        slots["vmax"] = _check(max_exp_avg_sq, "state max_exp_avg_sq", dev, n)
    return Row(slots, np.asarray(scalars, np.float32))


def sgd_row(param: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor | None,
            scalars: np.ndarray, momentum: bool, pair_checked: bool = False) -> Row:
    """One SGD parameter's tensors, checked (see adam_row)."""
    dev, n = param.device, param.numel()
    slots = {"p": param, "g": grad} if pair_checked else check_pair(param, grad)
    if momentum:
        slots["buf"] = _check(buf, "state momentum_buffer", dev, n)
    return Row(slots, np.asarray(scalars, np.float32))


def run(flags: rule.AdamFlags | rule.SgdFlags, rows: list[Row], executor: str) -> None:
    """Step checked rows of one rule variant with ``executor`` ("torch" or "triton"; the
    numba executor has its own entry points in :mod:`checkmate.optim.ops`)."""
    if executor == "torch":
        for r in rows:
            s = {k: t.detach().view(-1) for k, t in r.slots.items()}
            if isinstance(flags, rule.AdamFlags):
                exact_torch.adam(s["p"], s["g"], s["m"], s["v"], s.get("vmax"), r.scalars,
                                 flags)
            else:
                exact_torch.sgd(s["p"], s["g"], s.get("buf"), r.scalars, flags)
        return
    if executor != "triton":
        raise CheckmateError(f"executor {executor!r} does not run device rows")
    groups: dict[tuple, list[Row]] = {}
    for r in rows:
        groups.setdefault((str(r.slots["p"].device), r.slots["g"].dtype), []).append(r)
    for group in groups.values():
        dev = group[0].slots["p"].device
        with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
            triton_step.launch(flags, [r.slots for r in group],
                               np.stack([r.scalars for r in group]))


def adam_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
              exp_avg_sq: torch.Tensor, max_exp_avg_sq: torch.Tensor | None, *, lr: float,
              beta1: float, beta2: float, eps: float, weight_decay: float, decoupled: bool,
              amsgrad: bool, step: int, clip_coef: float | None = None,
              maximize: bool = False, executor: str = "auto") -> None:
    """:func:`checkmate.optim.ops.adam_step` on torch tensors of any supported device."""
    if step < 1:
        raise CheckmateError(f"Adam step must be >= 1, got {step}")
    ex = executor_for(executor, param.device)
    s = ops.adam_scalars(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                         decoupled=decoupled, step=step,
                         gscale=ops.gscale_of(clip_coef, maximize))
    row = adam_row(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, s, amsgrad)
    if ex == "numba":
        sl = {k: t.detach().view(-1) for k, t in row.slots.items()}
        ops.adam_step(sl["p"].numpy(), _kernel_grad(sl["g"]), sl["m"].numpy(), sl["v"].numpy(),
                      sl["vmax"].numpy() if amsgrad else None, lr=lr, beta1=beta1,
                      beta2=beta2, eps=eps, weight_decay=weight_decay, decoupled=decoupled,
                      amsgrad=amsgrad, step=step, clip_coef=clip_coef, maximize=maximize)
        return
    run(rule.AdamFlags.of(s, amsgrad), [row], ex)


def sgd_step(param: torch.Tensor, grad: torch.Tensor, momentum_buffer: torch.Tensor | None, *,
             lr: float, momentum: float = 0.0, dampening: float = 0.0,
             weight_decay: float = 0.0, nesterov: bool = False, first: bool,
             clip_coef: float | None = None, maximize: bool = False,
             executor: str = "auto") -> None:
    """:func:`checkmate.optim.ops.sgd_step` on torch tensors of any supported device."""
    if nesterov and (momentum <= 0 or dampening != 0):
        raise CheckmateError("Nesterov momentum requires a momentum and zero dampening")
    ex = executor_for(executor, param.device)
    s = ops.sgd_scalars(lr=lr, momentum=momentum, dampening=dampening,
                        weight_decay=weight_decay, gscale=ops.gscale_of(clip_coef, maximize))
    row = sgd_row(param, grad, momentum_buffer, s, momentum != 0)
    if ex == "numba":
        sl = {k: t.detach().view(-1) for k, t in row.slots.items()}
        ops.sgd_step(sl["p"].numpy(), _kernel_grad(sl["g"]),
                     sl["buf"].numpy() if momentum != 0 else None, lr=lr, momentum=momentum,
                     dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                     first=first, clip_coef=clip_coef, maximize=maximize)
        return
    run(rule.SgdFlags.of(s, ops.sgd_mode(momentum, nesterov, first)), [row], ex)


def _kernel_grad(g: torch.Tensor) -> np.ndarray:
    from checkmate.optim.grads import as_kernel_grad
    return as_kernel_grad(g)
