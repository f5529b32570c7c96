"""A complete training script with Checkmate; run it with `checkmate launch` (docs/usage.md):

    checkmate launch --nproc-per-node 4 --shadows 2 --max-restarts 1 examples/train.py

Every iteration is replicated to the shadows; when a trainer dies, the launcher restarts
the group and ``from_env`` resumes it from the shadows' newest consistent iteration.
"""

import argparse

import torch
from torch import nn

from checkmate.optim import AdamW  # torch.optim.AdamW's arithmetic, repeated by the shadows
from checkmate.train import CheckmateSession


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
    optimizer = AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / 10))
    # Addresses, rank, world and "fresh or resume" all come from the launcher's environment.
    sess = CheckmateSession.from_env(model, optimizer, scheduler, max_grad_norm=1.0)
    for it in range(sess.done_iteration + 1, args.steps + 1):
        sess.begin(it)  # reseeds torch's RNG per (rank, iteration): batches are reproducible
        x = torch.randn(args.batch, 3, 8, 8)
        y = x.mean(dim=(2, 3)).argmax(dim=1)  # a learnable label: the brightest channel
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(sess.model(x), y)
        loss.backward()  # gradients are allreduced and replicated while backward runs
        sess.step()  # clip, optimizer and scheduler step, control message to the shadows
        sess.report(loss)  # rank 0: a progress line every --progress-every iterations
    sess.finish()  # wait until the shadows hold the last iteration
    if args.out and sess.layout.rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict()}, args.out)
    sess.close()


if __name__ == "__main__":
    main()
