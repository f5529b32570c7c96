"""Which flat ranges of the gradient a trainer sends, cut where the shadows need them cut.

With a user's own gradient path (stock DDP's buckets, FSDP2's shards) each rank sends the
shadows one share of the reduced gradient: a set of flat ranges of the model spec. A
datagram may not straddle a parameter (its memory is elsewhere) nor a partition (another
shadow owns the rest), so the ranges are cut at both; neighbouring cuts of one partition are
merged again when they are sent, so the datagrams are as large as a frame allows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

#: (element offset in the parameter, count, flat offset, partition) of one owned segment.
Segment = tuple[int, int, int, int]


def cut_segments(spec: Any, ranges: Iterable[tuple[int, int]]) -> dict[str, list[Segment]]:
    """Per parameter name, the segments of the flat ``ranges`` ([lo, hi) element offsets),
    cut at parameter and partition boundaries, in flat order."""
    ranges = list(ranges)
    cuts: list[tuple[int, int, int]] = []  # (lo, hi, partition)
    for part in range(spec.partitions):
        a, b = spec.bounds(part)
        for lo, hi in ranges:
            lo2, hi2 = max(a, lo), min(b, hi)
            if lo2 < hi2:
                cuts.append((lo2, hi2, part))
    out: dict[str, list[Segment]] = {}
    for p in spec.params:
        segs = []
        for lo, hi, part in cuts:
            a, b = max(lo, p.offset), min(hi, p.offset + p.numel)
            if a < b:
                segs.append((a - p.offset, b - a, a, part))
        out[p.name] = sorted(segs, key=lambda s: s[2])
    return out


def send_runs(runs: list[tuple[int, int, np.ndarray]], piece: int,
              send: Callable[[int, int, bytes], None]) -> tuple[int, int]:
    """Send float32 ``runs`` ``(flat offset, partition, values)`` as pieces of at most
    ``piece`` elements through ``send(offset, partition, payload)``, runs that touch in one
    partition merged first. Returns (pieces, bytes) sent."""
    runs = sorted(runs, key=lambda r: r[0])
    merged: list[tuple[int, int, list[np.ndarray]]] = []
    end = -1
    for off, part, a in runs:
        if merged and merged[-1][1] == part and end == off:
            merged[-1][2].append(a)
        else:
            merged.append((off, part, [a]))
        end = off + len(a)
    pieces = nbytes = 0
    for off, part, parts in merged:
        data = (np.concatenate(parts) if len(parts) > 1 else parts[0]).tobytes()
        for a in range(0, len(data), 4 * piece):
            payload = data[a:a + 4 * piece]
            send(off + a // 4, part, payload)
            pieces += 1
            nbytes += len(payload)
    return pieces, nbytes
