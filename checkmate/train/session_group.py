"""Which data-parallel group a session trains in, and where the group's ranks are.

One session replicates one data-parallel group: its ranks allreduce the gradient over one
ckm ring and share one set of shadows. Everything the session needs to know about that group
is found here, once per attempt: the process group Checkmate's own messages go over (gloo,
beside the job's own backend), every rank's ring address, and every rank's node (for the
ring schedule).
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

from checkmate.errors import CheckmateError
from checkmate.train.layout import JobLayout


def join_group(job: Any) -> Any:
    """The process group for Checkmate's own messages (barriers, the run nonce, buffers) of
    a worker of ``job`` (checkmate.train.env.read): the default group, initialized here if
    the script has not done it, when it is gloo (None); otherwise a gloo group beside it."""
    from checkmate.train import env as envmod

    if not dist.is_initialized():
        # On GPUs (checkmate launch binds each worker to its GPU) the job's collectives
        # run on NCCL: CUDA tensors on NCCL, CPU ones on gloo, in the group the script
        # sees; Checkmate's own messages still get a gloo group of their own (below).
        dist.init_process_group(envmod.backend_for(job.device), rank=job.rank,
                                world_size=job.world)
    if dist.get_backend() != "gloo":
        return dist.new_group(backend="gloo")
    return None


def ring_addrs(job: Any, group: Any) -> list[tuple[str, int]]:
    """Every rank's ring address in rank order: the launcher's list, or (several nodes)
    exchanged among the ranks of ``group``."""
    return job.trainers or exchange_addrs(job.local_trainer, job.world, group)


def exchange_addrs(mine: tuple[str, int] | None, world: int, group: Any
                   ) -> list[tuple[str, int]]:
    """Every rank's ring address in rank order, from each rank's own (multi-node launches:
    the rendezvous assigns the ranks, so the workers tell each other where they are)."""
    if mine is None:
        raise CheckmateError("no ring address for this worker: the launcher sets "
                             "CHECKMATE_TRAINERS or CHECKMATE_LOCAL_TRAINERS")
    out: list[Any] = [None] * world
    dist.all_gather_object(out, [mine[0], mine[1]], group=group)
    addrs = [(str(a[0]), int(a[1])) for a in out]
    if len(set(addrs)) != world:
        dup = sorted({a for a in addrs if addrs.count(a) > 1})
        raise CheckmateError(f"two ranks of the job share the ring address {dup[0][0]}:"
                             f"{dup[0][1]}: give each node its own --worker-ip")
    return addrs


def gather_nodes(layout: JobLayout, group: Any) -> list[int] | None:
    """Every rank's node, the same on every rank: the layout's ``node_of``, else what each
    rank reads from torch elastic's environment (GROUP_RANK), gathered over ``group``. In
    switch mode, ranks that share an address must share a node (ring_schedule.check_hosts).
    None: no rank knows its node (every rank is then a node of its own)."""
    from checkmate.train import ring_schedule

    nodes = layout.node_of
    if nodes is None:
        keys: list[Any] = [None] * layout.world
        dist.all_gather_object(keys, ring_schedule.node_from_env(os.environ), group=group)
        nodes = ring_schedule.node_of_from_keys(keys)
    if layout.mode == "switch":
        ring_schedule.check_hosts(ring_schedule.RingSchedule.build(layout.world, nodes),
                                  [ip for ip, _ in layout.trainers])
    return nodes
