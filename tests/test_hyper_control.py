"""The control message's ``hyper``: parsed by the assembler, applied by the shadow's
optimizer, so a setting changed mid-run keeps shadow and trainer bit-identical; changes the
fixed slots cannot follow are refused. (Two real processes do the same in
test_safe_resume.py; here one step at a time, in process.)"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from checkmate.errors import CheckmateError
from checkmate.optim import SGD, AdamW, FlatOptimizer
from checkmate.optim import hyper as H
from checkmate.shadow.control_message import parse_control


def _control(it: int, lrs: list[float], hyper) -> bytes:
    return json.dumps({"iteration": it, "lrs": lrs, "clip_coef": None, "skip": False,
                       "hyper": hyper, "buffers": {}, "extra": {}}).encode()


def _pair(kind: str):
    torch.manual_seed(0)
    init = torch.randn(50)
    params = [nn.Parameter(init[:30].clone()), nn.Parameter(init[30:].clone())]
    if kind == "adamw":
        opt = AdamW([{"params": [params[0]], "weight_decay": 0.01},
                     {"params": [params[1]], "weight_decay": 0.0}], lr=1e-2)
    else:
        opt = SGD([{"params": [params[0]], "weight_decay": 0.01},
                   {"params": [params[1]]}], lr=1e-2, momentum=0.9)

    def shadow() -> FlatOptimizer:
        f = FlatOptimizer(kind, [(0, 30, {**opt.param_groups[0], "group": 0}),
                                 (30, 50, {**opt.param_groups[1], "group": 1})], 50)
        f.load({s: init.numpy().copy() if s == "param" else np.zeros(50, np.float32)
                for s in f.slots}, 0)
        return f
    return params, opt, shadow


@pytest.mark.parametrize("kind,change", [
    ("adamw", {0: {"weight_decay": 0.3}, 1: {"betas": (0.5, 0.9), "eps": 1e-6}}),
    ("sgd", {0: {"momentum": 0.5, "weight_decay": 0.2}, 1: {"nesterov": True}}),
])
def test_shadow_follows_a_mid_run_change_bit_for_bit(kind, change):
    params, opt, shadow = _pair(kind)
    following, ignoring = shadow(), shadow()
    gen = torch.Generator().manual_seed(1)
    for it in range(1, 6):
        if it == 3:
            for gi, kv in change.items():
                opt.param_groups[gi].update(kv)
        grad = torch.randn(50, generator=gen)
        params[0].grad, params[1].grad = grad[:30].clone(), grad[30:].clone()
        lrs = [g["lr"] for g in opt.param_groups]
        hyper = [H.control_hyper(kind, g) for g in opt.param_groups]
        ctl = parse_control(_control(it, lrs, hyper), it, 2)
        opt.step()
        following.step(grad.numpy(), ctl.lrs, ctl.clip_coef, ctl.hyper)
        ignoring.step(grad.numpy(), ctl.lrs, ctl.clip_coef)
    trainer = torch.cat([p.detach() for p in params]).numpy()
    assert np.array_equal(following.state["param"], trainer)
    assert not np.array_equal(ignoring.state["param"], trainer)  # the change mattered


def test_changes_the_slots_cannot_follow_are_refused():
    _, opt, shadow = _pair("adamw")
    f = shadow()
    hyper = [H.control_hyper("adamw", g) for g in opt.param_groups]
    hyper[1]["amsgrad"] = True
    with pytest.raises(CheckmateError, match="param group 1 amsgrad changed from False to True"):
        f.set_hyper(hyper)
    _, opt, shadow = _pair("sgd")
    hyper = [H.control_hyper("sgd", g) for g in opt.param_groups]
    hyper[0]["momentum"] = 0.0
    with pytest.raises(CheckmateError, match="param group 0 momentum changed from 0.9 to 0.0"):
        shadow().set_hyper(hyper)


@pytest.mark.parametrize("hyper,why", [
    ([{}], "must be 2 objects"),
    ([{"lr": 0.1}, {}], "bad entry 'lr'"),
    ([{"weight_decay": float("nan")}, {}], "bad entry 'weight_decay'"),
    ([{"betas": [0.9]}, {}], "bad entry 'betas'"),
    ([{"eps": "1e-8"}, {}], "bad entry 'eps'"),
])
def test_assembler_rejects_a_malformed_hyper(hyper, why):
    with pytest.raises(ValueError, match=why):
        parse_control(_control(4, [0.1, 0.1], hyper), 4, 2)
    assert parse_control(_control(4, [0.1, 0.1], None), 4, 2).hyper is None
