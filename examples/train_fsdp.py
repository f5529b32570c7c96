"""The same job sharded with FSDP2 (``fully_shard``); run it with `checkmate launch`:

    checkmate launch --nproc-per-node 4 --shadows 2 --max-restarts 1 examples/train_fsdp.py

What differs from examples/train_ddp.py: ``fully_shard`` on each block and on the root
instead of the DDP wrapper, and ``FSDPSession``. Each rank sends its shard of the reduced
gradient to the shadows at ``sess.step()`` (docs/architecture.md, "FSDP2").

``--hsdp R``: HSDP instead, on a 2-D DeviceMesh ``(dp_replicate, dp_shard)`` of R replicas
of world/R shards each (``fully_shard(..., mesh=mesh)``); the mesh goes to the session too.
"""

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from checkmate.optim import AdamW  # torch.optim.AdamW's arithmetic, repeated by the shadows
from checkmate.train import FSDPSession


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--out", help="rank 0 saves the final (whole) state here (torch.save)")
    ap.add_argument("--hsdp", type=int, default=0, metavar="R",
                    help="HSDP with R replicas (dp_replicate x dp_shard) instead of FSDP2")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)  # every rank builds the same initial model
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 3))
    dist.init_process_group("gloo")  # "nccl" on GPUs; Checkmate adds a gloo group beside it
    mesh = None
    if args.hsdp:
        mesh = init_device_mesh("cpu", (args.hsdp, dist.get_world_size() // args.hsdp),
                                mesh_dim_names=("dp_replicate", "dp_shard"))
    for block in (model[0], model[3], model[8]):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)  # every parameter is now a DTensor sharded on dim 0
    optimizer = AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / 10))
    sess = FSDPSession.from_env(model, optimizer, scheduler, max_grad_norm=1.0, mesh=mesh)
    for it in range(sess.done_iteration + 1, args.steps + 1):
        sess.begin(it)  # reseeds torch's RNG per (rank, iteration): batches are reproducible
        x = torch.randn(args.batch, 3, 8, 8)
        y = x.mean(dim=(2, 3)).argmax(dim=1)  # a learnable label: the brightest channel
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()  # FSDP2 reduce-scatters: each rank keeps its shard of the gradient
        sess.step()  # send the shard, clip, optimizer and scheduler step, control message
        sess.report(loss)
    sess.finish()
    if args.out:  # gathering whole tensors is a collective: every rank takes part
        def full(v: object) -> object:
            return v.full_tensor() if isinstance(v, DTensor) else v
        osd = optimizer.state_dict()
        state = {"model": {k: full(v) for k, v in model.state_dict().items()},
                 "optimizer": {"state": {i: {k: full(v) for k, v in st.items()}
                                         for i, st in sorted(osd["state"].items())},
                               "param_groups": osd["param_groups"]},
                 "scheduler": scheduler.state_dict()}
        if sess.layout.rank == 0:
            torch.save(state, args.out)
    sess.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
