"""Stock DDP reduces in the same buckets after a restart as the run it resumes.

Why: a gradient allreduce sums each element in an order that depends on where the element
lies in the buffer being reduced (gloo's and NCCL's ring algorithms cut the buffer into one
piece per rank, and each piece's sum starts at a different rank). With two ranks the order
does not matter (a + b == b + a); with three or more it does, in the last bits. Stock
``DistributedDataParallel`` reduces its first iteration in one bucket of every parameter
(unless ``find_unused_parameters``) and then rebuilds its buckets in autograd's ready order,
so a DDP built after a restart would reduce the first iteration it runs in that one bucket,
where the run it resumes reduced it in the rebuilt ones: every tensor then differs by about
1e-7, and the runs drift apart.

So the DDP hook records the bucket layout each iteration's successor reduces in (each
bucket as the spec indices of its parameters, in buffer order) and sends it with the
iteration's control message, which the shadows keep with the checkpoint. A restored job's
hook reduces any bucket that holds several recorded buckets as those buckets, one allreduce
each, with every element at the offset it had: the sums are the resumed run's, bit for bit.
Once the new DDP has rebuilt its buckets (in the same ready order), they are the recorded
ones and the hook reduces them as they are. ``DDPSession`` makes DDP rebuild at the end of its
first step (``reducer._rebuild_buckets()``, what DDP's next forward would call; it
broadcasts rank 0's layout, so every rank calls it at the same point) so that the first
control message already carries the rebuilt layout.

Torch is not patched: only the reducer's own ``_rebuild_buckets`` and
``_get_zeros_like_grad_buckets`` (which DDP's join hook uses) are called, both in torch 2.11.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

Layout = list[list[int]]  # buckets in index order, each the spec indices of its parameters


def current_layout(ddp: Any, index_of: dict[int, int]) -> Layout:
    """DDP's buckets as they are now (``index_of``: id(parameter) -> spec index)."""
    buckets = ddp.reducer._get_zeros_like_grad_buckets()
    return [[index_of[id(p)] for p in b.parameters()]
            for b in sorted(buckets, key=lambda b: b.index())]


def parse_layout(value: Any, nparams: int) -> Layout | None:
    """A layout from a control message's extra; None if absent or not a partition of the
    parameters (an older run's message, or a damaged one: the caller says so)."""
    if not isinstance(value, list) or not all(isinstance(b, list) for b in value):
        return None
    flat = [i for b in value for i in b]
    if sorted(flat) != list(range(nparams)) or not all(isinstance(i, int) for i in flat):
        return None
    return [list(b) for b in value]


def fits(current: Layout, recorded: Layout) -> str | None:
    """None when each current bucket is a union of whole recorded buckets (the hook can
    reduce it as them); else the first bucket that is not, in words."""
    home = {i: b for b, bucket in enumerate(current) for i in bucket}
    for r, bucket in enumerate(recorded):
        homes = {home[i] for i in bucket}
        if len(homes) != 1:
            return (f"the resumed run's bucket {r} spans this DDP's buckets "
                    f"{sorted(homes)[:4]}")
    return None


class BucketPlan:
    """The recorded layout a restored hook reduces in until DDP's own buckets match it."""

    def __init__(self, recorded: Layout) -> None:
        self.recorded = recorded
        self._as_is = {tuple(b) for b in recorded}
        self._bucket_of = {i: r for r, b in enumerate(recorded) for i in b}

    def pieces(self, idx: Sequence[int]) -> list[list[int]] | None:
        """The recorded buckets inside a DDP bucket holding parameters ``idx`` (in recorded
        order); None when the bucket is a recorded one as it is (reduce it whole)."""
        if tuple(idx) in self._as_is:
            return None
        inside = sorted({self._bucket_of[i] for i in idx})
        if sum(len(self.recorded[r]) for r in inside) != len(idx):
            raise ValueError("a DDP bucket holds part of a recorded bucket")
        return [self.recorded[r] for r in inside]


def reduce_as(buf: torch.Tensor, idx: Sequence[int], numels: Sequence[int],
              pieces: list[list[int]], group: Any) -> torch.futures.Future:
    """Allreduce (sum) ``buf`` -- a DDP bucket of parameters ``idx`` with ``numels``
    elements each, in that order -- as the buckets ``pieces``: each gathered contiguous in
    its recorded order, reduced on its own and copied back. The future's value is ``buf``."""
    where: dict[int, tuple[int, int]] = {}
    off = 0
    for i, n in zip(idx, numels, strict=True):
        where[i] = (off, n)
        off += n
    parts = []
    for piece in pieces:
        t = torch.cat([buf[where[i][0]:where[i][0] + where[i][1]] for i in piece])
        parts.append((piece, t, dist.all_reduce(t, group=group, async_op=True).get_future()))

    def back(_f: torch.futures.Future) -> torch.Tensor:
        for piece, t, fut in parts:
            fut.wait()
            o = 0
            for i in piece:
                a, n = where[i]
                buf[a:a + n].copy_(t[o:o + n])
                o += n
        return buf

    return torch.futures.collect_all([f for _, _, f in parts]).then(back)
