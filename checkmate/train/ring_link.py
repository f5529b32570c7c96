"""The ring's reliable link: one ordered datagram stream per direction over ckm UDP.

Every data datagram carries a per-sender seq; the receiver processes strictly in seq order,
answers with ACKs (the next seq it needs) listing the gaps it saw (NACK), and the sender
resends those and, after rto, the oldest unacknowledged ones. A payload whose CRC32C does
not match is dropped and counted, so corruption becomes loss. The schedule that decides
what to send is in ring.py."""

from __future__ import annotations

import struct
import time

from checkmate.errors import CheckmateError
from checkmate.protocol import wire

# Plain ints: IntFlag arithmetic costs microseconds per datagram on the hot path.
_REPLICATE, _ACK, _NACK = (int(f) for f in (wire.Flags.REPLICATE, wire.Flags.ACK,
                                             wire.Flags.NACK))
_PACK = wire.STRUCT.pack
_UNPACK = wire.STRUCT.unpack_from
_FLOAT32, _BYTES = int(wire.DType.FLOAT32), int(wire.DType.BYTES)
_NO_TAG = (0, 0, 0, 0)  # datagrams no shadow takes carry no tag
_SIZES = {int(k): v for k, v in wire.DTYPE_SIZE.items()}
_HLEN = wire.HEADER_LEN
_NACK_MAX = 256  # gaps listed in one ACK datagram


class RingError(CheckmateError):
    """The ring stalled (a peer is gone) or was closed with work in flight."""


class _ReliableLink:
    """Part of :class:`RingAllreduce` (ring.py):
    The reliable ordered link under the ring schedule."""

    def _transmit(self, parts: tuple[bytes, ...], addr: tuple[str, int]) -> bool:
        """Send one datagram given as (header, payload) parts, gathered by the kernel."""
        if self.link is not None:
            d = self.link.apply(b"".join(parts), _HLEN)
            if d is None:
                return True
            parts = (d,)
        try:
            self.sock.sendmsg(parts, (), 0, addr)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as e:
            # ECONNREFUSED and the like from ICMP: the peer is not up yet; resend later.
            if e.errno in (111, 113, 101):
                return True
            raise
        return True

    def _send_ready(self) -> None:
        now = time.monotonic()
        while self._ready and len(self._unacked) < self.window:
            flags, it, bucket, off, cnt, part, payload, c, mac = self._ready[0]
            seq = self._tx_next & 0xFFFFFFFF
            hdr = _PACK(wire.MAGIC, wire.VERSION, flags, self.job_id, 0, self.nonce, it, off,
                        cnt, seq, bucket, part, _FLOAT32, *mac, c)
            dgram = (hdr, payload)
            if not self._transmit(dgram, self.right):
                return
            self._ready.popleft()
            self._unacked[self._tx_next] = [dgram, now]
            self._tx_next += 1
            self.stats["sent"] += 1

    def _resend_timed_out(self) -> None:
        if not self._unacked:
            return
        now = time.monotonic()
        first = self._unacked.get(self._tx_base)
        if first is None or now - max(first[1], self._ack_progress) < self.rto:
            return
        for n, seq in enumerate(range(self._tx_base, self._tx_next)):
            ent = self._unacked.get(seq)
            if ent is None or n >= 64:
                break
            if now - ent[1] >= self.rto:
                if not self._transmit(ent[0], self.right):
                    return
                ent[1] = now
                self.stats["resent"] += 1

    def _receive_batch(self) -> None:
        got = 0
        while got < 256:
            try:
                data = self.sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                break
            except ConnectionRefusedError:
                continue
            got += 1
            self._on_datagram(data)
            if got % 32 == 0:
                self._maybe_ack()
        if got:
            self._process_in_order()
        self._maybe_ack()

    def _on_datagram(self, data: bytes) -> None:
        if len(data) < _HLEN:
            self.stats["malformed"] += 1
            return
        h = _UNPACK(data)
        if h[0] != wire.MAGIC or h[1] != wire.VERSION:
            self.stats["malformed"] += 1
            return
        if h[3] != self.job_id or h[5] != self.nonce:
            self.stats["foreign"] += 1
            return
        payload = memoryview(data)[_HLEN:]
        size = _SIZES.get(h[12])
        if size is None or len(payload) != h[8] * size:
            self.stats["malformed"] += 1
            return
        if wire.crc(payload) != h[17]:
            self.stats["corrupt"] += 1
            return
        if h[2] & _ACK:
            self._on_ack(h, payload)
            return
        self.stats["received"] += 1
        seq = self._unwrap(h[9])
        if seq < self._recv_next or seq in self._held:
            self.stats["duplicate"] += 1
            self._ack_due = True
            return
        self._held[seq] = (h, payload)
        if seq > self._max_seen:
            self._max_seen = seq
        while self._recv_next in self._held:
            self._recv_next += 1

    def _unwrap(self, seq32: int) -> int:
        """The 64-bit sequence number nearest the receive point with these low 32 bits."""
        base = self._recv_next
        cand = (base & ~0xFFFFFFFF) | seq32
        if cand < base - 2**31:
            cand += 2**32
        elif cand > base + 2**31:
            cand -= 2**32
        return cand

    def _on_ack(self, h: tuple, payload: bytes) -> None:
        self.stats["acks_received"] += 1
        cum = self._tx_base + ((h[9] - self._tx_base) & 0xFFFFFFFF)
        if cum > self._tx_next:
            return  # stale or bogus
        if cum > self._tx_base:
            self._ack_progress = time.monotonic()
        while self._tx_base < cum:
            self._unacked.pop(self._tx_base, None)
            self._tx_base += 1
        if h[2] & _NACK and payload:
            now = time.monotonic()
            for (s32,) in struct.iter_unpack("!I", payload[: len(payload) // 4 * 4]):
                seq = self._tx_base + ((s32 - self._tx_base) & 0xFFFFFFFF)
                ent = self._unacked.get(seq)
                if ent is not None and now - ent[1] >= self.nack_gap:
                    if not self._transmit(ent[0], self.right):
                        return
                    ent[1] = now
                    self.stats["resent"] += 1

    def _maybe_ack(self) -> None:
        now = time.monotonic()
        gaps = self._max_seen >= self._recv_next
        if not (self._ack_due or gaps or self._recv_next != self._last_ack[0]):
            return
        if (self._recv_next == self._last_ack[0] and not self._ack_due
                and now - self._last_ack[1] < self.nack_gap):
            return
        missing = []
        if gaps:
            for s in range(self._recv_next, self._max_seen):
                if s not in self._held:
                    missing.append(s & 0xFFFFFFFF)
                    if len(missing) >= _NACK_MAX:
                        break
        payload = struct.pack(f"!{len(missing)}I", *missing)
        flags = _ACK | (_NACK if missing else 0)
        hdr = _PACK(wire.MAGIC, wire.VERSION, flags, self.job_id, 0, self.nonce, 0, 0,
                    len(payload), self._recv_next & 0xFFFFFFFF, 0, 0, _BYTES,
                    0, 0, 0, 0, wire.crc(payload))
        if self._transmit((hdr, payload), self.left):
            self.stats["acks_sent"] += 1
            self._ack_due = False
            self._last_ack = (self._recv_next, now)

    def _check_stall(self) -> None:
        if not self._ops:
            return
        now = time.monotonic()
        for key, op in list(self._ops.items()):
            if now - op.last_progress > self.stall_timeout:
                del self._ops[key]
                op.future.set_exception(RingError(
                    f"no progress on bucket {op.bucket} of iteration {op.iteration} for "
                    f"{self.stall_timeout:.0f} s: a peer is gone"))
