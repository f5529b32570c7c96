"""Where a resume starts: the newest iteration every partition holds, in memory or on disk.

Each shadow says what it can serve (the ``holdings`` op: the iterations it retains in
memory, and the restorable checkpoints of its partition on disk). The resume point is the
newest iteration in the intersection, over partitions, of memory and disk; each partition
is read from memory where it still holds that iteration there, else from its checkpoint.
So a correlated failure (a shadow and every trainer killed close together, as a rack or
power-domain failure does) resumes from disk instead of failing because no iteration is
in every shadow's memory any more.

A shadow that cannot be reached yet (restarting after the same failure) is waited for, up
to ``wait`` seconds, with one line saying so. Only "there is nothing" fails: one line naming
what each partition holds, or that it cannot be reached.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from checkmate.errors import CheckmateError

Addr = tuple[str, int]

def say_line(line: str) -> None:
    """Diagnostics go to stderr: a worker's stdout may be a machine-read event stream."""
    print(line, file=sys.stderr, flush=True)


#: Seconds a resume waits for a shadow that cannot be reached (a restarting one).
RESUME_WAIT = 60.0


@dataclass
class Holding:
    """What one partition's shadow can serve, or why it cannot be asked."""

    partition: int
    addr: Addr
    memory: list[int] = field(default_factory=list)
    disk: list[int] = field(default_factory=list)
    error: str = ""
    #: the iteration the shadow reloaded from its disk at start (in memory since)
    reloaded: int | None = None
    #: a mesh job's data-parallel group (checkmate.train.mesh_restore); None: the only one
    group: int | None = None
    #: of memory and disk, the iterations that passed the state check (``--verify-every``)
    verified: list[int] = field(default_factory=list)

    @property
    def name(self) -> str:
        g = "" if self.group is None else f"group {self.group} "
        return f"{g}partition {self.partition}"

    @property
    def where(self) -> str:
        return f"{self.name} ({self.addr[0]}:{self.addr[1]})"

    def describe(self) -> str:
        if self.error:
            return f"{self.where} cannot be reached: {self.error}"
        checked = f", verified {spans(self.verified)}" if self.verified else ""
        return (f"{self.where} memory {spans(self.memory) or 'none'}, "
                f"disk {spans(self.disk) or 'none'}{checked}")


@dataclass
class ResumePoint:
    """The iteration to resume from and, per partition, ``memory`` or ``disk``."""

    iteration: int
    sources: list[str]
    line: str


def spans(its: Sequence[int]) -> str:
    """Iterations as runs: [3, 4, 5, 9] -> '3-5,9'."""
    out: list[str] = []
    its = sorted(its)
    i = 0
    while i < len(its):
        j = i
        while j + 1 < len(its) and its[j + 1] == its[j] + 1:
            j += 1
        out.append(str(its[i]) if i == j else f"{its[i]}-{its[j]}")
        i = j + 1
    return ",".join(out)


def ask(addrs: Sequence[Addr], timeout: float = 10.0) -> list[Holding]:
    """Every shadow's holdings once; an unreachable shadow or a refusal is an ``error``."""
    from checkmate.train.shadow_client import ShadowClient

    out = []
    for p, a in enumerate(addrs):
        h = Holding(p, a)
        try:
            with ShadowClient(a, timeout) as c:
                reply = c.holdings()
            if reply.get("partition") != p:
                raise CheckmateError(f"it serves partition {reply.get('partition')}, not {p}")
            h.memory = sorted(int(i) for i in reply.get("memory") or [])
            h.disk = sorted(int(i) for i in reply.get("disk") or [])
            h.verified = sorted(int(i) for i in reply.get("verified") or [])
            r = reply.get("reloaded")
            h.reloaded = r if isinstance(r, int) and not isinstance(r, bool) else None
        except (CheckmateError, OSError) as e:
            h.error = " ".join(str(e).split()) or type(e).__name__
        out.append(h)
    return out


def survey(addrs: Sequence[Addr], wait: float = RESUME_WAIT,
           say: Callable[[str], None] = say_line) -> list[Holding]:
    """Holdings of every shadow, waiting up to ``wait`` seconds for unreachable ones."""
    deadline = time.monotonic() + wait
    told = False
    while True:
        hs = ask(addrs)
        down = [h for h in hs if h.error]
        if not down or time.monotonic() >= deadline:
            return hs
        if not told:
            say(f"checkmate: resume waits up to {wait:.0f}s for "
                + "; ".join(h.describe() for h in down))
            told = True
        time.sleep(0.5)


