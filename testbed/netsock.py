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
            if rcvbuf:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            if bind:
                s.bind(bind)
        except BaseException:
            s.close()
            raise
        return s

    return call_in_netns(netns, make)
