"""A shadow's replica of one partition: seeding, the optimizer step, retained versions.

Consistency by version retention: after every committed iteration the partition's slots are
copied into an immutable version, and the last ``retain`` versions are kept. A restore asks
every shadow what it retains and takes the newest iteration they all hold, so no
cross-shadow commit protocol is needed on the training path (shadows never talk to each
other and never slow the trainers); the price is ``retain`` extra copies of the partition in
memory, and a restore point at most ``retain - 1`` iterations behind the slowest shadow's
newest when shadows drift apart. Versions being served or persisted are pinned and their
arrays are recycled only after they are released.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from checkmate.errors import CheckmateError
from checkmate.shadow import control_message
from checkmate.shadow.assembler import Assembler
from checkmate.shadow.control_message import Control
from checkmate.shadow.intervals import IntervalSet
from checkmate.shadow.kernels import make_optimizer, warm_up
from checkmate.shadow.osname import name_thread
from checkmate.shadow.state_check import StateCheck
from checkmate.spec.model import ModelSpec

log = logging.getLogger("checkmate.shadow")


@dataclass
class Version:
    """One committed iteration of the partition; its arrays never change once committed."""

    iteration: int
    step: int
    slots: dict[str, np.ndarray]
    buffers: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    lrs: list[float] | None = None
    pins: int = 0
    evicted: bool = False
    #: the state check found it equal to the trainers' (shadow/state_check.py)
    verified: bool = False


#: The job id of a shadow started without one (no --config): it serves the job of the
#: first spec it is seeded with (or restores from disk).
ANY_JOB = 0


class ShadowState:
    """Everything the shadow knows about its partition, shared by its threads."""

    def __init__(self, partition: int, partitions: int, job: int, retain: int = 4,
                 window: int = 8, gap_timeout: float = 2.0,
                 on_commit: Callable[[Version], None] | None = None) -> None:
        if retain < 1:
            raise CheckmateError(f"retain must be >= 1, got {retain}")
        self.partition, self.partitions, self.job = partition, partitions, job
        #: checkmate.protocol.datamac.control_key of the job secret: control messages must end with
        #: their MAC (set by the node; None only where the check's cost is measured).
        self.control_key: bytes | None = None
        self.retain, self.window, self.gap_timeout = retain, window, gap_timeout
        self.on_commit = on_commit
        #: called by ``apply`` after a commit, outside the lock (Persister.wait_room: the
        #: step waits for a writer that is behind, while readers are answered)
        self.after_commit: Callable[[], None] | None = None
        self.spec: ModelSpec | None = None
        self.start = self.end = 0
        self.opt: Any = None
        self.asm: Assembler | None = None
        self.on_assembler: Callable[[Assembler], None] | None = None
        self.drops: Any = None  # Counter shared with the receiver, set by the node
        self.lock = threading.RLock()
        self.versions: deque[Version] = deque()
        self._free: list[dict[str, np.ndarray]] = []
        self.seeded_iteration: int | None = None
        self.installs = 0  # states installed (seed, disk restore, re-seed): lineage changes
        self._seed: dict[str, Any] | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._stepper: threading.Thread | None = None
        self.committed_count = 0
        self.step_seconds = 0.0
        self.last_error = ""
        #: A live re-seed in progress (checkmate.shadow.reseed), completed re-seeds, and why
        #: the last one started.
        self.reseed: Any = None
        self.reseeds_done = 0
        self.reseed_reason = ""
        self._reseed_pending: str | None = None
        #: when the running re-seed was asked for (the trainers' reseed op, monotonic), and
        #: how long the last one took from there to its commit: the time to current
        self.reseed_started: float | None = None
        self.reseed_seconds: float | None = None
        #: (iteration, wall-clock time) of recent commits: commit lag is measured from them.
        self.commit_times: deque[tuple[int, float]] = deque(maxlen=4096)
        #: The trainers' digests checked against what was committed (shadow.state_check);
        #: ``on_diverged(since)``: a check failed, nothing from ``since`` on is the
        #: trainers' (the node removes those disk checkpoints).
        self.check = StateCheck(partition)
        self.on_diverged: Callable[[int], None] | None = None
        #: ``on_verified(iteration)``: a check passed (the node marks its checkpoint).
        self.on_verified: Callable[[int], None] | None = None

    # ----- spec -------------------------------------------------------------------------
    def set_spec(self, spec: ModelSpec) -> None:
        """Accept the job's spec once; the same spec again is fine, a different one is not."""
        with self.lock:
            if self.spec is not None:
                if self.spec.dumps() != spec.dumps():
                    raise CheckmateError("a different spec is already set for this job")
                return
            if self.job == ANY_JOB:  # started without a config: the seed names the job
                self.job = spec.job
            elif spec.job != self.job:
                raise CheckmateError(f"spec is for job {spec.job}, this shadow serves "
                                     f"job {self.job}")
            if spec.partitions != self.partitions:
                raise CheckmateError(f"spec has {spec.partitions} partitions, this shadow is "
                                     f"one of {self.partitions}")
            self.spec = spec
            self.start, self.end = spec.bounds(self.partition)

    @property
    def size(self) -> int:
        return self.end - self.start

    # ----- seeding ----------------------------------------------------------------------
    def seed(self, iteration: int, slot: str, offset: int, count: int, step: int,
             data: memoryview, buffers: dict | None = None, extra: dict | None = None) -> bool:
        """Take one seed share; True once every slot of the partition is covered."""
        with self.lock:
            spec = self.spec
            if spec is None:
                raise CheckmateError("no spec yet: send the spec op before seeding")
            if slot not in spec.slots:
                raise CheckmateError(f"unknown slot {slot!r} for {spec.kind} "
                                     f"(slots: {', '.join(spec.slots)})")
            if offset < self.start or offset + count > self.end or count < 0:
                raise CheckmateError(
                    f"seed range [{offset}, {offset + count}) is outside partition "
                    f"{self.partition} [{self.start}, {self.end})")
            if len(data) != 4 * count:
                raise CheckmateError(f"seed carries {len(data)} bytes for {count} float32")
            if iteration < 0 or step < 0:
                raise CheckmateError("seed iteration and step must be >= 0")
            if not isinstance(buffers or {}, dict) or not isinstance(extra or {}, dict):
                raise CheckmateError("seed buffers and extra must be objects")
            sd = self._seed
            if sd is None or sd["iteration"] != iteration or sd["step"] != step:
                sd = self._seed = {
                    "iteration": iteration, "step": step, "buffers": {}, "extra": {},
                    "arrays": {s: np.zeros(self.size, np.float32) for s in spec.slots},
                    "cov": {s: IntervalSet() for s in spec.slots},
                }
            if buffers:
                sd["buffers"] = dict(buffers)
            if extra:
                sd["extra"] = dict(extra)
            a = offset - self.start
            sd["arrays"][slot][a:a + count] = np.frombuffer(data, dtype="<f4")
            sd["cov"][slot].add(a, a + count)
            if all(c.total == self.size for c in sd["cov"].values()):
                self._seed = None
                self.install(iteration, step, sd["arrays"], sd["buffers"], sd["extra"])
                return True
            return False

    def install(self, iteration: int, step: int, arrays: dict[str, np.ndarray],
                buffers: dict | None = None, extra: dict | None = None,
                lrs: list[float] | None = None, reset_assembler: bool = True,
                trusted: bool = True) -> None:
        """Make ``arrays`` the partition's state at ``iteration`` (seed, disk restore, or
        the end of a live re-seed, where the assembler is already past ``iteration``).
        ``trusted``: known to be the trainers' state (False: a checkpoint no check
        passed, which a failed check later withdraws with what followed it)."""
        with self.lock:
            spec = self.spec
            assert spec is not None
            warm_up(spec)  # before anyone sees "seeded"
            opt = make_optimizer(spec, self.start, self.end)
            opt.load({s: arrays[s] for s in spec.slots}, step)
            self.opt = opt
            self.reseed = None
            for v in self.versions:
                v.evicted = True
            self.versions.clear()
            self.seeded_iteration = iteration
            self.installs += 1
            self.check.installed(iteration if trusted else None)
            self._commit(iteration, buffers or {}, extra or {}, lrs)
            if not self._ensure_assembler(iteration) and reset_assembler:
                assert self.asm is not None
                self.asm.request_reset(iteration)
            log.info("partition %d of job %d state installed at iteration %d (step %d)",
                     self.partition, self.job, iteration, step)

    def _ensure_assembler(self, iteration: int) -> bool:
        """Create the assembler (and stepper) expecting ``iteration`` + 1; False if one exists."""
        if self.asm is not None:
            return False
        spec = self.spec
        assert spec is not None
        self.asm = Assembler(self.start, self.end, len(spec.groups), self._enqueue,
                             self.drops, self.window, self.gap_timeout, job=self.job,
                             control_key=self.control_key,
                             control_limit=control_message.control_limit(spec),
                             buffers=control_message.buffer_sizes(spec))
        self.asm.committed = iteration
        self.asm.next_dispatch = iteration + 1
        self.asm.on_wanted = self._reseed_failed
        self._start_stepper()
        if self.on_assembler is not None:
            self.on_assembler(self.asm)
        return True

    # ----- live re-seed -----------------------------------------------------------------
    def prepare_reseed(self, reason: str) -> None:
        """Get ready for a live re-seed (the spec is set): compile the optimizer kernels now,
        before the first piece fixes the start iteration, so no gradient is dropped while
        compiling. The re-seed begins at the first piece's iteration."""
        if self.spec is None:
            raise CheckmateError("no spec yet: send it with the reseed op")
        started = time.monotonic()
        warm_up(self.spec)
        with self.lock:
            self.reseed = None
            self._reseed_pending = reason
            if self.reseed_started is None:  # a retry counts from the first ask
                self.reseed_started = started

    def _reseed_failed(self, reason: str) -> None:
        """A hole the trainers no longer hold: a running re-seed cannot finish; drop it so
        the trainers see ``reseed.wanted`` and start over."""
        with self.lock:
            if self.reseed is not None:
                log.error("partition %d: re-seed from iteration %d abandoned: %s",
                          self.partition, self.reseed.t0, reason)
                self.reseed = None

    def begin_reseed(self, t0: int, reason: str) -> None:
        """Start collecting re-seed pieces from iteration ``t0`` on (checkmate.shadow.reseed).

        Gradients from ``t0`` + 1 on are assembled as usual (holes repaired) and roll the
        pieces forward; retained versions stay restorable until the re-seed commits.
        """
        from checkmate.shadow.reseed import Reseed

        with self.lock:
            if self.spec is None:
                raise CheckmateError("no spec yet: send it with the reseed op")
            if t0 < 0:
                raise CheckmateError("reseed iteration must be >= 0")
            if self.reseed_started is None:
                self.reseed_started = time.monotonic()
            warm_up(self.spec)
            self.reseed = Reseed(self.spec, self.start, self.end, t0, reason,
                                 limit=max(self.window, 8))
            self.reseed_reason = reason
            if not self._ensure_assembler(t0):
                assert self.asm is not None
                self.asm.request_reset(t0)
            log.warning("partition %d: live re-seed from iteration %d (%s)", self.partition,
                        t0, reason)

    def reseed_piece(self, iteration: int, step: int, offset: int, count: int,
                     arrays: dict[str, np.ndarray]) -> bool:
        """Take one piece; True once the re-seed committed. The first piece after
        ``prepare_reseed`` begins the re-seed at its iteration."""
        with self.lock:
            # Checked before the first piece begins the re-seed: a refused piece changes
            # nothing (add_piece checks the rest against a re-seed in progress).
            if step < 0 or iteration < 0:
                raise CheckmateError("reseed iteration and step must be >= 0")
            if offset < self.start or offset + count > self.end or count <= 0:
                raise CheckmateError(f"re-seed piece [{offset}, {offset + count}) is outside "
                                     f"the partition [{self.start}, {self.end})")
            if self.reseed is None and self._reseed_pending is not None:
                reason, self._reseed_pending = self._reseed_pending, None
                self.begin_reseed(iteration, reason)
            if self.reseed is None:
                raise CheckmateError("no re-seed in progress (send the reseed op first)")
            self.reseed.add_piece(iteration, step, offset, count, arrays)
            return self._maybe_finish_reseed()

    def _maybe_finish_reseed(self) -> bool:
        rs = self.reseed
        if rs is None or not rs.done():
            return False
        it, step, arrays, ctl = rs.result()
        self.install(it, step, arrays, ctl.buffers, ctl.extra, ctl.lrs, reset_assembler=False)
        self.reseeds_done += 1
        if self.reseed_started is not None:
            self.reseed_seconds = round(time.monotonic() - self.reseed_started, 3)
            self.reseed_started = None
        log.warning("partition %d: re-seed complete, committed iteration %d (pieces from "
                    "iteration %d on) %s", self.partition, it, rs.t0,
                    f"{self.reseed_seconds:.2f}s after it was asked for"
                    if self.reseed_seconds is not None else "")
        return True

    # ----- stepping ---------------------------------------------------------------------
    def _enqueue(self, it: int, staging: np.ndarray, control: Control) -> None:
        self._queue.put((it, staging, control))

    def _start_stepper(self) -> None:
        self._stepper = threading.Thread(target=self._step_loop, name="shadow-step",
                                         daemon=True)
        self._stepper.start()

    def stop(self) -> None:
        if self._stepper is not None:
            self._queue.put(None)
            self._stepper.join(10)

    def _step_loop(self) -> None:
        name_thread()
        while True:
            item = self._queue.get()
            if item is None:
                return
            it, staging, control = item
            try:
                self.apply(it, staging, control)
            except Exception as e:  # keep serving retained versions; say why it stopped
                self.last_error = f"step of iteration {it} failed: {e}"
                log.exception("step of iteration %d failed", it)
            finally:
                if self.asm is not None:
                    self.asm.release(staging)

    def apply(self, it: int, grad: np.ndarray, control: Control) -> None:
        """Step with iteration ``it``'s gradient and control message, then commit."""
        with self.lock:
            if self.reseed is not None:
                try:
                    self.reseed.on_iteration(it, grad, control)
                    if self.asm is not None:
                        self.asm.committed = max(self.asm.committed, it)  # window moves on
                    self._maybe_finish_reseed()
                except CheckmateError as e:  # start over: the trainers see reseed_wanted
                    self.reseed = None
                    self.last_error = f"re-seed failed: {e}"
                    if self.asm is not None:
                        self.asm.reseed_wanted = self.last_error
                    log.error("partition %d: %s", self.partition, self.last_error)
                return
            latest = self.versions[-1].iteration if self.versions else None
            if latest is None or it != latest + 1:
                return  # a reset raced with this iteration; it is stale now
            t0 = time.perf_counter()
            stepped = None
            if not control.skip:
                # Straight into the next version's arrays: the optimizer reads the newest
                # version (never written again) and its state becomes the new one.
                stepped = self._fresh_arrays()
                self.opt.step(control.step_gradient(grad), control.lrs, control.clip_coef,
                              control.hyper, out=stepped)
            self.step_seconds += time.perf_counter() - t0
            self._commit(it, control.buffers, control.extra, control.lrs, stepped)
            self.check.maybe_flip(self, self.versions[-1])
            if control.digests is not None:
                self.check.committed(self, control.digests)
        if self.after_commit is not None:  # outside the lock: a wait here blocks no reader
            self.after_commit()

    def _fresh_arrays(self) -> dict[str, np.ndarray]:
        """Arrays for the next version: an evicted, unpinned version's, or new ones."""
        assert self.spec is not None
        return self._free.pop() if self._free else {
            s: np.empty(self.size, np.float32) for s in self.spec.slots}

    def _commit(self, it: int, buffers: dict, extra: dict, lrs: list[float] | None,
                arrays: dict[str, np.ndarray] | None = None) -> None:
        """Retain the optimizer's state as iteration ``it``: ``arrays`` where the step wrote
        it there (and the optimizer's state now is those arrays), else a copy."""
        spec = self.spec
        assert spec is not None and self.opt is not None
        if arrays is None:
            arrays = self._fresh_arrays()
            for s in spec.slots:
                np.copyto(arrays[s], _slot(self.opt, s))
        v = Version(it, int(self.opt.step_count), arrays, buffers, extra, lrs)
        self.versions.append(v)
        self._evict()
        self.committed_count += 1
        self.commit_times.append((it, time.time()))
        if self.asm is not None:
            self.asm.committed = it
        if self.on_commit is not None:
            self.on_commit(v)

    def _evict(self) -> None:
        """Keep the newest ``retain`` versions, and beside them the newest one a state check
        verified: the iteration a rewind after the trainers' replicas diverge resumes at
        (checkmate.train.replica_check), however many iterations a check spans."""
        while True:
            n = len(self.versions)
            kept = n > 1 and self.versions[0].iteration == self.check.verified
            if n <= self.retain + kept:
                return
            old = self.versions[1 if kept else 0]
            self.versions.remove(old)
            old.evicted = True
            if old.pins == 0:
                self._free.append(old.slots)

    # ----- reading ----------------------------------------------------------------------
    def retained(self) -> list[int]:
        """The iterations a restore may take (a failed state check withdraws some)."""
        with self.lock:
            return [v.iteration for v in self.versions if self.check.restorable(v.iteration)]

    def verified_retained(self) -> list[int]:
        """The retained iterations a state check passed."""
        with self.lock:
            return [v.iteration for v in self.versions
                    if v.verified and self.check.restorable(v.iteration)]

    @property
    def latest(self) -> int | None:
        with self.lock:
            return self.versions[-1].iteration if self.versions else None

    def pin(self, it: int | None = None) -> Version:
        """Pin a retained version (the newest by default); CheckmateError if not retained."""
        with self.lock:
            ok = [v for v in self.versions if self.check.restorable(v.iteration)]
            for v in ok:
                if it is None and v is ok[-1] or v.iteration == it:
                    v.pins += 1
                    return v
            have = [v.iteration for v in ok]
            why = (f"; after iteration {self.check.suspect_after} none is, a state check "
                   "failed" if self.check.suspect_after is not None else "")
            raise CheckmateError(f"iteration {it} is not retained (retained: {have}{why})")

    def unpin(self, v: Version) -> None:
        with self.lock:
            v.pins -= 1
            if v.pins == 0 and v.evicted and self.spec is not None \
                    and set(v.slots) == set(self.spec.slots):
                self._free.append(v.slots)

    @contextmanager
    def pinned(self, it: int | None = None) -> Iterator[Version]:
        v = self.pin(it)
        try:
            yield v
        finally:
            self.unpin(v)


def _slot(opt: Any, name: str) -> np.ndarray:
    """The optimizer's live array for a slot."""
    return opt.state[name]
