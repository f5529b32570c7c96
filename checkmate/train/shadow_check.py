"""The trainers' side of the shadows' state check (checkmate.protocol.state_digest).

Every ``verify_every`` iterations, after the step: each rank hashes its share of every
partition of what the shadows hold (``_state_pieces``: the slots it would seed them with,
as the tensors it holds, hashed where they are, a GPU's on the GPU), the ranks all-gather
the digests over the session's group, and rank 0 sends them in that iteration's control
message. Each shadow compares them with what it committed for the iteration; a difference
is its one line and a live re-seed from the trainers (checkmate.shadow.state).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from checkmate.protocol.state_digest import StreamDigest, digest_key
from checkmate.spec.partition import partition_bounds, share_bounds


def share_digests(sess: Any) -> list[str]:
    """This rank's digest of its share of each partition, in partition order."""
    spec, lay = sess.spec, sess.layout
    pieces = sess._state_pieces()
    key = digest_key(getattr(sess.sender, "control_key", None))
    out = []
    for start, end in partition_bounds(spec.total, spec.partitions):
        a, b = share_bounds(start, end, lay.rank, lay.world)
        d = StreamDigest(key, 2 * (b - a) * len(spec.slots))
        for si, s in enumerate(spec.slots):
            for offset, t in pieces[s]:
                lo, hi = max(a, offset), min(b, offset + t.numel())
                if lo < hi:
                    # float32, as the shadows store it; 2 words an element
                    d.add(2 * (si * (b - a) + lo - a),
                          t.detach().reshape(-1)[lo - offset:hi - offset].float())
        out.append(d.hexdigest())
    return out


def gathered(sess: Any) -> list[list[str]]:
    """Every rank's ``share_digests``, in rank order (a collective of the session's group)."""
    every: list[Any] = [None] * sess.layout.world
    dist.all_gather_object(every, share_digests(sess), group=sess.group)
    return every
