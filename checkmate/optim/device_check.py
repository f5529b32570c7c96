"""Checks of the device optimizers for the device check (one GPU): bit-identity with the
shadows' kernels, and speed against torch's fused AdamW.

:func:`check_case` trains parameters on ``device`` with :class:`checkmate.optim.SGD` /
``Adam`` / ``AdamW`` (two param groups, a LambdaLR scheduler changing each group's lr,
optionally clip_grad_norm_) and a shadow (:class:`checkmate.optim.FlatOptimizer`, the
Numba kernels) from the same raw gradients, lrs and clip factor, and compares every slot's
bit patterns. :func:`bench_adamw` times one step of both optimizers on CUDA. Both run on
CPU tensors too (``executor="torch"``), which is how the CPU suite tests them.

Usage on the GPU machine::

    from checkmate.optim import device_check as dc
    for name, kind, hp in dc.CASES:
        r = dc.check_case(kind, hp, n=10_000_000, steps=50, device="cuda")
        print(name, "ok" if r.ok else "FAIL", r.detail)
    print(dc.bench_adamw(n=100_000_000))
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import checkmate.optim as co
from checkmate.errors import cli_guard
from checkmate.optim import device as dev
from checkmate.optim import triton_step

#: (name, kind, param-group hyperparameters) covering every option.
CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("sgd", "sgd", {"lr": 0.05}),
    ("sgd-momentum-dampening-wd", "sgd", {"lr": 0.02, "momentum": 0.8, "dampening": 0.3,
                                          "weight_decay": 0.01}),
    ("sgd-nesterov-maximize", "sgd", {"lr": 0.05, "momentum": 0.9, "nesterov": True,
                                      "weight_decay": 1e-3, "maximize": True}),
    ("adam", "adam", {"lr": 1e-3}),
    ("adam-l2-amsgrad", "adam", {"lr": 1e-2, "weight_decay": 0.05, "amsgrad": True}),
    ("adam-betas-eps", "adam", {"lr": 1e-2, "betas": (0.3, 0.5), "eps": 1e-6}),
    ("adamw", "adamw", {"lr": 1e-2, "weight_decay": 0.1}),
    ("adamw-amsgrad-maximize", "adamw", {"lr": 1e-2, "weight_decay": 0.1, "amsgrad": True,
                                         "maximize": True}),
]
#: 16-bit gradients go to the kernels as they are, so these cases run without clipping
#: (torch's clip would multiply in the 16-bit dtype, the shadow in float32).
CLASSES = {"sgd": co.SGD, "adam": co.Adam, "adamw": co.AdamW}
GRAD_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
               "float16": torch.float16}


@dataclass
class Result:
    ok: bool
    detail: str
    seconds: float


def _awkward(rng: np.random.Generator, n: int, nonfinite: bool,
             exps: tuple[int, int] = (-60, 60), huge: bool = True) -> np.ndarray:
    """Exponents over ``exps``, both zeros, subnormals, tiny values, huge ones (unless
    ``huge`` is False: a clipped gradient's norm must stay finite), NaN/inf if asked."""
    x = (rng.standard_normal(n) * 2.0 ** rng.integers(*exps, n)).astype(np.float32)
    k = n // 50
    idx = rng.integers(0, n, k)
    specials = [0.0, -0.0, 1e-45, -1e-40, 1.1754944e-38, 1e-30] + ([3e38, -1e30] if huge else [])
    x[idx] = rng.choice(np.array(specials, np.float32), k)
    if nonfinite:
        x[rng.integers(0, n, 9)] = np.array([np.nan, np.inf, -np.inf] * 3, np.float32)
    return x


def _bits(a: np.ndarray) -> np.ndarray:
    b = a.view(np.int32).copy()
    b[np.isnan(a)] = 0x7FC00000  # NaN payloads differ between devices; NaN-ness may not
    return b


def _sizes(n: int) -> list[int]:
    """A large tensor, mid-size ones with odd sizes and a 1-element one (every kernel form:
    direct + tail, aligned table + tail, tail only)."""
    small = [5003, 97 * 5, 1, 4096]
    return [max(1, n - sum(small))] + small


def check_case(kind: str, hp: dict[str, Any], *, n: int = 10_000_000, steps: int = 50,
               device: str = "cuda", grad_dtype: str = "float32", clip: bool = True,
               executor: str = "auto", seed: int = 0) -> Result:
    """Train ``steps`` steps on ``device`` and on a shadow; compare every slot bit for bit.

    With ``clip`` the gradients are finite (a NaN would make every later step NaN) and
    clip_grad_norm_ runs each step; without it they hold NaN and inf."""
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    sizes = _sizes(n)
    total = sum(sizes)
    names = [f"p{i}" for i in range(len(sizes))]
    # most parameters within reach of an update (else every step is absorbed and a wrong
    # step goes unseen), gradients wide, narrower under clipping (the factor is 1 / norm)
    init = _awkward(rng, total, False, (-24, 6))
    offs = np.cumsum([0] + sizes)
    params = [torch.nn.Parameter(torch.from_numpy(init[offs[i]:offs[i + 1]].copy()).to(device))
              for i in range(len(sizes))]
    g2 = {**hp, "lr": hp["lr"] / 2}
    groups = [{"params": params[:2], **hp}, {"params": params[2:], **g2}]
    opt = CLASSES[kind](groups, executor=executor)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, [lambda e: 0.97 ** e, lambda e: 1 / (1 + e)])
    spec = {"params": [{"name": nm, "shape": [s]} for nm, s in zip(names, sizes, strict=True)],
            "total": total, "partitions": 1,
            "optimizer": {"kind": kind, "groups": [{**hp, "params": names[:2]},
                                                   {**g2, "params": names[2:]}]}}
    shadow = co.FlatOptimizer.from_spec(spec, 0)
    shadow.state["param"][:] = init
    wire = GRAD_DTYPES[grad_dtype]
    pool = [_awkward(rng, total, not clip, (-30, 8) if clip else (-50, 50), huge=not clip)
            for _ in range(3)]
    used = {dev.executor_for(executor, p.device) for p in params}
    for step in range(steps):
        scale = np.float32(2.0 ** ((step % 7) - 3))
        with np.errstate(over="ignore"):  # huge values may become inf: meant
            raw = torch.from_numpy(pool[step % 3] * scale).to(wire)  # what the wire carries
        for i, p in enumerate(params):
            g = raw[offs[i]:offs[i + 1]].to(device, copy=True)  # clip works in place
            p.grad = torch.zeros_like(p)
            p.grad.data = g  # bf16/fp16 gradients stay 16-bit, as the CPU path takes them
        coef = None
        if clip:
            if wire != torch.float32:
                for p in params:  # torch's clip multiplies in the gradient's dtype
                    p.grad.data = p.grad.data.float()
            _, coef = co.clip_grad_norm_(params, max_norm=1.0)
            if not 0.0 < coef < 1.0:
                return Result(False, f"step {step}: clip factor {coef} clips nothing",
                              time.perf_counter() - t0)
        lrs = [g["lr"] for g in opt.param_groups]
        opt.step()
        sched.step()
        shadow.step(co.as_kernel_grad(raw), lrs, coef)
        if step % 10 == 9 or step == steps - 1:
            diff = _compare(opt, params, shadow, offs)
            if diff:
                return Result(False, f"step {step}: {diff} ({', '.join(sorted(used))})",
                              time.perf_counter() - t0)
    return Result(True, f"{total} elements, {steps} steps, bit-identical "
                        f"({', '.join(sorted(used))})", time.perf_counter() - t0)


