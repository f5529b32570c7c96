"""Trainer vs shadow: bit-identical optimizer state after every one of 100 iterations.

The trainer side is a real torch model stepped by checkmate.optim's torch.optim drop-ins
after torch's clip_grad_norm_; the shadow side is one FlatOptimizer per partition, built
from the model spec, fed the partition's slice of the flat gradient (float32 or its
bfloat16/float16 bits, as the wire would carry it), the per-group lrs and the clip factor.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
import pytest
import torch

import checkmate.optim as co
from checkmate.spec.partition import partition_bounds

PARTITIONS = 3


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    # 13*7+7 + 7*5+5 + 5*3+3 = 156 elements: cuts land inside parameters.
    return torch.nn.Sequential(torch.nn.Linear(13, 7), torch.nn.Tanh(), torch.nn.Linear(7, 5),
                               torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _flat(ts) -> np.ndarray:
    return torch.cat([t.detach().reshape(-1) for t in ts]).numpy()


def _spec(model: torch.nn.Module, kind: str, groups: list[dict[str, Any]]) -> dict[str, Any]:
    params = [{"name": n, "shape": list(p.shape)} for n, p in model.named_parameters()]
    total = sum(p.numel() for p in model.parameters())
    return {"job": 1, "params": params, "total": total, "partitions": PARTITIONS,
            "optimizer": {"kind": kind, "groups": groups}, "buffers": [],
            "grad_dtype": "float32"}


def _torch_groups(model: torch.nn.Module, groups: list[dict[str, Any]]) -> list[dict]:
    named = dict(model.named_parameters())
    return [{**{k: v for k, v in g.items() if k != "params"},
             "params": [named[n] for n in g["params"]]} for g in groups]


def _state_slot(opt: torch.optim.Optimizer, model: torch.nn.Module, slot: str) -> np.ndarray:
    out = []
    for p in model.parameters():
        t = opt.state[p].get(slot)
        out.append(torch.zeros_like(p) if t is None else t)
    return _flat(out)


NAMES = ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
TWO_GROUPS = [{"params": NAMES[:3]}, {"params": NAMES[3:]}]

CASES = [
    ("sgd", co.SGD, [{"params": NAMES, "lr": 0.05}], {}),
    ("sgd", co.SGD, [{**TWO_GROUPS[0], "lr": 0.05, "momentum": 0.9, "nesterov": True,
                      "weight_decay": 1e-3},
                     {**TWO_GROUPS[1], "lr": 0.02, "momentum": 0.5, "dampening": 0.2}], {}),
    ("adam", co.Adam, [{"params": NAMES, "lr": 1e-2, "weight_decay": 1e-2}], {}),
    ("adamw", co.AdamW, [{**TWO_GROUPS[0], "lr": 1e-2, "weight_decay": 0.1},
                         {**TWO_GROUPS[1], "lr": 3e-3, "amsgrad": True, "betas": (0.5, 0.9)}],
     {}),
    ("adamw", co.AdamW, [{"params": NAMES, "lr": 1e-2, "amsgrad": True, "maximize": True}], {}),
    ("sgd", co.SGD, [{**TWO_GROUPS[0], "lr": 0.05, "momentum": 0.9},
                     {**TWO_GROUPS[1], "lr": 0.02}], {}),
]


class _Versions:
    """The shadow's way of stepping (shadow/state.py): each step reads the newest retained
    arrays and writes into another set, recycled from an evicted version (here: three
    sets in turn, refilled with NaN so an element the step fails to write shows)."""

    def __init__(self, sh: co.FlatOptimizer) -> None:
        self.sh = sh
        self.sets = [{k: np.empty(sh.size, np.float32) for k in sh.slots} for _ in range(3)]
        self.n = 0

    def step(self, grad: np.ndarray, lrs: list[float], coef: float) -> None:
        before = {k: v.copy() for k, v in self.sh.state.items()}
        old = self.sh.state
        out = self.sets[self.n % 3]
        self.n += 1
        for a in out.values():
            a.fill(np.nan)
        self.sh.step(grad, lrs, coef, out=out)
        assert all(self.sh.state[k] is out[k] for k in self.sh.slots)
        for k in before:  # the version it read is never written
            assert np.array_equal(old[k], before[k], equal_nan=True), k


@pytest.mark.parametrize("into", [False, True], ids=["in-place", "into-version"])
@pytest.mark.parametrize("grad_dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0] + f"-{len(c[2])}g")
def test_shadow_partitions_track_trainer_bit_for_bit(case, grad_dtype: str, into: bool) -> None:
    kind, cls, groups, _ = case
    model = _model()
    opt = cls(_torch_groups(model, groups))
    spec = _spec(model, kind, groups)
    shadows = [co.FlatOptimizer.from_spec(spec, i) for i in range(PARTITIONS)]
    bounds = partition_bounds(spec["total"], PARTITIONS)
    start = _flat(model.parameters())
    for sh, (s, e) in zip(shadows, bounds, strict=True):
        sh.state["param"][:] = start[s:e]
    steppers = [_Versions(sh) if into else sh for sh in shadows]
    wire = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    gen = torch.Generator().manual_seed(1)
    base_lrs = [g["lr"] for g in groups]
    coefs = []
    for it in range(100):
        x = torch.randn(8, 13, generator=gen)
        opt.zero_grad()
        model(x).pow(2).sum().mul(3.0).backward()
        # What the wire carries (reduced gradient in grad_dtype); trainer widens it back.
        sent = [p.grad.to(wire[grad_dtype], copy=True) for p in model.parameters()]
        for p, w in zip(model.parameters(), sent, strict=True):
            p.grad = w.to(torch.float32, copy=True)
        _, coef = co.clip_grad_norm_(model.parameters(), max_norm=0.5)
        coefs.append(coef)
        lrs = [lr * (0.99 ** it) for lr in base_lrs]
        for g, lr in zip(opt.param_groups, lrs, strict=True):
            g["lr"] = lr
        opt.step()
        flat_sent = co.as_kernel_grad(torch.cat([w.reshape(-1) for w in sent]))
        for st, (s, e) in zip(steppers, bounds, strict=True):
            st.step(flat_sent[s:e], lrs, coef)
        params = _flat(model.parameters())
        for sh, (s, e) in zip(shadows, bounds, strict=True):
            assert np.array_equal(sh.param, params[s:e], equal_nan=True), f"iteration {it}"
            for slot in sh.slots[1:]:
                assert np.array_equal(sh.state[slot], _state_slot(opt, model, slot)[s:e]), slot
            if kind != "sgd":
                assert sh.step_count == int(opt.state[next(model.parameters())]["step"])
    assert min(coefs) < 1.0  # clipping was really exercised


def _large_run(threads: int, into: bool = False) -> dict[str, np.ndarray]:
    """Three AdamW steps on 1000003 elements, trainer vs 3 shadows, at a thread count;
    ``into``: the shadows step into other arrays (the parallel into-kernel)."""
    n = 1000003
    before = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        gen = torch.Generator().manual_seed(3)
        w = torch.nn.Parameter(torch.randn(n, generator=gen))
        opt = co.AdamW([w], lr=1e-3, amsgrad=True)
        spec = {"params": [{"name": "w", "shape": [n]}], "total": n, "partitions": PARTITIONS,
                "optimizer": {"kind": "adamw", "groups": [{"params": ["w"], "lr": 1e-3,
                                                           "amsgrad": True}]}}
        shadows = [co.FlatOptimizer.from_spec(spec, i) for i in range(PARTITIONS)]
        bounds = partition_bounds(n, PARTITIONS)
        for sh, (s, e) in zip(shadows, bounds, strict=True):
            sh.state["param"][:] = w.detach().numpy()[s:e]
        for _ in range(3):
            g = torch.randn(n, generator=gen)
            w.grad = g.clone()
            _, coef = co.clip_grad_norm_([w], max_norm=100.0)
            opt.step()
            for sh, (s, e) in zip(shadows, bounds, strict=True):
                (_Versions(sh) if into else sh).step(g.numpy()[s:e], [1e-3], coef)
                assert np.array_equal(sh.param, w.detach().numpy()[s:e])
                assert np.array_equal(sh.max_exp_avg_sq, opt.state[w]["max_exp_avg_sq"][s:e])
        return {"param": w.detach().numpy().copy(),
                **{k: opt.state[w][k].numpy().copy()
                   for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")}}
    finally:
        numba.set_num_threads(before)


def test_large_partitions_match_whole_tensor_step_at_any_thread_count() -> None:
    """1000003 elements: the trainer's one parallel call and the shadows' calls cut the
    work at different places, and 1 or 2 threads must give the same bits."""
    one, two = _large_run(1), _large_run(2)
    for k in one:
        assert np.array_equal(one[k], two[k]), k


def test_large_partitions_stepped_into_other_arrays_match_at_any_thread_count() -> None:
    """The parallel into-step (the shadow's, writing its next version) gives the trainer's
    bits at 1 and 2 threads, as the in-place step does."""
    one, two = _large_run(1, into=True), _large_run(2, into=True)
    for k in one:
        assert np.array_equal(one[k], two[k]), k


def test_an_into_step_refuses_arrays_that_overlap_its_inputs() -> None:
    from checkmate.errors import CheckmateError

    sh = co.FlatOptimizer("adamw", [(0, 8, {"lr": 1e-3})], 8)
    g = np.ones(8, np.float32)
    with pytest.raises(CheckmateError, match="out param overlaps an input array"):
        sh.step(g, [1e-3], out={**{k: np.zeros(8, np.float32) for k in sh.slots},
                                "param": sh.state["param"]})
    with pytest.raises(CheckmateError, match=r"out lacks slots \['exp_avg_sq'\]"):
        sh.step(g, [1e-3], out={"param": np.zeros(8, np.float32),
                                "exp_avg": np.zeros(8, np.float32)})
    assert sh.step_count == 0 and not sh.state["param"].any()  # nothing was stepped
