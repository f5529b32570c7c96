"""Which iterations a shadow writes to disk: the same ones on every partition.

A restore from disk needs an iteration that *every* partition wrote. The partitions'
writers run at different speeds (each shadow has its own disk, load and partition size), so
a rule "skip a due iteration while a write still runs" lets them skip different ones, and a
correlated failure can then find no iteration common to all (seen with ``--persist-every 5``
under load).

The rule here never depends on timing for *which* iterations survive, only for *how many*:
iterations are due at multiples of ``every``; an iteration's level is how many times
``2 * every`` divides it (10 is level 1 for every=5, 20 level 2, 15 level 0). A partition
at level L writes every due iteration of level >= L. When a due iteration finds the backlog
full (``backlog`` versions waiting behind the running write), the partition steps up to
L + 1 and drops only waiting iterations of level L; when its writer runs dry, it steps
back down one level. So an iteration of level >= M, M the highest level any partition
reached, is written by every partition that is alive and whose disk works: the partitions
stay aligned on multiples of ``every * 2**M``, and a slow disk thins out the checkpoints
instead of scattering them.
"""

from __future__ import annotations

#: the level is capped (every * 2**MAX_LEVEL iterations apart); at the cap a full backlog
#: drops the new iteration instead.
MAX_LEVEL = 20


class PersistSchedule:
    """The aligned write schedule of one partition (pure bookkeeping; the Persister keeps
    the versions and calls it under its lock)."""

    def __init__(self, every: int, backlog: int = 2) -> None:
        if every < 1 or backlog < 1:
            raise ValueError(f"every and backlog must be >= 1, got {every}, {backlog}")
        self.every, self.backlog = every, backlog
        self.level = 0
        self.max_level = 0  # the highest level reached (status: how thin it got)

    def slot_level(self, iteration: int) -> int | None:
        """The level of a due iteration; None if it is not a multiple of ``every``."""
        if iteration % self.every:
            return None
        k, level = iteration // self.every, 0
        while k and k % 2 == 0 and level < MAX_LEVEL:
            k //= 2
            level += 1
        return MAX_LEVEL if k == 0 else level

    def admit(self, iteration: int, waiting: list[int]) -> tuple[bool, list[int]]:
        """A due iteration committed while ``waiting`` (oldest first) wait behind the
        running write: (queue it?, the waiting iterations to drop)."""
        level = self.slot_level(iteration)
        if level is None or level < self.level:
            return False, []
        drop: list[int] = []
        left = list(waiting)
        while len(left) >= self.backlog:
            if self.level >= MAX_LEVEL:
                return False, drop  # never reached in practice: keep what waits
            self.level += 1
            self.max_level = max(self.max_level, self.level)
            gone = [it for it in left if (self.slot_level(it) or 0) < self.level]
            drop += gone
            left = [it for it in left if it not in gone]
            if level < self.level:
                return False, drop
        return True, drop

    def drained(self) -> None:
        """The writer found nothing waiting after a write: one level finer again."""
        if self.level:
            self.level -= 1

    @property
    def spacing(self) -> int:
        """Iterations between the writes due at the current level."""
        return self.every << self.level