def _compare(opt: torch.optim.Optimizer, params: list[torch.Tensor],
             shadow: co.FlatOptimizer, offs: np.ndarray) -> str:
    for slot in shadow.slots:
        if slot == "param":
            got = torch.cat([p.detach().reshape(-1).cpu() for p in params]).numpy()
        else:
            got = torch.cat([opt.state[p].get(slot, torch.zeros_like(p)).reshape(-1).cpu()
                             for p in params]).numpy()
        bad = int((_bits(got) != _bits(shadow.state[slot])).sum())
        if bad:
            return f"{slot}: {bad} elements differ"
    return ""


def _model_sizes(n: int) -> list[int]:
    """Tensor sizes of a transformer-like model with about ``n`` parameters."""
    d = 1024
    layer = [3 * d * d, 3 * d, d * d, d, 4 * d * d, 4 * d, 4 * d * d, d, d, d, d, d]
    sizes = [50304 * d]
    while sum(sizes) + sum(layer) <= n:
        sizes += layer
    return sizes


def bench_adamw(n: int = 100_000_000, steps: int = 20, device: str = "cuda",
                executor: str = "auto", sizes: list[int] | None = None) -> dict[str, Any]:
    """ms per step of torch's fused AdamW and checkmate's AdamW on the same tensors (a
    transformer-like set of about ``n`` parameters, or ``sizes``), and their ratio."""
    sizes = sizes or _model_sizes(n)
    out: dict[str, Any] = {"params": sum(sizes), "tensors": len(sizes)}
    cuda = torch.device(device).type == "cuda"
    for name in ("torch_fused", "checkmate"):
        params = [torch.nn.Parameter(torch.randn(s, device=device)) for s in sizes]
        for p in params:
            p.grad = torch.randn_like(p)
        if name == "torch_fused":
            opt = torch.optim.AdamW(params, lr=1e-3, fused=cuda or None)
        else:
            opt = co.AdamW(params, lr=1e-3, executor=executor)
            out["executor"] = dev.executor_for(executor, params[0].device)
        for _ in range(3):
            opt.step()  # compile, allocate state
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(steps):
            opt.step()
        if cuda:
            torch.cuda.synchronize()
        out[f"{name}_ms"] = (time.perf_counter() - t) / steps * 1e3
        del opt, params
        if cuda:
            torch.cuda.empty_cache()
    out["ratio"] = out["checkmate_ms"] / out["torch_fused_ms"]
    out["triton_direct_min"] = triton_step.DIRECT_MIN
    return out


