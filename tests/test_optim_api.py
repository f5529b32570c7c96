"""checkmate.optim: gradient element types, clipping factor, state_dict format, errors."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import checkmate.optim as co
from checkmate.errors import CheckmateError
from checkmate.optim import ops


def _sgd_neg(grad: np.ndarray) -> np.ndarray:
    """param = -0.0 - 1 * grad through the kernel: exposes the widened gradient bit for bit
    (starting from -0.0 keeps the sign of zero gradients)."""
    p = np.full(grad.shape[0], -0.0, np.float32)
    ops.sgd_step(p, grad, None, lr=1.0, first=True)
    return p


@pytest.mark.parametrize("kind", ["bfloat16", "float16"])
def test_every_16bit_pattern_widens_exactly_inside_the_kernel(kind: str) -> None:
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    t = torch.from_numpy(bits.view(np.int16)).view(getattr(torch, kind))
    kernel_form = co.as_kernel_grad(t)
    assert kernel_form.dtype == co.KERNEL_GRAD_DTYPES[kind]
    widened = t.float().numpy()  # torch's exact conversion
    nan = np.isnan(widened)  # NaN payloads may be quieted differently: compare NaN-ness
    for ours in (co.widen(kernel_form), -_sgd_neg(kernel_form)):
        assert np.array_equal(np.isnan(ours), nan)
        assert np.array_equal(ours[~nan].view(np.int32), widened[~nan].view(np.int32))
    assert int(nan.sum()) == (2 * 127 if kind == "bfloat16" else 2 * 1023)


def test_numpy_float16_and_tensor_forms_map_to_kernel_types() -> None:
    h = np.array([1.5, -2.0, 6e-8], np.float16)
    assert co.as_kernel_grad(h).dtype == np.int16
    assert co.as_kernel_grad(torch.ones(3)).dtype == np.float32
    with pytest.raises(CheckmateError, match="unsupported"):
        co.as_kernel_grad(np.zeros(3, np.float64))
    with pytest.raises(CheckmateError, match="contiguous"):
        co.as_kernel_grad(torch.ones(4, 4).t())


def test_clip_factor_reproduces_torch_clipping_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in (1000, 37, 5)]
    grads = [torch.randn(p.shape, generator=gen) * 10 for p in ps]
    for p, g in zip(ps, grads, strict=True):
        p.grad = g.clone()
    _, coef = co.clip_grad_norm_(ps, max_norm=1.0)
    assert coef is not None and coef < 1.0
    assert np.float32(coef) == coef  # exactly a float32
    for p, g in zip(ps, grads, strict=True):
        assert np.array_equal(p.grad.numpy(), g.numpy() * np.float32(coef))
    # below the threshold the factor is exactly 1.0 and gradients stay unchanged
    _, coef = co.clip_grad_norm_(ps, max_norm=1e9)
    assert coef == 1.0
    assert co.clip_grad_norm_([torch.nn.Parameter(torch.ones(2))], 1.0)[1] is None


def _model_and_grads(seed: int = 0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 2))
    return m, [torch.randn(p.shape) for p in m.parameters()]


@pytest.mark.parametrize("ours,theirs,kw", [
    (co.AdamW, torch.optim.AdamW, {"lr": 1e-2, "amsgrad": True}),
    (co.Adam, torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.1}),
    (co.SGD, torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9}),
])
def test_state_dict_round_trips_with_torch_optim(ours, theirs, kw) -> None:
    m1, grads = _model_and_grads()
    o1 = ours(m1.parameters(), **kw)
    for _ in range(3):
        for p, g in zip(m1.parameters(), grads, strict=True):
            p.grad = g.clone()
        o1.step()
    sd = copy.deepcopy(o1.state_dict())  # torch shares state tensors on load otherwise
    first = sd["state"][0]
    if ours is co.SGD:
        assert set(first) == {"momentum_buffer"}
    else:
        assert first["step"].dtype == torch.float32 and float(first["step"]) == 3.0
        assert {"exp_avg", "exp_avg_sq"} <= set(first)
    # ours -> torch's optimizer: same state, and torch steps on from it
    m2, _ = _model_and_grads()
    m2.load_state_dict(m1.state_dict())
    o2 = theirs(m2.parameters(), **kw)
    o2.load_state_dict(sd)
    for k, v in sd["state"][0].items():
        assert torch.equal(o2.state[next(m2.parameters())][k], v)
    # torch's -> ours: a fresh optimizer of ours continues exactly like o1 does
    m3, _ = _model_and_grads()
    m3.load_state_dict(m1.state_dict())
    o3 = ours(m3.parameters(), **kw)
    o3.load_state_dict(copy.deepcopy(o2.state_dict()))
    for mod, opt in ((m1, o1), (m3, o3)):
        for p, g in zip(mod.parameters(), grads, strict=True):
            p.grad = g.clone()
        opt.step()
    for a, b in zip(m1.parameters(), m3.parameters(), strict=True):
        assert torch.equal(a, b)


def test_sgd_without_momentum_keeps_torch_state_shape() -> None:
    m, grads = _model_and_grads()
    o = co.SGD(m.parameters(), lr=0.1)
    for p, g in zip(m.parameters(), grads, strict=True):
        p.grad = g
    o.step()
    assert o.state_dict()["state"][0] == {"momentum_buffer": None}


def test_bad_arguments_are_one_line_errors() -> None:
    p = [torch.nn.Parameter(torch.ones(3))]
    with pytest.raises(CheckmateError, match="Nesterov"):
        co.SGD(p, lr=0.1, nesterov=True)
    with pytest.raises(CheckmateError, match="fused"):
        co.AdamW(p, fused=True)
    with pytest.raises(CheckmateError, match="betas"):
        co.Adam(p, betas=(1.0, 0.9))
    q = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    q.grad = torch.ones(3, dtype=torch.float64)
    with pytest.raises(CheckmateError, match="float32"):
        co.AdamW([q]).step()
    a = np.zeros(5, np.float32)
    with pytest.raises(CheckmateError, match="gradient"):
        ops.adam_step(a, np.zeros(4, np.float32), a.copy(), a.copy(), None, lr=1e-3,
                      beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0, decoupled=True,
                      amsgrad=False, step=1)


def test_a_negative_lr_from_the_scheduler_is_named_as_the_schedulers() -> None:
    """The lr a step refuses is the scheduler's for that step; the line says so (and its
    base), not as if the optimizer had been built with it."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = co.AdamW([p], lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0 - 2.0 * e)  # 1, -1, ...
    p.grad = torch.ones(3)
    opt.step()
    sched.step()
    with pytest.raises(CheckmateError) as e:
        opt.step()
    assert "(lr -0.01 is the scheduler's for this step, from initial_lr 0.01)" in str(e.value)
    with pytest.raises(CheckmateError) as e:  # without a scheduler: no such words
        co.AdamW([p], lr=-0.5)
    assert "must be >= 0" in str(e.value) and "scheduler" not in str(e.value)


