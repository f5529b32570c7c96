"""``checkmate checkpoints``: the iterations a job's shadows hold, per partition, and which
of them a resume (or ``checkmate launch --resume-at``) can start from.

Each shadow is asked what it can serve (the ``holdings`` op: iterations retained in memory,
complete checkpoints on disk, and which of them passed the state check); an iteration every
partition holds, in memory or on disk, is one a resume can load. A mesh job's shadows are
``--groups`` equal sets, group 0's first (as the launcher lists them); a resume needs an
iteration every partition of every group holds.
"""

from __future__ import annotations

import argparse

from checkmate.errors import CheckmateError
from checkmate.train import resume_point
from checkmate.train.shadow_client import parse_addr


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="checkmate checkpoints",
        description="What a job's shadows hold, in memory and on disk, and where a resume "
                    "can start.")
    ap.add_argument("--shadow", action="append", default=[], metavar="HOST[:PORT]",
                    help="a shadow's TCP service, once per partition, in order (a mesh job: "
                         "group 0's partitions, then group 1's, ...)")
    ap.add_argument("--groups", type=int, default=1, metavar="G",
                    help="data-parallel groups of a mesh job (its --pp x --tp; default 1)")
    return ap


def main(argv: list[str]) -> int:
    a = _parser().parse_args(argv)
    if not a.shadow:
        raise CheckmateError("give --shadow HOST[:PORT] once per partition")
    if a.groups < 1 or len(a.shadow) % a.groups:
        raise CheckmateError(f"--groups {a.groups} does not divide the {len(a.shadow)} "
                             "shadows into equal sets")
    addrs = [parse_addr(s) for s in a.shadow]
    per = len(addrs) // a.groups
    groups = [resume_point.ask(addrs[g * per:(g + 1) * per]) for g in range(a.groups)]
    flat = []
    for g, hs in enumerate(groups):
        for h in hs:
            if a.groups > 1:
                h.group = g
            print(h.describe() + (f" (reloaded {h.reloaded} from disk at start)"
                                  if h.reloaded is not None else ""))
            flat.append(h)
    common: set[int] | None = None
    for h in flat:
        held = set(h.memory) | set(h.disk)
        common = held if common is None else common & held
    if any(h.error for h in flat) or not common:
        print("a resume can start at: no iteration (not every partition holds one)")
        return 1
    print(f"a resume can start at: {resume_point.spans(sorted(common))} (newest "
          f"{max(common)}; `checkmate launch --resume-at ITERATION` rewinds to another)")
    checked = set.intersection(*(set(h.verified) for h in flat)) & common
    if checked:
        print(f"verified in every partition: {resume_point.spans(sorted(checked))} (newest "
              f"{max(checked)}: the shadows' state equalled the trainers' there)")
    else:
        print("verified in every partition: none (a job run with --verify-every K has the "
              "shadows check their state against the trainers' every K iterations)")
    return 0
