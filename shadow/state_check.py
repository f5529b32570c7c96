"""The shadow's side of the state check: what it committed, against the trainers' digests.

A checked iteration's control message carries every trainer's digest of its share of each
partition after the step (checkmate.protocol.state_digest). The shadow hashes the same
shares of the version it just committed. Equal: the iteration is verified. Different: the
state is not the trainers' (a corrupted gradient or control message, a flipped bit in
memory), and from the newest iteration known to be theirs on, nothing it holds may be
restored: those versions leave its holdings and are refused to a restore, their disk
checkpoints are removed and none is written, until the trainers have re-seeded the
partition live, which the shadow asks for at once. One line says so, naming the iteration,
the first share that differs and the parameters it covers.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from checkmate.errors import CheckmateError
from checkmate.protocol.state_digest import digest, digest_key, valid_rows
from checkmate.protocol.wire import GROUP_SHIFT
from checkmate.spec.partition import share_bounds

log = logging.getLogger("checkmate.shadow")

#: Test only: ``PARTITION:ITERATION`` makes that partition's shadow flip a bit of its
#: committed state after that iteration (the fault the check exists for).
FLIP_AT = "CHECKMATE_SHADOW_FLIP_AT"


class StateCheck:
    """What the checks found so far, for one partition (used under the state's lock)."""

    def __init__(self, partition: int) -> None:
        self.partition = partition
        #: The newest iteration known to hold the trainers' state: installed from them (a
        #: seed, a re-seed, a checked disk checkpoint) or verified by a check.
        self.trusted: int | None = None
        #: Versions after this iteration are not restorable (a check failed); None: all are.
        self.suspect_after: int | None = None
        self.verified: int | None = None  # the newest iteration a check passed
        self.diverged = ""  # the failed check's line, until the state is installed anew
        self.recovering = False  # a check failed and none has passed since
        self.checks = self.failures = 0
        self.first_failed: int | None = None  # the iteration the last divergence was found
        self.flip_at = _flip_at(partition)

    def installed(self, iteration: int | None) -> None:
        """A state from the trainers (or their verified checkpoint) became the partition's;
        None: a state not known to be theirs (an unverified checkpoint)."""
        self.trusted, self.suspect_after, self.diverged = iteration, None, ""

    def restorable(self, iteration: int) -> bool:
        return self.suspect_after is None or iteration <= self.suspect_after

    def committed(self, state: Any, rows: list[list[str]]) -> None:
        """The version ``state`` just committed against the trainers' digests ``rows``; a
        difference is said, the re-seed asked for and the disk checkpoints since the
        trusted iteration dropped (``state.on_diverged``)."""
        trusted = self.trusted
        line = self.compare(state, state.versions[-1], rows)
        if line is None:
            return
        log.error("%s", line)
        state.last_error = line
        if self.suspect_after is None:
            return  # digests it could not check: said, nothing else changes
        if state.asm is not None:
            state.asm.want_reseed(f"the state check of iteration "
                                  f"{state.versions[-1].iteration} failed")
        if state.on_diverged is not None:
            state.on_diverged(0 if trusted is None else trusted + 1)

    def compare(self, state: Any, version: Any, rows: list[list[str]]) -> str | None:
        """Check ``version`` (just committed) against the trainers' digests ``rows``; the
        line to say when it differs (once per divergence), else None."""
        spec, it = state.spec, version.iteration
        self.checks += 1
        if len(rows[0]) != state.partitions:
            return (f"partition {self.partition}: iteration {it}: the trainers sent digests "
                    f"for {len(rows[0])} partitions, the job has {state.partitions}: not "
                    "checked")
        key = digest_key(state.control_key)
        world = len(rows)
        bad = []
        for r in range(world):
            a, b = share_bounds(state.start, state.end, r, world)
            got = digest(key, [version.slots[s][a - state.start:b - state.start]
                               for s in spec.slots])
            if got != rows[r][self.partition]:
                bad.append((r, a, b))
        if not bad:
            if self.recovering:
                log.warning("partition %d: iteration %d: the state matches the trainers' "
                            "again", self.partition, it)
            self.verified = self.trusted = it
            self.diverged, self.recovering = "", False
            version.verified = True
            if state.on_verified is not None:
                state.on_verified(it)
            return None
        self.failures += 1
        if self.first_failed is None or self.suspect_after is None:
            self.first_failed = it  # where this divergence was found
        if self.suspect_after is not None:
            return None  # said when it began; the re-seed is asked for
        self.suspect_after = -1 if self.trusted is None else self.trusted
        self.recovering = True
        r, a, b = bad[0]
        names = [p.name for p in spec.params if p.offset < b and a < p.offset + p.numel]
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3
                                        else "")
        since = ("nothing it holds" if self.trusted is None
                 else f"nothing after iteration {self.trusted}")
        group = (state.job >> GROUP_SHIFT) - 1  # a mesh job's group is its job id's top byte
        self.diverged = (
            f"{f'group {group} ' if group >= 0 else ''}partition {self.partition}: "
            f"iteration {it}: the committed state differs from "
            f"the trainers' ({len(bad)} of {world} ranks' shares; the first, rank {r}'s, "
            f"elements [{a}, {b}) of {shown}): {since} is restorable until the trainers "
            "re-seed the partition, asked for now")
        return self.diverged

    def maybe_flip(self, state: Any, version: Any) -> None:
        """The test-only fault (FLIP_AT): one bit of the committed state, which the
        following steps carry on."""
        if self.flip_at is not None and version.iteration == self.flip_at:
            self.flip_at = None
            first = version.slots[state.spec.slots[0]]
            first[:1].view("<i4")[0] ^= 1 << 20
            log.warning("partition %d: test fault: flipped a bit of iteration %d's state",
                        self.partition, version.iteration)

    def status(self) -> dict[str, Any]:
        return {"verified_iteration": self.verified, "trusted_iteration": self.trusted,
                "checks": self.checks, "found_at": self.first_failed,
                "failures": self.failures, "diverged": self.diverged,
                "restorable_until": self.suspect_after}


def _flip_at(partition: int) -> int | None:
    text = os.environ.get(FLIP_AT, "")
    part, _, it = text.partition(":")
    if part.isdigit() and it.isdigit() and int(part) == partition:
        return int(it)
    return None


def check_newest(state: Any, iteration: int, rows: object) -> dict[str, Any]:
    """The ``check`` request (``finish()`` when the last iteration was not a checked one):
    the newest committed version, ``iteration``, against the trainers' digests ``rows``,
    as a checked control message would have it (a difference is said, withdrawn and
    re-seeded the same way). Refused, changing nothing, for another iteration or rows of
    another form."""
    if not valid_rows(rows):
        raise CheckmateError("check 'digests' must be one list per rank of one 32-digit hex "
                             "digest per partition")
    assert isinstance(rows, list)
    with state.lock:
        newest = state.versions[-1].iteration if state.versions else None
        if newest != iteration:
            raise CheckmateError(f"check: iteration {iteration} is not the newest committed "
                                 f"({newest})")
        c = state.check
        if c.verified != iteration:
            c.committed(state, rows)
        return {"iteration": iteration, "verified": c.verified == iteration,
                "diverged": c.diverged}

