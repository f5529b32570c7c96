"""Mixed precision under Checkmate: bf16 autocast, and fp16 loss scaling with GradScaler.

Real processes throughout for the end-to-end tests: two trainer processes (gloo on
loopback) and two ``shadow serve`` processes. The fp16 job trains stock DDP through
``DDPSession`` with ``torch.amp.GradScaler("cpu")`` and fp16 autocast on the CPU; two
iterations are forced to overflow (one by an inf loss on rank 0, which the allreduce spreads,
one by an inf written into rank 0's gradient after the reduction, which only rank 0 sees),
the trainers are SIGKILLed mid-run and a new pair resumes from the shadows. The result must
equal, bit for bit, the same DDP job with torch's GradScaler recipe and no Checkmate; the
shadows must equal the trainers; the scaler's scale and growth tracker must be the clean
run's. The bf16 job runs Checkmate's own ring under bf16 autocast against a plain run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from fakes import assert_optim_equal, assert_state_equal, host_layout, rank_main, run_ranks
from torch import nn

STEPS, KILL_AT, SEED = 10, 6, 5
INF_LOSS_AT, INF_LOCAL_AT = 3, 8  # forced overflows (see the module docstring)


# ----------------------------------------------------------------------------- worker
def _model() -> nn.Module:
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.GELU(), nn.Linear(64, 64),
                         nn.GELU(), nn.Linear(64, 8))


def _batch(rank: int, it: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED * 1000 + rank * 100 + it)
    x = torch.randn(32, 16, generator=g)
    return x, (x[:, :8] * 3).sin()


def _scaler() -> torch.amp.GradScaler:
    # growth every 3 good steps: the scale moves up and down during the run
    return torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=3)


def _loss(model: nn.Module, rank: int, it: int, dtype: torch.dtype) -> torch.Tensor:
    x, y = _batch(rank, it)
    with torch.autocast("cpu", dtype=dtype):
        out = model(x)
    loss = nn.functional.mse_loss(out.float(), y)
    if dtype == torch.float16 and it == INF_LOSS_AT and rank == 0:
        loss = loss * float("inf")
    return loss


def _poison(model: nn.Module, rank: int, it: int) -> None:
    """Rank 0 only: an inf in a reduced gradient that no other rank has."""
    if it == INF_LOCAL_AT and rank == 0:
        with torch.no_grad():
            next(model.parameters()).grad.view(-1)[3] = float("inf")


def _opt(model: nn.Module) -> tuple[torch.optim.Optimizer, object]:
    from checkmate.optim import AdamW

    opt = AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 4))


def _reference(rank: int, out: str) -> None:
    """Stock DDP with torch's GradScaler recipe; the found-inf flags are agreed over the
    ranks as torch's ShardedGradScaler does, and the scheduler steps only when the optimizer
    did (as Hugging Face's Trainer does: the scale did not drop)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from checkmate.train.session import rng_seed

    model = _model()
    ddp = DDP(model)
    opt, sched = _opt(model)
    scaler = _scaler()
    skipped = []
    for it in range(1, STEPS + 1):
        torch.manual_seed(rng_seed(SEED, rank, it))
        opt.zero_grad()
        scaler.scale(_loss(ddp, rank, it, torch.float16)).backward()
        _poison(model, rank, it)
        scaler.unscale_(opt)
        for v in scaler._found_inf_per_device(opt).values():  # as ShardedGradScaler does
            torch.distributed.all_reduce(v, op=torch.distributed.ReduceOp.MAX)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        if scaler.get_scale() >= before:
            sched.step()
        else:
            skipped.append(it)
    if rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                    "scheduler": sched.state_dict(), "scaler": scaler.state_dict(),
                    "skipped": skipped}, out)


def _fp16_worker(cfg: dict, rank: int, world: int) -> int:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from checkmate.train.ddp_hook import DDPSession
    from checkmate.train.shadow_client import restore_state_dicts

    if cfg.get("reference"):
        _reference(rank, cfg["reference"])
    model = _model()
    ddp = DDP(model)
    opt, sched = _opt(model)
    scaler = _scaler()
    layout = host_layout(cfg["net"], cfg["ips"], rank, world, SEED)
    sess = DDPSession(ddp, opt, sched, layout, max_grad_norm=1.0, scaler=scaler)
    start = sess.start(resume=cfg["resume"])
    skipped = []
    for it in range(start + 1, STEPS + 1):
        sess.begin(it)
        opt.zero_grad()
        scaler.scale(_loss(sess.model, rank, it, torch.float16)).backward()
        _poison(model, rank, it)
        steps = sess.opt_step
        sess.step(extra={"it": it})
        if sess.opt_step == steps:
            skipped.append(it)
        if it == cfg.get("kill_at"):
            os.kill(os.getpid(), signal.SIGKILL)
    prot = sess.finish(timeout=30)
    msd, osd, sit, _, extra = restore_state_dicts(layout.shadow_tcp, sess.spec, STEPS)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(), "scaler": scaler.state_dict(),
                "start": start, "skipped": skipped, "protected": prot["protected"],
                "opt_step": sess.opt_step, "shadow_model": msd, "shadow_optimizer": osd,
                "shadow_iteration": sit, "shadow_scaler": extra.get("scaler")},
               f"{cfg['out']}.{rank}")
    sess.close()
    return 0


