"""A GPU job: torch's DistributedDataParallel on NCCL, mixed precision, under Checkmate.

    checkmate launch --shadows 2 --max-restarts 1 examples/train_gpu.py --amp fp16

``checkmate launch`` starts one worker per GPU and binds each to its GPU before this script
runs, so ``"cuda"`` below is the worker's own device. Against a plain torch DDP script the
changes are the optimizer import and the session (``DDPSession.from_env``, ``begin``,
``step``); with fp16 the GradScaler goes to the session, which unscales, skips and updates
it (docs/usage.md, "GPU job"). Without a visible GPU the same script runs on the CPU with
gloo (tests/test_launch_gpu.py runs it so).
"""

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from checkmate.optim import AdamW  # was: from torch.optim import AdamW
from checkmate.train import DDPSession

AMP = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--amp", choices=sorted(AMP), default="none")
    ap.add_argument("--backend", choices=("nccl", "gloo"), default=None,
                    help="the job's process group (default: nccl on a GPU, gloo on the CPU; "
                         "gloo on a GPU allreduces CUDA tensors through the host)")
    ap.add_argument("--out", help="rank 0 saves the final state here (torch.save)")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if not cuda:
        torch.set_num_threads(1)
    dist.init_process_group(args.backend or ("nccl" if cuda else "gloo"))
    rank = dist.get_rank()
    torch.manual_seed(0)  # every rank builds the same initial model
    w = args.width
    model = nn.Sequential(nn.Linear(32, w), nn.LayerNorm(w), nn.GELU(), nn.Linear(w, w),
                          nn.GELU(), nn.Linear(w, 8)).to(device)
    ddp = DistributedDataParallel(model)
    optimizer = AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / 10))
    dtype = AMP[args.amp]
    scaler = (torch.amp.GradScaler(device.type, init_scale=2.0 ** 10, growth_interval=4)
              if dtype == torch.float16 else None)
    sess = DDPSession.from_env(ddp, optimizer, scheduler, max_grad_norm=1.0, scaler=scaler)
    for it in range(sess.done_iteration + 1, args.steps + 1):
        sess.begin(it)  # reseeds torch's RNG per (rank, iteration)
        g = torch.Generator().manual_seed(it * 1000 + rank)  # data: a function of (rank, it)
        x = torch.randn(args.batch, 32, generator=g).to(device)
        y = (x[:, :8] * 2).sin()
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            out = ddp(x)
        loss = nn.functional.mse_loss(out.float(), y)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        sess.step()  # (unscale,) clip, optimizer and scheduler step (or skip), control message
        sess.report(loss)
    sess.finish()
    if args.out and rank == 0:
        torch.save({"model": {k: v.cpu() for k, v in model.state_dict().items()},
                    "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                    "scaler": scaler.state_dict() if scaler is not None else None,
                    "steps": sess.opt_step}, args.out)
    sess.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
