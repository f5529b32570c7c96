"""Durable checkpoints of a shadow's partition in torch.distributed.checkpoint (DCP) format.

Layout under a root directory (one per cluster, or one per shadow host)::

    root/part<p>/iter-<iteration:012d>/   one committed partition checkpoint
        .metadata, __0_0.distcp           written by dcp.save (FileSystemWriter)
        ckm.json                          iteration, step, spec, slice bounds, buffers, extra
        manifest.json                     sha256 of every other file
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
pruning (:func:`prune`) always keeps the newest iteration that every partition holds.
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
from checkmate.shadow import merge, torch_layout
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
from checkmate.shadow.persist_schedule import PersistSchedule
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

    Never removed: the one ``latest`` names, and -- with ``partitions`` given -- the newest
    iteration that every sibling partition dir under ``pdir.parent`` holds
    (:func:`newest_common`), because that is what :func:`load_full` restores from. A healthy
    partition that runs ahead of a stalled one thus keeps ``keep`` + 1 checkpoints until the
    stalled one catches up. If some sibling dir does not exist yet nothing is held by all
    and only the keep rule applies. ``keep`` <= 0 prunes nothing.
    """
    its = list_iterations(pdir)
    if keep <= 0 or len(its) <= keep:
        return []
    protected = {_read_latest(pdir)}
    held = newest_common(pdir.parent, partitions) if partitions else None
    if held is not None:
        protected.add(f"{_ITER_PREFIX}{held:012d}")
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
    """Writes selected versions in the background; never blocks the caller.

    A version is due every ``every`` iterations (iteration % every == 0) or when ``seconds``
    have passed since the last write. Up to ``backlog`` due versions wait behind a running
    write; when more come, :class:`PersistSchedule` thins the schedule the same way on every
    partition (multiples of 2 * every, 4 * every, ...), so the partitions keep writing common
    iterations and a correlated failure finds one on disk. A version due only by time waits
    only if nothing else does (time is not aligned across partitions).

    A failed write (full disk, I/O error, CheckpointException, anything but KeyboardInterrupt
    and SystemExit) never ends the writer thread: it is counted in ``status()``, logged once
    per distinct error (numbers such as the iteration ignored), and the version is dropped,
    not retried -- the next due version is the retry, so writing resumes by itself once space
    returns, at the pace of ``every``/``seconds`` instead of a tight loop.
    """

    def __init__(self, root: str | Path, partition: int, state: Any, every: int = 0,
                 seconds: float = 0.0, keep: int = 3, backlog: int = 2) -> None:
        self.root, self.partition, self.state = Path(root), partition, state
        self.every, self.seconds, self.keep = every, seconds, keep
        self.schedule = PersistSchedule(every, backlog) if every > 0 else None
        self.dropped = 0  # due versions the schedule thinned out (status)
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
        self.purged: list[int] = []  # iterations the last re-seed removed from this partition
        #: waiting writes, oldest first: (version, generation, seeded, aligned slot?)
        self._queue: list[tuple[Any, int, bool, bool]] = []
        #: the newest due iteration the schedule thinned out (iteration, generation,
        #: seeded): written when the writer has nothing else to do, e.g. once training stops
        self._late: tuple[int, int, bool] | None = None
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
        if self.every > 0 and iteration % self.every == 0:
            return True
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

    def _new_lineage(self, since: int) -> None:
        with self._cv:
            self._generation += 1
            self.last_iteration = None
            old, self._queue = self._queue, []
            self._late = None
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
            log.warning("persist: partition %d seeded at iteration %d: removed its "
                        "checkpoints of iterations %s and the joins %s (a run not continued)",
                        self.partition, since, parts, joins)

    def offer(self, version: Any, seeded: bool = False) -> None:
        """Pin and queue ``version`` if due (under the state lock)."""
        it = version.iteration
        aligned = self.every > 0 and it % self.every == 0
        if not aligned and not self.due(it):
            return
        v = self.state.pin(it)
        with self._cv:
            if aligned:
                assert self.schedule is not None
                take, drop = self.schedule.admit(
                    it, [q[0].iteration for q in self._queue if q[3]])
                # an aligned version displaces a waiting time-only one; thinning drops some
                gone = [q for q in self._queue
                        if (q[3] and q[0].iteration in drop) or (take and not q[3])]
                self.dropped += len(drop) + (not take)
            else:  # due by time only: never displaces nor delays an aligned write
                take, gone = not self._queue, []
            self._queue = [q for q in self._queue if all(q is not g for g in gone)]
            if take:
                self._queue.append((v, self._generation, seeded, aligned))
                self.last_time = time.monotonic()
                if self._late is not None and self._late[0] <= it:
                    self._late = None
            else:
                gone.append((v, 0, False, False))
                if aligned:  # thinned out: written later only if the writer is idle
                    self._late = (it, self._generation, seeded)
            self._cv.notify()
        for q in gone:
            self.state.unpin(q[0])

    def _loop(self) -> None:
        name_thread()
        while True:
            late = None
            with self._cv:
                while not self._queue and self._late is None and not self._stop:
                    if self.schedule is not None:
                        self.schedule.drained()
                    self._cv.wait()
                if self._queue:
                    v, gen, seeded, _ = self._queue.pop(0)
                elif self._late is not None:
                    late, self._late = self._late, None
                else:
                    return
            if late is not None:
                # Idle (or stopping) with a thinned-out iteration newer than the disk's:
                # write it as an extra (alignment needs only the coarse ones), if the state
                # still retains it.
                it, gen, seeded = late
                if gen != self._generation or (self.last_iteration or -1) >= it:
                    continue
                try:
                    v = self.state.pin(it)
                except CheckmateError:
                    continue  # evicted meanwhile: the next due iteration comes instead
            try:
                self._write(v, gen, seeded)
            except BaseException as e:  # CheckpointException is not an Exception
                if _fatal(e):
                    raise
                self._failed(v.iteration, e)
            finally:
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
            left: list[tuple[Any, int, bool, bool]] = []
            if not flush:
                left, self._queue = self._queue, []
                self._late = None
            self._stop = True
            self._cv.notify()
        for q in left:
            self.state.unpin(q[0])
        self._thread.join(60)

    def status(self) -> dict[str, Any]:
        """What the shadow's status shows under ``persist``.

        ``error`` is the current failure ("" once a write succeeds again); ``last_error`` is
        the most recent failure even after recovery, ``last_failed_iteration`` its iteration;
        ``alive`` says the writer thread is running.
        """
        with self._cv:
            counts = {"last_iteration": self.last_iteration, "written": self.written,
                      "errors": self.errors, "error": self.error,
                      "last_error": self.last_error,
                      "last_failed_iteration": self.last_failed_iteration,
                      "failing": self.failing}
        return {"dir": str(part_dir(self.root, self.partition)), **counts,
                "alive": self._thread.is_alive(),
                "spacing": self.schedule.spacing if self.schedule else None,
                "spacing_max": (self.every << self.schedule.max_level) if self.schedule
                else None,
                "dropped": self.dropped}
