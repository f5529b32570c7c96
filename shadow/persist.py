"""Durable checkpoints of a shadow's partition in torch.distributed.checkpoint (DCP) format.

Layout under a root directory (one per cluster, or one per shadow host)::

    root/part<p>/iter-<iteration:012d>/   one committed partition checkpoint
        .metadata, __0_0.distcp           written by dcp.save (FileSystemWriter)
        ckm.json                          iteration, step, spec, slice bounds, buffers, extra
        manifest.json                     sha256 of every other file
        verified                          present once the iteration passed the state check
    root/part<p>/latest                   name of the newest complete checkpoint
    root/iter-<iteration:012d>/           all partitions joined: what plain dcp.load reads
    root/latest                           name of the newest joined checkpoint

A checkpoint is written into a hidden temp directory, fsynced, renamed into place, and only
then is ``latest`` replaced atomically, so a crash mid-write leaves the previous checkpoint
loadable (leftover temp directories are removed at the next start; a write that fails, e.g.
on a full disk, removes its own temp directory at once). The DCP keys are torch's own
(:mod:`checkmate.shadow.torch_layout`): ``model.<param>`` and ``optim.state.<i>.<slot>`` are
the full tensors, of which the partition stores its elements as chunks at their offsets.
Once every partition dir under the root holds an iteration, :mod:`checkmate.shadow.merge`
joins them into ``root/iter-N``. :func:`load_full` reads every partition at their newest
common iteration and assembles a full model state_dict and a torch.optim state_dict, so
pruning (:func:`prune`) always keeps the newest iteration that every partition holds, and
the ones a lagging partition will write next.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from checkmate.errors import CheckmateError
from checkmate.shadow import disk, merge, torch_layout
from checkmate.shadow.checkpoint_load import _keys, newest_common
from checkmate.shadow.disk import (
    _ITER_PREFIX,
    _TMP_PREFIX,
    FORMAT,
    PersistError,
    _discard,
    _fatal,
    _fsync_path,
    _read_latest,
    _sha256,
    _write_json,
    describe_error,
    list_iterations,
    log,
    part_dir,
)
from checkmate.shadow.osname import name_thread
from checkmate.spec.model import ModelSpec


def _space_hint(pdir: Path, need: int, text: str) -> str:
    """' (disk full: ...)' when the filesystem cannot hold the checkpoint.

    A full disk often surfaces from torch.save as an opaque RuntimeError ("unexpected pos"),
    so the free space, measured after the partial write was removed, tells the operator why.
    """
    if "No space left" in text:
        return ""
    try:
        free = shutil.disk_usage(pdir).free
    except OSError:
        return ""
    if free >= need:
        return ""
    return f" (disk full: {free} bytes free, the checkpoint needs about {need})"


def save(root: str | Path, spec: ModelSpec, partition: int, iteration: int, step: int,
         slots: dict[str, np.ndarray], buffers: dict | None = None, extra: dict | None = None,
         lrs: list[float] | None = None, keep: int = 3, seeded: bool = False,
         current: Callable[[], bool] | None = None, threads: int = 1) -> Path | None:
    """Write one checkpoint atomically and point ``latest`` at it; returns its directory.

    ``threads``: DCP writer threads. ``seeded`` marks the version a seed installed
    (never joined, see merge.SeedPoint).
    ``current`` is asked under the root lock just before the rename: False (the shadow was
    re-seeded meanwhile, so this version belongs to a lineage that was purged) discards the
    write and returns None.

    Any failure (OSError, torch's CheckpointException, ...) removes the hidden temp dir and
    the temp ``latest`` before it is raised as one-line PersistError, so a full disk leaves
    nothing behind and the previous checkpoint stays ``latest``. KeyboardInterrupt and
    SystemExit are re-raised as they are (after the same cleanup).
    """
    start, end = spec.bounds(partition)
    pdir = part_dir(root, partition)
    try:
        pdir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PersistError(f"cannot create checkpoint directory {pdir}: "
                           f"{e.strerror or e}") from None
    name = f"{_ITER_PREFIX}{iteration:012d}"
    tmp = pdir / f"{_TMP_PREFIX}{name}-{os.getpid()}-{threading.get_ident()}"
    latest_tmp = pdir / f"{_TMP_PREFIX}latest-{os.getpid()}"
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        keys = _keys(spec, start, end)
        bufs = spec.decode_buffers(buffers or {})
        sd = torch_layout.partition_state_dict(spec, partition, iteration, step, slots, bufs,
                                               extra, lrs)
        torch_layout.save(sd, tmp, threads)
        _write_json(tmp / "ckm.json", {
            "format": FORMAT, "partition": partition, "partitions": spec.partitions,
            "iteration": iteration, "step": step, "start": start, "end": end,
            "pieces": [[k[0], k[1], k[2]] for k in keys], "slots": list(spec.slots),
            "spec": spec.to_json(), "buffers": buffers or {}, "extra": extra or {},
            "lrs": lrs, "written_at": time.time(), "seeded": seeded,
        })
        files = sorted(f for f in os.listdir(tmp) if f != "manifest.json")
        _write_json(tmp / "manifest.json", {f: _sha256(tmp / f) for f in files})
        _fsync_path(tmp)
        with merge.root_lock(Path(root)):
            if current is not None and not current():
                _discard(tmp)
                return None
            final = pdir / name
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
            latest_tmp.write_text(name + "\n")
            with open(latest_tmp) as f:
                os.fsync(f.fileno())
            os.replace(latest_tmp, pdir / "latest")
            _fsync_path(pdir)
    except BaseException as e:  # CheckpointException is a BaseException
        _discard(tmp, latest_tmp)
        if _fatal(e):
            raise
        text = describe_error(e)
        need = 4 * (end - start) * len(spec.slots)
        raise PersistError(f"cannot write checkpoint {pdir / name}: {text}"
                           f"{_space_hint(pdir, need, text)}") from None
    try:
        prune(pdir, keep, spec.partitions)
    except OSError as e:  # the checkpoint is written; a failed prune is retried next time
        log.warning("cannot prune %s: %s", pdir, e)
    try:
        merge.publish(Path(root), spec.partitions, iteration, keep)
    except (OSError, CheckmateError) as e:  # the partition is written; say why no join
        log.warning("cannot publish the joined checkpoint of iteration %d under %s: %s",
                    iteration, root, describe_error(e))
    return pdir / name


def purge(root: str | Path, partition: int, since: int) -> tuple[list[int], list[int]]:
    """Forget a lineage: remove this partition's checkpoints of iterations >= ``since`` and
    the joins of those iterations (they hold this partition's old state); ``latest`` files
    point at the newest left. Returns (partition iterations, joins) removed.

    A shadow calls it when it is seeded at ``since``: what it wrote from there on belongs to
    a run the trainers no longer continue, and must neither be joined with the new run's
    partitions nor be served by a later restore from disk.
    """
    root = Path(root)
    pdir = part_dir(root, partition)
    if not pdir.is_dir():
        return [], []
    with merge.root_lock(root):
        gone = []
        for e in pdir.iterdir():
            if e.name.startswith(_ITER_PREFIX):
                try:
                    it = int(e.name[len(_ITER_PREFIX):])
                except ValueError:
                    continue
                if it >= since:
                    shutil.rmtree(e, ignore_errors=True)
                    gone.append(it)
        if gone:
            left = list_iterations(pdir)
            if left:
                (pdir / f"{_TMP_PREFIX}latest").write_text(f"{_ITER_PREFIX}{left[-1]:012d}\n")
                os.replace(pdir / f"{_TMP_PREFIX}latest", pdir / "latest")
            else:
                (pdir / "latest").unlink(missing_ok=True)
            _fsync_path(pdir)
        joins = merge.drop_joins(root, since)
    return sorted(gone), joins


def prune(pdir: Path, keep: int, partitions: int | None = None) -> list[int]:
    """Remove all but the newest ``keep`` checkpoints; returns the iterations removed.

    Never removed: the one ``latest`` names and -- with ``partitions`` given -- what a
    sibling partition dir under ``pdir.parent`` still needs to share one with this one:
    the newest iteration every partition holds (:func:`newest_common`, what
    :func:`load_full` restores from), and for each sibling the ``keep`` oldest of this
    partition's iterations newer than that sibling's newest. The partitions write the same
    iterations (:class:`Persister`), so those are the next ones a lagging sibling writes: a
    partition whose writer runs ahead cannot delete the iteration a slower one is about to
    make common. Hence this partition holds at most ``2 * keep`` (+ the common one) while a
    sibling lags, and if no partition's newest is more than ``2 * keep`` writes ahead of
    another's, every partition holds the newest iteration of the slowest one. A sibling dir
    that does not exist (a partition persisted elsewhere) constrains nothing.
    ``keep`` <= 0 prunes nothing.
    """
    its = list_iterations(pdir)
    if keep <= 0 or len(its) <= keep:
        return []
    protected = {_read_latest(pdir)}
    if partitions:
        held = newest_common(pdir.parent, partitions)
        if held is not None:
            protected.add(f"{_ITER_PREFIX}{held:012d}")
        for q in range(partitions):
            sib = part_dir(pdir.parent, q)
            if sib == pdir or not sib.is_dir():
                continue
            theirs = list_iterations(sib)
            newest = theirs[-1] if theirs else -1
            protected.update(f"{_ITER_PREFIX}{it:012d}"
                             for it in [i for i in its if i > newest][:keep])
    removed = []
    for it in its[:-keep]:
        name = f"{_ITER_PREFIX}{it:012d}"
        if name not in protected:
            shutil.rmtree(pdir / name, ignore_errors=True)
            removed.append(it)
    return removed


def clean_temp(pdir: Path) -> list[str]:
    """Remove leftovers of interrupted writes; returns their names."""
    gone = []
    if pdir.is_dir():
        for e in pdir.iterdir():
            if e.name.startswith(_TMP_PREFIX):
                if e.is_dir():
                    shutil.rmtree(e, ignore_errors=True)
                else:
                    e.unlink(missing_ok=True)
                gone.append(e.name)
    return gone


def restorable_iterations(pdir: Path) -> list[int]:
    """Complete checkpoints a restore may use, ascending: those a seed wrote are left out
    (as in :func:`load_full_state`, a seed point is never joined with its siblings). Cheap:
    reads each ckm.json, not the tensors; the manifest is checked when one is loaded."""
    out = []
    for it in list_iterations(pdir):
        try:
            meta = json.loads((pdir / f"{_ITER_PREFIX}{it:012d}" / "ckm.json").read_text())
        except (OSError, ValueError):
            continue  # pruned or purged meanwhile, or unreadable: not offered
        if isinstance(meta, dict) and not meta.get("seeded"):
            out.append(it)
    return out


class Persister:
    """Writes the due versions in the background, the same iterations on every partition.

    With ``every`` > 0 the due versions are exactly the multiples of ``every`` (plus none
    other), and none is skipped: a restore from disk needs an iteration that *every*
    partition wrote, and partitions whose writers run at different speeds would skip
    different ones. Up to ``backlog`` due versions wait, pinned, behind a running write;
    when more do, the step that committed the last one waits in :meth:`wait_room` (outside
    the state lock; receiving goes on) until the running write ends. So a partition's
    newest checkpoint is at most (``backlog`` + 1) * ``every`` iterations behind its newest
    commit, and a slow disk shows as ``persist.waits`` / ``waited_seconds`` in status and
    as shadow lag, never as a missing iteration. With ``every`` = 0, ``seconds`` > 0 makes
    a version due when that much time passed since the last write; it is written only if
    no write waits (such versions are not aligned across partitions, so none waits for
    them either).

    A failed write (full disk, I/O error, CheckpointException, anything but KeyboardInterrupt
    and SystemExit) never ends the writer thread: it is counted in ``status()``, logged once
    per distinct error (numbers such as the iteration ignored), and the version is dropped,
    not retried -- the next due version is the retry, so writing resumes by itself once space
    returns, at the pace of ``every``/``seconds`` instead of a tight loop.
    """

    def __init__(self, root: str | Path, partition: int, state: Any, every: int = 0,
                 seconds: float = 0.0, keep: int = 3, backlog: int = 2) -> None:
        if backlog < 1:
            raise CheckmateError(f"persist backlog must be >= 1, got {backlog}")
        self.root, self.partition, self.state = Path(root), partition, state
        self.every, self.keep, self.backlog = every, keep, backlog
        if every > 0 and seconds > 0:
            log.warning("persist: seconds=%s ignored: with every=%d the partitions write the "
                        "same iterations, every %d", seconds, every, every)
        self.seconds = seconds if every == 0 else 0.0  # time-due writes only when unaligned
        self.last_time = time.monotonic()
        self.last_iteration: int | None = None
        self.written = 0
        self.errors = 0
        self.error = ""  # the current failure; "" once a write succeeds again
        self.last_error = ""  # the most recent failure, kept after recovery
        self.last_failed_iteration: int | None = None
        self.failing = 0  # failed writes since the last success
        self._logged = ""  # key of the error last logged
        self.seconds_spent = 0.0
        self.waits = 0  # due versions that waited for room behind a running write
        self.waited_seconds = 0.0  # how long the shadow's step waited for them in all
        self._waiting_since: float | None = None  # the step waits for the writer now
        self.purged: list[int] = []  # iterations the last re-seed removed from this partition
        #: waiting writes, oldest first: (version, generation, seeded)
        self._queue: list[tuple[Any, int, bool]] = []
        self._running = False  # a write is under way (it holds one more pinned version)
        self._generation = 0  # +1 at every (re)seed: older versions are of a purged lineage
        self._installs = getattr(state, "installs", 0)
        # The writes use torch's DCP. The shadow starts without torch (checkmate.optim's
        # torch parts load on first use): importing it takes seconds, so it is done here, at
        # start, not in the first write while the trainers run -- a shadow killed soon after
        # must find that write on disk.
        import torch.distributed.checkpoint  # noqa: F401
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="shadow-persist", daemon=True)
        gone = clean_temp(part_dir(self.root, partition))
        if gone:
            log.warning("removed leftovers of interrupted checkpoint writes: %s", gone)
        self._thread.start()

    def due(self, iteration: int) -> bool:
        if self.every > 0:
            return iteration % self.every == 0
        return self.seconds > 0 and time.monotonic() - self.last_time >= self.seconds

    def on_commit(self, v: Any) -> None:
        """Every commit of the state (under its lock), as ShadowNode wires it.

        A commit made by a (re)seed (``state.installs`` moved) starts a new lineage at its
        iteration: this partition's checkpoints from there on and their joins are purged
        before the shadow reports seeded, a write still running for the old lineage is
        discarded, and the seed version is written marked ``seeded`` (never joined).
        """
        installs = getattr(self.state, "installs", 0)
        seeded = installs != self._installs
        if seeded:
            self._installs = installs
            self._new_lineage(v.iteration)
        if self.last_iteration is None or v.iteration > self.last_iteration:
            self.offer(v, seeded)

    def verified(self, iteration: int) -> None:
        """The state check passed ``iteration`` (under the state's lock): mark its
        checkpoint if written; a write still to come marks itself (``_write``)."""
        disk.mark_verified(disk.part_dir(self.root, self.partition), iteration)

    def drop_from(self, since: int) -> None:
        """A state check failed: this partition's checkpoints of iterations ``since`` on
        are not the trainers' state; removed (and their joins), a queued write dropped."""
        self._new_lineage(since, "a state check failed: not the trainers' state")

    def _new_lineage(self, since: int, why: str = "") -> None:
        with self._cv:
            self._generation += 1
            self.last_iteration = None
            old, self._queue = self._queue, []
            self._cv.notify_all()
        for q in old:
            self.state.unpin(q[0])
        try:
            parts, joins = purge(self.root, self.partition, since)
        except OSError as e:
            self._failed(since, PersistError(
                f"cannot remove the checkpoints of iterations >= {since} after a re-seed: "
                f"{describe_error(e)}"))
            return
        self.purged = parts
        if parts or joins:
            log.warning("persist: partition %d %s: removed its checkpoints of iterations %s "
                        "and the joins %s (%s)", self.partition,
                        f"from iteration {since}" if why else f"seeded at iteration {since}",
                        parts, joins, why or "a run not continued")

    def offer(self, version: Any, seeded: bool = False) -> None:
        """Pin and queue ``version`` if due (under the state lock; never waits there, so
        status and fetch are answered meanwhile). An aligned version is always queued; the
        step that made it then waits in :meth:`wait_room` if the writer is behind."""
        it = version.iteration
        if not self.due(it) or not self.state.check.restorable(it):
            return  # a failed state check: not the trainers' state, never written
        v = self.state.pin(it)
        with self._cv:
            if self.every > 0:
                take = not self._stop
            else:  # due by time only: written if nothing waits
                take = not self._queue and not self._running and not self._stop
            if take:
                self._queue.append((v, self._generation, seeded))
                self.last_time = time.monotonic()
                self._cv.notify_all()
        if not take:
            self.state.unpin(v)

    def wait_room(self) -> None:
        """Called by the step after a commit, outside the state lock: while more than
        ``backlog`` due versions wait behind the running write, the shadow's step waits
        for the writer instead of any due version being skipped (receiving goes on)."""
        if self.every <= 0:
            return
        with self._cv:
            t0, waited = time.monotonic(), False
            while (len(self._queue) + self._running > self.backlog and not self._stop
                   and self._thread.is_alive()):
                waited, self._waiting_since = True, t0
                self._cv.wait(0.5)
            self._waiting_since = None
            if waited:
                self.waits += 1
                self.waited_seconds += time.monotonic() - t0

    def _loop(self) -> None:
        name_thread()
        while True:
            with self._cv:
                while not self._queue and not self._stop:
                    self._cv.wait()
                if not self._queue:
                    return
                v, gen, seeded = self._queue.pop(0)
                self._running = True
            try:
                self._write(v, gen, seeded)
            except BaseException as e:  # CheckpointException is not an Exception
                if _fatal(e):
                    raise
                self._failed(v.iteration, e)
            finally:
                with self._cv:  # room for a waiting step
                    self._running = False
                    self._cv.notify_all()
                self.state.unpin(v)

    def _write(self, v: Any, gen: int = 0, seeded: bool = False) -> None:
        t0 = time.perf_counter()
        done = save(self.root, self.state.spec, self.partition, v.iteration, v.step, v.slots,
                    v.buffers, v.extra, v.lrs, self.keep, seeded,
                    current=lambda: gen == self._generation)
        self.seconds_spent += time.perf_counter() - t0
        # One update under the lock, read whole by status(): a status that already counts
        # this write never still shows the failure it ended.
        with self._cv:
            if done is None or gen != self._generation:
                return  # re-seeded meanwhile: not written (or purged right after)
            self.last_iteration = v.iteration
            self.written += 1
            if getattr(v, "verified", False):  # checked before this write ended
                disk.mark_verified(done.parent, v.iteration)
            failed, self.failing = self.failing, 0
            self.error = ""
            self._logged = ""
        if failed:
            log.warning("persist: writing again, iteration %d written after %d failed "
                        "write(s)", v.iteration, failed)

    def _failed(self, iteration: int, e: BaseException) -> None:
        """Count a failed write; log it only if it differs from the error last logged."""
        msg = str(e) if isinstance(e, PersistError) else \
            f"cannot write checkpoint of iteration {iteration}: {describe_error(e)}"
        msg = " ".join(msg.split())
        key = re.sub(r"\d+", "#", msg)  # the same error at another iteration is not new
        with self._cv:
            self.errors += 1
            self.failing += 1
            self.error = self.last_error = msg
            self.last_failed_iteration = iteration
            new = key != self._logged
            self._logged = key
        if new:
            log.error("persist: %s (previous checkpoint kept; retrying at the next due "
                      "iteration)", msg)

    def stop(self, flush: bool = True) -> None:
        with self._cv:
            left: list[tuple[Any, int, bool]] = []
            if not flush:
                left, self._queue = self._queue, []
            self._stop = True
            self._cv.notify_all()
        for q in left:
            self.state.unpin(q[0])
        self._thread.join(60)

    def status(self) -> dict[str, Any]:
        """What the shadow's status shows under ``persist``.

        ``error`` is the current failure ("" once a write succeeds again); ``last_error`` is
        the most recent failure even after recovery, ``last_failed_iteration`` its iteration;
        ``alive`` says the writer thread is running; ``waits`` / ``waited_seconds``: how
        often and how long the shadow's step waited for the writer; ``waiting_seconds``: how
        long the current wait has lasted (0: none; a hung disk shows here).
        """
        with self._cv:
            counts = {"last_iteration": self.last_iteration, "written": self.written,
                      "errors": self.errors, "error": self.error,
                      "last_error": self.last_error,
                      "last_failed_iteration": self.last_failed_iteration,
                      "failing": self.failing, "waits": self.waits,
                      "waited_seconds": round(self.waited_seconds, 3),
                      "waiting_seconds": 0.0 if self._waiting_since is None else
                      round(time.monotonic() - self._waiting_since, 3)}
        return {"dir": str(part_dir(self.root, self.partition)), **counts,
                "alive": self._thread.is_alive(), "every": self.every}