def choose(hs: Sequence[Holding], at: int | None = None) -> ResumePoint:
    """The newest iteration every partition holds (memory first, then disk), with its line;
    CheckmateError naming what is missing when there is none. ``at``: that iteration (a
    rewind), or one line naming what every partition holds."""
    if not hs:
        raise CheckmateError("resume: no shadow addresses given")
    down = [h for h in hs if h.error]
    if down:
        raise CheckmateError("resume: nothing to resume from: " +
                             "; ".join(h.describe() for h in down))
    empty = [h for h in hs if not h.memory and not h.disk]
    if empty:
        h = empty[0]
        raise CheckmateError(
            f"resume=True but the shadow of {h.where} holds no state to restore (never "
            "seeded, nothing on disk); start the job with resume=False")
    common = set(hs[0].memory) | set(hs[0].disk)
    for h in hs[1:]:
        common &= set(h.memory) | set(h.disk)
    if not common:
        raise CheckmateError("resume: no iteration is held by every partition, in memory "
                             "or on disk: " + "; ".join(h.describe() for h in hs))
    if at is not None and at not in common:
        raise CheckmateError(f"resume at iteration {at}: not held by every partition; held "
                             f"by all: {spans(sorted(common))} (" +
                             "; ".join(h.describe() for h in hs) + ")")
    it = max(common) if at is None else at
    sources = ["memory" if it in h.memory else "disk" for h in hs]
    reloaded = [h.name for h, s in zip(hs, sources, strict=True)
                if s == "memory" and h.reloaded == it]
    if at is not None and at != max(common):
        why = (f"rewound as asked (newest held by all: {max(common)}); "
               + ("every shadow holds it in memory" if all(s == "memory" for s in sources)
                  else ", ".join(f"{h.name} from {s}" for h, s in zip(hs, sources,
                                                                       strict=True))))
    elif all(s == "memory" for s in sources):
        why = "every shadow holds it in memory"
        if reloaded:
            why += (f" (partition(s) {', '.join(n.removeprefix('partition ') for n in reloaded)}"
                    " reloaded it from disk at start)")
    else:
        parts = []
        for h, s in zip(hs, sources, strict=True):
            parts.append(f"{h.name} from {s}" + (
                f" (memory holds {spans(h.memory) or 'nothing'})" if s == "disk" else
                " (reloaded from disk at start)" if h.name in reloaded else ""))
        why = ", ".join(parts) + "; no newer iteration is held by every partition"
    return ResumePoint(it, sources, f"checkmate: resuming at iteration {it}: {why}")


def choose_groups(per_group: Sequence[Sequence[Holding]], at: int | None = None
                  ) -> tuple[ResumePoint, list[list[str]]]:
    """:func:`choose` over every partition of every data-parallel group of a mesh job (one
    iteration for all of them), with each group's sources."""
    flat = [replace(h, group=g) for g, hs in enumerate(per_group) for h in hs]
    point = choose(flat, at)
    out, at = [], 0
    for hs in per_group:
        out.append(point.sources[at:at + len(hs)])
        at += len(hs)
    return point, out


def merge_replicas(per_set: Sequence[Sequence[Holding]]) -> list[Holding]:
    """Per partition, what any of its replicas can serve (``per_set``: :func:`ask` of each
    replica set): the union of their iterations; an error only when no replica answered.
    The address is the replica with the newest iteration in memory (:func:`replica_for`
    picks the one to read a given iteration from)."""
    out = []
    for p, reps in enumerate(zip(*per_set, strict=True)):
        live = [h for h in reps if not h.error]
        if not live:
            out.append(replace(reps[0], error="; ".join(
                f"replica {k} ({h.addr[0]}:{h.addr[1]}): {h.error}"
                for k, h in enumerate(reps))))
            continue
        best = max(live, key=lambda h: (max(h.memory, default=-1), max(h.disk, default=-1)))
        # an iteration reloaded from disk at start by every replica holding it in memory
        rel = {h.reloaded for h in live if h.reloaded is not None}
        reloaded = next((r for r in sorted(rel) if all(
            h.reloaded == r for h in live if r in h.memory)), None)
        out.append(replace(best, partition=p,
                           memory=sorted(set().union(*(h.memory for h in live))),
                           disk=sorted(set().union(*(h.disk for h in live))),
                           verified=sorted(set().union(*(h.verified for h in live))),
                           reloaded=reloaded))
    return out


def replica_for(per_set: Sequence[Sequence[Holding]], partition: int, iteration: int
                ) -> tuple[Addr, str]:
    """The replica of ``partition`` to read ``iteration`` from, and whether from its
    ``memory`` or ``disk``: one that holds it in memory first."""
    reps = [hs[partition] for hs in per_set if not hs[partition].error]
    for h in reps:
        if iteration in h.memory:
            return h.addr, "memory"
    for h in reps:
        if iteration in h.disk:
            return h.addr, "disk"
    raise CheckmateError(f"resume: no replica of partition {partition} holds iteration "
                         f"{iteration}")


def find(addrs: Sequence[Addr], wait: float = RESUME_WAIT,
         say: Callable[[str], None] = say_line) -> ResumePoint:
    """:func:`survey` then :func:`choose`."""
    return choose(survey(addrs, wait, say))
