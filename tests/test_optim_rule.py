"""The one update rule: its device executors equal the shadows' Numba kernels bit for bit.

The exact torch executor (checkmate.optim.exact_torch, the path CUDA parameters take where
triton is missing) runs here on CPU tensors and is compared with the Numba kernels
(checkmate.optim.ops, what the shadows run) over several steps of >= 10k elements of
awkward data: wide exponent ranges, zeros of both signs, subnormals, huge/small ratios,
NaN and inf in gradients, bf16/fp16 gradients, clip factors, maximize, every option.
Comparison is of bit patterns (int32 views); NaN payloads are not part of the contract
(devices produce different NaNs), so every NaN compares as one pattern.

The Triton kernel is generated from the same rule; its source is checked here against the
rule's trace, and, where triton is installed, run under Triton's CPU interpreter with the
interpreter's fma replaced by the hardware FMA (the interpreter's own fma rounds twice).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from itertools import product
from pathlib import Path

import numpy as np
import pytest
import torch

import checkmate.optim as co
from checkmate.errors import CheckmateError
from checkmate.optim import device, exact_torch, ops, rule, triton_step
from checkmate.optim.grads import as_kernel_grad
from checkmate.optim.kernels import fma32

N = 12289  # >= 10k, odd, not a multiple of any block or vector width
STEPS = 4
SPECIALS = np.array([0.0, -0.0, 1e-45, -1e-45, 1e-40, -3e-39, 1.1754944e-38, -1.1754942e-38,
                     3.4028235e38, -3e38, 1e30, -1e-30, 1.0, -1.0, 2.0 ** -75, 65504.0],
                    np.float32)
HAVE_CUDA = torch.cuda.is_available()
NO_CUDA = "needs a CUDA device (none on this machine): the device check runs it"


def bits(x: torch.Tensor | np.ndarray) -> np.ndarray:
    """int32 bit patterns with every NaN as one canonical pattern."""
    a = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    b = a.astype(np.float32, copy=False).reshape(-1).view(np.int32).copy()
    b[np.isnan(a.reshape(-1))] = 0x7FC00000
    return b


def assert_same(a, b, what: str) -> None:
    ba, bb = bits(a), bits(b)
    diff = np.flatnonzero(ba != bb)
    assert diff.size == 0, f"{what}: {diff.size} elements differ, first at {diff[:5]}"


def awkward(rng: np.random.Generator, n: int, nonfinite: bool) -> np.ndarray:
    """float32 values over most of the exponent range, with specials sprinkled in."""
    x = (rng.standard_normal(n) * 2.0 ** rng.integers(-70, 70, n)).astype(np.float32)
    idx = rng.choice(n, n // 10, replace=False)
    x[idx] = rng.choice(SPECIALS, idx.size)
    if nonfinite:
        bad = rng.choice(n, min(n, 12), replace=False)
        x[bad] = np.array([np.nan, np.inf, -np.inf] * 4, np.float32)[:bad.size]
    return x


def as_dtype(x: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(x).to(dtype)


# -------------------------------------------------------------- the exact operations


@pytest.fixture(scope="module")
def hw_fma():
    """The CPU's fused multiply-add (llvm.fma.f32 through Numba, as the kernels use)."""
    from numba import njit

    @njit(cache=False)
    def run(a, b, c, out):
        for i in range(a.shape[0]):
            out[i] = fma32(a[i], b[i], c[i])

    def fma(a, b, c):
        a, b, c = (np.ascontiguousarray(x, np.float32).ravel()
                   for x in np.broadcast_arrays(a, b, c))
        out = np.empty(a.shape, np.float32)
        run(a, b, c, out)
        return out
    return fma


def _fma_cases(rng: np.random.Generator) -> list[tuple[np.ndarray, ...]]:
    n = 200_000
    rand_bits = [rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
                 for _ in range(3)]
    a = rng.standard_normal(n).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    cancel = (-(a.astype(np.float64) * b)).astype(np.float32)  # a*b + c nearly cancels
    # a*b lands next to a float32 midpoint, c a tiny nudge: where double rounding bites
    near = np.float32(1) + rng.integers(-4, 4, n).astype(np.float32) * np.float32(2.0 ** -23)
    nudge = (rng.standard_normal(n) * 2.0 ** -30).astype(np.float32)
    tiny = (rng.standard_normal((3, n)) * np.array([[1e-20], [1e-20], [1e-39]])).astype(
        np.float32)  # products and sums in the subnormal range
    with np.errstate(over="ignore"):
        big = (rng.standard_normal((3, n)) * np.array([[1e19], [1e19], [3e38]])).astype(
            np.float32)  # overflow to inf, inf - inf
    # a*b exactly a float32 midpoint (a odd in [1, 2), b = 1.5 * 2^k), c a tiny push off it:
    # float64 rounds the sum back onto the midpoint and float32 then ties to even
    odd = (np.float32(1) + (2 * rng.integers(0, 2 ** 22, n) + 1).astype(np.float32)
           * np.float32(2.0 ** -23))
    scale = (np.float32(1.5) * 2.0 ** rng.integers(-20, 20, n)).astype(np.float32)
    push = (odd * scale * 2.0 ** -60 * rng.choice([-1.0, 1.0], n)).astype(np.float32)
    s = np.concatenate([SPECIALS, np.array([np.nan, np.inf, -np.inf], np.float32)])
    grid = [x.ravel() for x in np.meshgrid(s, s, s)]
    return [tuple(rand_bits), (a, b, cancel), (a, near, nudge), (odd, scale, push),
            tuple(tiny), tuple(big), tuple(grid)]


