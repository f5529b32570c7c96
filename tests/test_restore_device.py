"""Restored state lands on each parameter's device, bit for bit (checkmate.train.restore).

The shadows hand back host tensors; ``load_trainer_state`` must put every one where the live
model and optimizer keep theirs. On the CPU the placement check is tested with a state
tensor on another device (``meta``); the CUDA load itself needs a GPU and skips without one.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from checkmate.errors import CheckmateError
from checkmate.train.restore import check_placement, load_trainer_state


def _trained(device: str) -> tuple[nn.Module, torch.optim.Optimizer, object]:
    from checkmate.optim import AdamW

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 2)).to(device)
    opt = AdamW(m.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    return m, opt, sched


def test_a_state_on_another_device_is_one_line():
    p = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    opt.state[p]["momentum_buffer"] = torch.empty(3, device="meta")
    with pytest.raises(CheckmateError, match="momentum_buffer is on meta, its parameter on cpu"):
        check_placement(opt)


def test_the_scaler_state_is_restored():
    m, opt, sched = _trained("cpu")
    scaler = torch.amp.GradScaler("cpu")
    saved = {"scale": 512.0, "growth_factor": 2.0, "backoff_factor": 0.5,
             "growth_interval": 7, "_growth_tracker": 3}
    load_trainer_state(m, opt, sched, m.state_dict(), opt.state_dict(),
                       {"scaler": saved, "scheduler": sched.state_dict()}, scaler)
    assert scaler.state_dict() == saved


@pytest.mark.skipif(not torch.cuda.is_available(), reason="loading into CUDA needs a GPU")
def test_restore_into_a_cuda_model_and_optimizer_bit_for_bit():
    src, opt, sched = _trained("cpu")
    for _ in range(3):  # some optimizer state worth restoring (CPU arithmetic)
        opt.zero_grad()
        src(torch.randn(4, 8)).sum().backward()
        opt.step()
        sched.step()
    msd = {k: v.clone() for k, v in src.state_dict().items()}  # host tensors, as restored
    osd = opt.state_dict()
    dst, dopt, dsched = _trained("cuda")
    load_trainer_state(dst, dopt, dsched, msd, osd, {"scheduler": sched.state_dict()})
    for k, v in dst.state_dict().items():
        assert v.device.type == "cuda" and torch.equal(v.cpu(), msd[k]), k
    for i, st in dopt.state_dict()["state"].items():
        for k, v in st.items():
            if k != "step":
                assert v.device.type == "cuda", (i, k)
            assert torch.equal(v.cpu(), osd["state"][i][k].cpu()), (i, k)
    assert [g["lr"] for g in dopt.param_groups] == [g["lr"] for g in opt.param_groups]