def _bf16_worker(cfg: dict, rank: int, world: int) -> int:
    """Checkmate's own ring under bf16 autocast, then the same job without Checkmate
    (mode off: the same ring, no shadows)."""
    from checkmate.train.session import CheckmateSession
    from checkmate.train.shadow_client import restore_state_dicts

    outs = {}
    for mode in ("host", "off"):
        model = _model()
        opt, sched = _opt(model)
        layout = host_layout(cfg["net"], cfg["ips"], rank, world, SEED)
        if mode == "off":
            layout = dataclasses.replace(
                layout, mode="off", shadows=[], shadow_tcp=[],
                trainers=[(ip, port + 1) for ip, port in layout.trainers])
        sess = CheckmateSession(model, opt, sched, layout, max_grad_norm=1.0)
        sess.start()
        for it in range(1, STEPS + 1):
            sess.begin(it)
            opt.zero_grad()
            _loss(sess.model, rank, it, torch.bfloat16).backward()
            sess.step()
        outs[mode] = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        if mode == "host":
            prot = sess.finish(timeout=30)
            msd, osd, sit, _, _ = restore_state_dicts(layout.shadow_tcp, sess.spec, STEPS)
            outs["shadow"] = {"model": msd, "optimizer": osd, "iteration": sit,
                              "protected": prot["protected"]}
        sess.close()
    if rank == 0:
        torch.save(outs, cfg["out"])
    return 0


