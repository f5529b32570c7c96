"""Checks of the device optimizers (one GPU): bit-identity with the shadows' kernels.

The one CUDA-vs-shadow optimizer comparison: ``testbed device-check`` runs its CASES as
optim[CASE] and its speed check as optim-speed; ``python -m checkmate.optim.device_check``
runs them alone.

:func:`check_case` trains parameters on ``device`` with :class:`checkmate.optim.SGD` /
``Adam`` / ``AdamW`` (one or two param groups, optionally a LambdaLR scheduler changing
each group's lr, clip_grad_norm_ every step, in some steps, or never) and a shadow
(:class:`checkmate.optim.FlatOptimizer`, the Numba kernels) from the same raw gradients,
lrs and clip factor, and compares every slot's bit patterns. :func:`bench_adamw` times one
step of both optimizers on CUDA. Both run on CPU tensors too (``executor="torch"``), which
is how the CPU suite tests them.

Usage on the GPU machine::

    from checkmate.optim import device_check as dc
    for case in dc.CASES:
        r = dc.check_case(case, n=10_000_000, steps=50, device="cuda")
        print(case.name, "ok" if r.ok else "FAIL", r.detail)
    print(dc.bench_adamw(n=100_000_000))
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

import checkmate.optim as co
from checkmate.errors import cli_guard
from checkmate.optim import device as dev
from checkmate.optim import triton_step

CLASSES = {"sgd": co.SGD, "adam": co.Adam, "adamw": co.AdamW}
#: 16-bit gradients go to the kernels as they are, so those cases run without clipping
#: (torch's clip would multiply in the 16-bit dtype, the shadow in float32).
GRAD_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
               "float16": torch.float16}
#: How a case clips: every step (the factor must lie in (0, 1) each step), in some steps
#: (max_norm at the gradients' typical norm: at least one step clipped and one not), or
#: never (then the gradients also hold NaN and inf).
CLIPS = ("always", "some", "none")


@dataclass(frozen=True)
class Case:
    """One optimizer configuration the check trains on the device and on a shadow."""

    name: str
    kind: str  # sgd, adam, adamw
    groups: tuple[dict[str, Any], ...]  # each param group's hyperparameters (1 or 2 groups)
    clip: str = "always"
    scheduler: bool = True  # a LambdaLR changing each group's lr every step
    grad_dtype: str = "float32"


def _halved(hp: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Two groups with the same options, the second at half the rate."""
    return hp, {**hp, "lr": hp["lr"] / 2}


_SGD_NESTEROV_MAX = {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3,
                     "maximize": True}
_ADAMW_AMSGRAD_MAX = {"lr": 1e-2, "weight_decay": 0.1, "amsgrad": True, "maximize": True}