def run_all(n: int = 10_000_000, steps: int = 50, device: str = "cuda",
            executor: str = "auto", bench_n: int = 100_000_000,
            print_line: Any = print) -> bool:
    """Every CASES entry with clipping, the 16-bit gradient cases, and (on CUDA) the speed
    ratio: one line each, then a summary line. True if every check passed."""
    results = []
    runs = [(name, kind, hp, "float32", True) for name, kind, hp in CASES]
    runs += [(f"adamw-amsgrad-maximize-{d}", "adamw", CASES[-1][2], d, False)
             for d in ("bfloat16", "float16")]
    runs += [("sgd-nesterov-maximize-bfloat16", "sgd", CASES[2][2], "bfloat16", False)]
    for name, kind, hp, gd, clip in runs:
        r = check_case(kind, hp, n=n, steps=steps, device=device, grad_dtype=gd, clip=clip,
                       executor=executor)
        results.append(r.ok)
        print_line(f"optim {name}{' +clip' if clip else ''}: {'ok' if r.ok else 'FAIL'} "
                   f"({r.detail}; {r.seconds:.1f} s)")
    if torch.device(device).type == "cuda" and bench_n:
        b = bench_adamw(n=bench_n, device=device, executor=executor)
        ok = b["ratio"] <= 2.0
        results.append(ok)
        print_line(f"optim speed: {'ok' if ok else 'FAIL'} (AdamW {b['params']} params in "
                   f"{b['tensors']} tensors: checkmate {b['checkmate_ms']:.2f} ms/step "
                   f"[{b['executor']}], torch fused {b['torch_fused_ms']:.2f} ms/step, "
                   f"ratio {b['ratio']:.2f}, target <= 2)")
    print_line(f"optim: {sum(results)}/{len(results)} checks passed")
    return all(results)


@cli_guard("checkmate.optim.device_check")
def main(argv: list[str] | None = None) -> int:
    """``python -m checkmate.optim.device_check``: run_all; exit 0 when every check passed."""
    import argparse

    ap = argparse.ArgumentParser(prog="checkmate.optim.device_check",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=10_000_000, help="elements per case")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--executor", default="auto", choices=dev.EXECUTORS)
    ap.add_argument("--bench-n", type=int, default=100_000_000,
                    help="parameters of the speed check (0: skip it)")
    a = ap.parse_args(argv)
    return 0 if run_all(a.n, a.steps, a.device, a.executor, a.bench_n) else 1


if __name__ == "__main__":
    raise SystemExit(main())
