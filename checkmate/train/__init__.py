"""Training side: ckm ring allreduce, DDP wrapper, replication, bootstrap, restore.

Entry points: :class:`CheckmateSession` (one per trainer process; see its module for the
training loop), :class:`DDPSession` (the same over a user's own torch
DistributedDataParallel, through its comm hook), :class:`FSDPSession` (over a user's own
FSDP2 ``fully_shard`` model), :class:`JobLayout` (addresses of a job),
:class:`CheckmateDDP` and :class:`RingAllreduce` (usable on their own),
:func:`restore_trainer` (one process) and :func:`restore_session` (every rank of a job;
``python -m checkmate.train.restore`` on the command line).

Names are resolved lazily so that ``python -m checkmate.train.restore`` (and the worker) do
not find their own module imported before they run.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "CheckmateDDP": "checkmate.train.ddp",
    "CheckmateSession": "checkmate.train.session",
    "DDPSession": "checkmate.train.ddp_hook",
    "FSDPSession": "checkmate.train.fsdp",
    "JobLayout": "checkmate.train.layout",
    "RingAllreduce": "checkmate.train.ring",
    "ShadowTarget": "checkmate.train.replicate",
    "restore_trainer": "checkmate.train.restore",
    "restore_session": "checkmate.train.restore",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'checkmate.train' has no attribute {name!r}")
