"""Where a job's shadows go when they run on the job's own nodes (issue 38, the rule only).

Each of ``partitions`` partitions gets ``replicas`` shadows. The rule: no two replicas of a
partition on one node, and on different failure domains (a rack, a power domain: each
node is its own domain unless told otherwise), so the loss of any one domain leaves every
partition a replica; and the shadows spread over the nodes as evenly as the domains allow
(the least loaded eligible node first, ties to the node after the one chosen last, so equal
nodes take turns). With one replica a node's loss takes the only copy of its partitions
with the node's trainers: the job then resumes from disk; the placement says so in
``warning``.

When the membership changes (a node lost, a spare joining), ``replace`` keeps every replica
whose node is still there, in its place (its replica number), and places only the missing
ones (each then re-seeded from a live sibling), so a change moves as few shadows as it can;
``reslot`` keeps the ports of every shadow that stays.

``checkmate launch --colocate NODE=IP,... --node NAME [--domain ...]`` places a job's
shadows by it at every rendezvous (checkmate.launch.colocation), every node's launcher
computing the same placement and starting its own share.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from checkmate.config import cluster as config
from checkmate.errors import CheckmateError

#: Ports of a node's j-th shadow: UDP 47001 + 4j (odd: never a trainer's ring or repair
#: port, 47000 + 4L and 47002 + 4L), TCP 47100 + j.
UDP_STRIDE = 4


@dataclass
class Placement:
    """``nodes[p]``: the nodes of partition ``p``'s replicas, in replica order."""

    nodes: list[list[str]]
    domains: dict[str, str]
    warning: str = ""
    load: dict[str, int] = field(default_factory=dict)

    def describe(self) -> str:
        """One line per partition, as the launcher would print it at start."""
        return "\n".join(f"partition {p}: " + ", ".join(
            f"{n} ({self.domains[n]})" if self.domains[n] != n else n for n in ns)
            for p, ns in enumerate(self.nodes))


def _domains(nodes: Sequence[str], domains: Mapping[str, str] | None) -> dict[str, str]:
    if len(set(nodes)) != len(nodes) or not nodes:
        raise CheckmateError(f"shadow placement needs distinct node names, got {list(nodes)}")
    given = dict(domains or {})
    unknown = sorted(set(given) - set(nodes))
    if unknown:
        raise CheckmateError(f"failure domains given for nodes the job does not have: "
                             f"{', '.join(unknown)}")
    return {n: given.get(n, n) for n in nodes}


def _check(partitions: int, replicas: int, dom: dict[str, str]) -> None:
    if partitions < 1 or replicas < 1:
        raise CheckmateError(f"shadow placement needs at least 1 partition and 1 replica, got "
                             f"{partitions} and {replicas}")
    distinct = sorted(set(dom.values()))
    if replicas > len(distinct):
        what = "nodes" if all(d == n for n, d in dom.items()) else "failure domains"
        raise CheckmateError(f"{replicas} replicas per partition need {replicas} {what}, the "
                             f"job has {len(distinct)} ({', '.join(distinct)})")


def _add(nodes: list[str], dom: dict[str, str], load: dict[str, int], have: list[str],
         turn: list[int]) -> str:
    """The node for one more replica beside ``have``: another domain, least loaded, ties to
    the node after the last one chosen."""
    used = {dom[n] for n in have}
    ok = [i for i, n in enumerate(nodes) if dom[n] not in used]
    best = min(ok, key=lambda i: (load[nodes[i]], (i - turn[0]) % len(nodes)))
    turn[0] = (best + 1) % len(nodes)
    load[nodes[best]] += 1
    return nodes[best]


def place(nodes: Sequence[str], partitions: int, replicas: int,
          domains: Mapping[str, str] | None = None) -> Placement:
    """Every partition's replicas on ``nodes`` (CheckmateError, one line, when the rule
    cannot be met: more replicas than domains)."""
    dom = _domains(nodes, domains)
    _check(partitions, replicas, dom)
    order = list(nodes)
    load = dict.fromkeys(order, 0)
    turn = [0]
    out: list[list[str]] = []
    for _ in range(partitions):
        have: list[str] = []
        for _ in range(replicas):
            have.append(_add(order, dom, load, have, turn))
        out.append(have)
    return Placement(out, dom, _warning(replicas), load)


def replace(old: Placement, nodes: Sequence[str], replicas: int,
            domains: Mapping[str, str] | None = None) -> Placement:
    """``old`` after the membership became ``nodes``: surviving replicas stay where they
    are, each keeping its replica number (a survivor whose domain an earlier survivor of its
    partition shares is dropped), the missing ones are placed by the rule."""
    dom = _domains(nodes, domains)
    _check(len(old.nodes), replicas, dom)
    order = list(nodes)
    load = dict.fromkeys(order, 0)
    kept: list[list[str | None]] = []
    for ns in old.nodes:
        have: list[str | None] = []
        for n in list(ns)[:replicas]:
            ok = n in dom and dom[n] not in {dom[h] for h in have if h is not None}
            have.append(n if ok else None)
            if ok:
                load[n] += 1
        kept.append(have + [None] * (replicas - len(have)))
    turn = [0]
    out: list[list[str]] = []
    for have in kept:
        for k, n in enumerate(have):
            if n is None:
                have[k] = _add(order, dom, load, [h for h in have if h is not None], turn)
        out.append([h for h in have if h is not None])
    return Placement(out, dom, _warning(replicas), load)


def _warning(replicas: int) -> str:
    if replicas > 1:
        return ""
    return ("one replica per partition: a node's loss takes its partitions' only shadow with "
            "its trainers, and the job resumes from disk (--replicas 2 keeps a copy "
            "elsewhere)")


def slots(placement: Placement, ips: Mapping[str, str]) -> list[tuple[str, str, int, int]]:
    """Every shadow of the job as (node, IP, UDP port, TCP port), in the launcher's order:
    replica 0 of partitions 0..n-1, then replica 1, ... (shadow i is replica i // n of
    partition i % n); a node's shadows take its ports in that order."""
    n = len(placement.nodes)
    replicas = len(placement.nodes[0]) if n else 0
    used: dict[str, int] = {}
    out = []
    for i in range(n * replicas):
        node = placement.nodes[i % n][i // n]
        j = used.get(node, 0)
        used[node] = j + 1
        out.append((node, ips[node], config.SHADOW_PORT + UDP_STRIDE * j,
                    config.RESTORE_PORT + j))
    return out


def reslot(old: Sequence[tuple[str, str, int, int]], placement: Placement,
           ips: Mapping[str, str]) -> list[tuple[str, str, int, int]]:
    """:func:`slots` after ``replace``: a shadow whose node is unchanged keeps its address
    and ports (it keeps running), a moved one takes the lowest ports its new node has free."""
    n = len(placement.nodes)
    out: list[tuple[str, str, int, int] | None] = [None] * len(old)
    for i, slot in enumerate(old):
        if placement.nodes[i % n][i // n] == slot[0]:
            out[i] = slot
    for i in range(len(old)):
        if out[i] is None:
            node = placement.nodes[i % n][i // n]
            taken = {s[3] - config.RESTORE_PORT for s in out if s is not None and s[0] == node}
            j = next(j for j in range(len(old) + 1) if j not in taken)
            out[i] = (node, ips[node], config.SHADOW_PORT + UDP_STRIDE * j,
                      config.RESTORE_PORT + j)
    return [s for s in out if s is not None]
