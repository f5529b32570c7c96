"""One restore point for a mesh job: every data-parallel group resumes at one iteration.

Each group's shadows hold its own part of the model, so no single rank can check them all
against its spec. The check is split: the first rank of every group checks its own group's
shadows (spec, waiting for restarting ones and for the last commits to settle) and
publishes what they hold in the attempt's c10d store; rank 0 of the job reads every
group's holdings, picks the newest iteration that every partition of every group holds
(memory or disk: checkmate.train.resume_point.choose_groups) and publishes it through
checkmate.train.agreement, so every rank of every group loads that one iteration, or
every rank raises the same one line (a group whose shadows lack it, a spec that differs).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from checkmate.errors import CheckmateError
from checkmate.train import agreement, resume_point
from checkmate.train.resume_point import Holding

KEY = "mesh-holdings"


def agree(sess: Any, addrs: list[tuple[str, int]]) -> dict[str, Any]:
    """This group's part of the job's restore point: ``{"iteration", "sources", "line"}``
    (``sources``: this group's partitions' memory/disk). Every rank of the job calls it."""
    from checkmate.train.restore import check_holdings

    place = sess.mesh.place
    store = agreement.attempt_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    # The n-th restore of this attempt on every rank reads the n-th holdings.
    n = store.add(f"{KEY}/asked/{rank}", 1)
    if place.dp_rank == 0:
        try:
            mine: dict[str, Any] = {"holdings": [asdict(h) for h in
                                                 check_holdings(addrs, sess.spec)]}
        except CheckmateError as e:
            mine = {"error": f"data-parallel group {place.group}: {e}"}
        store.set(f"{KEY}/{n}/{place.group}", json.dumps(mine))

    def compute() -> dict[str, Any]:
        store.set_timeout(timedelta(seconds=agreement.ANSWER_TIMEOUT))
        per_group = []
        for g in range(place.groups):
            got = json.loads(store.get(f"{KEY}/{n}/{g}"))
            if "error" in got:
                raise CheckmateError(got["error"])
            per_group.append([Holding(**{**h, "addr": tuple(h["addr"])})
                              for h in got["holdings"]])
        point, sources = resume_point.choose_groups(per_group,
                                                    getattr(sess, "resume_at", None))
        at = f"iteration {point.iteration}:"
        line = point.line if place.groups == 1 else point.line.replace(
            at, f"{at[:-1]} (all {place.groups} data-parallel groups):", 1)
        resume_point.say_line(line)
        return {"iteration": point.iteration, "sources": sources, "line": line}

    got = agreement.decide(store, "mesh-resume-point", rank, world, compute)
    return {"iteration": got["iteration"], "sources": got["sources"][place.group],
            "line": got["line"]}
