"""Tensor parallel beside data parallel: what one TP rank's session replicates.

Under ``parallelize_module`` a TP rank's parameters are DTensors on the job's ``tp``
submesh: its local shard of a ColwiseParallel or RowwiseParallel weight, or a whole copy
(``Replicate``: a RowwiseParallel bias; plain tensors such as norms and embeddings are
copies too). Data parallel reduces each TP rank's *local* tensors over its own
data-parallel ranks, so a mesh session on a TP rank (one data-parallel group per TP
coordinate, checkmate.train.session_group) replicates local tensors: its spec has their
shapes, its ring reduces them, its shadows step them, and a restore wraps them back into
DTensors placed as the parameters are. The whole model's gradient norm counts every shard
once and every copy once (on the first TP rank only), as torchtitan's clip does.
"""

from __future__ import annotations

from typing import Any

import torch

from checkmate.errors import CheckmateError

try:
    from torch.distributed.tensor import DTensor, Replicate
except ImportError:  # a torch built without distributed: no DTensors
    DTensor = Replicate = None


def is_dtensor(t: Any) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def local(t: Any) -> Any:
    """The rank's own tensor of ``t`` (a DTensor's local shard, which shares its memory);
    anything else as it is."""
    if is_dtensor(t):
        with torch.no_grad():
            return t.to_local()
    return t


def uses_tensor_parallel(model: torch.nn.Module, place: Any) -> bool:
    """Whether ``model`` holds DTensor parameters, all on non-data-parallel dimensions of the
    session's mesh (``place``: checkmate.train.session_group.GroupPlace); one line for a
    DTensor on a data-parallel dimension (FSDP2: FSDPSession) or with no mesh given."""
    found = False
    for name, p in model.named_parameters():
        if not is_dtensor(p):
            continue
        dims = tuple(p.device_mesh.mesh_dim_names or ())
        if place is None or not dims or not set(dims) <= set(place.other_dims):
            raise CheckmateError(
                f"parameter {name} is a DTensor sharded as {tuple(p.placements)} over mesh "
                f"dimensions {dims or '(unnamed)'}: this session replicates whole or "
                "tensor-parallel parameters (DTensors on the mesh's tp dimension, passing the "
                "mesh to from_env); an FSDP2 model takes checkmate.train.FSDPSession")
        found = True
    return found


def local_state(sd: dict[str, Any]) -> dict[str, Any]:
    """A module state dict with every DTensor replaced by its local tensor."""
    return {k: local(v) for k, v in sd.items()}


def local_optim_state(osd: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict with every DTensor state replaced by its local tensor."""
    return {**osd, "state": {i: {k: local(v) for k, v in st.items()}
                             for i, st in osd.get("state", {}).items()}}


def like(param: Any, t: torch.Tensor) -> Any:
    """``t`` (a restored local tensor) placed as ``param``: a DTensor with its mesh and
    placements when the parameter is one, else ``t``."""
    if not is_dtensor(param):
        return t
    return DTensor.from_local(t.to(param.device), param.device_mesh, param.placements,
                              run_check=False, shape=param.shape, stride=param.stride())


def counts_in_norm(p: Any, first_tp_rank: bool) -> bool:
    """Whether ``p``'s local gradient counts in this rank's share of the global norm: a
    shard always; a copy (plain, or a Replicate DTensor) only on the first TP rank."""
    if is_dtensor(p) and not all(isinstance(pl, Replicate) for pl in p.placements):
        return True
    return first_tp_rank