def test_exact_fma_equals_the_hardware_fma(hw_fma) -> None:
    rng = np.random.default_rng(11)
    naive_wrong = 0
    for a, b, c in _fma_cases(rng):
        ta, tb, tc = (torch.from_numpy(x) for x in (a, b, c))
        got = exact_torch.ARITH.fma(ta, tb, tc)
        assert_same(got, hw_fma(a, b, c), "exact fma")
        naive = (ta.double() * tb.double() + tc.double()).float()
        naive_wrong += int((bits(naive) != bits(got)).sum())
    # the round-to-odd step matters: one float64 rounding then one float32 rounding is
    # wrong on some of these cases (so this test would catch its absence)
    assert naive_wrong > 0


def test_exact_basic_operations_are_correctly_rounded() -> None:
    """+ - * / sqrt in float64 then one rounding == numpy's float32 operations (IEEE on
    this CPU), over random bit patterns (all exponents, subnormals, NaN, inf)."""
    rng = np.random.default_rng(12)
    a, b = (rng.integers(0, 2 ** 32, 300_000, dtype=np.uint64).astype(np.uint32)
            .view(np.float32) for _ in range(2))
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    A = exact_torch.ARITH
    with np.errstate(all="ignore"):
        assert_same(A.mul(ta, tb), a * b, "mul")
        assert_same(A.add(ta, tb), a + b, "add")
        assert_same(A.sub(ta, tb), a - b, "sub")
        assert_same(A.div(ta, tb), a / b, "div")
        assert_same(A.sqrt(ta.abs()), np.sqrt(np.abs(a)), "sqrt")
        assert_same(A.sqrt(ta), np.sqrt(a), "sqrt of negatives")
        assert_same(A.mul(ta, float(b[0])), a * b[0], "mul by a scalar")


def test_maximum_propagates_nan_and_returns_b_on_ties() -> None:
    a = torch.tensor([1.0, float("nan"), 2.0, -0.0, 0.0, 3.0])
    b = torch.tensor([2.0, 1.0, float("nan"), 0.0, -0.0, 3.0])
    got = exact_torch.ARITH.maximum(a, b)
    assert_same(got, np.array([2.0, np.nan, np.nan, 0.0, -0.0, 3.0], np.float32), "maximum")


# -------------------------------------------------------- low-level steps, every option

ADAM_CASES = {
    "adam": dict(decoupled=False, weight_decay=0.0, amsgrad=False),
    "adam-l2": dict(decoupled=False, weight_decay=0.05, amsgrad=False),
    "adamw": dict(decoupled=True, weight_decay=0.1, amsgrad=False),
    "adamw-amsgrad": dict(decoupled=True, weight_decay=0.01, amsgrad=True),
    "adam-amsgrad-max": dict(decoupled=False, weight_decay=0.02, amsgrad=True, maximize=True),
    "adam-beta1-small": dict(decoupled=False, weight_decay=0.0, amsgrad=False, beta1=0.3,
                             beta2=0.5),  # lerp weight >= 0.5: the other vector form
    "adamw-beta2-0-eps-0": dict(decoupled=True, weight_decay=0.1, amsgrad=True, beta2=0.0,
                                eps=0.0),
}
SGD_CASES = {
    "sgd": dict(momentum=0.0),
    "sgd-wd-max": dict(momentum=0.0, weight_decay=0.01, maximize=True),
    "momentum": dict(momentum=0.9),
    "dampening-wd": dict(momentum=0.8, dampening=0.3, weight_decay=0.02),
    "nesterov-wd": dict(momentum=0.9, nesterov=True, weight_decay=0.001),
}
GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CLIPS = [None, 0.37109375, 1.0, None]  # one per step


