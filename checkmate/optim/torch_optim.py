"""torch.optim drop-ins (SGD, Adam, AdamW) that step by Checkmate's one update rule.

The trainer uses these so that its arithmetic is exactly the shadow's
(:class:`checkmate.optim.flat.FlatOptimizer`). CPU parameters step with the shadows' own
Numba kernels (:mod:`checkmate.optim.ops`, through zero-copy numpy views); CUDA parameters
with the Triton kernel generated from :mod:`checkmate.optim.rule`, or where triton is
missing the exact torch executor (:mod:`checkmate.optim.device` chooses; the constructor's
``executor=`` forces one, e.g. ``"torch"`` to run the device code path on CPU tensors).
State tensors live on the parameter's device. State and
``state_dict()`` follow torch.optim's format (``step`` as a float32 tensor,
``exp_avg``/``exp_avg_sq``/``max_exp_avg_sq``; ``momentum_buffer``), so checkpoints load
into torch's own optimizers and back.

Sharded parameters (FSDP2's DTensors) step their local shard: state is created like the
parameter (a DTensor, as torch.optim has it, so torch's distributed state-dict helpers see
the usual layout) and every kernel reads the rank's own ``to_local()`` memory.

These optimizers never clip: the trainer calls :func:`checkmate.optim.clip.clip_grad_norm_`
(torch's) before ``step()`` and sends the factor to the shadows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from checkmate.errors import CheckmateError
from checkmate.optim import device, kernels, ops, rule
from checkmate.optim import hyper as H
from checkmate.optim.grads import as_kernel_grad

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch built without distributed: no sharded parameters
    DTensor = None


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2), or ``t`` itself: the memory a kernel steps."""
    return t.to_local() if DTensor is not None and isinstance(t, DTensor) else t


def _flat(t: torch.Tensor, what: str) -> np.ndarray:
    t = _local(t)
    if t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous():
        raise CheckmateError(
            f"{what} must be a contiguous float32 CPU tensor, got {t.dtype} on {t.device}")
    return t.detach().view(-1).numpy()


def _batchable(p: torch.Tensor) -> bool:
    """Small float32 CPU parameter with a float32 gradient of its shape, both contiguous:
    fit for the batched kernel (anything else takes the checked one-tensor path)."""
    p, g = _local(p), p.grad
    g = None if g is None else _local(g)
    return (p.numel() < ops.PARALLEL_MIN and p.dtype == torch.float32 and p.device.type == "cpu"
            and p.is_contiguous() and g is not None and g.dtype == torch.float32
            and g.device.type == "cpu" and g.is_contiguous() and not g.is_sparse
            and g.shape == p.shape)


def _count_step(state: dict[str, Any]) -> int:
    """``state["step"] += 1`` and return the new count. A CPU float32 step tensor is
    counted through its numpy view: the same float32 addition, without two torch
    dispatcher round trips (measured ~0.1 ms per step after an idle gap)."""
    t = state["step"]
    if t.dtype == torch.float32 and t.device.type == "cpu" and not t.requires_grad:
        v = t.numpy()
        v += np.float32(1.0)
        return int(v)
    t += 1
    return int(t.item())


def _scalar(x: Any, name: str) -> float:
    if isinstance(x, torch.Tensor):
        raise CheckmateError(f"{name} must be a Python float, not a tensor")
    return float(x)


