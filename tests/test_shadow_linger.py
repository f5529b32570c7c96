"""The shadow receiver batches a trickle of datagrams instead of waking per datagram."""

from __future__ import annotations

import socket
import time
from collections import Counter

from checkmate.shadow import receiver as rx


def _receiver(rcvbuf: int) -> tuple[rx.Receiver, socket.socket]:
    sock, _ = rx.open_socket("127.0.0.1", 0, rcvbuf)
    return rx.Receiver(sock, job=1, partition=0, drops=Counter()), sock


def test_small_buffer_never_lingers() -> None:
    # A buffer that cannot hold LINGER seconds of traffic would overflow while sleeping.
    r, sock = _receiver(1 << 16)
    try:
        assert r.linger == 0.0
    finally:
        sock.close()


def test_trickle_is_taken_in_batches() -> None:
    r, sock = _receiver(rx.RCVBUF)
    if r.linger == 0.0:
        sock.close()
        import pytest

        pytest.skip("kernel granted no large receive buffer (needs root or big rmem_max)")
    r.start()
    out = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    n = 80
    try:
        for _ in range(n):
            out.sendto(b"x" * 100, sock.getsockname())  # not ckm: counted, then dropped
            time.sleep(0.0005)
        deadline = time.monotonic() + 5
        while r.received < n and time.monotonic() < deadline:
            time.sleep(0.01)
        assert r.received == n
        assert r.drops["short"] + r.drops["magic"] == n
        # ~40 ms of traffic with a 5 ms linger: about ten wake-ups, not one per datagram.
        assert r.wakeups < n // 3, r.wakeups
    finally:
        out.close()
        r.stop()
        sock.close()
