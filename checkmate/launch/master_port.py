"""The port each attempt's rank 0 hosts its process group's store on: below the kernel's
ephemeral range.

With the agent's store not shared (the launcher turns sharing off: a restarted group must
not meet the previous attempt's keys), torch's agent picks that port for every attempt with
``get_free_port`` (bind port 0, close; torch's own docstring says the port is not
reserved), and rank 0 listens on it only once its worker has started and imported torch,
seconds later. Any socket that takes an ephemeral port meanwhile -- an outgoing connection
of any process on the node -- can take it, and the attempt fails with EADDRINUSE (seen in
the suite, twice). A port below ``net.ipv4.ip_local_port_range`` is never handed out
implicitly, so only a process that binds that very number can; the pick is random in a
band below the range, and checked free when picked.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

#: The band picked from: below Linux's default ephemeral range (32768-60999), above the
#: ports services commonly bind by number, and clear of torch's defaults (29400: the c10d
#: rendezvous, 29500: MASTER_PORT).
BAND = (20000, 29000)
_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_low(path: Path = _RANGE) -> int:
    """The lowest port the kernel hands out implicitly (32768 where it cannot be read)."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def pick(tries: int = 64, low: int | None = None) -> int:
    """A port of BAND below the ephemeral range that binds now; torch's pick (an ephemeral
    port) when none does."""
    top = min(BAND[1], ephemeral_low() if low is None else low)  # exclusive
    for _ in range(tries if top > BAND[0] else 0):
        port = random.randrange(BAND[0], top)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def use() -> None:
    """Have torch's agent (this process) pick each attempt's port with :func:`pick`: its
    rendezvous (``RendezvousStoreInfo.build``) calls the module's ``get_free_port``."""
    from torch.distributed.elastic.rendezvous import api

    api.get_free_port = pick