#: Every option of every optimizer, in one and two groups (same and different options per
#: group), with and without a scheduler, clipping always, sometimes and never, and 16-bit
#: gradients.
CASES: list[Case] = [
    # two groups with the same options (the second at half the rate), scheduler, clipped
    Case("sgd", "sgd", _halved({"lr": 0.05})),
    Case("sgd-momentum-dampening-wd", "sgd",
         _halved({"lr": 0.02, "momentum": 0.8, "dampening": 0.3, "weight_decay": 0.01})),
    Case("sgd-nesterov-maximize", "sgd", _halved(_SGD_NESTEROV_MAX)),
    Case("adam", "adam", _halved({"lr": 1e-3})),
    Case("adam-l2-amsgrad", "adam", _halved({"lr": 1e-2, "weight_decay": 0.05,
                                              "amsgrad": True})),
    Case("adam-betas-eps", "adam", _halved({"lr": 1e-2, "betas": (0.3, 0.5), "eps": 1e-6})),
    Case("adamw", "adamw", _halved({"lr": 1e-2, "weight_decay": 0.1})),
    Case("adamw-amsgrad-maximize", "adamw", _halved(_ADAMW_AMSGRAD_MAX)),
    # one group, a constant rate, no clipping
    Case("sgd-one-group", "sgd", ({"lr": 0.05},), "none", False),
    Case("sgd-momentum-dampening", "sgd", ({"lr": 0.05, "momentum": 0.9, "dampening": 0.3},),
         "none", False),
    Case("sgd-nesterov-weight-decay", "sgd", ({"lr": 0.05, "momentum": 0.9, "nesterov": True,
                                               "weight_decay": 1e-3},), "none", False),
    Case("sgd-maximize", "sgd", ({"lr": 0.01, "momentum": 0.5, "weight_decay": 1e-4,
                                  "maximize": True},), "none", False),
    Case("adam-l2", "adam", ({"lr": 1e-3, "weight_decay": 1e-2},), "none", False),
    Case("adam-amsgrad", "adam", ({"lr": 1e-3, "amsgrad": True, "betas": (0.8, 0.99)},),
         "none", False),
    Case("adamw-one-group", "adamw", ({"lr": 1e-3, "weight_decay": 0.1},), "none", False),
    Case("adamw-maximize-eps", "adamw", ({"lr": 1e-3, "maximize": True, "eps": 1e-6},),
         "none", False),
    # two groups with different options, a scheduler; clipping in some steps
    Case("adamw-groups-scheduler", "adamw", ({"lr": 1e-3, "weight_decay": 0.1},
                                             {"lr": 3e-4, "weight_decay": 0.0,
                                              "amsgrad": True}), "none"),
    Case("adamw-clip", "adamw", ({"lr": 1e-3, "weight_decay": 0.01},), "some", False),
    Case("sgd-groups-scheduler-clip", "sgd", ({"lr": 0.05, "momentum": 0.9},
                                              {"lr": 0.01, "momentum": 0.9,
                                               "nesterov": True}), "some"),
    # 16-bit gradients, as the wire carries them
    Case("adamw-amsgrad-maximize-bfloat16", "adamw", _halved(_ADAMW_AMSGRAD_MAX), "none",
         grad_dtype="bfloat16"),
    Case("adamw-amsgrad-maximize-float16", "adamw", _halved(_ADAMW_AMSGRAD_MAX), "none",
         grad_dtype="float16"),
    Case("sgd-nesterov-maximize-bfloat16", "sgd", _halved(_SGD_NESTEROV_MAX), "none",
         grad_dtype="bfloat16"),
]
CASE_NAMES = {c.name: c for c in CASES}


@dataclass
class Result:
    ok: bool
    detail: str
    seconds: float
    figures: dict[str, Any] = field(default_factory=dict)


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


def check_case(case: Case, *, n: int = 10_000_000, steps: int = 50, device: str = "cuda",
               executor: str = "auto", seed: int = 0) -> Result:
    """Train ``steps`` steps on ``device`` and on a shadow; compare every slot bit for bit.

    Clipped cases get finite gradients (a NaN would make every later step NaN); unclipped
    ones hold NaN and inf too."""
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
    cut = [slice(0, 2), slice(2, None)] if len(case.groups) == 2 else [slice(None)]
    groups = [{"params": params[c], **hp} for c, hp in zip(cut, case.groups, strict=True)]
    opt = CLASSES[case.kind](groups, executor=executor)
    sched = (torch.optim.lr_scheduler.LambdaLR(
        opt, [lambda e: 0.97 ** e, lambda e: 1 / (1 + e)][:len(groups)])
        if case.scheduler else None)
    spec = {"params": [{"name": nm, "shape": [s]} for nm, s in zip(names, sizes, strict=True)],
            "total": total, "partitions": 1,
            "optimizer": {"kind": case.kind,
                          "groups": [{**hp, "params": names[c]}
                                     for c, hp in zip(cut, case.groups, strict=True)]}}
    shadow = co.FlatOptimizer.from_spec(spec, 0)
    shadow.state["param"][:] = init
    wire = GRAD_DTYPES[case.grad_dtype]
    clip = case.clip != "none"
    pool = [_awkward(rng, total, not clip, (-30, 8) if clip else (-50, 50), huge=not clip)
            for _ in range(3)]
    # "some": the limit is the norm of a pool at scale 1, so the steps at scale 8 clip and
    # those at 1/8 do not
    max_norm = (float(np.linalg.norm(pool[0].astype(np.float64)))
                if case.clip == "some" else 1.0)
    used = {dev.executor_for(executor, p.device) for p in params}
    figs: dict[str, Any] = {"elements": total, "steps": steps, "clipped": 0}
    where = ", ".join(sorted(used))

    def failed(why: str) -> Result:
        return Result(False, f"{why} ({where})", time.perf_counter() - t0, figs)

    for step in range(steps):
        scale = np.float32(2.0 ** ((step * 3) % 7 - 3))  # 1/8, 1, 8, 2, 1/4, 4, 1/2
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
            _, coef = co.clip_grad_norm_(params, max_norm=max_norm)
            figs["clipped"] += coef is not None and coef < 1.0
            if case.clip == "always" and not 0.0 < coef < 1.0:
                return failed(f"step {step}: clip factor {coef} clips nothing")
        lrs = [g["lr"] for g in opt.param_groups]
        opt.step()
        if sched is not None:
            sched.step()
        shadow.step(co.as_kernel_grad(raw), lrs, coef)
        if step % 10 == 9 or step == steps - 1:
            diff = _compare(opt, params, shadow)
            if diff:
                return failed(f"after step {step}: {diff}")
    if case.clip == "some" and not 0 < figs["clipped"] < steps:
        return failed(f"clipping acted in {figs['clipped']} of {steps} steps: the case is "
                      "meant to clip in some steps and not in others")
    secs = time.perf_counter() - t0
    figs["seconds"] = round(secs, 2)
    return Result(True, f"{total} elements, {steps} steps, slots {', '.join(shadow.slots)} "
                        f"bit-identical ({where})", secs, figs)