@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("case", list(ADAM_CASES), ids=str)
def test_adam_exact_torch_equals_numba_kernels(case: str, grad_dtype: torch.dtype) -> None:
    kw = dict(ADAM_CASES[case])
    beta1, beta2, eps = kw.pop("beta1", 0.9), kw.pop("beta2", 0.999), kw.pop("eps", 1e-8)
    rng = np.random.default_rng(hash((case, str(grad_dtype))) % 2 ** 32)
    p = awkward(rng, N, nonfinite=False)
    ref = {"p": p.copy(), "m": np.zeros(N, np.float32), "v": np.zeros(N, np.float32),
           "x": np.zeros(N, np.float32)}
    dev = {k: torch.from_numpy(v.copy()) for k, v in ref.items()}
    for step in range(1, STEPS + 1):
        g = as_dtype(awkward(rng, N, nonfinite=step == 3), grad_dtype)
        args = dict(lr=1e-3 * step, beta1=beta1, beta2=beta2, eps=eps, step=step,
                    clip_coef=CLIPS[step - 1], **kw)
        ops.adam_step(ref["p"], as_kernel_grad(g), ref["m"], ref["v"],
                      ref["x"] if kw["amsgrad"] else None, **args)
        device.adam_step(dev["p"], g, dev["m"], dev["v"], dev["x"] if kw["amsgrad"] else None,
                         executor="torch", **args)
        for k in ref:
            assert_same(dev[k], ref[k], f"{case} step {step} slot {k}")
    assert np.isnan(ref["p"]).any() and np.isfinite(ref["p"]).any()


@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("case", list(SGD_CASES), ids=str)
def test_sgd_exact_torch_equals_numba_kernels(case: str, grad_dtype: torch.dtype) -> None:
    kw = SGD_CASES[case]
    rng = np.random.default_rng(hash((case, str(grad_dtype))) % 2 ** 32)
    p = awkward(rng, N, nonfinite=False)
    ref = {"p": p.copy(), "b": np.zeros(N, np.float32)}
    dev = {k: torch.from_numpy(v.copy()) for k, v in ref.items()}
    mom = kw["momentum"] != 0
    for step in range(STEPS):
        g = as_dtype(awkward(rng, N, nonfinite=step == 2), grad_dtype)
        args = dict(lr=0.01 / (step + 1), first=step == 0, clip_coef=CLIPS[step], **kw)
        ops.sgd_step(ref["p"], as_kernel_grad(g), ref["b"] if mom else None, **args)
        device.sgd_step(dev["p"], g, dev["b"] if mom else None, executor="torch", **args)
        for k in ref:
            assert_same(dev[k], ref[k], f"{case} step {step} slot {k}")


def test_the_data_exposes_a_one_ulp_error_in_any_scalar() -> None:
    """The awkward data is sensitive: nudging any one Adam scalar by one ulp changes the
    result (so the equalities above cannot hold by the updates being absorbed)."""
    rng = np.random.default_rng(8)
    p0, g = awkward(rng, N, False), awkward(rng, N, False)
    s = ops.adam_scalars(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                         decoupled=True, step=2, gscale=np.float32(0.37109375))
    flags = rule.AdamFlags.of(s, True)

    def run(scalars: np.ndarray) -> list[torch.Tensor]:
        t = [torch.from_numpy(p0.copy())] + [torch.from_numpy(np.abs(g) * 1e-3)
                                               for _ in range(3)]
        exact_torch.adam(t[0], torch.from_numpy(g), t[1], t[2], t[3], scalars, flags)
        return t
    base = run(s)
    for i, name in enumerate(rule.ADAM_SCALARS):
        if name in ("wd", "l2", "base_is_avg"):
            continue  # not used by this variant (flags), so no effect is right
        nudged = s.copy()
        nudged[i] = np.nextafter(s[i], np.float32(np.inf))
        out = run(nudged)
        assert any((bits(a) != bits(b)).any() for a, b in zip(out, base, strict=True)), name


@pytest.mark.parametrize("executor", ["auto", "numba", "torch"])
def test_low_level_tensor_steps_take_any_shape_and_leaf_parameters(executor: str) -> None:
    """device.adam_step / sgd_step on a 2-D parameter that requires grad, by every CPU
    executor, equal ops.* on the flat arrays."""
    rng = np.random.default_rng(6)
    p0, g = awkward(rng, 600, False), awkward(rng, 600, True)
    ref = p0.copy()
    m, v = np.zeros(600, np.float32), np.zeros(600, np.float32)
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, decoupled=True,
              amsgrad=False, step=1, clip_coef=0.5)
    ops.adam_step(ref, g, m, v, None, **kw)
    p = torch.nn.Parameter(torch.from_numpy(p0.copy()).reshape(20, 30))
    tm, tv = torch.zeros(20, 30), torch.zeros(20, 30)
    device.adam_step(p, torch.from_numpy(g).reshape(20, 30), tm, tv, None, executor=executor,
                     **kw)
    assert_same(p, ref, "adam param")
    assert_same(tm, m, "adam exp_avg")
    ref_b, ref_p = np.zeros(600, np.float32), p0.copy()
    ops.sgd_step(ref_p, g, ref_b, lr=0.1, momentum=0.9, first=True)
    q, b = torch.nn.Parameter(torch.from_numpy(p0.copy()).reshape(20, 30)), torch.zeros(20, 30)
    device.sgd_step(q, torch.from_numpy(g).reshape(20, 30), b, lr=0.1, momentum=0.9,
                    first=True, executor=executor)
    assert_same(q, ref_p, "sgd param")
    assert_same(b, ref_b, "sgd buffer")


