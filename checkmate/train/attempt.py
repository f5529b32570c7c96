"""Switch mode under ``checkmate launch``: each rendezvous tells the controller its ranks.

The rendezvous decides which rank runs where, anew for every attempt (a restart, a spare
that replaced a lost node, a job that shrank). Before the attempt's first iteration,
rank 0 sends the controller the ring IP of every rank in ring order (an authenticated
handshake request, as the shadows' registration is); the controller programs the switch's
replication for exactly those hops under a new epoch for every partition, withdrawing the
entries of hosts that left, and answers with the new sessions (control/service.py,
``attempt``). Rank 0 then asks every shadow to take its new session from the controller
(the shadow asks the controller itself), so copies the switch stamped for an earlier
attempt are refused by epoch. The outcome is published in the attempt's c10d store
(checkmate.train.agreement): every rank starts only once the switch is programmed, and a
failure is the same one line on every rank.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from checkmate.errors import CheckmateError

#: Seconds the controller gets to program the switch for an attempt.
ATTEMPT_TIMEOUT = 20.0


def attempt_id() -> str:
    """This attempt's id: the job's rendezvous id and a random part (rank 0 makes it)."""
    return f"{os.environ.get('TORCHELASTIC_RUN_ID', 'none')[:100]}:{secrets.token_hex(8)}"


@dataclass(frozen=True)
class ControlPlace:
    """How the controller knows a session's shadows: by the job's own id and the config's
    partition numbers. A mesh job's data-parallel group ``group`` (of ``groups``) has a wire
    job id of its own and numbers its ``per_group`` partitions from 0; its partition p is
    the config's ``group * per_group + p``. ``shadow_tcp``: every group's shadows, in the
    config's partition order (rank 0 of the job asks each to adopt a new attempt)."""

    job: int
    group: int
    groups: int
    per_group: int
    shadow_tcp: tuple[tuple[str, int], ...]

    @classmethod
    def of_layout(cls, lay: Any) -> ControlPlace:
        """A group-less job's: the layout's own job id and shadows."""
        return cls(lay.job_id, 0, 1, len(lay.shadow_tcp), tuple(lay.shadow_tcp))

    def mine(self, regs: dict[int, Any]) -> dict[int, Any]:
        """The controller's config partitions -> this group's partitions, for this group's
        shadows only."""
        lo = self.group * self.per_group
        return {p - lo: v for p, v in regs.items() if lo <= p < lo + self.per_group}


def program(lay: Any, place: ControlPlace, rings: Sequence[Sequence[str]]) -> dict[str, Any]:
    """Rank 0's part: the controller programs this attempt's rings (per data-parallel
    group, every rank's ring IP in ring order: checkmate.train.ring_schedule, the rank
    order when each node's ranks are consecutive, as torch's agent numbers them), every
    shadow of every group adopts its new session; returns ``{"epoch": E, "attempt": id}``."""
    from checkmate.control.handshake_client import controller_request
    from checkmate.train.shadow_client import ShadowClient

    if lay.controller is None:
        raise CheckmateError("switch mode needs the controller's address")
    aid = attempt_id()
    req: dict[str, Any] = {"op": "attempt", "attempt": aid}
    if len(rings) == 1:
        req["ranks"] = list(rings[0])
    else:
        req["rings"] = [list(r) for r in rings]
    body = controller_request(lay.controller, place.job, req, timeout=ATTEMPT_TIMEOUT,
                              tries=10)
    parts = {int(p): v for p, v in (body.get("partitions") or {}).items()}
    if sorted(parts) != list(range(len(place.shadow_tcp))):
        raise CheckmateError(f"the controller programmed partitions {sorted(parts)}, the job "
                             f"has {len(place.shadow_tcp)}")
    epochs = {int(v["epoch"]) for v in parts.values()}
    for p, a in enumerate(place.shadow_tcp):
        with ShadowClient(a) as c:
            reply, _ = c.request({"op": "session"})
        if reply.get("epoch") != parts[p]["epoch"]:
            raise CheckmateError(f"shadow {a[0]}:{a[1]} holds epoch {reply.get('epoch')} "
                                 f"after the attempt, the controller gave "
                                 f"{parts[p]['epoch']}")
    return {"epoch": max(epochs), "attempt": aid}


def announce(lay: Any, place: ControlPlace, ring: Sequence[str], rank: int, world: int,
             group: Any = None) -> dict[str, Any]:
    """Every rank of the job (``rank`` of ``world``): wait until rank 0 had this attempt
    programmed (see the module docstring); the same result, or the same CheckmateError, on
    every rank. ``ring``: this rank's group's ring IPs in ring order; with several groups
    they are gathered over ``group`` (every rank of the job) first."""
    import torch.distributed as dist

    from checkmate.train import agreement

    rings: list[Sequence[str]] = [ring]
    if place.groups > 1:
        got: list[Any] = [None] * world
        dist.all_gather_object(got, [place.group, list(ring)], group=group)
        by_group = {int(g): r for g, r in got}
        rings = [by_group[g] for g in range(place.groups)]
    got = agreement.decide(agreement.attempt_store(), "switch-attempt", rank, world,
                           lambda: program(lay, place, rings))
    if rank == 0:
        per = f" in {place.groups} data-parallel groups" if place.groups > 1 else ""
        print(f"checkmate: attempt {got['attempt']}: the switch copies for {world} "
              f"rank(s){per} under epoch {got['epoch']}", flush=True)
    return got
