"""The worker processes the device check launches: a DDP or FSDP2 training job and the
schemes bench, each on its rank's device."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any


def _worker_device() -> Any:
    """GPU 0 for every rank, or the CPU where the check runs its launcher parts on CPU
    (``CKM_DEVCHECK_DEVICE=cpu``: the launcher, kill and comparison logic without a GPU)."""
    import torch

    if os.environ.get("CKM_DEVCHECK_DEVICE", "cuda") == "cpu":
        torch.set_num_threads(1)
        return torch.device("cpu")
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


def _worker_ddp_fsdp(kind: str, argv: list[str]) -> int:
    """A 2-rank job on GPU 0 under `checkmate launch` (model, optimizer, session)."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from checkmate.optim import AdamW

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    os.environ["NCCL_HOSTID"] = f"ckm-devcheck-{local}"  # read at NCCL's init, below
    backend = os.environ.get("CKM_DEVCHECK_BACKEND", "nccl")
    dev = _worker_device()  # every rank on the one GPU
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                          nn.Linear(1024, 10)).to(dev)
    if not dist.is_initialized():
        dist.init_process_group(backend)
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        from checkmate.train import DDPSession

        wrapped = DistributedDataParallel(model, device_ids=[0] if dev.type == "cuda" else None)
        optimizer = AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / 8))
        sess = DDPSession.from_env(wrapped, optimizer, sched, max_grad_norm=1.0)
    else:
        from torch.distributed.fsdp import fully_shard

        from checkmate.train import FSDPSession

        for i in (0, 2, 4):
            fully_shard(model[i])
        fully_shard(model)
        wrapped = model
        optimizer = AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / 8))
        sess = FSDPSession.from_env(model, optimizer, sched, max_grad_norm=1.0)
    for it in range(sess.done_iteration + 1, args.steps + 1):
        sess.begin(it)
        x = torch.randn(64, 256, device=dev)
        y = x[:, :10].argmax(dim=1)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(sess.model(x), y)
        loss.backward()
        sess.step()
    sess.finish()
    if args.out:
        from torch.distributed.tensor import DTensor

        def full(v: Any) -> Any:
            v = v.full_tensor() if isinstance(v, DTensor) else v
            return v.detach().cpu() if torch.is_tensor(v) else v

        osd = optimizer.state_dict()
        state = {"model": {k: full(v) for k, v in model.state_dict().items()},
                 "optimizer": {"state": {i: {k: full(v) for k, v in st.items()}
                                         for i, st in sorted(osd["state"].items())},
                               "param_groups": osd["param_groups"]},
                 "scheduler": sched.state_dict()}
        if sess.layout.rank == 0:
            torch.save(state, args.out)
    sess.close()
    dist.destroy_process_group()
    return 0


# ------------------------------------------------------------------- (d) the schemes

#: Baseline kinds alternated inside one launch (mode off); GoCkpt and Checkmate need a
#: session mode of their own, so each gets a launch.
ALTERNATED = ("none", "torchsave", "dcp", "dcp-process", "checkfreq")


def _worker_bench(argv: list[str]) -> int:
    """One launch of the schemes bench on GPU 0: rounds of timed steps per scheme."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from checkmate.optim import AdamW
    from checkmate.train import DDPSession
    from checkmate.train.baselines import Baseline

    ap = argparse.ArgumentParser()
    ap.add_argument("--schemes", required=True)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per round")
    ap.add_argument("--batch", type=int, default=4096,
                    help="rows per step: about 50 ms of fp32 compute on an H100 at width 4096")
    ap.add_argument("--ckdir", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    dev = _worker_device()
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.width, args.width), nn.ReLU()]
    model = nn.Sequential(*layers).to(dev)
    dist.init_process_group(os.environ.get("CKM_DEVCHECK_BACKEND", "nccl"))
    ddp = DistributedDataParallel(model, device_ids=[0] if dev.type == "cuda" else None)
    optimizer = AdamW(model.parameters(), lr=1e-4)
    sess = DDPSession.from_env(ddp, optimizer, None)
    schemes = args.schemes.split(",")
    rank = dist.get_rank()
    rates: dict[str, list[float]] = {s: [] for s in schemes}
    it = sess.done_iteration
    x = torch.randn(args.batch, args.width, device=dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def one_step(ck: Baseline | None) -> None:
        nonlocal it
        it += 1
        sess.begin(it)
        optimizer.zero_grad()
        sess.model(x).float().pow(2).mean().backward()
        if ck is not None:
            ck.before_step()
        sess.step()
        if ck is not None:
            ck.save(it, model, optimizer)

    for rnd in range(args.rounds):
        for s in (schemes if rnd % 2 == 0 else schemes[::-1]):
            d = Path(args.ckdir) / f"{s}-{rnd}"
            d.mkdir(parents=True, exist_ok=True)
            ck = Baseline(s, str(d), rank, 1) if s in ALTERNATED else None
            one_step(ck)  # untimed: a scheme's first save starts its threads/processes
            sync()
            t = time.perf_counter()
            for _ in range(args.steps):
                one_step(ck)
            if ck is not None:
                ck.finish()  # the checkpoints taken are paid for inside the round
            sync()
            rates[s].append(args.steps / (time.perf_counter() - t))
            shutil.rmtree(d, ignore_errors=True)  # 1.2 GB per checkpoint: the disk is finite
    n = sum(p.numel() for p in model.parameters())
    if rank == 0:
        Path(args.out).write_text(json.dumps({"rates": rates, "params": n,
                                              "state_gb": 12 * n / 1e9}))
    if sess.layout.mode != "off":
        sess.finish()
    sess.close()
    dist.destroy_process_group()
    return 0