def test_exact_torch_path_chunks_do_not_change_results(monkeypatch) -> None:
    """Chunking (the float64 temporaries' bound) is invisible in the result."""
    rng = np.random.default_rng(5)
    p, g = awkward(rng, N, False), torch.from_numpy(awkward(rng, N, True))
    outs = []
    for chunk in (exact_torch.CHUNK, 1000):
        monkeypatch.setattr(exact_torch, "CHUNK", chunk)
        t = {k: torch.zeros(N) for k in "mvx"}
        tp = torch.from_numpy(p.copy())
        device.adam_step(tp, g, t["m"], t["v"], t["x"], lr=1e-2, beta1=0.9, beta2=0.99,
                         eps=1e-8, weight_decay=0.1, decoupled=True, amsgrad=True, step=1,
                         executor="torch")
        outs.append(tp)
    assert_same(outs[0], outs[1], "chunked")


# ---------------------------------------------------- the torch.optim-style classes


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    # 128*80+80 + 80*24+24 = 12344 elements
    return torch.nn.Sequential(torch.nn.Linear(128, 80), torch.nn.Tanh(),
                               torch.nn.Linear(80, 24))


def _groups(model: torch.nn.Module, kind: str) -> list[dict]:
    ps = list(model.parameters())
    if kind == "sgd":
        return [{"params": ps[:2], "lr": 0.05, "momentum": 0.9, "nesterov": True,
                 "weight_decay": 1e-3},
                {"params": ps[2:], "lr": 0.02, "momentum": 0.5, "dampening": 0.2,
                 "maximize": True}]
    return [{"params": ps[:2], "lr": 1e-2, "weight_decay": 0.1},
            {"params": ps[2:], "lr": 3e-3, "amsgrad": True, "betas": (0.5, 0.9),
             "maximize": True}]


CLASSES = [("sgd", co.SGD), ("adam", co.Adam), ("adamw", co.AdamW)]


def _flat(ts) -> np.ndarray:
    return torch.cat([t.detach().reshape(-1) for t in ts]).numpy()


@pytest.mark.parametrize("kind,cls", CLASSES, ids=[c[0] for c in CLASSES])
def test_device_path_class_tracks_shadows_with_scheduler_and_clipping(kind, cls) -> None:
    """Real training: the class on the exact torch path, a LambdaLR scheduler changing each
    group's lr, clip_grad_norm_ every step; the shadows (FlatOptimizer, Numba) get the
    gradients, the lrs and the clip factor, as the control message carries them."""
    model = _model()
    groups = _groups(model, kind)
    opt = cls(groups, executor="torch")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, [lambda e: 0.9 ** e, lambda e: 1.0 / (1 + e)])
    names = [n for n, _ in model.named_parameters()]
    spec = {"params": [{"name": n, "shape": list(p.shape)} for n, p in model.named_parameters()],
            "total": sum(p.numel() for p in model.parameters()), "partitions": 2,
            "optimizer": {"kind": kind, "groups": [
                {**{k: v for k, v in g.items() if k != "params"},
                 "params": names[:2] if i == 0 else names[2:]} for i, g in enumerate(groups)]}}
    shadows = [co.FlatOptimizer.from_spec(spec, i) for i in range(2)]
    from checkmate.spec.partition import partition_bounds
    bounds = partition_bounds(spec["total"], 2)
    start = _flat(model.parameters())
    for sh, (s, e) in zip(shadows, bounds, strict=True):
        sh.state["param"][:] = start[s:e]
    gen = torch.Generator().manual_seed(3)
    coefs = []
    for it in range(6):
        opt.zero_grad()
        x = torch.randn(32, 128, generator=gen) * (10.0 ** (it % 3))
        model(x).pow(2).sum().backward()
        raw = _flat(p.grad for p in model.parameters()).copy()
        _, coef = co.clip_grad_norm_(model.parameters(), max_norm=1.0)
        coefs.append(coef)
        lrs = [g["lr"] for g in opt.param_groups]
        opt.step()
        sched.step()
        for sh, (s, e) in zip(shadows, bounds, strict=True):
            sh.step(raw[s:e], lrs, coef)
        params = _flat(model.parameters())
        for sh, (s, e) in zip(shadows, bounds, strict=True):
            assert_same(params[s:e], sh.param, f"{kind} iteration {it}")
            for slot in sh.slots[1:]:
                t = _flat(opt.state[p].get(slot, torch.zeros_like(p))
                          for p in model.parameters())
                assert_same(t[s:e], sh.state[slot], f"{kind} iteration {it} {slot}")
    assert min(coefs) < 1.0
    assert len({g["lr"] for g in opt.param_groups}) == 2


