"""Sharded parameters (FSDP2 ``fully_shard``, tensor parallel) outside FSDPSession: refused.

Under FSDP2 every parameter is a ``DTensor`` sharded on dim 0 and each rank's optimizer
steps only its shard, so neither Checkmate's ring (CheckmateDDP) nor the DDP comm hook
(DDPSession) sees the gradient the optimizer uses. A CheckmateSession or DDPSession over
such a model would be wrong mid-run, so it is refused up front in one line that names
``checkmate.train.FSDPSession``, which replicates the shards (checkmate.train.fsdp).
"""

from __future__ import annotations

from torch import nn

from checkmate.errors import CheckmateError


def refuse_sharded(model: nn.Module) -> None:
    """CheckmateError if any parameter of ``model`` is a DTensor (FSDP2, tensor parallel)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without DTensor cannot shard this way
        return
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            raise CheckmateError(
                f"parameter {name} is a DTensor sharded as {tuple(p.placements)} (FSDP2 "
                "fully_shard or tensor parallel): this session replicates whole parameters; "
                "an FSDP2 model takes checkmate.train.FSDPSession")
