"""CheckmateDDP: fixed bucket layout, gradients reduced over the ckm ring during backward."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from checkmate.train.ddp import CheckmateDDP, bucket_ranges


def test_bucket_ranges_cover_in_reverse_and_respect_params():
    sizes = [10, 5, 20, 1, 7]
    b = bucket_ranges(sizes, 12)
    # bucket 0 holds the end of the model
    assert b[0][2] == [2, 3, 4] and b[0][:2] == (15, 43)
    covered = sorted((s, e) for s, e, _ in b)
    assert covered[0][0] == 0 and covered[-1][1] == sum(sizes)
    assert all(a[1] == c[0] for a, c in zip(covered, covered[1:], strict=False))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 3))


def _grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    model(x).square().sum().backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("zero_to_none", [True, False])
def test_gradients_equal_the_mean_over_ranks(zero_to_none, ring_kit):
    world = 2
    models = [_model() for _ in range(world)]
    total = sum(p.numel() for p in models[0].parameters())
    rings = ring_kit.make(world, total, partitions=2, chunk=64)
    try:
        ddps = [CheckmateDDP(m, r, bucket_elems=100) for m, r in zip(models, rings, strict=True)]
        assert len(ddps[0].buckets) > 1
        xs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(r)) for r in range(world)]
        ref = [_grads(_model(), x) for x in xs]
        expect = [a / world + b / world for a, b in zip(*ref, strict=True)]
        for it in (1, 2):
            errors = []

            def work(r, it=it, errors=errors):
                try:
                    d = ddps[r]
                    d.iteration = it
                    d.module.zero_grad(set_to_none=zero_to_none)
                    d(xs[r]).square().sum().backward()
                except Exception as exc:  # surfaced below
                    errors.append(exc)

            ts = [threading.Thread(target=work, args=(r,)) for r in range(world)]
            for t in ts:
                t.start()
            for t in ts:
                t.join(30)
            assert not errors
            for d in ddps:
                for p, e in zip(d.module.parameters(), expect, strict=True):
                    assert torch.equal(p.grad, e)
            # the grads are views of the one flat buffer, in spec (parameter) order
            flat = torch.cat([p.grad.reshape(-1) for p in ddps[0].module.parameters()])
            assert torch.equal(flat, ddps[0].flat_gradient())
    finally:
        ring_kit.close_all(rings)
