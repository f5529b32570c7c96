"""The ring's schedule: the order of ranks in the ring and which hop carries each copy.

A job has several ranks per node. A ring hop between two ranks of one node never crosses the
switch (loopback here; NVLink or shared memory on GPUs), so a REPLICATE tag on it copies
nothing. This module decides, once, for the ring allreduce (checkmate.train.ring), the
replica owners a shadow asks for repairs (``replica_owners``) and the tests:

- **Order.** Ring positions hold the ranks of a node contiguously: ranks sorted by (the
  smallest rank of their node, rank). ``node_of`` None puts every rank on a node of its
  own, and a torch elastic job (whose nodes hold contiguous ranks) keeps position = rank.
  A ring over N >= 2 nodes then crosses the switch on exactly N hops: out of each node's
  last position.
- **Segments.** A bucket of n elements is cut into ``world`` segments; segment g
  (``segment_bounds``) starts at position g, gains one addend per hop and is fully
  reduced at position g - 1 (its *completer*). Its all-gather path is the w - 1 hops
  out of positions g - 1, g, ..., g - 3: every hop but the one into the completer.
- **Tagging rule.** Segment g is sent with REPLICATE on the first node-crossing hop of its
  all-gather path (``tagger(g)`` is that hop's sending position): exactly one hop per
  segment, and with N >= 2 nodes every segment has one (the path misses one hop of the
  ring, which has N >= 2 crossing ones). The tagger is the last position of the
  completer's node. With one node no hop crosses the switch: ``tagger(g)`` is None and
  the completer must send the copy to the shadow itself (host fallback,
  ``replicator``/``switched``).

The rank that sends a segment's copy (tagged hop or host fallback) also keeps it for
repairs and computes its FEC parity, so the replica owners follow the same rule.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from checkmate.errors import CheckmateError


def segment_bounds(n: int, world: int, g: int) -> tuple[int, int]:
    """Bucket-local [start, end) of segment ``g`` of an ``n``-element bucket."""
    return g * n // world, (g + 1) * n // world


@dataclass(frozen=True)
class RingSchedule:
    """The ring of ``world`` ranks on the nodes ``node_of`` names (see the module doc)."""

    world: int
    node_of: tuple[int, ...]  # per rank: its node id (any hashable int)
    order: tuple[int, ...]  # ring position -> rank
    _pos: tuple[int, ...]  # rank -> ring position
    _tagger: tuple[int | None, ...]  # segment -> position whose all-gather send is tagged

    @classmethod
    def build(cls, world: int, node_of: Sequence[int] | None = None) -> RingSchedule:
        """The schedule of ``world`` ranks; ``node_of`` None: every rank its own node."""
        if world < 1:
            raise CheckmateError(f"a ring needs at least one rank, got {world}")
        nodes = tuple(range(world)) if node_of is None else tuple(int(x) for x in node_of)
        if len(nodes) != world:
            raise CheckmateError(f"node_of names {len(nodes)} ranks for a world of {world}")
        first: dict[int, int] = {}
        for r, nd in enumerate(nodes):
            first.setdefault(nd, r)
        order = tuple(sorted(range(world), key=lambda r: (first[nodes[r]], r)))
        pos = [0] * world
        for p, r in enumerate(order):
            pos[r] = p

        def crosses(p: int) -> bool:
            return nodes[order[p]] != nodes[order[(p + 1) % world]]

        tagger: list[int | None] = []
        for g in range(world):
            hit = None
            for k in range(world - 1):  # the all-gather hops, from the completer on
                p = (g - 1 + k) % world
                if crosses(p):
                    hit = p
                    break
            tagger.append(hit)
        return cls(world, nodes, order, tuple(pos), tuple(tagger))

    # ------------------------------------------------------------------ order
    def position(self, rank: int) -> int:
        return self._pos[rank]

    def right(self, rank: int) -> int:
        """The rank this rank sends to."""
        return self.order[(self._pos[rank] + 1) % self.world]

    def left(self, rank: int) -> int:
        """The rank this rank receives from."""
        return self.order[(self._pos[rank] - 1) % self.world]

    def crosses(self, position: int) -> bool:
        """Whether the hop out of ``position`` leaves its node (goes through the switch)."""
        w = self.world
        return self.node_of[self.order[position]] != self.node_of[self.order[(position + 1) % w]]

    @property
    def nodes(self) -> int:
        return len(set(self.node_of))

    def network_hops(self) -> list[tuple[int, int]]:
        """``(sender rank, receiver rank)`` of every hop that crosses the switch: the hops
        the switch needs replication entries for (one per partition each)."""
        w = self.world
        return [(self.order[p], self.order[(p + 1) % w]) for p in range(w) if self.crosses(p)]

    # ------------------------------------------------------------------ tagging
    def completer(self, segment: int) -> int:
        """The position where ``segment`` is fully reduced."""
        return (segment - 1) % self.world

    def tagger(self, segment: int) -> int | None:
        """The position whose all-gather send of ``segment`` carries REPLICATE; None when
        no hop of its path crosses the switch (one node)."""
        return self._tagger[segment]

    def tagged_hop(self, position: int, segment: int) -> bool:
        """Whether ``position`` sends ``segment`` tagged (the ring asks this per send)."""
        return self._tagger[segment] == position

    def replicator(self, segment: int) -> int:
        """The position that hands ``segment``'s copy on: the tagger, or without a network
        hop the completer, which sends the copy to the shadow itself."""
        t = self._tagger[segment]
        return self.completer(segment) if t is None else t

    def switched(self, segment: int) -> bool:
        """Whether the switch copies ``segment`` (a tagged network hop exists)."""
        return self._tagger[segment] is not None

    def replica_owners(self, buckets: Sequence[tuple[int, int]], start: int, end: int
                       ) -> list[tuple[int, int, int]]:
        """Which rank sends (and keeps for repairs) which flat ranges of [start, end):
        sorted ``(lo, hi, rank)`` triples, the cut the ring makes."""
        w = self.world
        out = []
        for bs, be in buckets:
            n = be - bs
            for g in range(w):
                s, e = segment_bounds(n, w, g)
                lo, hi = max(start, bs + s), min(end, bs + e)
                if lo < hi:
                    out.append((lo, hi, self.order[self.replicator(g)]))
        return sorted(out)


def check_hosts(schedule: RingSchedule, ips: Sequence[str]) -> None:
    """Refuse ranks that share an address but not a node: a hop between them never crosses
    the switch, yet the schedule would tag it, and the shadows would get no copy."""
    seen: dict[str, int] = {}
    for r, ip in enumerate(ips):
        q = seen.setdefault(ip, r)
        if schedule.node_of[q] != schedule.node_of[r]:
            raise CheckmateError(
                f"ranks {q} and {r} share the address {ip} but are on nodes "
                f"{schedule.node_of[q]} and {schedule.node_of[r]}: the switch would never see "
                "the hop between them; run each node's ranks under one launcher (GROUP_RANK) "
                "or give each node its own address")


#: torch elastic's node rank (the worker group's rank in the rendezvous), set for every
#: worker by torchrun and ``checkmate launch``.
GROUP_RANK = "GROUP_RANK"


def node_from_env(env: Mapping[str, str]) -> int | None:
    """This worker's node id from torch elastic's variables: GROUP_RANK, else the first
    global rank of its node (RANK - LOCAL_RANK: elastic gives a node contiguous ranks);
    None when neither is set (the rank is then a node of its own)."""
    for name in (GROUP_RANK, "LOCAL_RANK", "RANK"):
        v = env.get(name, "")
        if v and not v.isdigit():
            raise CheckmateError(f"environment variable {name} must be an integer, got {v!r}")
    if env.get(GROUP_RANK):
        return int(env[GROUP_RANK])
    if env.get("LOCAL_RANK") and env.get("RANK"):
        return int(env["RANK"]) - int(env["LOCAL_RANK"])
    return None


def node_of_from_keys(keys: Sequence[int | None]) -> list[int] | None:
    """Every rank's node from what each rank read (``node_from_env``, gathered in rank
    order): None if no rank knows its node; a rank without one among ranks with one is
    refused (the ranks would disagree on which hops cross the switch)."""
    if all(k is None for k in keys):
        return None
    missing = [r for r, k in enumerate(keys) if k is None]
    if missing:
        raise CheckmateError(f"ranks {missing} do not know their node (GROUP_RANK or "
                             "LOCAL_RANK unset) while others do: start every rank the same way")
    return [int(k) for k in keys if k is not None]
