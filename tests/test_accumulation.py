"""Gradient accumulation through CheckmateDDP.no_sync(), and its misuse.

Unit level: two ranks in one process (threads, a real ring over loopback UDP): backward
passes inside no_sync() are summed locally and reduced once, bit for bit the mean of each
rank's accumulated gradient, including a parameter only an accumulation pass touched.

Job level: two trainer processes (gloo rendezvous, our ring, host mode) and two real shadow
processes train with two micro-batches per step; the shadows must equal the trainers bit
for bit, and reducing twice in one iteration (or stepping without a reduction) is one
CheckmateError line on every rank.
"""

from __future__ import annotations

import copy
import json
import os
import random
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from fakes import free_port
from torch import nn

from checkmate.config import cluster as cfgmod
from checkmate.errors import CheckmateError
from checkmate.train.ddp import CheckmateDDP
from checkmate.train.ring import RingAllreduce
from checkmate.train.transport import open_socket

WORLD = 2
STEPS = 4


class _TwoBranch(nn.Module):
    """``b`` joins only when asked: a parameter only some passes give a gradient."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 4)
        self.b = nn.Linear(8, 4)
        self.c = nn.Linear(8, 4)  # never used: its gradient is zero on every rank

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        return self.a(x) + self.b(x) if use_b else self.a(x)


def _rings(world: int, total: int) -> list[RingAllreduce]:
    net = f"127.{random.randrange(100, 200)}.{random.randrange(1, 255)}"
    addrs = [(f"{net}.{10 + r}", cfgmod.TRAINER_PORT) for r in range(world)]
    socks = [open_socket(*a) for a in addrs]
    return [RingAllreduce(r, world, socks[r], addrs[(r + 1) % world], addrs[(r - 1) % world],
                          7, 99, total, 2, chunk=64) for r in range(world)]


def _threads(fn, world: int) -> list[BaseException]:
    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            fn(r)
        except BaseException as e:  # surfaced by the caller
            errors.append(e)

    ts = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    return errors


def test_no_sync_accumulates_and_reduces_once():
    total = sum(p.numel() for p in _TwoBranch().parameters())
    rings = _rings(WORLD, total)
    try:
        ddps = [CheckmateDDP(_TwoBranch(), r, bucket_elems=16) for r in rings]
        assert len(ddps[0].buckets) > 1
        xs = [[torch.randn(5, 8, generator=torch.Generator().manual_seed(10 * r + k))
               for k in range(3)] for r in range(WORLD)]

        def step(r: int) -> None:
            d = ddps[r]
            d.iteration = 1
            with d.no_sync():
                d(xs[r][0], use_b=True).square().sum().backward()
                d(xs[r][1], use_b=False).square().sum().backward()
            d(xs[r][2], use_b=False).square().sum().backward()

        assert _threads(step, WORLD) == []
        local = []
        for r in range(WORLD):  # the same passes on a plain module: autograd accumulates
            m = _TwoBranch()
            for k, use_b in enumerate((True, False, False)):
                m(xs[r][k], use_b).square().sum().backward()
            local.append([p.grad if p.grad is not None else torch.zeros_like(p)
                          for p in m.parameters()])
        expect = [a / WORLD + b / WORLD for a, b in zip(*local, strict=True)]
        assert expect[2].abs().sum() > 0 and expect[4].abs().sum() == 0  # b.weight, c.weight
        for d in ddps:
            assert d.reduced_iteration == 1
            for (n, p), e in zip(d.module.named_parameters(), expect, strict=True):
                assert torch.equal(p.grad, e), n
        # Without no_sync the first backward is this iteration's only reduction.
        def twice(r: int) -> None:
            d = ddps[r]
            d.iteration = 2
            d(xs[r][0], use_b=True).square().sum().backward()
            d(xs[r][1], use_b=True).square().sum().backward()

        errors = _threads(twice, WORLD)
        assert len(errors) == WORLD and all(isinstance(e, CheckmateError) for e in errors)
        assert all("second backward() outside no_sync()" in str(e) and "\n" not in str(e)
                   for e in errors)
    finally:
        for r in rings:
            r.close(timeout=1.0)


# ----------------------------------------------------------------------------- job level


def _trainer(rank: int, net: str, ips: list[str], port: int, out: str) -> None:
    from checkmate.testbed.models import build
    from checkmate.train import CheckmateSession, JobLayout, ShadowTarget
    from checkmate.train.shadow_client import restore_state_dicts

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    report: dict = {}
    try:
        w = build("cnn", 5, STEPS)  # BatchNorm, SGD with momentum and weight decay
        layout = JobLayout(
            job_id=7, rank=rank, world=WORLD,
            trainers=[(f"{net}.{10 + r}", cfgmod.TRAINER_PORT) for r in range(WORLD)],
            shadows=[ShadowTarget(p, ip, cfgmod.SHADOW_PORT) for p, ip in enumerate(ips)],
            shadow_tcp=[(ip, cfgmod.RESTORE_PORT) for ip in ips], mode="host", seed=5,
            bucket_elems=1024)
        sess = CheckmateSession(w.model, w.optimizer, w.scheduler, layout, w.max_grad_norm)
        sess.start()
        for it in range(1, STEPS + 1):
            sess.begin(it)
            x, y = w.batch(rank, it)
            w.optimizer.zero_grad()
            if it == 1:  # the accumulated local gradient, on a plain copy of the model
                ref = copy.deepcopy(w.model)
                for a, b in ((0, 8), (8, 16)):
                    w.loss(ref(x[a:b]), y[a:b]).backward()
                mine = [p.grad for p in ref.parameters()]
            with sess.model.no_sync():
                w.loss(sess.model(x[:8]), y[:8]).backward()
            w.loss(sess.model(x[8:]), y[8:]).backward()
            if it == 1:
                every: list = [None] * WORLD
                dist.all_gather_object(every, mine)
                expect = [a / WORLD + b / WORLD for a, b in zip(*every, strict=True)]
                report["reduced_is_mean_of_sums"] = all(
                    torch.equal(p.grad, e) for p, e in zip(w.model.parameters(), expect,
                                                            strict=True))
                report["one_pass_differs"] = not all(
                    torch.equal(a, b) for a, b in zip(every[0], every[1], strict=True))
            sess.step(extra={"it": it})
        report["protected"] = sess.finish(timeout=30)["protected"]
        model_sd, optim_sd, it, _, _ = restore_state_dicts(layout.shadow_tcp, sess.spec)
        live_sd, live_opt = w.model.state_dict(), w.optimizer.state_dict()
        report["restored_iteration"] = it
        report["model_equal"] = [n for n, t in live_sd.items()
                                 if not torch.equal(t, model_sd[n])]
        report["optim_equal"] = [
            (k, s) for k, st in live_opt["state"].items() for s, t in st.items()
            if not torch.equal(t, optim_sd["state"][k][s])]
        # Misuse 1: a second backward outside no_sync in one iteration.
        sess.begin(STEPS + 1)
        x, y = w.batch(rank, STEPS + 1)
        w.loss(sess.model(x), y).backward()
        try:
            w.loss(sess.model(x), y).backward()
        except CheckmateError as e:
            report["twice"] = str(e)
        # Misuse 2: a step whose only backward ran inside no_sync.
        sess.begin(STEPS + 2)
        with sess.model.no_sync():
            w.loss(sess.model(x), y).backward()
        try:
            sess.step()
        except CheckmateError as e:
            report["unreduced"] = str(e)
        sess.close()
    finally:
        Path(out, f"rank{rank}.json").write_text(json.dumps(report))
        dist.destroy_process_group()


@pytest.mark.slow
def test_accumulating_job_keeps_shadows_bit_identical(loopback_shadows, tmp_path):
    net, ips = loopback_shadows
    mp.spawn(_trainer, args=(net, ips, free_port(), str(tmp_path)), nprocs=WORLD,
             join=True)
    for rank in range(WORLD):
        rep = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert rep["reduced_is_mean_of_sums"] and rep["one_pass_differs"], rep
        assert rep["protected"] and rep["restored_iteration"] == STEPS, rep
        assert rep["model_equal"] == [] and rep["optim_equal"] == [], rep
        assert "second backward() outside no_sync()" in rep["twice"], rep
        assert "step() without a reduced gradient" in rep["unreduced"], rep
        assert "\n" not in rep["twice"] + rep["unreduced"]
