"""Safe resume and mid-run hyperparameter changes, with two real trainer processes (gloo
rendezvous, our ring, host mode) and two real shadow processes on loopback.

One job, in order: ``resume=True`` against empty shadows is one line on every rank; a fresh
run changes weight decay and betas mid-run, and the shadows follow bit for bit; resuming with
a reordered module, a changed weight decay or an added layer is one line naming the
difference on every rank (never scrambled weights); the unchanged script resumes with the
changed settings; a change the shadows cannot follow (amsgrad) is refused in one line.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from fakes import free_port
from torch import nn

from checkmate.config import cluster as cfgmod
from checkmate.errors import CheckmateError
from checkmate.spec.model import ModelSpec, difference

WORLD = 2
STEPS = 4
CHANGE_AT = 3


class _Net(nn.Module):
    """Conv + BatchNorm + linear; ``swap`` defines bn before conv (same names and sizes),
    ``wider`` adds a layer."""

    def __init__(self, swap: bool = False, wider: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        if swap:
            self.bn = nn.BatchNorm2d(4)
            self.conv = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        else:
            self.conv = nn.Conv2d(3, 4, 3, padding=1, bias=False)
            self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 3)
        if wider:
            self.head = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(F.relu(self.bn(self.conv(x))).mean((2, 3)))
        return self.head(y) if hasattr(self, "head") else y


def _workload(swap: bool = False, wider: bool = False, wd1: float = 0.0):
    from checkmate.optim import AdamW

    model = _Net(swap, wider)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = AdamW([{"params": decay, "weight_decay": 0.01},
                 {"params": rest, "weight_decay": wd1}], lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    return model, opt, sched


def _batch(rank: int, it: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + it)
    return torch.randn(6, 3, 8, 8, generator=g), torch.randint(3, (6,), generator=g)


def test_difference_names_the_first_change():
    """The comparison alone (the job test below runs it through real shadows)."""
    def spec(**kw):
        m, o, _ = _workload(**kw)
        return ModelSpec.from_torch(7, m, o, 2)

    base = spec()
    assert difference(base, spec()) is None
    assert difference(base, spec(swap=True)) == \
        "parameter order differs at index 0: shadows have 'conv.weight', this model 'bn.weight'"
    assert difference(base, spec(wd1=0.05)) == \
        "param group 1 weight_decay: shadows 0.0, this optimizer 0.05"
    assert difference(base, spec(wider=True)) == \
        "this model has parameters the shadows do not: head.weight, head.bias"
    assert difference(spec(wider=True), base) == \
        "the shadows have parameters this model lacks: head.weight, head.bias"
    m, o, _ = _workload()
    assert difference(base, ModelSpec.from_torch(7, m, o, 3)) == \
        "partitions: shadows 2, this job 3"
    tied = _Net()
    tied.fc2 = nn.Linear(4, 3)
    untied_spec = ModelSpec.from_torch(7, tied, torch.optim.SGD(tied.parameters(), lr=0.1), 2)
    tied.fc2.weight = tied.fc.weight  # the same names, one parameter fewer: a tie, not a loss
    assert difference(untied_spec, ModelSpec.from_torch(
        7, tied, torch.optim.SGD(tied.parameters(), lr=0.1), 2)) == \
        "tied parameters changed (name = parameter): shadows none, this model " \
        "fc2.weight = fc.weight"
    m.fc = nn.Linear(4, 5)  # same names, another shape
    o = torch.optim.AdamW([{"params": [p for p in m.parameters() if p.dim() >= 2],
                            "weight_decay": 0.01},
                           {"params": [p for p in m.parameters() if p.dim() < 2],
                            "weight_decay": 0.0}], lr=1e-2)
    assert difference(base, ModelSpec.from_torch(7, m, o, 2)).startswith(
        "parameter 'fc.weight' shape: shadows [3, 4], this model [5, 4]")


def _train(sess, model, opt, rank: int, first: int, last: int) -> None:
    for it in range(first, last + 1):
        sess.begin(it)
        if it == CHANGE_AT:  # the script changes settings mid-run, as users do
            opt.param_groups[0]["weight_decay"] = 0.2
            opt.param_groups[1]["betas"] = (0.8, 0.99)
        x, y = _batch(rank, it)
        opt.zero_grad()
        F.cross_entropy(sess.model(x), y).backward()
        sess.step(extra={"it": it})


def _trainer(rank: int, net: str, ips: list[str], port: int, out: str) -> None:
    from checkmate.train import CheckmateSession, JobLayout, ShadowTarget
    from checkmate.train.shadow_client import restore_state_dicts

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    layout = JobLayout(
        job_id=7, rank=rank, world=WORLD,
        trainers=[(f"{net}.{10 + r}", cfgmod.TRAINER_PORT) for r in range(WORLD)],
        shadows=[ShadowTarget(p, ip, cfgmod.SHADOW_PORT) for p, ip in enumerate(ips)],
        shadow_tcp=[(ip, cfgmod.RESTORE_PORT) for ip in ips], mode="host", seed=5)
    report: dict = {"refused": {}}

    def refused(name: str, **kw) -> None:
        model, opt, sched = _workload(**kw)
        sess = CheckmateSession(model, opt, sched, layout, max_grad_norm=1.0)
        try:
            sess.start(resume=True)
            report["refused"][name] = None
        except CheckmateError as e:
            report["refused"][name] = str(e)
        finally:
            sess.close()

    try:
        refused("empty")
        model, opt, sched = _workload()
        sess = CheckmateSession(model, opt, sched, layout, max_grad_norm=1.0)
        sess.start()
        _train(sess, model, opt, rank, 1, STEPS)
        report["protected"] = sess.finish(timeout=30)["protected"]
        sess.close()
        model_sd, optim_sd, it, _, _ = restore_state_dicts(layout.shadow_tcp, sess.spec)
        report["shadow_iteration"] = it
        report["model_diff"] = [n for n, t in model.state_dict().items()
                                if not torch.equal(t, model_sd[n])]
        report["optim_diff"] = [
            (k, s) for k, st in opt.state_dict()["state"].items() for s, t in st.items()
            if not torch.equal(t, optim_sd["state"][k][s])]
        for name, kw in (("swap", {"swap": True}), ("wd", {"wd1": 0.05}),
                         ("wider", {"wider": True})):
            refused(name, **kw)
        # The unchanged script resumes, with the settings changed mid-run (new trainer
        # addresses: the first session's ring sockets stay bound in this process).
        m2, o2, s2 = _workload()
        again = dataclasses.replace(layout, trainers=[
            (f"{net}.{20 + r}", cfgmod.TRAINER_PORT) for r in range(WORLD)])
        sess = CheckmateSession(m2, o2, s2, again, max_grad_norm=1.0)
        report["resumed_at"] = sess.start(resume=True)
        report["resumed_model_diff"] = [
            n for (n, a), b in zip(model.state_dict().items(), m2.state_dict().values(),
                                   strict=True) if not torch.equal(a, b)]
        report["resumed_groups"] = [[g["weight_decay"], list(g["betas"]), g["lr"]]
                                    for g in o2.param_groups]
        report["trained_groups"] = [[g["weight_decay"], list(g["betas"]), g["lr"]]
                                    for g in opt.param_groups]
        # A change the shadows cannot follow: refused before the optimizer steps.
        o2.param_groups[0]["amsgrad"] = True
        sess.begin(STEPS + 1)
        x, y = _batch(rank, STEPS + 1)
        F.cross_entropy(sess.model(x), y).backward()
        before = m2.fc.weight.clone()
        try:
            sess.step()
        except CheckmateError as e:
            report["amsgrad"] = str(e)
        report["amsgrad_untouched"] = torch.equal(before, m2.fc.weight)
        sess.close()
    finally:
        Path(out, f"rank{rank}.json").write_text(json.dumps(report))
        dist.destroy_process_group()


@pytest.mark.slow
def test_resume_is_checked_and_settings_follow(loopback_shadows, tmp_path):
    net, ips = loopback_shadows
    mp.spawn(_trainer, args=(net, ips, free_port(), str(tmp_path)), nprocs=WORLD,
             join=True)
    for rank in range(WORLD):
        rep = json.loads((tmp_path / f"rank{rank}.json").read_text())
        ref = rep["refused"]
        assert all(m is not None and "\n" not in m for m in ref.values()), ref
        assert "holds no state to restore" in ref["empty"] and "resume=False" in ref["empty"]
        assert ("resume: parameter order differs at index 0: shadows have 'conv.weight', "
                "this model 'bn.weight'") in ref["swap"]
        assert "resume: param group 1 weight_decay: shadows 0.0, this optimizer 0.05" \
            in ref["wd"]
        assert "resume: this model has parameters the shadows do not: head.weight" \
            in ref["wider"]
        # The shadows followed the mid-run change bit for bit.
        assert rep["protected"] and rep["shadow_iteration"] == STEPS, rep
        assert rep["model_diff"] == [] and rep["optim_diff"] == [], rep
        assert rep["resumed_at"] == STEPS and rep["resumed_model_diff"] == [], rep
        assert rep["resumed_groups"] == rep["trained_groups"], rep
        assert rep["resumed_groups"][0][0] == 0.2 and rep["resumed_groups"][1][1] == [0.8, 0.99]
        assert "param group 0 amsgrad changed" in rep["amsgrad"], rep
        assert rep["amsgrad_untouched"] and "\n" not in rep["amsgrad"]