def _compare(opt: torch.optim.Optimizer, params: list[torch.Tensor],
             shadow: co.FlatOptimizer) -> str:
    """'' when every slot is bit-identical, else the slots that differ, how many elements
    of the first one and the first such element."""
    bad = []
    for slot in shadow.slots:
        if slot == "param":
            got = torch.cat([p.detach().reshape(-1).cpu() for p in params]).numpy()
        else:
            got = torch.cat([opt.state[p].get(slot, torch.zeros_like(p)).reshape(-1).cpu()
                             for p in params]).numpy()
        want = shadow.state[slot]
        diff = np.flatnonzero(_bits(got) != _bits(want))
        if len(diff):
            bad.append(f"{len(diff)} of {len(got)} elements of {slot} differ (first at "
                       f"{diff[0]}: {got[diff[0]]!r} vs shadow {want[diff[0]]!r})")
    return "; ".join(bad)


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
    """Every CASES entry and (on CUDA) the speed ratio: one line each, then a summary
    line. True if every check passed."""
    results = []
    for case in CASES:
        r = check_case(case, n=n, steps=steps, device=device, executor=executor)
        results.append(r.ok)
        print_line(f"optim[{case.name}]: {'ok' if r.ok else 'FAIL'} "
                   f"({r.detail}; {r.seconds:.1f} s)")
    if torch.device(device).type == "cuda" and bench_n:
        ok, line = speed_verdict(bench_adamw(n=bench_n, device=device, executor=executor))
        results.append(ok)
        print_line(f"optim-speed: {'ok' if ok else 'FAIL'} ({line})")
    print_line(f"optim: {sum(results)}/{len(results)} checks passed")
    return all(results)


#: checkmate AdamW may take at most this many times torch's fused AdamW's step time.
SPEED_TARGET = 2.0


def speed_verdict(b: dict[str, Any]) -> tuple[bool, str]:
    """Whether a :func:`bench_adamw` result meets SPEED_TARGET, and one line about it."""
    return b["ratio"] <= SPEED_TARGET, (
        f"AdamW {b['params']} params in {b['tensors']} tensors: checkmate "
        f"{b['checkmate_ms']:.2f} ms/step [{b['executor']}], torch fused "
        f"{b['torch_fused_ms']:.2f} ms/step, ratio {b['ratio']:.2f}, target <= {SPEED_TARGET:g}")


@cli_guard("checkmate.optim.device_check")
def main(argv: list[str] | None = None) -> int:
    """``python -m checkmate.optim.device_check``: run_all; exit 0 when every check passed.
    (``testbed device-check`` runs the same checks among its others.)"""
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