def _fsdp_fp16_worker(cfg: dict, rank: int, world: int) -> int:
    """FSDP2 with fp16 autocast and a GradScaler: torch's recipe (found-inf agreed over the
    ranks, as ShardedGradScaler does; torch's DTensor dispatch reduces it over the mesh
    too), then FSDPSession with the scaler. Rank 0's local overflow is in its own shard
    only."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from checkmate.train import FSDPSession
    from checkmate.train.session import rng_seed
    from checkmate.train.shadow_client import restore_state_dicts

    def make() -> tuple:
        m = _model()
        for i in (0, 3):
            fully_shard(m[i])
        fully_shard(m)
        opt, sched = _opt(m)
        return m, opt, sched, _scaler()

    def poison(m: nn.Module, it: int) -> None:
        if it == INF_LOCAL_AT and rank == 0:
            with torch.no_grad():
                next(m.parameters()).grad.to_local().view(-1)[3] = float("inf")

    def full(sd: dict) -> dict:
        return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in sd.items()}

    def state(m: nn.Module, opt: torch.optim.Optimizer) -> dict:
        osd = opt.state_dict()
        return {"model": full(m.state_dict()),
                "optimizer": {"state": {i: full(st) for i, st in osd["state"].items()},
                              "param_groups": osd["param_groups"]}}

    m, opt, sched, scaler = make()
    for it in range(1, STEPS + 1):
        torch.manual_seed(rng_seed(SEED, rank, it))
        opt.zero_grad()
        scaler.scale(_loss(m, rank, it, torch.float16)).backward()
        poison(m, it)
        scaler.unscale_(opt)
        for v in scaler._found_inf_per_device(opt).values():
            torch.distributed.all_reduce(v, op=torch.distributed.ReduceOp.MAX)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        if scaler.get_scale() >= before:
            sched.step()
    ref = state(m, opt)
    ref_scaler = scaler.state_dict()
    m, opt, sched, scaler = make()
    layout = host_layout(cfg["net"], cfg["ips"], rank, world, SEED)
    sess = FSDPSession(m, opt, sched, layout, max_grad_norm=1.0, scaler=scaler)
    sess.start()
    for it in range(1, STEPS + 1):
        sess.begin(it)
        opt.zero_grad()
        scaler.scale(_loss(m, rank, it, torch.float16)).backward()
        poison(m, it)
        sess.step()
    prot = sess.finish(timeout=30)
    got = state(m, opt)
    if rank == 0:
        msd, osd, sit, _, _ = restore_state_dicts(layout.shadow_tcp, sess.spec, STEPS)
        torch.save({"ref": ref, "got": got, "ref_scaler": ref_scaler,
                    "scaler": scaler.state_dict(), "opt_step": sess.opt_step,
                    "shadow_model": msd, "shadow_optimizer": osd, "iteration": sit,
                    "protected": prot["protected"]}, cfg["out"])
    sess.close()
    return 0


def _worker(cfg: dict, rank: int, world: int) -> int:
    return {"bf16": _bf16_worker, "fp16": _fp16_worker,
            "fsdp-fp16": _fsdp_fp16_worker}[cfg["job"]](cfg, rank, world)


# ----------------------------------------------------------------------------- unit
def test_shadow_unscale_then_clip_equals_gradscaler_then_clip_bit_for_bit():
    """One process: checkmate.optim.AdamW stepped through torch's GradScaler (unscale,
    clip, step) equals the shadow's FlatOptimizer fed the *scaled* gradient and the control
    message's inv_scale, clip_coef and skip -- over steps that include an overflow."""
    from checkmate.optim import AdamW
    from checkmate.optim.clip import clip_grad_norm_
    from checkmate.optim.flat import FlatOptimizer
    from checkmate.shadow.control_message import Control
    from checkmate.train import amp

    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(3000))
    opt = AdamW([p], lr=1e-2, weight_decay=0.1)
    flat = FlatOptimizer("adamw", [(0, 3000, {"lr": 1e-2, "weight_decay": 0.1})], 3000)
    flat.load({"param": p.detach().numpy().copy(), "exp_avg": np.zeros(3000, np.float32),
               "exp_avg_sq": np.zeros(3000, np.float32)}, 0)
    scaler = torch.amp.GradScaler("cpu", init_scale=3.0 * 2 ** 10, growth_interval=2)
    skips = []
    for it in range(1, 9):
        g = torch.randn(3000) * 10 ** (it % 4 - 2)
        if it == 5:
            g[7] = float("nan")
        p.grad = None
        scaler.scale((p * g).sum()).backward()  # p.grad = g * scale
        scaled = p.grad.numpy().copy()  # what the shadows receive
        inv, skip = amp.unscale(scaler, opt, 1, None)
        coef = None if skip else clip_grad_norm_([p], 0.5)[1]
        scaler.step(opt)
        scaler.update()
        ctl = Control(it, [1e-2], coef, skip, {}, {}, None, inv)
        if not ctl.skip:
            flat.step(ctl.step_gradient(scaled), ctl.lrs, ctl.clip_coef)
        skips.append(skip)
        assert np.array_equal(flat.state["param"], p.detach().numpy()), it
        assert np.array_equal(flat.state["exp_avg_sq"],
                              opt.state[p]["exp_avg_sq"].numpy()), it
    assert skips.count(True) == 1 and skips[4] is True
    assert flat.step_count == int(opt.state[p]["step"]) == 7
    # the inverse scale is not a power of two here (3 * 2**k): a product folded into one
    # factor, or unscaling after the clip, would differ in the last bits -- the check bites
    g = torch.randn(3000)
    two = (g * np.float32(1 / 3)) * np.float32(0.7)
    one = g * np.float32(np.float32(1 / 3) * np.float32(0.7))
    assert not torch.equal(two, one)


def test_control_inv_scale_is_checked():
    from checkmate.shadow.control_message import parse_control

    def body(inv: object) -> bytes:
        return json.dumps({"iteration": 1, "lrs": [0.1], "inv_scale": inv}).encode()

    assert parse_control(body(2.0 ** -16), 1, 1).inv_scale == 2.0 ** -16
    assert parse_control(body(None), 1, 1).inv_scale is None
    for bad in (0.1, -1.0, 0, True, "x", float("inf")):
        with pytest.raises(ValueError, match="inv_scale"):
            parse_control(body(bad), 1, 1)


