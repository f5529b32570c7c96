"""What a trainer retains of the replica stream, so shadows can repair holes from it.

Every REPLICATE piece this trainer sent (and, on rank 0, every control message) is kept for
the last ``keep`` iterations. The ring already builds each piece as an immutable ``bytes``
object; the log keeps a reference to it, so retaining costs no copy, one list append per
piece on the ring's thread (``seconds``) and memory: about ``keep * 4 * total / world``
bytes of gradient per trainer (each trainer sends 1/world of the reduced gradient as
REPLICATE pieces) plus ``keep`` control messages on rank 0. Older iterations are dropped
as new ones arrive; a request for one of them gets a "gone" answer (checkmate.protocol.repair),
after which the shadow must be re-seeded.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

#: Iterations retained by default (``JobLayout.repair_keep``).
DEFAULT_KEEP = 8


#: One in this many ``add_piece`` calls is timed; ``seconds`` scales the sample up (timing
#: every call would cost as much as the call).
_SAMPLE = 32


@dataclass
class _Iteration:
    #: (partition, offset, bucket, payload) in the order sent.
    pieces: list[tuple[int, int, int, bytes]] = field(default_factory=list)
    control: bytes | None = None


class ReplicaLog:
    """Pieces by iteration; filled by one thread at a time, read by others.

    ``add_piece`` runs on the ring's thread for every piece, so its common case takes no
    lock: it appends to the current iteration's list, found through one attribute read (a
    (iteration, list) pair, so a reader never sees one without the other). Only the first
    piece of an iteration takes the lock, to open its slot and drop iterations past the
    window. Readers copy a list before walking it.
    """

    def __init__(self, keep: int = DEFAULT_KEEP) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.keep = keep
        self._its: OrderedDict[int, _Iteration] = OrderedDict()
        self._lock = threading.Lock()
        self.newest = 0
        self._current: tuple[int, list] = (-1, [])
        #: Pieces retained so far (written by the ring's thread only).
        self.added = 0
        self._calls = 0
        self._sampled = 0.0

    @property
    def seconds(self) -> float:
        """Seconds the ring's thread spent retaining pieces (estimated from a sample): the
        cost of repair on a loss-free job."""
        return self._sampled * _SAMPLE

    @property
    def nbytes(self) -> int:
        """Bytes currently retained."""
        with self._lock:
            its = list(self._its.values())
        return sum(sum(len(p[3]) for p in list(e.pieces)) + len(e.control or b"")
                   for e in its)

    def _slot(self, it: int) -> _Iteration:
        e = self._its.get(it)
        if e is None:
            e = self._its[it] = _Iteration()
            if it > self.newest:
                self.newest = it
            while self._its and next(iter(self._its)) <= self.newest - self.keep:
                self._its.popitem(last=False)
        return e

    def add_piece(self, it: int, bucket: int, offset: int, partition: int,
                  payload: bytes) -> None:
        """Retain one REPLICATE piece (float32 elements starting at flat ``offset``)."""
        self._calls += 1
        if self._calls % _SAMPLE:
            self._add(it, bucket, offset, partition, payload)
            return
        t0 = time.perf_counter()
        self._add(it, bucket, offset, partition, payload)
        self._sampled += time.perf_counter() - t0

    def _add(self, it: int, bucket: int, offset: int, partition: int,
             payload: bytes) -> None:
        cur = self._current
        if cur[0] != it:
            with self._lock:
                if it <= self.newest - self.keep:
                    return
                cur = self._current = (it, self._slot(it).pieces)
        cur[1].append((partition, offset, bucket, payload))
        self.added += 1

    def add_control(self, it: int, data: bytes) -> None:
        """Retain the control message of ``it`` (rank 0)."""
        with self._lock:
            if it <= self.newest - self.keep:
                return
            self._slot(it).control = data

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
            have = list(e.pieces)
        out = []
        for part, off, bucket, payload in have:
            if part != partition:
                continue
            end = off + len(payload) // 4
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
