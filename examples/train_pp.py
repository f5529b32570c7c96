"""Pipeline parallel beside data parallel, protected per data-parallel group; run it with:

    checkmate launch --nproc-per-node 4 --pp 2 --shadows 2 --max-restarts 1 \\
        examples/train_pp.py --schedule 1f1b

A 2-D DeviceMesh ``(pp, dp)``: each pipeline stage holds its layers of a small language
model (torch.distributed.pipelining: PipelineStage with GPipe or 1F1B over micro-batches),
and ``CheckmateSession.from_env(..., mesh=mesh)`` protects that stage's data-parallel group
with its own ring and shadows (``--pp 2`` makes the launcher start ``--shadows`` per
group). The schedule runs every micro-batch's backward inside ``sess.model.no_sync()`` and
``sess.model.reduce()`` reduces their sum once. Gradients are clipped by the norm of the
whole model (every stage), and after a failure every stage resumes at one iteration.

What the script must do: pass the mesh; draw its data from the data-parallel coordinate and
the iteration (every stage of a replica sees the same micro-batches); run the schedule
inside ``no_sync()`` and reduce after it (any scaling the schedule does to the gradients
happens before the reduction, so the shadows get what the optimizer steps on; this script
scales the loss instead, ``scale_grads=False``). Stock DDP as the stage module does not
work: under a pipelining schedule it reduces twice in the first iteration (torch 2.13),
which DDPSession refuses.
"""

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from checkmate.optim import SGD
from checkmate.train import CheckmateSession

VOCAB, DIM, SEQ, LAYERS = 64, 32, 8, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up, self.down = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(nn.functional.gelu(self.up(self.norm(h))))


class Stage(nn.Module):
    """Layers ``lo..hi`` of the model; the first stage embeds, the last one predicts."""

    def __init__(self, first: bool, last: bool, lo: int, hi: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM) if first else None
        self.blocks = nn.ModuleList(Block() for _ in range(lo, hi))
        self.head = nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) if self.emb is not None else x
        for b in self.blocks:
            h = b(h)
        return self.head(h) if self.head is not None else h


def batch(seed: int, dp: int, iteration: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A replica's tokens and targets: a function of (dp coordinate, iteration) only."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + dp * 7_919 + iteration)
    x = torch.randint(0, VOCAB, (size, SEQ), generator=g)
    return x, (x * 3 + 1) % VOCAB  # a learnable next token


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--schedule", choices=("gpipe", "1f1b"), default="gpipe")
    ap.add_argument("--out", help="every rank saves its stage's final state to OUT.RANK")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (args.pp, world // args.pp), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    per = LAYERS // args.pp
    torch.manual_seed(pp)  # every replica of a stage builds the same initial layers
    stage_mod = Stage(pp == 0, pp == args.pp - 1, pp * per, (pp + 1) * per)
    optimizer = SGD(stage_mod.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
    sess = CheckmateSession.from_env(stage_mod, optimizer, scheduler, max_grad_norm=1.0,
                                     mesh=mesh)
    n = args.microbatches

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # mean over the whole batch: each micro-batch's mean over n (scale_grads=False)
        return nn.functional.cross_entropy(out.reshape(-1, VOCAB), target.reshape(-1)) / n

    stage = PipelineStage(sess.model, pp, args.pp, torch.device("cpu"),
                          group=mesh["pp"].get_group())
    kind = ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B
    schedule = kind(stage, n_microbatches=n, loss_fn=loss_fn, scale_grads=False)
    for it in range(sess.done_iteration + 1, args.steps + 1):
        sess.begin(it)
        x, y = batch(0, dp, it, args.batch)
        optimizer.zero_grad()
        losses: list[torch.Tensor] = []
        with sess.model.no_sync():  # the schedule's backward passes accumulate
            if pp == 0:
                schedule.step(x)
            elif pp == args.pp - 1:
                schedule.step(target=y, losses=losses)
            else:
                schedule.step()
        sess.model.reduce()  # their sum, reduced once over the stage's data-parallel ring
        sess.step()
        if losses:
            sess.report(torch.stack(losses).sum())
    sess.finish()
    if args.out:
        torch.save({"model": stage_mod.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict()}, f"{args.out}.{dist.get_rank()}")
    sess.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
