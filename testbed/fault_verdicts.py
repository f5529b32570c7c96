"""Verdicts of the chaos cases whose fault must be found (issue 35): a bit flipped in a
shadow's state or a trainer's parameters, gradients swapped under their CRC32C. Each says
what went wrong in one line per problem; bit-identity is the run's own check.
"""

from __future__ import annotations

from typing import Any

from checkmate.testbed.cluster import Cluster
from checkmate.testbed.scenario import Scenario


def state_faults(sc: Scenario, cl: Cluster) -> list[tuple[int, int]]:
    """(partition, iteration) of each fault the shadows' state check must find: a bit
    flipped in a shadow's state, gradients swapped under their CRC32C on a shadow's port."""
    out = [sc.shadow_flip] if sc.shadow_flip is not None else []
    for f in sc.faults:
        if f.swap:
            part = cl.cfg.host(f.port).partition
            if part is not None:
                out.append((part, max(f.start, 1)))
    return out


def fault_found(sc: Scenario, statuses: list[dict[str, Any]], p: int, at: int
                ) -> list[str]:
    """The fault of partition ``p`` at iteration ``at`` (a flipped bit, swapped
    gradients) was found by the first state check at or after it, the partition re-seeded,
    and its state equal to the trainers' again by the end."""
    k = sc.verify_every
    st = next((s.get("state_check") or {} for s in statuses if s.get("partition") == p), {})
    found = st.get("found_at")
    if not found:
        return [f"chaos: the fault in partition {p}'s state at iteration {at} was not found "
                f"(state check: {st})"]
    out = []
    if k and not at <= found < at + k:
        out.append(f"chaos: the fault at iteration {at} was found at {found}, not by the "
                   f"first check (every {k})")
    if st.get("diverged"):
        out.append(f"chaos: partition {p} still differs from the trainers at the end: "
                   f"{st['diverged']}")
    return out


def trainer_flip(sc: Scenario, diverged: dict[str, Any] | None) -> list[str]:
    """The flipped rank was named by the first check at or after the flip, and the job
    rewound to the check before (or began again); bit-identity is checked after."""
    rank, at = sc.trainer_flip or (0, 0)
    k = sc.verify_every
    if diverged is None:
        return [f"chaos: the bit flipped on rank {rank} after iteration {at} was not found"]
    found, back = diverged.get("iteration"), diverged.get("rewind")
    out = []
    if not (isinstance(found, int) and k and at <= found < at + k):
        out.append(f"chaos: the flip after iteration {at} was found at {found}, not by the "
                   f"first check (every {k})")
    elif back != max(found - k, 0):
        out.append(f"chaos: the job rewound to {back}, not to the check before {found}")
    if f"rank(s) {rank} differ" not in (diverged.get("line") or ""):
        out.append(f"chaos: the divergence line does not name rank {rank}: "
                   f"{diverged.get('line')}")
    return out
