"""Which data-parallel group a session trains in, and where the group's ranks are.

One session replicates one data-parallel group: its ranks allreduce the gradient over one
ckm ring and share one set of shadows. Everything the session needs to know about that group
is found here, once per attempt: the process group Checkmate's own messages go over (gloo,
beside the job's own backend), every rank's ring address, and every rank's node (for the
ring schedule).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
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


def check_same_shadows(layout: JobLayout, group: Any) -> None:
    """Every rank was given the same shadows (each replica set's service addresses): nodes
    started with different --shadow, --colocate or --domain lists would each send their
    copies and control messages to shadows of their own, and no shadow would hold the
    trainers' state. A mismatch is the same one line on every rank."""
    mine = [[list(a) for a in addrs] for addrs in layout.tcp_sets] if layout.shadow_tcp \
        else []
    got: list[Any] = [None] * layout.world
    dist.all_gather_object(got, mine, group=group)
    for r, theirs in enumerate(got):
        if theirs == got[0]:
            continue
        first = next((f"replica {k} of partition {p}: {a[0]}:{a[1]} on rank 0, "
                      f"{b[0]}:{b[1]} on rank {r}"
                      for k, (xs, ys) in enumerate(zip(got[0], theirs, strict=False))
                      for p, (a, b) in enumerate(zip(xs, ys, strict=False)) if a != b),
                     f"{sum(map(len, got[0]))} shadows on rank 0, "
                     f"{sum(map(len, theirs))} on rank {r}")
        raise CheckmateError(f"rank {r} was given other shadows than rank 0 ({first}): "
                             "start every node's launcher with the same --shadow, "
                             "--colocate and --domain")


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


# ----------------------------------------------------------------------------- meshes
#: Mesh dimension names that are data parallel: the gradient is reduced over them, and
#: Checkmate replicates that reduction. Every other dimension (``pp``, ``tp``, ...) tells
#: groups apart: each of its coordinates trains another part of the model.
DP_DIMS = ("dp", "dp_replicate", "dp_shard")


@dataclass(frozen=True)
class GroupPlace:
    """Where one rank sits in a mesh, as Checkmate sees it (pure: no process groups).

    ``rows[g]`` are the global ranks of data-parallel group ``g`` in data-parallel order
    (the group's ring order and its layout ranks); ``cols[d]`` the ranks that share the
    data-parallel coordinate ``d``, one per group (over them the clip norm and the AMP skip
    flag are agreed)."""

    group: int
    groups: int
    dp_rank: int
    dp_world: int
    rows: list[list[int]]
    cols: list[list[int]]
    dp_dims: tuple[str, ...]
    other_dims: tuple[str, ...]


def place_in_mesh(ranks: Any, names: Sequence[str] | None, rank: int) -> GroupPlace:
    """``rank``'s group and data-parallel place in a mesh given as its nested list (or
    tensor) of global ranks and its dimension names. Groups are numbered row-major over the
    non-data-parallel dimensions in mesh order; a group's data-parallel ranks in ascending
    global rank, its process group's order (row-major over the data-parallel dimensions for
    meshes made by ``init_device_mesh``; HSDP: replicate-major, as torch flattens them)."""
    import numpy as np

    grid = np.asarray(ranks.tolist() if hasattr(ranks, "tolist") else ranks, dtype=np.int64)
    if not names or len(names) != grid.ndim:
        raise CheckmateError("the DeviceMesh needs a name for every dimension (e.g. "
                             "init_device_mesh('cpu', (2, 2), mesh_dim_names=('pp', 'dp'))) "
                             "so that Checkmate can tell its data-parallel ones")
    dp = [i for i, n in enumerate(names) if n in DP_DIMS]
    if not dp:
        raise CheckmateError(f"the DeviceMesh has no data-parallel dimension (one of "
                             f"{', '.join(DP_DIMS)}); its dimensions are {', '.join(names)}")
    other = [i for i in range(grid.ndim) if i not in dp]
    flat = grid.transpose(other + dp)
    groups = int(np.prod([grid.shape[i] for i in other])) if other else 1
    # In ascending global rank: a process group's own rank order (torch's new_group sorts).
    rows = [sorted(r) for r in flat.reshape(groups, -1).tolist()]
    where = [(g, d) for g, row in enumerate(rows) for d, r in enumerate(row) if r == rank]
    if len(where) != 1:
        raise CheckmateError(f"rank {rank} is not in the DeviceMesh once ({len(where)} times)")
    g, d = where[0]
    cols = [[row[c] for row in rows] for c in range(len(rows[0]))]
    return GroupPlace(g, groups, d, len(rows[0]), rows, cols,
                      tuple(names[i] for i in dp), tuple(names[i] for i in other))


@dataclass
class MeshGroup:
    """A session's data-parallel group in a mesh job, with the gloo process groups its
    messages go over: ``dp`` (the group's own ranks: barriers, the run nonce, buffers),
    ``cross`` (the ranks of its data-parallel coordinate in every group: the global clip
    norm, the AMP skip flag) and ``world`` (every rank: the one restore point)."""

    place: GroupPlace
    dp: Any
    cross: Any
    world: Any

    @property
    def index(self) -> int:
        return self.place.group

    @property
    def count(self) -> int:
        return self.place.groups

    #: Whether this rank is the first of its tensor-parallel group (tp coordinate 0, or no
    #: tp dimension): where the whole model's norm counts the parameters TP ranks copy.
    first_tp_rank: bool = True


def mesh_group(mesh: Any, rank: int) -> MeshGroup:
    """The MeshGroup of ``rank`` in a torch ``DeviceMesh``. Every rank of the job must call
    it, in the same order (it creates gloo process groups, a collective)."""
    try:
        ranks, names = mesh.mesh, mesh.mesh_dim_names
    except AttributeError:
        raise CheckmateError(f"mesh must be a torch DeviceMesh, got {type(mesh).__name__}"
                             ) from None
    place = place_in_mesh(ranks, names, rank)
    if len(place.rows) * place.dp_world != dist.get_world_size():
        raise CheckmateError(f"the DeviceMesh holds {len(place.rows) * place.dp_world} ranks, "
                             f"the job {dist.get_world_size()}: a mesh must span the job")
    dp, _ = dist.new_subgroups_by_enumeration(place.rows, backend="gloo")
    cross, _ = dist.new_subgroups_by_enumeration(place.cols, backend="gloo")
    world = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    mg = MeshGroup(place, dp, cross, world)
    names = list(mesh.mesh_dim_names)
    if "tp" in names:
        mg.first_tp_rank = mesh.get_local_rank("tp") == 0
    return mg


def group_layout(job: Any, mg: MeshGroup) -> dict[str, Any]:
    """The JobLayout fields of ``mg``'s group for a worker of ``job``
    (checkmate.train.env.read): its wire job id, its ranks' ring addresses, its set of the
    launcher's shadows (set g of CHECKMATE_GROUPS equal sets, numbered from partition 0)."""
    from checkmate.protocol.wire import group_job_id
    from checkmate.train.replicate import ShadowTarget

    place = mg.place
    if job.shadow_tcp and job.groups != place.groups:
        raise CheckmateError(
            f"the DeviceMesh has {place.groups} data-parallel groups "
            f"({' x '.join(place.other_dims)}), the launcher started shadows for "
            f"{job.groups}: launch with --pp/--tp giving {place.groups} groups")
    if job.replica_tcp:
        raise CheckmateError("several replicas per partition are not yet supported for a "
                             "mesh job's groups: one shadow set (CHECKMATE_REPLICAS=1)")
    n = len(job.shadow_tcp) // place.groups if job.shadow_tcp else 0
    mine = slice(place.group * n, (place.group + 1) * n)
    udp = job.shadows[mine]
    if job.trainers:
        trainers = [job.trainers[r] for r in place.rows[place.group]]
    else:
        trainers = exchange_addrs(job.local_trainer, place.dp_world, mg.dp)
    return {"job_id": group_job_id(job.job_id, place.group, place.groups),
            "rank": place.dp_rank, "world": place.dp_world, "trainers": trainers,
            "shadows": [ShadowTarget(p, t.ip, t.port) for p, t in enumerate(udp)],
            "shadow_tcp": job.shadow_tcp[mine]}
