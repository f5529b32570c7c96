"""The trainers' side of the shadows' state check (checkmate.protocol.state_digest).

Every ``verify_every`` iterations, after the step: each rank hashes its share of every
partition of what the shadows hold (``_seed_flat``: the flat slots it would seed them
with), the ranks all-gather the digests over the session's group, and rank 0 sends them in
that iteration's control message. Each shadow compares them with what it committed for the
iteration; a difference is its one line and a live re-seed from the trainers
(checkmate.shadow.state).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from checkmate.protocol.state_digest import digest, digest_key
from checkmate.spec.partition import partition_bounds, share_bounds


def share_digests(sess: Any) -> list[str]:
    """This rank's digest of its share of each partition, in partition order."""
    spec, lay = sess.spec, sess.layout
    flat = sess._seed_flat()
    key = digest_key(getattr(sess.sender, "control_key", None))
    out = []
    for start, end in partition_bounds(spec.total, spec.partitions):
        a, b = share_bounds(start, end, lay.rank, lay.world)
        out.append(digest(key, [flat[s][a:b] for s in spec.slots]))
    return out


def gathered(sess: Any) -> list[list[str]]:
    """Every rank's ``share_digests``, in rank order (a collective of the session's group)."""
    every: list[Any] = [None] * sess.layout.world
    dist.all_gather_object(every, share_digests(sess), group=sess.group)
    return every