@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("kind,cls", CLASSES, ids=[c[0] for c in CLASSES])
def test_device_path_class_equals_numba_class_on_awkward_gradients(kind, cls, grad_dtype) -> None:
    """Same model, same awkward gradients (NaN/inf included, bf16/fp16 gradients as the
    CPU path takes them), one optimizer on the Numba path, one on the exact torch path."""
    rng = np.random.default_rng(7)
    models = [_model(1), _model(1)]
    opts = [cls(_groups(m, kind), executor=ex) for m, ex in zip(models, ("numba", "torch"),
                                                                strict=True)]
    for it in range(STEPS):
        for p0, p1 in zip(models[0].parameters(), models[1].parameters(), strict=True):
            g = awkward(rng, p0.numel(), nonfinite=it == 2).reshape(p0.shape)
            for p in (p0, p1):
                p.grad = torch.zeros_like(p)
                p.grad.data = torch.from_numpy(g).to(grad_dtype)  # a 16-bit gradient, as
                # the CPU path accepts it
        for o in opts:
            o.step()
        for p0, p1 in zip(models[0].parameters(), models[1].parameters(), strict=True):
            assert_same(p1, p0, f"{kind} step {it}")
            for slot, t0 in opts[0].state[p0].items():
                t1 = opts[1].state[p1][slot]
                if torch.is_tensor(t0):
                    assert_same(t1, t0, f"{kind} step {it} {slot}")
                else:
                    assert t0 is None and t1 is None


@pytest.mark.parametrize("kind,cls", CLASSES, ids=[c[0] for c in CLASSES])
def test_device_path_state_dict_is_torch_optims(kind, cls) -> None:
    model = _model()
    opt = cls(_groups(model, kind), executor="torch")
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    sd = opt.state_dict()
    theirs = getattr(torch.optim, cls.__name__)(_groups(_model(), kind))
    theirs.load_state_dict(sd)
    assert theirs.state_dict()["param_groups"] == sd["param_groups"]
    for k, st in sd["state"].items():
        for slot, t in st.items():
            if torch.is_tensor(t):
                assert torch.equal(theirs.state_dict()["state"][k][slot], t)
                assert t.device == next(model.parameters()).device
    if kind != "sgd":
        assert all(st["step"].dtype == torch.float32 and st["step"].item() == 1.0
                   for st in sd["state"].values())
    back = cls(_groups(model, kind), executor="torch")
    back.load_state_dict(sd)
    assert "executor" not in sd["param_groups"][0]


# --------------------------------------------------------------------- refusals


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert msg and "\n" not in msg
    return msg


def _adam(params, **kw):
    return co.AdamW(params, lr=1e-3, executor="torch", **kw)


REFUSED = {
    "float64 parameter": (lambda: torch.zeros(8, dtype=torch.float64), None, "float32"),
    "bfloat16 parameter": (lambda: torch.zeros(8, dtype=torch.bfloat16), None, "float32"),
    "non-contiguous parameter": (lambda: torch.zeros(4, 6).t(), None, "contiguous"),
    "sparse parameter": (lambda: torch.zeros(8).to_sparse(), None, "sparse_coo"),
    "sparse gradient": (lambda: torch.zeros(8), lambda p: torch.zeros(8).to_sparse(),
                        "sparse_coo"),
    "float64 gradient": (lambda: torch.zeros(8),
                         lambda p: torch.zeros(8, dtype=torch.float64), "gradient must be"),
    "non-contiguous gradient": (lambda: torch.zeros(4, 6), lambda p: torch.zeros(6, 4).t(),
                                "contiguous"),
}


@pytest.mark.parametrize("what", list(REFUSED))
def test_every_refused_tensor_is_one_error_line_and_changes_nothing(what: str) -> None:
    make_p, make_g, needle = REFUSED[what]
    p = torch.nn.Parameter(make_p())
    good = torch.nn.Parameter(torch.ones(5))
    good.grad = torch.ones(5)
    g = torch.zeros_like(p) if make_g is None else make_g(p)
    try:
        p.grad = g
    except (RuntimeError, TypeError):  # torch checks dtype on assignment, not on .data
        p.grad = torch.zeros_like(p)
        p.grad.data = g
    opt = _adam([good, p])
    before = good.detach().clone()
    with pytest.raises(CheckmateError) as e:
        opt.step()
    assert needle in _one_line(e)
    assert torch.equal(good, before)  # refused before anything was stepped
    assert all(int(st["step"]) == 0 for st in opt.state.values()) or not opt.state


def test_state_on_another_device_is_refused() -> None:
    p = torch.nn.Parameter(torch.zeros(8))
    p.grad = torch.ones(8)
    opt = _adam([p])
    opt.step()
    opt.state[p]["exp_avg"] = torch.zeros(8, device="meta")
    with pytest.raises(CheckmateError) as e:
        opt.step()
    assert "meta" in _one_line(e)
    assert int(opt.state[p]["step"]) == 1
    opt.state[p]["exp_avg"] = torch.zeros(9)
    with pytest.raises(CheckmateError) as e:
        opt.step()
    assert "elements" in _one_line(e)


