"""FEC parity for the pieces a trainer replicates (optional; checkmate.protocol.fec is the codec).

With ``JobLayout.fec = (k, m)`` every k consecutive REPLICATE pieces this trainer sends for
one (iteration, partition) form a group, and m parity datagrams go straight to the owning
shadow (flag PARITY, not REPLICATE: no switch copies them), so a shadow that lost up to m
copies of a group rebuilds them without a repair round trip. Encoding runs on this module's
own thread, never on the ring's: the ring only enqueues a reference to each piece. At the
end of an iteration's step the session flushes its short last groups. Pieces must fit a
parity payload in one frame: the ring cuts them at ``fec.max_piece_bytes(k)``.
"""

from __future__ import annotations

import queue
import threading

from checkmate.protocol.fec import GroupEncoder
from checkmate.train.replicate import ShadowSender


class ParitySender:
    """Groups pieces per (iteration, partition), encodes and sends parity on one thread."""

    def __init__(self, k: int, m: int, sender: ShadowSender) -> None:
        self.k, self.m, self.sender = k, m, sender
        GroupEncoder(k, m)  # fails now (FecError) if the codec cannot do (k, m) here
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._enc: dict[tuple[int, int], tuple[GroupEncoder, list[int]]] = {}
        self.groups = 0
        self._thread = threading.Thread(target=self._run, name="ckm-fec", daemon=True)
        self._thread.start()

    def piece(self, iteration: int, partition: int, offset: int, payload: bytes) -> None:
        """From the ring's thread: one REPLICATE piece just queued for sending."""
        self._q.put((iteration, partition, offset, payload))

    def flush(self, iteration: int) -> None:
        """After the step of ``iteration``: every piece of it was produced; close groups."""
        self._q.put((iteration, None, 0, b""))

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(5.0)

    def _send(self, it: int, p: int, gid: int, first: int, parity: list[tuple[int, bytes]],
              k: int) -> None:
        for index, payload in parity:
            self.sender.parity(it, p, gid, index, k, self.m, first, payload)
        self.groups += 1

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            it, p, offset, payload = item
            if p is None:  # flush every encoder of this iteration (and older)
                for key in sorted(k for k in self._enc if k[0] <= it):
                    enc, firsts = self._enc.pop(key)
                    gid, k = enc.group_id, enc.next_index
                    out = enc.flush()
                    if out:
                        self._send(key[0], key[1], gid, firsts[-1], out, k)
                continue
            enc, firsts = self._enc.setdefault((it, p), (GroupEncoder(self.k, self.m), []))
            if enc.next_index == 0:
                firsts.append(offset)
            gid = enc.group_id
            out = enc.add(offset, payload)
            if out:
                self._send(it, p, gid, firsts[-1], out, self.k)
