"""Pipeline, tensor and data parallel at once (torchtitan's 3-D layout); run it with:

    checkmate launch --nproc-per-node 8 --pp 2 --tp 2 --shadows 1 --persist-every 1 \\
        --dir runs/3d examples/train_3d.py --schedule 1f1b

A 3-D DeviceMesh ``(pp, dp, tp)``. Every rank builds the whole model from one seed, then
keeps its stage's layers and deletes the rest, torchtitan's way, so that every parameter
keeps the name it has in the whole model (``blocks.3.up.weight`` on the second stage); then
splits each block it keeps over the TP ranks (ColwiseParallel up-projection,
RowwiseParallel down-projection). ``CheckmateSession.from_env(..., mesh=mesh)`` protects
each (stage, TP rank) data-parallel group with its own ring and shadows: 2 x 2 groups here.
The schedule runs inside ``no_sync()`` and ``sess.model.reduce()`` reduces once; the
gradient is clipped by the norm of the whole model (every stage, every shard, every copy
once).

The shadows' disk checkpoint (``--persist-every``) is an ordinary DCP checkpoint of the
whole model: each parameter under its full name with its global shape, each shard at its
offset. ``shadow export --out OUT DIR/group*/`` joins the groups into one, and plain
``torch.distributed.checkpoint.load`` reads it into this model on any mesh, or into the
unsplit model on one process. ``--load OUT`` does the former here and says whether it
found the values this run ended with.

What the script must do: pass the mesh; keep the whole model's parameter names in each
stage; draw its data from the data-parallel coordinate and the iteration.
"""

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

VOCAB, DIM, SEQ, LAYERS = 64, 32, 8, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(nn.functional.gelu(self.up(self.norm(h))))


class LM(nn.Module):
    """The whole model; a stage is this module with the other stages' parts deleted."""

    def __init__(self) -> None:
        super().__init__()
        self.emb: nn.Module | None = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleDict({str(i): Block() for i in range(LAYERS)})
        self.norm: nn.Module | None = nn.LayerNorm(DIM)
        self.head: nn.Module | None = nn.Linear(DIM, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) if self.emb is not None else x
        for b in self.blocks.values():
            h = b(h)
        return self.head(self.norm(h)) if self.head is not None else h


def stage_of(pp: int, stages: int) -> LM:
    """This stage's part of the whole model, parameter names unchanged."""
    torch.manual_seed(0)  # every rank builds the same whole model
    model = LM()
    per = LAYERS // stages
    for i in range(LAYERS):
        if not pp * per <= i < (pp + 1) * per:
            del model.blocks[str(i)]
    if pp > 0:
        model.emb = None
    if pp < stages - 1:
        model.norm = model.head = None
    return model


def split_blocks(model: LM, tp_mesh) -> None:  # noqa: ANN001 -- a 1-D DeviceMesh
    for block in model.blocks.values():
        parallelize_module(block, tp_mesh, {"up": ColwiseParallel(),
                                            "down": RowwiseParallel()})


def batch(dp: int, iteration: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A replica's tokens and targets: a function of (dp coordinate, iteration) only."""
    g = torch.Generator().manual_seed(dp * 7_919 + iteration)
    x = torch.randint(0, VOCAB, (size, SEQ), generator=g)
    return x, (x * 3 + 1) % VOCAB


def local(v):  # noqa: ANN001, ANN201 -- a DTensor's shard, anything else as it is
    return v.to_local().clone() if hasattr(v, "to_local") else v


def load_check(model: LM, path: str) -> None:
    """Plain DCP into this rank's stage (DTensor shards): the values this run ended with?"""
    import torch.distributed.checkpoint as dcp

    want = {k: local(v) for k, v in model.state_dict().items()}
    sd = {k: torch.zeros_like(v) if not hasattr(v, "to_local") else v.clone().zero_()
          for k, v in model.state_dict().items()}
    dcp.load({"model": sd}, checkpoint_id=path)
    same = all(torch.equal(local(sd[k]), want[k]) for k in want)
    print(f"rank {dist.get_rank()} dcp.load of {len(want)} tensors from {path}: "
          f"{'the saved values' if same else 'DIFFERENT values'}", flush=True)


def main() -> None:
    # here, not above: the model's definition imports no checkmate, so a plain torch
    # program can import it to load the shadows' checkpoint
    from checkmate.optim import AdamW
    from checkmate.train import CheckmateSession

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--schedule", choices=("gpipe", "1f1b"), default="1f1b")
    ap.add_argument("--out", help="every rank saves its final state (local shards) to OUT.RANK")
    ap.add_argument("--load", help="after training, dcp.load this checkpoint and compare")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (args.pp, world // (args.pp * args.tp), args.tp),
                           mesh_dim_names=("pp", "dp", "tp"))
    pp, dp = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    model = stage_of(pp, args.pp)
    split_blocks(model, mesh["tp"])
    optimizer = AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / 5))
    sess = CheckmateSession.from_env(model, optimizer, scheduler, max_grad_norm=1.0,
                                     mesh=mesh)
    n = args.microbatches

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.reshape(-1, VOCAB), target.reshape(-1)) / n

    stage = PipelineStage(sess.model, pp, args.pp, torch.device("cpu"),
                          group=mesh["pp"].get_group())
    kind = ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B
    schedule = kind(stage, n_microbatches=n, loss_fn=loss_fn, scale_grads=False)
    for it in range(sess.done_iteration + 1, args.steps + 1):
        sess.begin(it)
        x, y = batch(dp, it, args.batch)
        optimizer.zero_grad()
        losses: list[torch.Tensor] = []
        with sess.model.no_sync():
            if pp == 0:
                schedule.step(x)
            elif pp == args.pp - 1:
                schedule.step(target=y, losses=losses)
            else:
                schedule.step()
        sess.model.reduce()
        sess.step()
        if losses:
            sess.report(torch.stack(losses).sum())
    sess.finish()
    if args.out:
        opt = optimizer.state_dict()
        opt["state"] = {i: {k: local(v) for k, v in st.items()}
                        for i, st in opt["state"].items()}
        torch.save({"model": {k: local(v) for k, v in model.state_dict().items()},
                    "optimizer": opt, "scheduler": scheduler.state_dict()},
                   f"{args.out}.{dist.get_rank()}")
    if args.load:
        load_check(model, args.load)
    sess.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