def test_a_refused_momentum_buffer_creates_no_other_buffer() -> None:
    """SGD: a parameter's first step sets its buffer to the gradient; a buffer created for
    it while another parameter's buffer is refused would turn that into a later step."""
    a, b = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    b.grad = torch.ones(4)
    opt = co.SGD([a, b], lr=0.1, momentum=0.9, dampening=0.5, executor="torch")
    opt.step()  # b has a buffer now, a none (no gradient yet)
    a.grad = torch.ones(4)
    opt.state[b]["momentum_buffer"] = torch.zeros(4, dtype=torch.float64)
    with pytest.raises(CheckmateError) as e:
        opt.step()
    assert "momentum_buffer" in _one_line(e)
    assert opt.state[a].get("momentum_buffer") is None


def test_devices_without_an_exact_path_and_bad_executors_are_refused(monkeypatch) -> None:
    p = torch.zeros(8, device="meta")
    with pytest.raises(CheckmateError) as e:
        device.adam_step(p, p, p, p, None, lr=1e-3, beta1=0.9, beta2=0.99, eps=1e-8,
                         weight_decay=0.0, decoupled=True, amsgrad=False, step=1)
    assert "meta" in _one_line(e)
    with pytest.raises(CheckmateError) as e:
        co.SGD([torch.nn.Parameter(torch.zeros(2))], executor="fast")
    assert "fast" in _one_line(e)
    monkeypatch.setattr(triton_step, "available", lambda dev: False)
    with pytest.raises(CheckmateError) as e:
        device.executor_for("triton", torch.device("cuda"))
    assert "triton" in _one_line(e)
    with pytest.raises(CheckmateError) as e:
        device.executor_for("numba", torch.device("cuda"))
    assert "CPU" in _one_line(e)
    cpu = torch.zeros(8)
    with pytest.raises(CheckmateError) as e:
        device.sgd_step(cpu, torch.zeros(8, device="meta"), None, lr=0.1, first=True,
                        executor="torch")
    assert "meta" in _one_line(e)


def test_auto_takes_triton_on_cuda_else_says_once_it_takes_the_exact_torch_path(
        monkeypatch, capsys) -> None:
    cuda = torch.device("cuda")
    monkeypatch.setattr(device, "_warned_slow", False)
    monkeypatch.setattr(triton_step, "available", lambda dev: dev.type == "cuda")
    assert device.executor_for("auto", cuda) == "triton"
    assert device.executor_for("auto", torch.device("cpu")) == "numba"
    monkeypatch.setattr(triton_step, "available", lambda dev: False)
    assert device.executor_for("auto", cuda) == "torch"
    assert device.executor_for("auto", cuda) == "torch"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "exact torch path" in err[0]


# ------------------------------------------------------------ the Triton kernel source

ALL_ADAM_FLAGS = [rule.AdamFlags(*f) for f in product((False, True), repeat=4)
                  if not (f[0] and f[1])]
ALL_SGD_FLAGS = [rule.SgdFlags(l2, m, nest) for l2, m, nest in
                 product((False, True), (0, 1, 2), (False, True)) if not (nest and m == 0)]
_STMT = re.compile(r"^    (t\d+) = (.*)  # rule: (\w+)\((.*)\)$")


def _template_regex(tmpl: str) -> str:
    """A regex for one EMIT template: operands as named groups, repeats as backreferences."""
    out, seen = "", set()
    for part in re.split(r"(\{\d\})", tmpl):
        m = re.fullmatch(r"\{(\d)\}", part)
        if m:
            k = "abc"[int(m.group(1))]
            out += f"(?P={k})" if k in seen else f"(?P<{k}>\\w+)"
            seen.add(k)
        else:
            out += re.escape(part)
    return out


def _parse_op(expr: str) -> tuple[str, tuple[str, ...]]:
    """Map one emitted Triton expression back to (rule op, operands)."""
    for op, tmpl in triton_step.EMIT.items():
        m = re.fullmatch(_template_regex(tmpl), expr)
        if m:
            return op, tuple(v for v in (m.groupdict().get(k) for k in "abc") if v)
    raise AssertionError(f"not one rule operation: {expr}")


@pytest.mark.parametrize("form", triton_step.FORMS)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
def test_triton_source_is_exactly_the_rule_in_order(grad_dtype, form) -> None:
    for flags in ALL_ADAM_FLAGS + ALL_SGD_FLAGS:
        src = triton_step.kernel_source(flags, grad_dtype, form)
        ast.parse(src)
        tracer = (rule.trace_adam(flags) if isinstance(flags, rule.AdamFlags)
                  else rule.trace_sgd(flags))[0]
        stmts = [m.groups() for m in map(_STMT.match, src.splitlines()) if m]
        assert [(name, *_parse_op(expr)) for name, expr, _, _ in stmts] == tracer.ops
        body = "\n".join(line.split("#")[0] for line in src.splitlines())
        assert " / " not in body and "tl.sqrt(" not in body and "tl.math" not in body
        assert "libdevice" not in body and "fast" not in body
        ops_used = {op for _, op, _ in tracer.ops}
        assert ops_used <= set(rule.OPS)
        conv = ".to(tl.float32)" in body
        assert conv == (grad_dtype != torch.float32)