SPEC = {
    "job": 1, "total": 10, "partitions": 2, "buffers": [], "grad_dtype": "float32",
    "params": [{"name": "a", "shape": [2, 3], "offset": 0, "numel": 6},
               {"name": "b", "shape": [4], "offset": 6, "numel": 4}],
    "optimizer": {"kind": "adam", "groups": [{"params": ["a"], "lr": 0.1},
                                             {"params": ["b"], "lr": 0.2, "amsgrad": True}]},
}


def test_flat_optimizer_from_spec_builds_group_ranges_and_slots() -> None:
    f0, f1 = (co.FlatOptimizer.from_spec(SPEC, i) for i in range(2))
    assert f0.size == 5 and f1.size == 5
    assert [(s, e, g) for s, e, g, _ in f0.ranges] == [(0, 5, 0)]
    assert [(s, e, g) for s, e, g, _ in f1.ranges] == [(0, 1, 0), (1, 5, 1)]
    assert f1.slots == ("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    g = np.ones(5, np.float32)
    f1.step(g, [0.1, 0.2])
    assert f1.step_count == 1
    # Adam's first step moves every element by lr (bias-corrected m/sqrt(v) = 1)
    assert np.allclose(f1.param, [-0.1, -0.2, -0.2, -0.2, -0.2], rtol=1e-6)
    assert np.array_equal(f1.max_exp_avg_sq[1:], f1.exp_avg_sq[1:])
    snap = f1.snapshot()
    f1.step(g, [0.1, 0.2])
    assert not np.array_equal(snap["param"], f1.param)
    f1.load(snap, 1)
    assert np.array_equal(snap["param"], f1.param) and f1.step_count == 1


@pytest.mark.parametrize("mutate,match", [
    (lambda s: s.pop("total"), "lacks"),
    (lambda s: s.update(total=11), "total"),
    (lambda s: s["optimizer"].update(kind="lamb"), "unknown optimizer"),
    (lambda s: s["optimizer"]["groups"][1]["params"].remove("b"), "no param group"),
    (lambda s: s["optimizer"]["groups"][1]["params"].append("a"), "two param groups"),
    (lambda s: s["params"][1].update(offset=5), "offset"),
    (lambda s: s["params"][1].update(numel=5), "numel"),
])
def test_flat_optimizer_rejects_inconsistent_specs(mutate, match: str) -> None:
    spec = copy.deepcopy(SPEC)
    mutate(spec)
    with pytest.raises(CheckmateError, match=match):
        co.FlatOptimizer.from_spec(spec, 1)


def test_flat_optimizer_checks_ranges_and_step_inputs() -> None:
    with pytest.raises(CheckmateError, match="hole"):
        co.FlatOptimizer("sgd", [(0, 3, {}), (4, 6, {})], 6)
    with pytest.raises(CheckmateError, match="overlap"):
        co.FlatOptimizer("sgd", [(0, 4, {}), (3, 6, {})], 6)
    with pytest.raises(CheckmateError, match="cover"):
        co.FlatOptimizer("sgd", [(0, 4, {})], 6)
    f = co.FlatOptimizer("sgd", [(0, 3, {"momentum": 0.9}), (3, 6, {})], 6)
    assert f.slots == ("param", "momentum_buffer")
    with pytest.raises(CheckmateError, match="learning rates"):
        f.step(np.zeros(6, np.float32), [0.1])
    with pytest.raises(CheckmateError, match="elements"):
        f.step(np.zeros(5, np.float32), [0.1, 0.1])
    f.step(np.ones(6, np.float32), [0.1, 0.1])
    assert np.array_equal(f.momentum_buffer, [1, 1, 1, 0, 0, 0])


@pytest.mark.parametrize("parallel", [False, True], ids=["serial", "parallel"])
def test_kernels_release_the_gil(parallel: bool) -> None:
    """The shadow steps in one thread while its receive thread keeps running Python: the
    main thread must make progress in the middle of one long kernel call. (With the GIL
    held it cannot: any progress would have to fall before or after the call.)"""
    import threading
    import time

    from checkmate.optim import kernels

    n = 8_000_000
    p, g, m, v = (np.zeros(n, np.float32) for _ in range(4))
    s = ops.adam_scalars(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                         decoupled=True, step=1, gscale=np.float32(1.0))
    kernel = kernels._adam_parallel if parallel else kernels._adam_serial
    empty = np.zeros(0, np.float32)
    kernel(p, g, m, v, empty, s, False)  # compile / load outside the measurement
    # On a loaded machine the main thread may not be scheduled inside a given call: try until
    # it is. With the GIL held no try can pass, however many there are.
    for _ in range(25):
        span: list[float] = []

        def stepper(span: list[float] = span) -> None:
            span.append(time.perf_counter())
            kernel(p, g, m, v, empty, s, False)
            span.append(time.perf_counter())

        t = threading.Thread(target=stepper)
        stamps = []
        t.start()
        while t.is_alive():
            stamps.append(time.perf_counter())
        t.join()
        t0, t1 = span
        lo, hi = t0 + 0.3 * (t1 - t0), t1 - 0.3 * (t1 - t0)
        if any(lo < x < hi for x in stamps):
            return
    pytest.fail("the main thread never ran while a kernel was running")


def test_warm_up_compiles_every_gradient_type() -> None:
    co.warm_up(("adamw", "sgd"), (np.float32, np.uint16, np.int16))
    from checkmate.optim import kernels

    for fn in (kernels._adam_serial, kernels._adam_worker, kernels._sgd_serial,
               kernels._sgd_worker):
        grad_types = {str(sig[1].dtype) for sig in fn.signatures}
        assert {"float32", "uint16", "int16"} <= grad_types, fn


BATCH_CASES = [
    (co.AdamW, {"lr": 1e-2, "amsgrad": True, "weight_decay": 0.05}),
    (co.Adam, {"lr": 1e-2, "weight_decay": 0.05, "maximize": True}),
    (co.SGD, {"lr": 1e-2, "momentum": 0.9, "nesterov": True, "weight_decay": 0.05}),
    (co.SGD, {"lr": 1e-2, "momentum": 0.5, "dampening": 0.5}),
    (co.SGD, {"lr": 1e-2}),
]


@pytest.mark.parametrize("cls,kw", BATCH_CASES, ids=lambda x: getattr(x, "__name__", ""))
def test_batched_small_params_match_the_one_tensor_path(monkeypatch, cls, kw) -> None:
    """Small params go through one batched call; with different step counts per param
    (a param without a gradient skips a step) results equal the one-tensor path's."""
    from checkmate.optim import torch_optim

    def make():
        gen = torch.Generator().manual_seed(5)
        return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in
                ((5,), (300001,), (7, 3), (0,))]

    a, b = make(), make()
    oa, ob = cls(a, **kw), cls(b, **kw)
    gen = torch.Generator().manual_seed(6)
    for it in range(4):
        for i, (pa, pb) in enumerate(zip(a, b, strict=True)):
            g = None if (i == 2 and it == 1) else torch.randn(pa.shape, generator=gen)
            pa.grad = None if g is None else g.clone()
            pb.grad = None if g is None else g.clone()
        oa.step()
        with monkeypatch.context() as mp:
            mp.setattr(torch_optim, "_batchable", lambda p: False)
            ob.step()
        for pa, pb in zip(a, b, strict=True):
            assert torch.equal(pa, pb)
            for k, v in oa.state[pa].items():
                assert (v is None and ob.state[pb][k] is None) or torch.equal(v, ob.state[pb][k])
    if cls is not co.SGD:
        assert float(oa.state[a[2]]["step"]) == 3.0 and float(oa.state[a[0]]["step"]) == 4.0