class _KernelOptimizer(torch.optim.Optimizer):
    kind = ""

    def __init__(self, params: Any, defaults: dict[str, Any], executor: str = "auto") -> None:
        for flag in ("capturable", "differentiable", "fused"):
            if defaults.get(flag):
                raise CheckmateError(f"{type(self).__name__}: {flag}=True is not supported")
        #: "auto", "numba", "torch" or "triton" (checkmate.optim.device); not in state_dict.
        self.executor = device.check_executor(executor)
        super().__init__(params, defaults)

    def _check_group(self, group: dict[str, Any]) -> dict[str, Any]:
        hp = H.resolve(self.kind, {k: _scalar(v, k) if k in ("lr", "eps", "weight_decay")
                                   else v for k, v in group.items()})
        for p in group["params"]:
            if p.grad is not None and p.grad.shape != p.shape:
                raise CheckmateError(f"gradient shape {tuple(p.grad.shape)} != {tuple(p.shape)}")
        return hp

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One optimizer step. On the Numba path, small parameters with float32 gradients
        go through one batched kernel call per group and the rest one call each (parallel
        when large); on a device path, a group's parameters go in one batch per executor."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        executor = getattr(self, "executor", "auto")
        for group in self.param_groups:
            hp = self._check_group(group)
            small = []
            on_device: dict[str, list[torch.Tensor]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                ex = device.executor_for(executor, _local(p).device)
                if ex != "numba":
                    on_device.setdefault(ex, []).append(p)
                elif _batchable(p):
                    small.append(p)
                else:
                    self._step_param(p, hp)
            if small:
                self._step_batch(small, hp)
            for ex, params in on_device.items():
                self._step_device(params, hp, ex)
        return loss

    def _step_device(self, params: list[torch.Tensor], hp: dict[str, Any], ex: str) -> None:
        raise NotImplementedError  # each optimizer kind defines its own

    def _step_param(self, p: torch.Tensor, hp: dict[str, Any]) -> None:
        raise NotImplementedError  # each optimizer kind defines its own

    def _step_batch(self, params: list[torch.Tensor], hp: dict[str, Any]) -> None:
        raise NotImplementedError  # each optimizer kind defines its own


class SGD(_KernelOptimizer):
    """torch.optim.SGD's arithmetic (foreach=False path) on the Numba kernels."""

    kind = "sgd"

    def __init__(self, params: Any, lr: float = 1e-3, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False,
                 *, maximize: bool = False, foreach: bool | None = None,
                 differentiable: bool = False, fused: bool | None = None,
                 executor: str = "auto") -> None:
        defaults = {"lr": lr, "momentum": momentum, "dampening": dampening,
                    "weight_decay": weight_decay, "nesterov": nesterov, "maximize": maximize,
                    "foreach": foreach, "differentiable": differentiable, "fused": fused}
        H.resolve("sgd", defaults)
        super().__init__(params, defaults, executor)

    def _step_device(self, params: list[torch.Tensor], hp: dict[str, Any], ex: str) -> None:
        mom = hp["momentum"]
        s = ops.sgd_scalars(lr=hp["lr"], momentum=mom, dampening=hp["dampening"],
                            weight_decay=hp["weight_decay"],
                            gscale=ops.gscale_of(None, hp["maximize"]))
        # refuse before any state changes (a buffer created for one parameter while another
        # is refused would make the next step take the later-step rule on a zero buffer)
        pairs = [device.check_pair(_local(p), _local(p.grad)) for p in params]
        for p, pair in zip(params, pairs, strict=True):
            if mom != 0 and self.state[p].get("momentum_buffer") is not None:
                device.sgd_row(pair["p"], pair["g"], _local(self.state[p]["momentum_buffer"]),
                               s, True, pair_checked=True)
        by_flags: dict[rule.SgdFlags, list[device.Row]] = {}
        for p, pair in zip(params, pairs, strict=True):
            state = self.state[p]
            buf = state.get("momentum_buffer")
            first = buf is None
            if mom == 0:
                state.setdefault("momentum_buffer", None)
            elif buf is None:
                buf = torch.zeros_like(p, memory_format=torch.contiguous_format)
                state["momentum_buffer"] = buf
            row = device.sgd_row(pair["p"], pair["g"], None if mom == 0 else _local(buf), s,
                                 mom != 0, pair_checked=True)
            flags = rule.SgdFlags.of(s, ops.sgd_mode(mom, hp["nesterov"], first))
            by_flags.setdefault(flags, []).append(row)
        for flags, rows in by_flags.items():
            device.run(flags, rows, ex)

    def _step_batch(self, params: list[torch.Tensor], hp: dict[str, Any]) -> None:
        mom = hp["momentum"]
        rows, modes = [], []
        for p in params:
            state = self.state[p]
            buf = state.get("momentum_buffer")
            modes.append(ops.sgd_mode(mom, hp["nesterov"], buf is None))
            if mom == 0:
                state.setdefault("momentum_buffer", None)
                rows.append([_local(p).data_ptr(), _local(p.grad).data_ptr(), 0])
                continue
            if buf is None:
                buf = torch.zeros_like(p, memory_format=torch.contiguous_format)
                state["momentum_buffer"] = buf
            elif not (buf.dtype == torch.float32 and buf.device.type == "cpu"
                      and _local(buf).is_contiguous()
                      and _local(buf).numel() == _local(p).numel()):
                raise CheckmateError(f"state momentum_buffer must be a contiguous float32 CPU "
                                     f"tensor of {_local(p).numel()} elements, got {buf.dtype} "
                                     f"{tuple(buf.shape)} on {buf.device}")
            rows.append([_local(p).data_ptr(), _local(p.grad).data_ptr(), _local(buf).data_ptr()])
        s = ops.sgd_scalars(lr=hp["lr"], momentum=mom, dampening=hp["dampening"],
                            weight_decay=hp["weight_decay"],
                            gscale=ops.gscale_of(None, hp["maximize"]))
        kernels._sgd_multi(np.array(rows, dtype=np.int64),
                           np.array([_local(p).numel() for p in params], dtype=np.int64),
                           np.tile(s, (len(params), 1)), np.array(modes, dtype=np.int64))

    def _step_param(self, p: torch.Tensor, hp: dict[str, Any]) -> None:
        state = self.state[p]
        buf = state.get("momentum_buffer")
        first = buf is None
        if hp["momentum"] != 0 and buf is None:
            buf = torch.zeros_like(p, memory_format=torch.contiguous_format)
            state["momentum_buffer"] = buf
        ops.sgd_step(_flat(p, "parameter"), as_kernel_grad(_local(p.grad)),
                     None if hp["momentum"] == 0 else _flat(buf, "momentum_buffer"),
                     lr=hp["lr"], momentum=hp["momentum"], dampening=hp["dampening"],
                     weight_decay=hp["weight_decay"], nesterov=hp["nesterov"], first=first,
                     maximize=hp["maximize"])
        if hp["momentum"] == 0:
            state.setdefault("momentum_buffer", None)


class Adam(_KernelOptimizer):
    """torch.optim.Adam's arithmetic (foreach=False path) on the Numba kernels."""

    kind = "adam"

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, *,
                 foreach: bool | None = None, maximize: bool = False, capturable: bool = False,
                 differentiable: bool = False, fused: bool | None = None,
                 decoupled_weight_decay: bool = False, executor: str = "auto") -> None:
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                    "amsgrad": amsgrad, "maximize": maximize, "foreach": foreach,
                    "capturable": capturable, "differentiable": differentiable, "fused": fused,
                    "decoupled_weight_decay": decoupled_weight_decay}
        H.resolve(self.kind, defaults)
        super().__init__(params, defaults, executor)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("decoupled_weight_decay", self.kind == "adamw")
            for p in group["params"]:
                st = self.state.get(p, {})
                if st and not torch.is_tensor(st["step"]):
                    st["step"] = torch.tensor(float(st["step"]), dtype=torch.float32)

    def _init_state(self, p: torch.Tensor, hp: dict[str, Any]) -> dict[str, Any]:
        state = self.state[p]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if hp["amsgrad"] and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _step_batch(self, params: list[torch.Tensor], hp: dict[str, Any]) -> None:
        states = [self._init_state(p, hp) for p in params]
        slots = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if hp["amsgrad"] else ())
        for p, st in zip(params, states, strict=True):
            for k in slots:  # a loaded state may differ; the kernel trusts these sizes
                t, n = _local(st[k]), _local(p).numel()
                if not (t.dtype == torch.float32 and t.device.type == "cpu"
                        and t.is_contiguous() and t.numel() == n):
                    raise CheckmateError(f"state {k} must be a contiguous float32 CPU tensor "
                                         f"of {n} elements, got {t.dtype} "
                                         f"{tuple(t.shape)} on {t.device}")
        steps = [st["step"] for st in states]
        torch._foreach_add_(steps, 1)
        b1, b2 = hp["betas"]
        gscale = ops.gscale_of(None, hp["maximize"])
        rows: dict[float, np.ndarray] = {}
        scal = np.empty((len(params), 11), np.float32)
        for i, k in enumerate(torch.stack(steps).tolist()):
            if k not in rows:
                rows[k] = ops.adam_scalars(lr=hp["lr"], beta1=b1, beta2=b2, eps=hp["eps"],
                                           weight_decay=hp["weight_decay"],
                                           decoupled=self._decoupled(hp), step=int(k),
                                           gscale=gscale)
            scal[i] = rows[k]
        ams = hp["amsgrad"]
        ptrs = np.array([[_local(p).data_ptr(), _local(p.grad).data_ptr(),
                          _local(st["exp_avg"]).data_ptr(), _local(st["exp_avg_sq"]).data_ptr(),
                          _local(st["max_exp_avg_sq"]).data_ptr() if ams else 0]
                         for p, st in zip(params, states, strict=True)], dtype=np.int64)
        lens = np.array([_local(p).numel() for p in params], dtype=np.int64)
        kernels._adam_multi(ptrs, lens, scal, bool(ams))

    def _step_param(self, p: torch.Tensor, hp: dict[str, Any]) -> None:
        state = self._init_state(p, hp)
        step = _count_step(state)
        b1, b2 = hp["betas"]
        mx = _flat(state["max_exp_avg_sq"], "max_exp_avg_sq") if hp["amsgrad"] else None
        ops.adam_step(_flat(p, "parameter"), as_kernel_grad(_local(p.grad)),
                      _flat(state["exp_avg"], "exp_avg"), _flat(state["exp_avg_sq"], "exp_avg_sq"),
                      mx, lr=hp["lr"], beta1=b1, beta2=b2, eps=hp["eps"],
                      weight_decay=hp["weight_decay"], decoupled=self._decoupled(hp),
                      amsgrad=hp["amsgrad"], step=step, maximize=hp["maximize"])

    def _step_device(self, params: list[torch.Tensor], hp: dict[str, Any], ex: str) -> None:
        b1, b2 = hp["betas"]
        ams = hp["amsgrad"]
        none = np.zeros(len(rule.ADAM_SCALARS), np.float32)
        pairs = [device.check_pair(_local(p), _local(p.grad)) for p in params]  # refuse
        states = [self._init_state(p, hp) for p in params]  # before any state changes
        rows = [device.adam_row(pair["p"], pair["g"], _local(st["exp_avg"]),
                                _local(st["exp_avg_sq"]),
                                _local(st["max_exp_avg_sq"]) if ams else None, none, ams,
                                pair_checked=True)
                for pair, st in zip(pairs, states, strict=True)]
        gscale = ops.gscale_of(None, hp["maximize"])
        cache: dict[int, tuple[np.ndarray, rule.AdamFlags]] = {}
        by_flags: dict[rule.AdamFlags, list[device.Row]] = {}
        for row, st in zip(rows, states, strict=True):
            step = _count_step(st)
            if step not in cache:
                sc = ops.adam_scalars(lr=hp["lr"], beta1=b1, beta2=b2, eps=hp["eps"],
                                      weight_decay=hp["weight_decay"],
                                      decoupled=self._decoupled(hp), step=step, gscale=gscale)
                cache[step] = (sc, rule.AdamFlags.of(sc, ams))
            row.scalars, flags = cache[step]
            by_flags.setdefault(flags, []).append(row)
        for flags, group_rows in by_flags.items():
            device.run(flags, group_rows, ex)

    def _decoupled(self, hp: dict[str, Any]) -> bool:
        return self.kind == "adamw" or bool(hp.get("decoupled_weight_decay"))

    def _check_group(self, group: dict[str, Any]) -> dict[str, Any]:
        hp = super()._check_group(group)
        hp["decoupled_weight_decay"] = bool(group.get("decoupled_weight_decay", False))
        return hp


class AdamW(Adam):
    """torch.optim.AdamW's arithmetic (Adam with decoupled weight decay)."""

    kind = "adamw"

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *,
                 foreach: bool | None = None, maximize: bool = False, capturable: bool = False,
                 differentiable: bool = False, fused: bool | None = None,
                 executor: str = "auto") -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach,
                         maximize=maximize, capturable=capturable,
                         differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=True, executor=executor)