def test_rule_traces_follow_the_documented_sequence() -> None:
    t, out = rule.trace_adam(rule.AdamFlags(decay=True, l2=False, base_is_avg=True,
                                            amsgrad=True))
    assert t.ops == [("t0", "mul", ("g", "gscale")), ("t1", "mul", ("p", "decay")),
                     ("t2", "sub", ("t0", "m")), ("t3", "fma", ("coeff", "t2", "m")),
                     ("t4", "mul", ("c2", "t0")), ("t5", "mul", ("v", "b2")),
                     ("t6", "fma", ("t4", "t0", "t5")), ("t7", "maximum", ("vmax", "t6")),
                     ("t8", "sqrt", ("t7",)), ("t9", "div", ("t8", "bc2_sqrt")),
                     ("t10", "add", ("t9", "eps")), ("t11", "mul", ("neg_step", "t3")),
                     ("t12", "div", ("t11", "t10")), ("t13", "add", ("t1", "t12"))]
    assert out == ("t13", "t3", "t6", "t7")
    t, out = rule.trace_sgd(rule.SgdFlags(l2=True, momentum=rule.MOMENTUM, nesterov=True))
    assert t.ops == [("t0", "mul", ("g", "gscale")), ("t1", "fma", ("p", "wd", "t0")),
                     ("t2", "mul", ("buf", "momentum")), ("t3", "fma", ("t1", "damp1", "t2")),
                     ("t4", "fma", ("t3", "momentum", "t1")),
                     ("t5", "fma", ("t4", "neg_lr", "p"))]
    assert out == ("t5", "t3")


def test_triton_launches_disable_fp_fusion() -> None:
    assert triton_step.launch_options()["enable_fp_fusion"] is False