@pytest.mark.parametrize("cls,slot", [(co.Adam, "exp_avg"), (co.SGD, "momentum_buffer")])
def test_batched_path_refuses_mis_sized_loaded_state(cls, slot: str) -> None:
    p = torch.nn.Parameter(torch.ones(10))
    o = cls([p], lr=0.1, **({"momentum": 0.9} if cls is co.SGD else {}))
    p.grad = torch.ones(10)
    o.step()
    sd = copy.deepcopy(o.state_dict())
    sd["state"][0][slot] = torch.zeros(3)  # would write out of bounds if trusted
    o2 = cls([p], lr=0.1, **({"momentum": 0.9} if cls is co.SGD else {}))
    o2.load_state_dict(sd)
    with pytest.raises(CheckmateError, match=slot):
        o2.step()


def test_the_shadow_side_runs_without_torch_and_while_another_thread_imports_it():
    """The shadow imports checkmate.optim's grads and kernels only (no torch: seconds per
    start); a thread importing torch meanwhile (a disk checkpoint being loaded) must not
    break the step's as_kernel_grad on a numpy gradient (a half-built torch module)."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import sys, threading
        import numpy as np
        import checkmate.shadow.node
        from checkmate.optim import as_kernel_grad
        g = np.arange(8, dtype=np.float32)
        assert as_kernel_grad(g) is not None
        print("torch" in sys.modules, flush=True)
        # Hand the GIL over every 0.1 ms, not every 5: the check runs at many more points of
        # the import, and the import is not starved by this loop (36 s, not 3).
        sys.setswitchinterval(1e-4)
        t = threading.Thread(target=lambda: __import__("torch"))
        t.start()
        while t.is_alive():
            assert as_kernel_grad(g).base is g
        print("ok")
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["False", "ok"], p.stdout
