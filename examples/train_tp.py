"""Tensor parallel beside data parallel, protected per data-parallel group; run it with:

    checkmate launch --nproc-per-node 4 --tp 2 --shadows 2 --max-restarts 1 \\
        examples/train_tp.py

A 2-D DeviceMesh ``(dp, tp)``: every block of a small language model (tied embeddings) is
split over the TP ranks with torch's ``parallelize_module`` (ColwiseParallel
up-projection, RowwiseParallel down-projection: DTensor parameters), the embedding, norms
and head are copies on every TP rank, and ``CheckmateSession.from_env(..., mesh=mesh)``
protects each TP rank's data-parallel group (its local shards and copies) with its own ring
and shadows. The gradient is clipped by the norm of the whole model: every shard once,
every copy once.

What the script must do: pass the mesh, and draw its data from the data-parallel
coordinate and the iteration (the TP ranks of a replica see the same batch).

``--fsdp``: FSDP2 + TP (torchtitan's 2-D layout) instead: every block and the root are
also ``fully_shard``-ed over the mesh's ``dp`` dimension, and ``FSDPSession`` protects each
TP rank's group, each rank sending its rows of its TP part.
"""

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from checkmate.optim import AdamW
from checkmate.train import CheckmateSession, FSDPSession

VOCAB, DIM, SEQ, LAYERS = 64, 32, 8, 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(nn.functional.gelu(self.up(self.norm(h))))


class LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB))
        self.head[1].weight = self.emb.weight  # tied embeddings: one parameter, two names

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h.reshape(-1, DIM))  # (tokens, VOCAB): not a view (FSDP2 warns)


def batch(dp: int, iteration: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A replica's tokens and targets: a function of (dp coordinate, iteration) only."""
    g = torch.Generator().manual_seed(dp * 7_919 + iteration)
    x = torch.randint(0, VOCAB, (size, SEQ), generator=g)
    return x, (x * 3 + 1) % VOCAB


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--out", help="every rank saves its final state (local shards) to OUT.RANK")
    ap.add_argument("--fsdp", action="store_true", help="FSDP2 over dp beside TP")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    dp = mesh.get_local_rank("dp")
    torch.manual_seed(0)  # every rank builds the same model, then keeps its shards
    model = LM()
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(),
                                               "down": RowwiseParallel()})
    session = CheckmateSession
    if args.fsdp:
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        session = FSDPSession
    optimizer = AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / 5))
    sess = session.from_env(model, optimizer, scheduler, max_grad_norm=1.0, mesh=mesh)
    for it in range(sess.done_iteration + 1, args.steps + 1):
        sess.begin(it)
        x, y = batch(dp, it, args.batch)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(sess.model(x), y.reshape(-1))
        loss.backward()
        sess.step()
        sess.report(loss)
    sess.finish()
    if args.out:
        def local(v):  # noqa: ANN001, ANN202 -- a DTensor's shard, anything else as it is
            return v.to_local().clone() if hasattr(v, "to_local") else v

        opt = optimizer.state_dict()
        opt["state"] = {i: {k: local(v) for k, v in st.items()}
                        for i, st in opt["state"].items()}
        torch.save({"model": {k: local(v) for k, v in model.state_dict().items()},
                    "optimizer": opt, "scheduler": scheduler.state_dict()},
                   f"{args.out}.{dist.get_rank()}")
    sess.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
