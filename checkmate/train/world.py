"""A job resumed on another number of ranks than it ran on: said out loud, or refused.

The shadows hold the whole model, so any number of ranks can load it: a change is allowed,
and every rank says so in one line, with the old and the new size, because what each rank
computes changes with it (its share of the data, a function of rank and world size; the
order in which the allreduce sums, so the run is no longer bit-identical to one without the
restart). A job that must keep its size (``checkmate launch --fixed-world``, or
``JobLayout(fixed_world=True)``) is refused in one line instead. GoCkpt checkpoints are cut
into one partition per rank, so GoCkpt mode refuses a change by itself.

The size a step ran on travels in its control message (``extra["world"]``), so the check
needs the checkpoint only.
"""

from __future__ import annotations

import os
from typing import Any

from checkmate.errors import CheckmateError

#: ``1``: refuse to resume on another number of ranks (``checkmate launch --fixed-world``).
FIXED_WORLD = "CHECKMATE_FIXED_WORLD"


def fixed_from_env() -> bool:
    """The launcher's --fixed-world (unset: False); a bad value is one CheckmateError."""
    value = os.environ.get(FIXED_WORLD, "0")
    if value not in ("0", "1"):
        raise CheckmateError(f"environment variable {FIXED_WORLD} must be 0 or 1, got "
                             f"{value!r}")
    return value == "1"


def check(restored: dict[str, Any], rank: int, world: int, fixed: bool,
          quiet: bool = False) -> None:
    """Announce (every rank) or refuse a resume on ``world`` ranks of a checkpoint whose
    control message says it ran on another number; nothing when it does not say.
    ``quiet``: refuse only (rank 0 deciding for every rank), announce nothing."""
    old = restored.get("world")
    if not isinstance(old, int) or old == world:
        return
    if fixed:
        raise CheckmateError(f"the checkpoint was written by a job of {old} ranks and this "
                             f"one has {world}, but the job asked for a fixed size "
                             f"(--fixed-world): restart it with {old} ranks")
    if quiet:
        return
    print(f"checkmate: rank {rank}: resuming a job of {old} ranks on {world}: every rank "
          f"loads the whole model from the checkpoint; each rank's data (a function of "
          f"rank and world size) and the allreduce's summation order change, so the run "
          f"continues consistently but not bit-identically (--fixed-world refuses this)",
          flush=True)


def mesh_of(place: Any) -> dict[str, Any] | None:
    """What a mesh job's control message says of its mesh (``extra["mesh"]``): how many
    data-parallel groups, over which dimensions, and which group wrote it; None: a plain
    data-parallel job."""
    if place is None:
        return None
    return {"groups": place.groups, "group": place.group, "dims": list(place.other_dims)}


def check_mesh(restored: dict[str, Any], place: Any) -> None:
    """Refuse, in one line, a resume whose group is not the one that wrote the checkpoint:
    another mesh shape (its groups hold other parts of the model), or a plain job resuming
    a mesh job's shadows or the reverse. A different number of data-parallel ranks within
    the group is :func:`check`'s to say."""
    old, now = restored.get("mesh"), mesh_of(place)
    if old is None and now is None:
        return

    def shape(m: dict[str, Any] | None) -> str:
        if m is None:
            return "a plain data-parallel job"
        return f"group {m['group']} of {m['groups']} ({' x '.join(m['dims']) or 'dp'})"

    if old is None or now is None or (old.get("groups"), old.get("group"), old.get("dims")) \
            != (now["groups"], now["group"], now["dims"]):
        raise CheckmateError(f"the shadows hold {shape(old)} and this rank is {shape(now)}: "
                             "a resume onto another mesh shape is not supported from the "
                             "shadows; restart with the mesh the job ran on")
