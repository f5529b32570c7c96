"""The shadow's side of repair: ask the trainer that sent a missing piece for exactly it.

The trainers tell each shadow who they are (the ``peers`` op of the TCP service): every
trainer's repair address, which trainer sends which element ranges of this partition as
REPLICATE pieces (a fixed function of the bucket layout and the world size, see
``checkmate.train.ring.replica_owners``) and which rank sends the control message. A hole is
then split by owner and each trainer is asked only for its own ranges. Before the peers are
known, or after :data:`ASK_ALL_AFTER` unanswered rounds, every trainer is asked (a trainer
answers only what it holds, so this costs a few small datagrams and never a wrong answer).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections import Counter
from collections.abc import Callable
from typing import Any

from checkmate.errors import CheckmateError
from checkmate.protocol import repair

log = logging.getLogger("checkmate.shadow")

#: Rounds after which a hole is asked of every trainer, not only its owner.
ASK_ALL_AFTER = 3


class RepairRequester:
    """Sends repair requests for one partition through the shadow's UDP socket."""

    def __init__(self, sock: socket.socket, job: int, partition: int,
                 session: Callable[[], tuple[int, int]], stats: Counter,
                 key: tuple[int, int] | None = None) -> None:
        self.sock, self.job, self.partition = sock, job, partition
        self.key = key  # checkmate.protocol.datamac: trainers answer tagged requests only
        self.session = session
        self.stats = stats
        self.trainers: list[tuple[str, int]] = []
        self.owners: list[tuple[int, int, int]] = []
        self.control_rank = 0
        self._seq = 0

    @property
    def known(self) -> bool:
        return bool(self.trainers)

    def set_peers(self, body: dict[str, Any], start: int, end: int) -> None:
        """Validate and take a ``peers`` request; CheckmateError says what is wrong (and
        nothing is taken)."""
        self.trainers, self.owners, self.control_rank = parse_peers(body, start, end)

    def _by_owner(self, ranges: list[tuple[int, int]], ask_all: bool
                  ) -> dict[int, list[tuple[int, int]]]:
        if ask_all or not self.owners:
            return {r: list(ranges) for r in range(len(self.trainers))}
        out: dict[int, list[tuple[int, int]]] = {}
        for a, b in ranges:
            for s, e, rank in self.owners:
                lo, hi = max(a, s), min(b, e)
                if lo < hi:
                    out.setdefault(rank, []).append((lo, hi))
        return out

    def request(self, iteration: int, missing: list[tuple[int, int]], control: bool,
                tries: int) -> None:
        """Ask for the gradient ranges ``missing`` and/or the whole control message."""
        if not self.trainers:
            self.stats["no_peers"] += 1
            return
        epoch, token = self.session()
        ask_all = tries >= ASK_ALL_AFTER
        sends: list[tuple[int, list[tuple[int, int]], bool]] = []
        for rank, rs in self._by_owner(missing, ask_all).items():
            for i in range(0, len(rs), repair.MAX_RANGES):
                sends.append((rank, rs[i:i + repair.MAX_RANGES], False))
        if control:
            ranks = range(len(self.trainers)) if ask_all else [self.control_rank]
            sends.extend((r, [], True) for r in ranks)
        for rank, rs, ctrl in sends:
            self._seq = (self._seq + 1) & 0xFFFFFFFF
            dgram = repair.request(self.job, epoch, token, iteration, self.partition, rs,
                                   control=ctrl, seq=self._seq, key=self.key)
            try:
                self.sock.sendto(dgram, self.trainers[rank])
            except OSError as e:  # an unreachable trainer: the next round tries again
                self.stats["send_errors"] += 1
                log.debug("repair request to %s failed: %s", self.trainers[rank], e)
                continue
            self.stats["requests"] += 1
            if ctrl:
                self.stats["control_requests"] += 1
            self.stats["ranges"] += len(rs)


def parse_peers(body: dict[str, Any], start: int, end: int
                ) -> tuple[list[tuple[str, int]], list[tuple[int, int, int]], int]:
    """A ``peers`` request checked whole: (trainer addresses, owner ranges within the
    partition [start, end), control rank); CheckmateError says what is wrong."""
    trainers = body.get("trainers")
    if not isinstance(trainers, list) or not trainers or len(trainers) > 4096:
        raise CheckmateError("peers needs 'trainers': a non-empty list of [ip, port]")
    addrs = []
    for t in trainers:
        if (not isinstance(t, list) or len(t) != 2 or not isinstance(t[0], str)
                or not isinstance(t[1], int) or isinstance(t[1], bool)
                or not 0 < t[1] < 65536):
            raise CheckmateError(f"peers: bad trainer address {t!r}")
        try:
            ipaddress.IPv4Address(t[0])
        except ValueError:
            raise CheckmateError(f"peers: bad trainer address {t!r}") from None
        addrs.append((t[0], t[1]))
    owners = []
    for o in body.get("owners") or []:
        if (not isinstance(o, list) or len(o) != 3
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in o)
                or not start <= o[0] < o[1] <= end or not 0 <= o[2] < len(addrs)):
            raise CheckmateError(f"peers: bad owner range {o!r} for partition "
                                 f"[{start}, {end})")
        owners.append((o[0], o[1], o[2]))
    ctrl = body.get("control", 0)
    if not isinstance(ctrl, int) or isinstance(ctrl, bool) or not 0 <= ctrl < len(addrs):
        raise CheckmateError(f"peers: control rank {ctrl!r} is not a trainer")
    return addrs, sorted(owners), ctrl