def test_triton_is_imported_lazily() -> None:
    code = ("import sys, checkmate.optim, checkmate.optim.triton_step, "
            "checkmate.optim.device; print('triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "False"


# ---------------------------------------- the Triton kernel under Triton's CPU interpreter


def _triton_installed() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture
def interpreted_triton(monkeypatch, hw_fma):
    """Triton's CPU interpreter with two of its numpy stand-ins made exact, as the GPU's
    instructions are: fma (the interpreter computes x*y + z, two roundings) by the CPU's
    FMA, and bfloat16 -> float32 (its bit-twiddling conversion loses subnormals) by the
    exact ``bits << 16``. What this double does not model: the GPU's code generation (FP
    contraction, FTZ, vector widths); the device check runs the real thing."""
    import triton.language as tl
    from triton.runtime import interpreter as interp

    def create_fma(self, x, y, z):
        return interp.TensorHandle(hw_fma(x.data, y.data, z.data).reshape(
            np.broadcast_shapes(x.data.shape, y.data.shape, z.data.shape)), z.dtype.scalar)

    plain_ext = interp.InterpreterBuilder.create_fp_ext

    def create_fp_ext(self, src, dst_type):
        if src.dtype.scalar == tl.bfloat16 and dst_type.scalar == tl.float32:
            wide = (src.data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
            return interp.TensorHandle(wide, tl.float32)
        return plain_ext(self, src, dst_type)

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(interp.InterpreterBuilder, "create_fma", create_fma)
    monkeypatch.setattr(interp.InterpreterBuilder, "create_fp_ext", create_fp_ext)
    monkeypatch.setattr(triton_step, "DIRECT_MIN", 8192)  # every kernel form runs
    forms: set[str] = set()
    real = triton_step._kernel
    monkeypatch.setattr(triton_step, "_kernel",
                        lambda f, d, form, i: forms.add(form) or real(f, d, form, i))
    triton_step.launch_options.cache_clear()
    yield forms
    triton_step.launch_options.cache_clear()


@pytest.mark.skipif(not _triton_installed(), reason="triton is not installed here (the "
                    "GPU machine has it; the device check runs the kernel on CUDA)")
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("kind,cls", CLASSES, ids=[c[0] for c in CLASSES])
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on inf/NaN data: meant
def test_triton_kernel_under_interpreter_equals_numba(interpreted_triton, kind, cls,
                                                      grad_dtype) -> None:
    rng = np.random.default_rng(9)
    # direct + tail, table16 + tail, tail only, table16 + tail: every kernel form runs
    shapes = [(N,), (3000,), (1,), (97, 5)]
    params = [[torch.nn.Parameter(torch.from_numpy(awkward(np.random.default_rng(i), int(
        np.prod(s)), False)).reshape(s)) for i, s in enumerate(shapes)] for _ in range(2)]
    hp = {"sgd": dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
          "adam": dict(lr=1e-2, weight_decay=0.1, amsgrad=True, betas=(0.3, 0.5)),
          "adamw": dict(lr=1e-2, weight_decay=0.1, maximize=True)}[kind]
    opts = [cls(params[0], executor="numba", **hp), cls(params[1], executor="triton", **hp)]
    for it in range(3):
        for p0, p1 in zip(*params, strict=True):
            g = torch.from_numpy(awkward(rng, p0.numel(), it == 1)).reshape(p0.shape)
            for p in (p0, p1):
                p.grad = torch.zeros_like(p)
                p.grad.data = g.to(grad_dtype)
        for o in opts:
            o.step()
        for p0, p1 in zip(*params, strict=True):
            assert_same(p1, p0, f"{kind} step {it} {tuple(p0.shape)}")
            for slot, t0 in opts[0].state[p0].items():
                if torch.is_tensor(t0) and slot != "step":
                    assert_same(opts[1].state[p1][slot], t0, f"{kind} {slot}")
    assert interpreted_triton == set(triton_step.FORMS)


@pytest.mark.skipif(not _triton_installed(), reason="triton is not installed here (the "
                    "GPU machine has it; the device check runs the kernel on CUDA)")
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("flags", [rule.AdamFlags(True, False, True, True),
                                   rule.AdamFlags(False, True, False, False),
                                   rule.SgdFlags(True, rule.MOMENTUM, True),
                                   rule.SgdFlags(False, rule.FIRST_MOMENTUM, False)],
                         ids=lambda f: f.tag)
def test_triton_ptx_for_h100_has_exactly_the_rules_rounded_operations(flags, grad_dtype):
    """Compiled for sm_90 here (no GPU needed): per element, the rule's fma, mul, add, sub,
    div and sqrt, each ``.rn`` (round to nearest, no FTZ, nothing approximate, no
    multiply-add the rule does not have); aligned forms load with 128-bit vectors."""
    tracer = (rule.trace_adam(flags) if isinstance(flags, rule.AdamFlags)
              else rule.trace_sgd(flags))[0]
    per_elem = {op: sum(1 for _, o, _ in tracer.ops if o == op)
                for op in ("fma", "mul", "add", "sub", "div", "sqrt")}
    per_thread = triton_step.BLOCK // (32 * triton_step.NUM_WARPS)
    for form in triton_step.FORMS:
        text = triton_step.ptx(flags, grad_dtype, form)
        for op, k in per_elem.items():
            found = len(re.findall(rf"\b{op}\.rn\.f32\b", text))
            # the compiler may recompute a value (it did: bf16 g*gscale, once per layout),
            # never contract one: fma exactly as the rule has them, the others at least
            ok = found == k * per_thread if op == "fma" else (
                found >= k * per_thread and (found == 0) == (k == 0))
            assert ok, (form, op, found, k)
        assert not re.search(r"\.ftz|\.approx|\bmad(\.\w+)*\.f32|\bfma\.(?!rn\.f32)|\.f64\b",
                             text)
        vec = re.search(r"ld\.global(\.\w+)*\.v[248]", text)
        assert bool(vec) == (form != "table"), form


# --------------------------------------------------------------------------- CUDA


@pytest.mark.skipif(not HAVE_CUDA, reason=NO_CUDA)
@pytest.mark.parametrize("kind,cls", CLASSES, ids=[c[0] for c in CLASSES])
def test_cuda_optimizer_equals_shadow_kernels(kind, cls, monkeypatch) -> None:
    monkeypatch.setattr(triton_step, "DIRECT_MIN", 1 << 20)  # every kernel form runs
    rng = np.random.default_rng(4)
    shapes = [(1 << 22) + 3, 5000, 1]
    cpu = [torch.nn.Parameter(torch.from_numpy(awkward(rng, n, False))) for n in shapes]
    gpu = [torch.nn.Parameter(p.detach().cuda()) for p in cpu]
    hp = {"sgd": dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
          "adam": dict(lr=1e-2, weight_decay=0.1, amsgrad=True, betas=(0.3, 0.5)),
          "adamw": dict(lr=1e-2, weight_decay=0.1, maximize=True)}[kind]
    opts = [cls(cpu, executor="numba", **hp), cls(gpu, **hp)]
    for it in range(3):
        for pc, pg in zip(cpu, gpu, strict=True):
            g = torch.from_numpy(awkward(rng, pc.numel(), it == 1))
            pc.grad, pg.grad = g.clone(), g.cuda()
        for o in opts:
            o.step()
        for pc, pg in zip(cpu, gpu, strict=True):
            assert_same(pg, pc, f"{kind} step {it}")


def test_cuda_tests_skip_with_their_reason_without_a_gpu() -> None:
    if HAVE_CUDA:
        pytest.skip("a GPU is present: the CUDA test runs instead of skipping")
    here = Path(__file__)
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
         f"{here}::test_cuda_optimizer_equals_shadow_kernels"],
        capture_output=True, text=True, timeout=300, cwd=here.parent.parent,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "3 skipped" in out.stdout and NO_CUDA in out.stdout
