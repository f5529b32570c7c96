"""What a trainer sends to the shadows itself: host-mode gradient copies and control messages.

In switch mode the switch copies the REPLICATE datagrams of the ring, so trainers send the
shadows nothing but rank 0's control message, except on one node, where no ring hop crosses
the switch and the rank that completes a segment sends its copy itself
(checkmate.train.ring_schedule). In host mode (no switch, e.g. loopback) each rank also sends
every piece the ring schedule makes it replicate straight to the owning shadow: about 1/N of
the gradient per rank per iteration with one rank per node, N the world size, on top of the
ring's 2(N-1)/N.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from checkmate.control.pfc import mark_ckm
from checkmate.protocol import datamac, wire

_F = wire.Flags
_PACK = wire.STRUCT.pack
#: Bytes of control JSON per datagram (fits a 9000-byte MTU).
CONTROL_FRAGMENT = wire.MAX_PAYLOAD_JUMBO


@dataclass
class ShadowTarget:
    """Where one partition's shadow receives ckm datagrams, and its current session."""

    partition: int
    ip: str
    port: int
    epoch: int = 0
    token: int = 0


class ShadowSender:
    """One unbound UDP socket for everything a trainer sends to shadows directly."""

    def __init__(self, job_id: int, targets: Sequence[ShadowTarget],
                 secret: bytes | None = None,
                 mirrors: Sequence[Sequence[ShadowTarget]] = ()) -> None:
        self.job_id = job_id
        #: checkmate.protocol.datamac keys of the job secret (None: untagged, only for tests of
        #: what a shadow does with such datagrams).
        self.secret = secret
        #: Longest control message the shadows take (control_message.control_limit of the
        #: job's spec; None: unchecked). A longer one is one CheckmateError, never sent.
        self.control_limit: int | None = None
        self.data_key: tuple[int, int] | None = None
        self.control_key: bytes | None = None
        self.set_run("")
        self.targets = {t.partition: t for t in targets}
        #: partition -> its further replicas (whole sets beside ``targets``): each gets
        #: every datagram its partition's first replica gets (host mode)
        self.mirrors: dict[int, list[ShadowTarget]] = {}
        for rset in mirrors:
            for t in rset:
                self.mirrors.setdefault(t.partition, []).append(t)
        self.sock = mark_ckm(socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
        self._seq = 0
        self._lock = threading.Lock()
        self.sent_bytes = 0
        self.sent_datagrams = 0
        self.copy_bytes = 0  # host replication only (the extra traffic of host mode)
        #: partition -> checkmate.shadow.verbs.VerbsSender: that shadow takes its datagrams
        #: on a UD queue pair (docs/verbs.md); pieces are cut to its message size.
        self.verbs: dict[int, Any] = {}

    def set_run(self, run: str) -> None:
        """Tag everything from now on with run ``run``'s keys (checkmate.protocol.datamac)."""
        if self.secret is not None:
            rs = datamac.run_secret(self.secret, run)
            self.data_key, self.control_key = datamac.data_key(rs), datamac.control_key(rs)

    def use_verbs(self, partition: int, sender: Any) -> None:
        """Send everything for ``partition`` through ``sender`` (a VerbsSender)."""
        self.verbs[partition] = sender

    def close(self) -> None:
        self.sock.close()
        for v in self.verbs.values():
            v.close()

    def update_sessions(self, sessions: dict[int, tuple[int, int]], replica: int = 0) -> None:
        """New (epoch, token) per partition for its ``replica``-th shadow (0: the target,
        k: the k-th mirror set's), e.g. after a shadow re-registered."""
        for p, (epoch, token) in sessions.items():
            chosen = ([self.targets[p]] if p in self.targets else []) if replica == 0 \
                else self.mirrors.get(p, [])[replica - 1:replica]
            for t in chosen:
                t.epoch, t.token = epoch, token

    def _send(self, t: ShadowTarget, flags: int, iteration: int, offset: int, count: int,
              bucket: int, dtype: int, payload: bytes, fec_group: int = 0) -> None:
        with self._lock:
            seq = self._seq
            self._seq = (self._seq + 1) & 0xFFFFFFFF
        c = wire.crc(payload)
        key = self.data_key
        tag = (0, 0, 0, fec_group)  # a CONTROL fragment's fec_group: its message's length
        if key is not None and flags & _F.CONTROL:
            seq = datamac.control_tag(key, _PACK(
                wire.MAGIC, wire.VERSION, flags, self.job_id, 0, 0, iteration, offset, count,
                0, 0, t.partition, dtype, *tag, c))
        elif key is not None:
            tag = datamac.data_tag(key, self.job_id, flags, iteration, offset, count,
                                   t.partition, dtype, c)
        hdr = _PACK(wire.MAGIC, wire.VERSION, flags, self.job_id, t.epoch, t.token, iteration,
                    offset, count, seq, bucket, t.partition, dtype, *tag, c)
        v = self.verbs.get(t.partition)
        try:
            if v is not None:
                with self._lock:  # one send ring per shadow, shared by the sending threads
                    v.send(hdr + payload)
            else:
                self.sock.sendto(hdr + payload, (t.ip, t.port))
        except OSError:
            return  # a shadow that is down misses this copy; its gap report says so
        self.sent_bytes += len(payload)
        self.sent_datagrams += 1

    def copy(self, iteration: int, bucket: int, offset: int, partition: int,
             payload: bytes) -> None:
        """Host replication of one fully reduced chunk (the ring's ``on_reduced`` hook)."""
        t = self.targets.get(partition)
        if t is None:
            return
        v = self.verbs.get(partition)
        step = len(payload) if v is None else (v.slot_bytes - wire.HEADER_LEN) // 4 * 4
        for to in (t, *self.mirrors.get(partition, ())):
            self.copy_bytes += len(payload)
            for a in range(0, len(payload), max(step, 4)):  # UD: one piece per message
                piece = payload[a:a + step]
                self._send(to, _F.REPLICATE, iteration, offset + a // 4, len(piece) // 4,
                           bucket, wire.DType.FLOAT32, piece)

    def control(self, iteration: int, body: dict[str, Any]) -> bytes:
        """Send the control message of ``iteration`` to every shadow; returns its bytes
        (retained for repairs)."""
        data = json.dumps(body, separators=(",", ":")).encode()
        if self.control_key is not None:  # the shadow checks the message whole
            data += datamac.control_mac(self.control_key, self.job_id, iteration, data)
        if self.control_limit is not None and len(data) > self.control_limit:
            from checkmate.errors import CheckmateError

            raise CheckmateError(
                f"the control message of iteration {iteration} is {len(data)} bytes, more "
                f"than the {self.control_limit} the shadows take for this model (keep the "
                "step's extra state, e.g. the data position, under 1 MiB)")
        for t in [*self.targets.values(), *(m for ms in self.mirrors.values() for m in ms)]:
            v = self.verbs.get(t.partition)
            size = CONTROL_FRAGMENT if v is None else v.slot_bytes - wire.HEADER_LEN
            for off in range(0, max(len(data), 1), size):
                frag = data[off:off + size]
                self._send(t, _F.CONTROL, iteration, off, len(frag), 0, wire.DType.BYTES,
                           frag, fec_group=len(data))
        return data
