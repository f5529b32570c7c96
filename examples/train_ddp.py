"""The same job on torch's own DistributedDataParallel; run it with `checkmate launch`:

    checkmate launch --nproc-per-node 4 --shadows 2 --max-restarts 1 examples/train_ddp.py

Only three lines differ from examples/train.py: the process group, the DDP wrapper, and
``DDPSession`` instead of ``CheckmateSession``. Checkmate's comm hook does DDP's allreduce
and sends each rank's share of the reduced gradient to the shadows (docs/architecture.md).
"""

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from checkmate.optim import AdamW  # torch.optim.AdamW's arithmetic, repeated by the shadows
from checkmate.train import DDPSession


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--out", help="rank 0 saves the final state here (torch.save)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)  # every rank builds the same initial model
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 3))
    dist.init_process_group("gloo")  # "nccl" on GPUs; Checkmate adds a gloo group beside it
    ddp = DistributedDataParallel(model)
    optimizer = AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / 10))
    sess = DDPSession.from_env(ddp, optimizer, scheduler, max_grad_norm=1.0)
    for it in range(sess.done_iteration + 1, args.steps + 1):
        sess.begin(it)  # reseeds torch's RNG per (rank, iteration): batches are reproducible
        x = torch.randn(args.batch, 3, 8, 8)
        y = x.mean(dim=(2, 3)).argmax(dim=1)  # a learnable label: the brightest channel
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(sess.model(x), y)  # sess.model is ddp
        loss.backward()  # DDP allreduces; the hook replicates the reduced buckets
        sess.step()  # clip, optimizer and scheduler step, control message to the shadows
        sess.report(loss)
    sess.finish()
    if args.out and sess.layout.rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict()}, args.out)
    sess.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
