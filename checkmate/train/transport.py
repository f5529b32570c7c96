"""UDP endpoint of a trainer: the socket every ckm datagram of the ring goes through.

One socket per trainer, bound to its address on ``config.TRAINER_PORT`` (or any port given),
with large kernel buffers so a window of in-flight datagrams fits. Root may exceed
``net.core.rmem_max`` with SO_RCVBUFFORCE; others get what the sysctl allows, and the ring
sizes its window from what it got.

``LossyLink`` is a test double of a lossy network for loopback tests only (no switch there);
on the namespace testbed, loss and corruption come from the real switch's fault knobs.
"""

from __future__ import annotations

import random
import socket
from dataclasses import dataclass, field

from checkmate.control.pfc import mark_ckm

#: Kernel buffer asked for in each direction (bytes).
SOCKET_BUFFER = 32 * 1024 * 1024
_SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)
_SO_SNDBUFFORCE = getattr(socket, "SO_SNDBUFFORCE", 32)


def open_socket(ip: str, port: int, buffer: int = SOCKET_BUFFER) -> socket.socket:
    """A non-blocking UDP socket bound to ``ip:port`` with buffers as large as allowed."""
    s = mark_ckm(socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
    for force, plain in ((_SO_RCVBUFFORCE, socket.SO_RCVBUF), (_SO_SNDBUFFORCE, socket.SO_SNDBUF)):
        try:
            s.setsockopt(socket.SOL_SOCKET, force, buffer)
        except OSError:
            s.setsockopt(socket.SOL_SOCKET, plain, buffer)
    try:
        s.bind((ip, port))
    except OSError as e:
        s.close()
        from checkmate.errors import CheckmateError

        raise CheckmateError(f"cannot bind trainer socket {ip}:{port}: {e.strerror}") from None
    s.setblocking(False)
    return s


def receive_buffer(s: socket.socket) -> int:
    """Bytes the kernel really gave the socket for receiving (Linux reports twice the use)."""
    return s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) // 2


@dataclass
class LossyLink:
    """Drops or corrupts outgoing datagrams with given probabilities (loopback tests only).

    Corruption flips one payload byte after the header, as the switch's fault knob does, so
    the receiver's CRC32C check must catch it.
    """

    drop: float = 0.0
    corrupt: float = 0.0
    seed: int = 0
    dropped: int = 0
    corrupted: int = 0
    _rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def apply(self, datagram: bytes, header_len: int) -> bytes | None:
        r = self._rng.random()
        if r < self.drop:
            self.dropped += 1
            return None
        if r < self.drop + self.corrupt and len(datagram) > header_len:
            self.corrupted += 1
            b = bytearray(datagram)
            i = self._rng.randrange(header_len, len(b))
            b[i] ^= 0xFF
            return bytes(b)
        return datagram