def test_a_scaler_the_user_already_unscaled_is_one_line():
    from checkmate.errors import CheckmateError
    from checkmate.optim import SGD
    from checkmate.train import amp

    p = nn.Parameter(torch.ones(4))
    p.grad = torch.ones(4)
    opt = SGD([p], lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(CheckmateError, match="before sess.step"):  # no scale() yet
        amp.unscale(scaler, opt, 1, None)
    scaler.scale(torch.ones(()))
    scaler.unscale_(opt)
    with pytest.raises(CheckmateError, match="sess.step\\(\\) unscales"):
        amp.unscale(scaler, opt, 1, None)
    with pytest.raises(CheckmateError, match="torch.amp.GradScaler"):
        amp.check_scaler(object())
    assert amp.check_scaler(torch.amp.GradScaler("cpu", enabled=False)) is None


# ----------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_fp16_gradscaler_skips_kill_restore_bit_identical(loopback_shadows, tmp_path):
    net, ips = loopback_shadows
    ref = tmp_path / "ref.pt"
    base = {"job": "fp16", "net": net, "ips": ips, "out": str(tmp_path / "x")}
    res = run_ranks(__file__, json.dumps({**base, "resume": False, "kill_at": KILL_AT,
                                          "reference": str(ref)}), 2)
    assert [r.returncode for r in res] == [-signal.SIGKILL] * 2, [r.stderr[-2000:] for r in res]
    out = tmp_path / "amp"
    res = run_ranks(__file__, json.dumps({**base, "resume": True, "out": str(out)}), 2)
    assert all(r.returncode == 0 for r in res), [r.stderr[-2000:] for r in res]
    plain = torch.load(ref, weights_only=False)
    got = [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]
    assert plain["skipped"] == [INF_LOSS_AT, INF_LOCAL_AT]  # the recipe skipped both
    assert KILL_AT - 1 <= got[0]["start"] <= KILL_AT
    # after the restore both ranks skipped the local overflow of rank 0 (agreement)
    assert got[0]["skipped"] == got[1]["skipped"] == [INF_LOCAL_AT]
    assert got[0]["opt_step"] == STEPS - 2
    for r in range(2):
        assert_state_equal(got[r]["model"], plain["model"], f"rank {r} vs torch's recipe")
        assert_optim_equal(got[r]["optimizer"], plain["optimizer"],
                           f"rank {r} vs torch's recipe")
        assert got[r]["scheduler"] == plain["scheduler"], r
        assert got[r]["scaler"] == plain["scaler"], r  # scale and growth tracker resumed
    assert got[0]["protected"] is True and got[0]["shadow_iteration"] == STEPS
    assert got[0]["shadow_scaler"] == plain["scaler"]
    assert_state_equal(got[0]["shadow_model"], got[0]["model"], "shadows vs trainers")
    assert_optim_equal(got[0]["shadow_optimizer"], got[0]["optimizer"],
                       "shadows vs trainers", lrs=False)


@pytest.mark.slow
def test_fsdp2_fp16_gradscaler_agrees_on_a_shard_local_overflow(loopback_shadows, tmp_path):
    net, ips = loopback_shadows
    out = tmp_path / "fsdp.pt"
    res = run_ranks(__file__, json.dumps({"job": "fsdp-fp16", "net": net, "ips": ips,
                                          "out": str(out)}), 2)
    assert all(r.returncode == 0 for r in res), [r.stderr[-2000:] for r in res]
    got = torch.load(out, weights_only=False)
    assert got["protected"] is True and got["iteration"] == STEPS
    assert got["opt_step"] == STEPS - 2 and got["scaler"] == got["ref_scaler"]
    assert_state_equal(got["got"]["model"], got["ref"]["model"], "FSDP2 vs torch's recipe")
    assert_optim_equal(got["got"]["optimizer"], got["ref"]["optimizer"], "FSDP2 vs recipe")
    assert_state_equal(got["shadow_model"], got["got"]["model"], "shadows vs trainers")
    assert_optim_equal(got["shadow_optimizer"], got["got"]["optimizer"],
                       "shadows vs trainers", lrs=False)


@pytest.mark.slow
def test_bf16_autocast_through_the_ring_bit_identical(loopback_shadows, tmp_path):
    net, ips = loopback_shadows
    out = tmp_path / "bf16.pt"
    res = run_ranks(__file__, json.dumps({"job": "bf16", "net": net, "ips": ips,
                                          "out": str(out)}), 2)
    assert all(r.returncode == 0 for r in res), [r.stderr[-2000:] for r in res]
    got = torch.load(out, weights_only=False)
    assert got["shadow"]["protected"] is True and got["shadow"]["iteration"] == STEPS
    assert_state_equal(got["host"]["model"], got["off"]["model"], "Checkmate vs plain")
    assert_optim_equal(got["host"]["optimizer"], got["off"]["optimizer"], "Checkmate vs plain")
    assert_state_equal(got["shadow"]["model"], got["host"]["model"], "shadows vs trainers")
    assert_optim_equal(got["shadow"]["optimizer"], got["host"]["optimizer"],
                       "shadows vs trainers", lrs=False)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    cfg = json.loads(sys.argv[1])
    rank_main(lambda rank, world: _worker(cfg, rank, world))
