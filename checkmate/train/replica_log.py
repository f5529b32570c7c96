"""What a trainer retains of the replica stream, so shadows can repair holes from it.

Every REPLICATE piece this trainer sent (and, on rank 0, every control message) is kept for
the last ``keep`` iterations. The ring already builds each piece as an immutable ``bytes``
object; the log keeps a reference to it, so retaining costs no copy and no time on the ring's
path, only memory: about ``keep * 4 * total / world`` bytes of gradient per trainer (each
trainer sends 1/world of the reduced gradient as REPLICATE pieces) plus ``keep`` control
messages on rank 0. Older iterations are dropped as new ones arrive; a request for one of
them gets a "gone" answer (checkmate.repair), after which the shadow must be re-seeded.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

#: Iterations retained by default (``JobLayout.repair_keep``).
DEFAULT_KEEP = 8


@dataclass
class _Iteration:
    pieces: dict[int, list[tuple[int, int, int, bytes]]] = field(default_factory=dict)
    control: bytes | None = None
    nbytes: int = 0


class ReplicaLog:
    """Pieces by iteration and partition; safe to fill from one thread and read from others."""

    def __init__(self, keep: int = DEFAULT_KEEP) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.keep = keep
        self._its: OrderedDict[int, _Iteration] = OrderedDict()
        self._lock = threading.Lock()
        self.nbytes = 0  # bytes currently retained
        self.newest = 0

    def _slot(self, it: int) -> _Iteration:
        e = self._its.get(it)
        if e is None:
            e = self._its[it] = _Iteration()
            if it > self.newest:
                self.newest = it
            while self._its and next(iter(self._its)) <= self.newest - self.keep:
                _, old = self._its.popitem(last=False)
                self.nbytes -= old.nbytes
        return e

    def add_piece(self, it: int, bucket: int, offset: int, partition: int,
                  payload: bytes) -> None:
        """Retain one REPLICATE piece (float32 elements starting at flat ``offset``)."""
        with self._lock:
            if it <= self.newest - self.keep:
                return
            e = self._slot(it)
            e.pieces.setdefault(partition, []).append((offset, len(payload) // 4, bucket,
                                                       payload))
            e.nbytes += len(payload)
            self.nbytes += len(payload)

    def add_control(self, it: int, data: bytes) -> None:
        """Retain the control message of ``it`` (rank 0)."""
        with self._lock:
            if it <= self.newest - self.keep:
                return
            e = self._slot(it)
            e.nbytes += len(data)
            self.nbytes += len(data)
            e.control = data

    def holds(self, it: int) -> bool:
        """True while ``it`` is retained (it may still hold nothing for a given range)."""
        with self._lock:
            return it in self._its

    def oldest(self) -> int | None:
        with self._lock:
            return next(iter(self._its), None)

    def pieces(self, it: int, partition: int, ranges: list[tuple[int, int]]
               ) -> list[tuple[int, int, int, bytes]] | None:
        """Retained pieces of ``partition`` overlapping any of ``ranges``, cut to them.

        Returns ``(offset, count, bucket, payload)`` tuples, or None when ``it`` is no
        longer retained.
        """
        with self._lock:
            e = self._its.get(it)
            if e is None:
                return None
            have = list(e.pieces.get(partition, ()))
        out = []
        for off, n, bucket, payload in have:
            end = off + n
            for a, b in ranges:
                lo, hi = max(a, off), min(b, end)
                if lo < hi:
                    out.append((lo, hi - lo, bucket, payload[4 * (lo - off):4 * (hi - off)]))
        return out

    def control(self, it: int) -> bytes | None:
        """The control message of ``it`` if retained (rank 0), else None."""
        with self._lock:
            e = self._its.get(it)
            return None if e is None else e.control
