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
from typing import Any

from checkmate.errors import CheckmateError

#: Seconds the controller gets to program the switch for an attempt.
ATTEMPT_TIMEOUT = 20.0


def attempt_id() -> str:
    """This attempt's id: the job's rendezvous id and a random part (rank 0 makes it)."""
    return f"{os.environ.get('TORCHELASTIC_RUN_ID', 'none')[:100]}:{secrets.token_hex(8)}"


def program(lay: Any, order: Sequence[int]) -> dict[str, Any]:
    """Rank 0's part: the controller programs this attempt's ring (``order``: ring position
    -> rank, checkmate.train.ring_schedule; the rank order when each node's ranks are
    consecutive, as torch's agent numbers them), every shadow adopts its new session;
    returns ``{"epoch": E, "attempt": id}``."""
    from checkmate.control.handshake_client import controller_request
    from checkmate.train.shadow_client import ShadowClient

    if lay.controller is None:
        raise CheckmateError("switch mode needs the controller's address")
    aid = attempt_id()
    body = controller_request(lay.controller, lay.job_id,
                              {"op": "attempt", "attempt": aid,
                               "ranks": [lay.trainers[r][0] for r in order]},
                              timeout=ATTEMPT_TIMEOUT, tries=10)
    parts = {int(p): v for p, v in (body.get("partitions") or {}).items()}
    if sorted(parts) != list(range(len(lay.shadow_tcp))):
        raise CheckmateError(f"the controller programmed partitions {sorted(parts)}, the job "
                             f"has {len(lay.shadow_tcp)}")
    epochs = {int(v["epoch"]) for v in parts.values()}
    for p, a in enumerate(lay.shadow_tcp):
        with ShadowClient(a) as c:
            reply, _ = c.request({"op": "session"})
        if reply.get("epoch") != parts[p]["epoch"]:
            raise CheckmateError(f"shadow {a[0]}:{a[1]} holds epoch {reply.get('epoch')} "
                                 f"after the attempt, the controller gave "
                                 f"{parts[p]['epoch']}")
    return {"epoch": max(epochs), "attempt": aid}


def announce(lay: Any, order: Sequence[int]) -> dict[str, Any]:
    """Every rank: wait until rank 0 had this attempt programmed (see the module
    docstring); the same result, or the same CheckmateError, on every rank."""
    from checkmate.train import agreement

    got = agreement.decide(agreement.attempt_store(), "switch-attempt", lay.rank, lay.world,
                           lambda: program(lay, order))
    if lay.rank == 0:
        print(f"checkmate: attempt {got['attempt']}: the switch copies for {lay.world} "
              f"rank(s) under epoch {got['epoch']}", flush=True)
    return got
