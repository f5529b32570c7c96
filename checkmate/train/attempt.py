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
    config's partition order (rank 0 of the job asks each to adopt a new attempt);
    ``replica_tcp``: the further replica sets of a data-parallel job, asked too.
    ``placed``: co-located shadows (``checkmate launch --colocate --mode switch``): per
    partition, every replica's UDP address as the launchers' rendezvous placed it, which
    the attempt tells the controller (None: the controller's shadows registered
    themselves)."""

    job: int
    group: int
    groups: int
    per_group: int
    shadow_tcp: tuple[tuple[str, int], ...]
    replica_tcp: tuple[tuple[tuple[str, int], ...], ...] = ()
    placed: tuple[tuple[tuple[str, int], ...], ...] | None = None

    @classmethod
    def of_layout(cls, lay: Any) -> ControlPlace:
        """A group-less job's: the layout's own job id and shadows."""
        placed = None
        if getattr(lay, "placed", False):
            sets = [lay.shadows, *lay.replica_shadows]
            placed = tuple(tuple((s[p].ip, s[p].port) for s in sets)
                           for p in range(len(lay.shadows)))
        return cls(lay.job_id, 0, 1, len(lay.shadow_tcp), tuple(lay.shadow_tcp),
                   tuple(tuple(t) for t in lay.replica_tcp), placed)

    def mine(self, regs: dict[int, Any]) -> dict[int, Any]:
        """The controller's config partitions -> this group's partitions, for this group's
        shadows only."""
        lo = self.group * self.per_group
        return {p - lo: v for p, v in regs.items() if lo <= p < lo + self.per_group}


def program(lay: Any, place: ControlPlace, rings: Sequence[Sequence[str]]) -> dict[str, Any]:
    """Rank 0's part: the controller programs this attempt's rings (per data-parallel
    group, every rank's ring IP in ring order: checkmate.train.ring_schedule, the rank
    order when each node's ranks are consecutive, as torch's agent numbers them) and, for
    co-located shadows, where each replica runs; every shadow adopts its new session;
    returns ``{"epoch": E, "attempt": id}``. A replica that does not answer (its launcher
    is starting it again) is one warning line while a sibling took the session: started
    again, it takes its session from the controller itself (shadow.node)."""
    from checkmate.control.handshake_client import controller_request

    if lay.controller is None:
        raise CheckmateError("switch mode needs the controller's address")
    aid = attempt_id()
    req: dict[str, Any] = {"op": "attempt", "attempt": aid}
    if len(rings) == 1:
        req["ranks"] = list(rings[0])
    else:
        req["rings"] = [list(r) for r in rings]
    if place.placed is not None:
        req["shadows"] = [[f"{ip}:{port}" for ip, port in reps] for reps in place.placed]
    body = controller_request(lay.controller, place.job, req, timeout=ATTEMPT_TIMEOUT,
                              tries=10)
    parts = {int(p): v for p, v in (body.get("partitions") or {}).items()}
    if sorted(parts) != list(range(len(place.shadow_tcp))):
        raise CheckmateError(f"the controller programmed partitions {sorted(parts)}, the job "
                             f"has {len(place.shadow_tcp)}")
    epochs = {int(v["epoch"]) for v in parts.values()}
    replicas = {int(p): {int(r.get("replica", 0)): r for r in v}
                for p, v in (body.get("replicas") or {}).items()}
    took: set[int] = set()
    missed: list[str] = []
    for k, shadows in enumerate((place.shadow_tcp, *place.replica_tcp)):
        for p, a in enumerate(shadows):
            want = parts[p] if k == 0 else replicas.get(p, {}).get(k)
            if want is None:
                raise CheckmateError(f"the controller holds no session of partition {p} "
                                     f"replica {k} after the attempt")
            got = _adopted(a, place.replica_tcp != ())
            if got is None:
                missed.append(f"{a[0]}:{a[1]} (partition {p} replica {k})")
                continue
            if got != want["epoch"]:
                raise CheckmateError(f"shadow {a[0]}:{a[1]} holds epoch {got} after the "
                                     f"attempt, the controller gave {want['epoch']}")
            took.add(p)
    lost = sorted(set(range(len(place.shadow_tcp))) - took)
    if lost:
        raise CheckmateError(f"no shadow of partition(s) {lost} answered after the attempt: "
                             f"{', '.join(missed)}")
    if missed:
        import logging

        logging.getLogger("checkmate.train").warning(
            "checkmate: %s did not answer after the attempt (started again, a replica "
            "takes its session from the controller itself)", ", ".join(missed))
    return {"epoch": max(epochs), "attempt": aid}


def _adopted(addr: tuple[str, int], tolerant: bool) -> int | None:
    """The epoch shadow ``addr`` holds once asked to adopt its session; None when it did
    not answer within ATTEMPT_TIMEOUT and ``tolerant`` (its partition has replicas)."""
    import time

    from checkmate.train.shadow_client import ShadowClient

    deadline = time.monotonic() + ATTEMPT_TIMEOUT
    while True:
        try:
            with ShadowClient(addr) as c:  # its answer waits on the controller's
                reply, _ = c.request({"op": "session"})
            return reply.get("epoch")
        except (CheckmateError, OSError):
            if not tolerant:
                raise
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.5)


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
