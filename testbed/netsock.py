"""Sockets opened inside another network namespace, from this process.

A socket belongs to the namespace it was created in, for its whole life. Creating it on a
short-lived thread that first setns()es into the namespace lets one test or benchmark
process talk from many "hosts" without spawning a process per host.
"""

from __future__ import annotations

import ctypes
import os
import socket
import threading
from collections.abc import Callable
from typing import TypeVar

from checkmate.dataplane.switch import NETNS_DIR
from checkmate.errors import CheckmateError

CLONE_NEWNET = 0x40000000
SO_RCVBUFFORCE = 33
_libc = ctypes.CDLL(None, use_errno=True)
T = TypeVar("T")


def call_in_netns(netns: str, fn: Callable[[], T]) -> T:
    """Run ``fn`` on a thread that lives in ``netns``; returns its result or raises."""
    box: dict[str, object] = {}

    def body() -> None:
        try:
            fd = os.open(NETNS_DIR / netns, os.O_RDONLY)
        except OSError as e:
            box["err"] = CheckmateError(f"no network namespace {netns}: {e.strerror}")
            return
        try:
            if _libc.setns(fd, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                box["err"] = CheckmateError(f"setns({netns}): {os.strerror(err)}")
                return
            box["ok"] = fn()
        except BaseException as e:  # handed to the caller
            box["err"] = e
        finally:
            os.close(fd)

    t = threading.Thread(target=body, name=f"netns-{netns}")
    t.start()
    t.join()
    if "err" in box:
        raise box["err"]  # type: ignore[misc]
    return box["ok"]  # type: ignore[return-value]


def udp_socket_in(netns: str, bind: tuple[str, int] | None = None,
                  rcvbuf: int | None = None) -> socket.socket:
    """A UDP socket created (and bound) inside ``netns``."""

    def make() -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            if rcvbuf:  # FORCE (root) so net.core.rmem_max does not cap it silently
                s.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, rcvbuf)
            if bind:
                s.bind(bind)
        except BaseException:
            s.close()
            raise
        return s

    return call_in_netns(netns, make)


ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4


def packet_socket_in(netns: str, ifname: str) -> socket.socket:
    """An AF_PACKET socket inside ``netns`` bound to ``ifname``: sees every frame in both
    directions (recvfrom's address[2] is the packet type; PACKET_OUTGOING for sent ones) and
    can send raw Ethernet frames (built with scapy in tests)."""

    def make() -> socket.socket:
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        try:
            s.bind((ifname, 0))
        except BaseException:
            s.close()
            raise
        return s

    return call_in_netns(netns, make)


def drain(sock: socket.socket, quiet: float = 0.2, limit: float = 5.0,
          bufsize: int = 65535) -> list[tuple[bytes, tuple]]:
    """Everything ``sock`` receives until it stays quiet for ``quiet`` seconds."""
    import time

    out = []
    deadline = time.monotonic() + limit
    sock.settimeout(quiet)
    while time.monotonic() < deadline:
        try:
            out.append(sock.recvfrom(bufsize))
        except TimeoutError:
            break
    return out
