"""Ring allreduce over the ckm UDP transport, run by one communication thread.

Each rank sends only to its right neighbour (rank + 1) and receives only from its left one,
so the ring needs one reliable, ordered datagram stream per direction:

- every data datagram carries a per-sender ``seq``; the receiver keeps out-of-order arrivals
  and processes strictly in ``seq`` order, so each chunk's reduce-scatter arrival is always
  processed before its all-gather arrival;
- the receiver answers with ACK datagrams (``seq`` = next sequence number it still needs)
  whose payload lists the gaps it has seen (flag NACK); the sender resends those, and resends
  the oldest unacknowledged datagrams after ``rto`` without an acknowledgement;
- a payload whose CRC32C does not match is dropped and counted, which turns corruption into
  loss.

A bucket of ``n`` elements is cut into ``world`` segments, and each segment into chunks of
at most ``chunk`` elements (64 KB datagrams, IP-fragmented on a 9000-byte path) that never
cross a partition boundary of the flat parameter space. The ring's order and which hop of a
segment's all-gather path carries the copy are checkmate.train.ring_schedule's: segment
``g`` starts at ring position ``g``, collects one addend per hop and is complete at
position ``g - 1``; the first hop of its all-gather path that leaves a node (its
*tagger*'s send) goes in frame-sized pieces with REPLICATE set (the switch copies each
piece to the partition's shadow), and the tagger calls ``on_reduced`` per piece (host
replication sends the copy itself; ``switched`` True). Every other hop forwards whole
chunks untagged, so each element reaches its shadow once per iteration. Without a hop that
leaves a node (a job on one node) nothing is tagged and the completer calls ``on_reduced``
per piece with ``switched`` False: the trainer must send that copy itself.

The caller divides the bucket by the world size before submitting; the reduced bytes are then
exactly the gradient every rank uses and the shadows receive.
"""

from __future__ import annotations

import bisect
import os
import queue
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from checkmate.errors import CheckmateError
from checkmate.protocol import wire
from checkmate.protocol.datamac import split as _split
from checkmate.protocol.datamac import tag56 as _tag
from checkmate.spec.partition import partition_bounds
from checkmate.train.ring_link import (
    _FLOAT32,
    _HLEN,
    _NO_TAG,
    _REPLICATE,
    RingError,
    _ReliableLink,
)
from checkmate.train.ring_schedule import RingSchedule, segment_bounds
from checkmate.train.transport import LossyLink, receive_buffer

#: Largest float32 count in one REPLICATE datagram: one 9000-byte frame with IPv4, UDP and ckm
#: headers, so the switch sees (and copies) each replicated datagram whole.
MAX_CHUNK = wire.MAX_PAYLOAD_JUMBO // 4
#: Largest float32 count in a plain ring datagram (64 KB UDP). Larger than the MTU, so the
#: sending kernel fragments it and the switch forwards the fragments as plain traffic: seven
#: times fewer datagrams for Python to handle on the hops nobody copies.
BIG_CHUNK = 16_000
#: Called for each fully reduced piece once: (iteration, bucket, flat offset, partition, bytes,
#: switched). ``switched``: the piece went out tagged on a hop through the switch, which
#: copies it; False: no hop of its path crosses the switch (one node), so in switch mode the
#: trainer sends the copy itself.
ReducedCallback = Callable[[int, int, int, int, bytes, bool], None]


def replica_owners(buckets: list[tuple[int, int]], world: int, start: int, end: int,
                   node_of: Sequence[int] | None = None) -> list[tuple[int, int, int]]:
    """Which rank sends which flat ranges of [start, end) as REPLICATE pieces (and keeps
    them for repairs): the ring schedule's rule (checkmate.train.ring_schedule) for ranks
    on the nodes ``node_of`` names (None: every rank its own node). Returns sorted
    ``(lo, hi, rank)`` triples. A shadow uses them to ask the right trainer for a hole.
    """
    return RingSchedule.build(world, node_of).replica_owners(buckets, start, end)


@dataclass


class _Op:
    """One bucket allreduce in flight."""

    iteration: int
    bucket: int
    base: int  # flat offset of the bucket's first element
    tensor: torch.Tensor
    buf: np.ndarray
    future: torch.futures.Future
    chunks: list[tuple[int, int, int, int]]  # (segment, start, end, partition), bucket-local
    at: dict[int, int]  # flat offset -> chunk index
    starts: list[int]  # flat offset of each chunk, ascending
    received: np.ndarray  # arrivals per chunk
    pending: np.ndarray  # elements still missing of chunks that arrive in pieces
    left: int  # arrivals still expected before the result is final
    last_progress: float = field(default_factory=time.monotonic)


