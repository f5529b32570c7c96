"""Replica agreement: data-parallel ranks that hold the same state compare it (issue 35).

Why: under the own wrapper, stock DDP and every tensor-parallel group, each data-parallel
rank holds the whole (group's) model and optimizer state, and after every step these
copies are equal bit for bit. A rank whose copy differs was corrupted silently (a GPU or
memory that flipped a bit) and would go on training a different model, and poison the
others through its gradients. Every ``verify_every`` iterations each rank hashes its state
(checkmate.protocol.state_digest over the bytes of every parameter and optimizer state
tensor, in one fixed order, where the tensors are) and the ranks all-gather 8 bytes of it
over the session's gloo group; a rank that differs from the majority is named in one line
on every rank, and the job stops with it. Under ``checkmate launch`` the restart resumes
from the shadows at the newest iteration the ranks verified (the previous check, or where
the attempt started): from there on the corrupted copy may have fed the allreduce, and so
the shadows, its gradients.

Under HSDP the copies are the replicas of each shard: the ranks of one dp_shard coordinate
across dp_replicate (``columns``), each column compared on its own; plain FSDP2's ranks hold
different shards, so there is nothing to compare.

What it cannot catch: a corruption before the allreduce (a wrong gradient) reaches every
replica and every shadow alike, so they all agree.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.distributed as dist

from checkmate.errors import CheckmateError
from checkmate.protocol.state_digest import digest_pieces
from checkmate.train import failures


class ReplicaDivergence(CheckmateError):
    """The data-parallel copies of the state differ; the message names the ranks.
    ``stop``: the job is to end here, not restart (``--on-divergence stop``)."""

    stop = False


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach()


def state_digest(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """64 bits of the state digest of this rank's parameters and optimizer state tensors
    (each rank's local tensors), in the module's parameter order and each state's sorted
    slot names."""
    params = list(module.parameters())
    tensors = [_local(p) for p in params]
    for p in params:
        for _, t in sorted(optimizer.state.get(p, {}).items()):
            if torch.is_tensor(t):
                tensors.append(_local(t))
    return int.from_bytes(bytes.fromhex(digest_pieces(b"", tensors))[:8], "little",
                          signed=True)


def odd_ones(digests: list[int]) -> tuple[list[int], bool]:
    """(ranks whose digest differs from the majority's, whether there is a majority): with
    no digest held by more than half the ranks every rank is named."""
    common, n = Counter(digests).most_common(1)[0]
    if n * 2 <= len(digests):
        return list(range(len(digests))), False
    return [r for r, d in enumerate(digests) if d != common], True


def agree(module: torch.nn.Module, optimizer: torch.optim.Optimizer, group: Any,
          world: int, iteration: int, verified: int | None = None,
          columns: list[list[int]] | None = None, restore: bool = True) -> None:
    """Every rank of ``group``: compare this iteration's state digests within each of
    ``columns`` (the ranks that hold the same state; default: all); ReplicaDivergence, the
    same line on every rank, when a rank differs. ``restore``: after recording that the
    launcher's next attempt resumes at ``verified`` (the newest iteration the ranks agreed
    on); else the error says the job stops (``--on-divergence stop``)."""
    mine = torch.tensor([state_digest(module, optimizer)], dtype=torch.int64)
    every = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    digests = [int(t[0]) for t in every]
    cols = columns if columns is not None else [list(range(world))]
    bad: list[int] = []
    majority = True
    for col in cols:
        odd, held = odd_ones([digests[r] for r in col])
        bad += [col[i] for i in odd]
        majority = majority and held
    if not bad:
        return
    if restore:
        then = "stopping: a restart resumes from the shadows"
        if verified is not None:
            failures.record_rewind(verified)
            then = (f"{then} at iteration {verified}, the newest the ranks verified"
                    if verified else "stopping: a restart begins the job again, as no "
                    "iteration was verified")
    else:
        where = (f"iteration {verified}, the newest the ranks verified" if verified
                 else "the start")
        then = (f"the job stops (--on-divergence stop; with restore it would resume from "
                f"the shadows at {where})")
    error = _error(iteration, ", ".join(str(r) for r in sorted(bad)), world, len(bad),
                   len(cols) > 1, majority, then)
    error.stop = not restore
    raise error


def _error(iteration: int, who: str, world: int, bad: int, hsdp: bool, majority: bool,
           then: str) -> ReplicaDivergence:
    """The one line of a divergence: who differs, from whom, and what happens next."""
    if hsdp:  # each shard's replicas
        theirs = "their replicas' shards"
        return ReplicaDivergence(
            f"iteration {iteration}: the model and optimizer state shards of data-parallel "
            f"rank(s) {who} differ from {theirs if majority else 'each other'} "
            f"(HSDP: the ranks of one dp_shard coordinate hold the same shard; silent data "
            f"corruption, or a step that is not deterministic); {then}")
    if majority:
        return ReplicaDivergence(
            f"iteration {iteration}: the model and optimizer state of data-parallel rank(s) "
            f"{who} differ from the other {world - bad} ranks' (silent data corruption "
            f"on that rank, or a step that is not deterministic); {then}")
    return ReplicaDivergence(
        f"iteration {iteration}: the {world} data-parallel ranks' model and optimizer states "
        f"differ with no majority (silent data corruption, or a step that is not "
        f"deterministic); {then}")