class RingAllreduce(_ReliableLink):
    """The ring of one trainer. ``submit`` may be called from any thread.

    Args:
        rank, world: this trainer's rank and the number of ranks.
        sock: its bound UDP socket (see ``transport.open_socket``).
        right, left: ``(ip, port)`` of the ranks the schedule puts after and before this
            one (``RingSchedule.right``/``left``; ranks ``rank + 1`` and ``rank - 1``
            when every rank is its own node or nodes hold contiguous ranks).
        job_id: stamped into every datagram; others are dropped and counted.
        nonce: stamped into ``token``; datagrams of an earlier incarnation of the job are
            dropped (every rank must use the same value).
        total, partitions: the flat parameter space and its partition count (chunks never
            straddle a partition boundary, so each REPLICATE datagram has one owner).
        chunk: elements per plain ring datagram (at most ``BIG_CHUNK``); the first
            all-gather hop of a chunk goes in REPLICATE pieces of ``MAX_CHUNK`` elements.
        on_reduced: host replication hook, see the module docstring.
        link: a ``LossyLink`` test double applied to outgoing datagrams (loopback tests).
        rto: seconds without acknowledgement before resending.
        tag: set REPLICATE on first all-gather hops (off: a plain allreduce, no copies).
        piece: largest REPLICATE piece in elements (smaller with FEC, so a parity payload
            with its piece table still fits one frame).
        stall_timeout: seconds without progress before an operation fails.
        node_of: each rank's node id (checkmate.train.ring_schedule); None: every rank its
            own node. Every rank must pass the same.
    """

    def __init__(
        self,
        rank: int,
        world: int,
        sock: socket.socket,
        right: tuple[str, int],
        left: tuple[str, int],
        job_id: int,
        nonce: int,
        total: int,
        partitions: int,
        chunk: int = BIG_CHUNK,
        on_reduced: ReducedCallback | None = None,
        link: LossyLink | None = None,
        rto: float = 0.05,
        stall_timeout: float = 60.0,
        window: int | None = None,
        tag: bool = True,
        piece: int = MAX_CHUNK,
        mac_key: tuple[int, int] | None = None,
        node_of: Sequence[int] | None = None,
    ) -> None:
        if not 0 <= rank < world:
            raise CheckmateError(f"rank {rank} outside 0..{world - 1}")
        if not 1 <= chunk <= BIG_CHUNK:
            raise CheckmateError(f"chunk must be 1..{BIG_CHUNK} elements, got {chunk}")
        self.rank, self.world = rank, world
        #: ring order and tagging rule (checkmate.train.ring_schedule)
        self.schedule = RingSchedule.build(world, node_of)
        self.pos = self.schedule.position(rank)
        self.sock, self.right, self.left = sock, right, left
        self.job_id, self.nonce = job_id, nonce & 0xFFFFFFFF
        self.total, self.partitions = total, partitions
        self._bounds = [(p, a, b) for p, (a, b) in enumerate(partition_bounds(total, partitions))
                        if a < b]
        self.chunk = chunk
        self.piece = min(chunk, MAX_CHUNK, max(1, piece))
        self.on_reduced = on_reduced
        self.tag = tag
        #: checkmate.protocol.datamac key: REPLICATE pieces carry the tag a shadow checks
        #: (the switch
        #: copies them as they are).
        self.mac_key = mac_key
        self.link = link
        self.rto = rto
        self.nack_gap = min(rto / 2, 0.005)
        self.stall_timeout = stall_timeout
        if window is None:
            per = (chunk * 4 + _HLEN + 1024) * 8
            window = max(16, min(512, receive_buffer(sock) // per))
        self.window = window
        self.stats = dict(sent=0, resent=0, received=0, duplicate=0, corrupt=0, foreign=0,
                          malformed=0, acks_sent=0, acks_received=0)
        # sender
        self._ready: deque[tuple[int, int, int, int, int, int, bytes, int,
                                 tuple[int, int, int, int]]] = deque()
        self._unacked: dict[int, list] = {}
        self._tx_next = 0
        self._tx_base = 0
        self._ack_progress = time.monotonic()  # last time an ACK moved _tx_base
        # receiver
        self._held: dict[int, tuple[tuple, memoryview]] = {}  # seq -> (header fields, payload)
        self._proc_next = 0
        self._recv_next = 0
        self._max_seen = -1
        self._ack_due = False
        self._last_ack = (-1, 0.0)
        # ops
        self._ops: dict[tuple[int, int], _Op] = {}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._closing = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"ckm-ring-{rank}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public API
    def submit(self, tensor: torch.Tensor, base: int, iteration: int, bucket: int
               ) -> torch.futures.Future:
        """Start the allreduce of ``tensor`` (1-D float32, reduced in place).

        ``base`` is the flat offset of ``tensor[0]``. The future completes on the
        communication thread with ``tensor`` once it holds the sum over all ranks.
        """
        if tensor.dtype != torch.float32 or tensor.dim() != 1 or not tensor.is_contiguous():
            raise CheckmateError("ring allreduce takes a contiguous 1-D float32 tensor")
        if base < 0 or base + tensor.numel() > self.total:
            raise CheckmateError(f"bucket [{base}, {base + tensor.numel()}) outside the flat "
                                 f"space of {self.total} elements")
        fut: torch.futures.Future = torch.futures.Future()
        if self._error is not None:
            fut.set_exception(RingError(f"ring is down: {self._error}"))
            return fut
        self._inbox.put((tensor, base, iteration, bucket, fut))
        os.write(self._wake_w, b"x")
        return fut

    def allreduce(self, tensor: torch.Tensor, base: int = 0, iteration: int = 0,
                  bucket: int = 0) -> torch.Tensor:
        """Blocking form of ``submit``."""
        return self.submit(tensor, base, iteration, bucket).wait()

    def close(self, timeout: float = 2.0) -> None:
        """Stop the thread after the peers acknowledged what is in flight (or ``timeout``)."""
        deadline = time.monotonic() + timeout
        while ((self._unacked or self._ready) and self._thread.is_alive()
               and time.monotonic() < deadline):
            time.sleep(0.005)
        self._closing = True
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=2.0)
        os.close(self._wake_r)
        os.close(self._wake_w)

    # ------------------------------------------------------------------ layout
    def _layout(self, base: int, n: int) -> list[tuple[int, int, int, int]]:
        chunks = []
        for g in range(self.world):
            s, e = segment_bounds(n, self.world, g)
            pos = s
            while pos < e:
                flat = base + pos
                for p, a, b in self._bounds:
                    if a <= flat < b:
                        part, limit = p, b - base
                        break
                else:
                    raise CheckmateError(f"offset {flat} outside every partition")
                stop = min(e, pos + self.chunk, limit)
                chunks.append((g, pos, stop, part))
                pos = stop
        return chunks

    # ------------------------------------------------------------------ comm thread
    def _run(self) -> None:
        poller = select.poll()
        poller.register(self.sock.fileno(), select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        try:
            while not self._closing:
                self._take_new_ops()
                self._process_in_order()
                self._send_ready()
                self._resend_timed_out()
                busy = bool(self._ready) and len(self._unacked) < self.window
                wait_ms = 0 if busy else (int(self.rto * 500) + 1 if self._unacked or self._ops
                                          else 200)
                for fd, _ in poller.poll(wait_ms):
                    if fd == self._wake_r:
                        try:
                            os.read(self._wake_r, 4096)
                        except BlockingIOError:
                            pass
                self._receive_batch()
                self._check_stall()
        except BaseException as e:  # noqa: BLE001 - surfaced through every pending future
            self._error = e
            for op in self._ops.values():
                if not op.future.done():
                    op.future.set_exception(RingError(f"ring thread failed: {e!r}"))
            raise

    def _take_new_ops(self) -> None:
        while True:
            try:
                tensor, base, iteration, bucket, fut = self._inbox.get_nowait()
            except queue.Empty:
                return
            n = tensor.numel()
            chunks = self._layout(base, n)
            at = {base + c[1]: i for i, c in enumerate(chunks)}
            r, w = self.pos, self.world
            # Each chunk has one final arrival: its all-gather hop, or, for the segment this
            # rank completes, its last reduce-scatter hop.
            op = _Op(iteration, bucket, base, tensor, tensor.numpy(), fut, chunks, at,
                     [base + c[1] for c in chunks], np.zeros(len(chunks), np.int8),
                     np.array([c[2] - c[1] for c in chunks], np.int64), len(chunks))
            key = (iteration, bucket)
            if key in self._ops:
                fut.set_exception(RingError(f"bucket {bucket} of iteration {iteration} "
                                            "submitted twice"))
                continue
            if w == 1:
                for i in range(len(chunks)):  # no hop at all: the trainer copies
                    self._copy_pieces(op, i, switched=False, send=False)
                fut.set_result(tensor)
                continue
            self._ops[key] = op
            for i, c in enumerate(chunks):
                if c[0] == r:
                    self._queue(op, i)

    def _queue(self, op: _Op, i: int) -> None:
        """Send chunk ``i`` on to the right neighbour whole and untagged."""
        g, s, e, p = op.chunks[i]
        payload = op.buf[s:e].tobytes()
        self._ready.append((0, op.iteration, op.bucket, op.base + s, e - s, p, payload,
                            wire.crc(payload), _NO_TAG))

    def _all_gather(self, op: _Op, i: int) -> None:
        """Send fully reduced chunk ``i`` on its all-gather path: tagged pieces where this
        position is its segment's tagger, else whole; the completer of a segment without a
        network hop also hands the copy to ``on_reduced`` (switched False)."""
        g = op.chunks[i][0]
        sched = self.schedule
        if sched.tagged_hop(self.pos, g):
            self._copy_pieces(op, i, switched=True, send=True)
            return
        if not sched.switched(g) and sched.completer(g) == self.pos:
            self._copy_pieces(op, i, switched=False, send=False)
        self._queue(op, i)

    def _copy_pieces(self, op: _Op, i: int, switched: bool, send: bool) -> None:
        """Chunk ``i`` in frame-sized pieces to ``on_reduced`` and, with ``send``, to the
        right neighbour with REPLICATE (the switch copies each piece whole; the same pieces
        untagged without Checkmate, so both send identical traffic)."""
        g, s, e, p = op.chunks[i]
        flags = _REPLICATE if self.tag else 0
        key = self.mac_key if self.tag else None
        for a in range(s, e, self.piece):
            b = min(e, a + self.piece)
            payload = op.buf[a:b].tobytes()
            if send:
                c = wire.crc(payload)
                mac = _NO_TAG if key is None else _split(int(_tag(
                    key[0], key[1], self.job_id, flags, op.iteration, op.base + a, b - a, p,
                    _FLOAT32, c)))
                self._ready.append((flags, op.iteration, op.bucket, op.base + a, b - a, p,
                                    payload, c, mac))
            self._reduced(op, op.base + a, p, payload, switched)

    def _reduced(self, op: _Op, offset: int, part: int, payload: bytes, switched: bool
                 ) -> None:
        if self.on_reduced is not None:
            self.on_reduced(op.iteration, op.bucket, offset, part, payload, switched)


    def _process_in_order(self) -> None:
        r, w = self.pos, self.world
        sched = self.schedule
        while self._proc_next in self._held:
            h, payload = self._held[self._proc_next]
            op = self._ops.get((h[6], h[10]))
            if op is None:
                return  # our own backward has not produced this bucket yet
            del self._held[self._proc_next]
            self._proc_next += 1
            off, cnt = h[7], h[8]
            i = op.at.get(off)
            if i is None:  # a REPLICATE piece inside a chunk
                i = bisect.bisect_right(op.starts, off) - 1
            g, s, e, _ = op.chunks[i] if i >= 0 else (-1, 0, 0, 0)
            lo = off - op.base
            whole = lo == s and lo + cnt == e
            # Segment g's reduce-scatter arrival comes first (none at its start, g == r);
            # its all-gather arrival comes in pieces from the segment's tagger.
            gather = g == r or (i >= 0 and op.received[i] > 0)
            pieces = gather and sched.tagged_hop((r - 1) % w, g)
            if i < 0 or lo + cnt > e or not (whole or pieces):
                raise RingError(f"datagram for unknown chunk at offset {off} of bucket "
                                f"{h[10]}: ranks disagree on the bucket layout")
            vals = np.frombuffer(payload, dtype="<f4")
            op.last_progress = time.monotonic()
            if not gather:  # reduce-scatter hop: add
                op.received[i] = 1
                op.buf[s:e] += vals
                if g != (r + 1) % w:
                    self._queue(op, i)  # pass on
                    continue
                self._all_gather(op, i)  # last hop: this chunk is now fully reduced here
            else:  # all-gather hop, possibly in pieces: take the result
                op.buf[lo:lo + cnt] = vals
                op.pending[i] -= cnt
                if op.pending[i] > 0:
                    continue
                if (r - g) % w < w - 2:  # pass on unless the next position completed it
                    self._all_gather(op, i)
            op.left -= 1
            if op.left == 0:
                del self._ops[(op.iteration, op.bucket)]
                op.future.set_result(op.tensor)
