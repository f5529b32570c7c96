"""GoCkpt mode: periodic checkpoints whose state transfer is spread over k training steps.

No switch and no shadow hosts: each trainer rank has a local CPU process
(checkmate.gockpt.worker) and checkpoints its partition of the job's state (the model spec
cut into ``world`` partitions, partition = rank). Every ``every`` iterations, right after the
optimizer step of iteration t0, a window opens:

- after the step of t0 + j (j = 0..k-1) slice j of the partition's state (parameters and
  optimizer slots, 1/k of it) is copied to the process; it holds the state at t0 + j;
- with every step t0 + j (j = 1..k) the reduced, unclipped gradient of the slices already
  sent goes along, with that step's control (rates, clip factor, hyperparameters, buffers,
  scheduler state, the user's extra): the process rolls each slice forward through the
  steps it missed with the trainers' own arithmetic (``checkmate.shadow.reseed.Reseed``, the
  code a shadow uses for a live re-seed), so after step t0 + k every slice stands at t0 + k;
- the process writes that consistent state as a shadow partition checkpoint (DCP with
  several writer threads); once every rank's partition of t0 + k is written, the joined
  checkpoint (plain ``dcp.load``) is published beside them.

The copies overlap training (checkmate.train.copyengine): a slice is copied on a copy stream into
pinned host memory while the next step's forward and backward compute, and only that next
optimizer step waits for it (on CUDA a device-side wait: the host never blocks); the
gradient of the sent slices is snapshot on the device (it is clipped in place right after)
and leaves the device the same way. A sender thread hands each completed host buffer to the
process in issue order and returns it to the pool. So the trainer's cost per step of the
window is issuing the copies (plus the gradient's device snapshot), never a pause for the
state. The one wait is for the disk: a window opens only once the checkpoint of the window
before it is written, so a kill never loses more than ``every + steps`` iterations however
slow the disk; while the writes keep up (the normal case) it costs nothing, and a wait is
counted in ``stats``. ``restore`` reads the newest iteration every partition wrote. Several
ranks share a directory on one node; across nodes the directory must be shared storage.
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import threading
import time
from pathlib import Path
from typing import Any

import torch

from checkmate.errors import CheckmateError
from checkmate.gockpt import worker as gockpt_worker
from checkmate.spec.model import ModelSpec, difference
from checkmate.train import copyengine

log = logging.getLogger("checkmate.gockpt.trainer")


class GoCkpt:
    """The trainer's side of GoCkpt mode for one rank.

    Args:
        model, optimizer: the live objects (a checkmate.optim optimizer: the process repeats
            its arithmetic).
        root: checkpoint directory (``part<rank>/`` under it, the joined checkpoints beside).
        every: checkpoint interval in iterations (a window opens after steps t0 with
            t0 % every == 0); at least ``steps``.
        steps: k, the steps one checkpoint's state transfer is spread over.
        rank, world: this trainer's partition and the number of partitions.
        keep: checkpoints kept per partition; threads: DCP writer threads.
        start_timeout: seconds the process may take to start (it waits for a previous
            incarnation of this rank to finish its write first).
        stall_limit: seconds a window may wait for the previous checkpoint's write (see
            ``_wait_previous``); past it the window opens anyway, with one warning line.

    Per iteration: ``before_clip(it)`` after backward (the gradient as reduced, before any
    clipping), then the optimizer and scheduler step, then ``after_step(it, step, control)``.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 root: str | Path, every: int, steps: int, rank: int = 0, world: int = 1,
                 job: int = 0, keep: int = 3, threads: int = 4,
                 start_timeout: float = 180.0, stall_limit: float = 120.0) -> None:
        if steps < 1 or every < steps:
            raise CheckmateError(f"gockpt: need 1 <= steps <= every, got steps {steps}, "
                                 f"every {every}")
        self.spec = ModelSpec.from_torch(job, model, optimizer, max(1, world))
        self.params = dict(model.named_parameters())
        self.optimizer = optimizer
        self.every, self.rank, self.root = every, rank, Path(root)
        start, end = self.spec.bounds(rank)
        n = max(1, min(steps, end - start))
        self.cuts = [(start + (end - start) * i // n, start + (end - start) * (i + 1) // n)
                     for i in range(n)]
        self.t0: int | None = None  # the open window's first iteration
        self._grad: tuple[int, copyengine.Ticket] | None = None
        #: Newest iteration this rank's process wrote; errors it reported.
        self.committed: int | None = None
        self.errors: list[str] = []
        #: Checkpoints of closed windows not yet confirmed (iteration, errors seen when the
        #: window closed): a window opens only once the newest that closed before it is
        #: written (or reported lost).
        self._pending: list[tuple[int, int]] = []
        self.stall_limit = stall_limit
        #: Windows opened, bytes handed to the process, seconds the training thread spent
        #: issuing copies and at fences (the copies themselves overlap training).
        self.stats: dict[str, float] = {"windows": 0, "bytes": 0, "seconds": 0.0,
                                        "persist_seconds": 0.0, "stalls": 0,
                                        "stall_seconds": 0.0}
        ctx = multiprocessing.get_context("spawn")  # no fork of a process holding threads
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=gockpt_worker.main, name=f"ckm-gockpt-{rank}",
                                 args=(child, str(self.root), rank, self.spec.to_json(), keep,
                                       threads), daemon=True)
        self._proc.start()
        child.close()
        self._closed = False
        # Copies in flight are bounded by twice the partition's state and gradient: a
        # window's worth ahead of a slow process, then the trainer waits for buffers.
        part_bytes = 4 * (end - start) * (len(self.spec.slots) + 1)
        self.engine = copyengine.engine_for(_device_of(model), limit=max(2 * part_bytes,
                                                                          1 << 26))
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._send_error: str | None = None
        self._thread = threading.Thread(target=self._sender, name=f"ckm-gockpt-send-{rank}",
                                        daemon=True)
        self._thread.start()
        # Training starts once the process runs, holds its lock and has compiled its
        # kernels: a window never waits for them, and a kill never finds it half started.
        try:
            ready = self._conn.poll(start_timeout) and self._conn.recv() == ("ready",)
        except (EOFError, OSError):  # it died while starting
            ready = False
        if not ready:
            self._proc.kill()
            self._proc.join()
            raise CheckmateError(f"gockpt: the checkpoint process of rank {rank} did not "
                                 f"start within {start_timeout:.0f} s (exit code "
                                 f"{self._proc.exitcode})")

    # ------------------------------------------------------------------ per iteration
    def before_clip(self, it: int) -> None:
        """Before iteration ``it`` clips and steps: the slice copied after the previous step
        must be read first (a fence, not a host wait on CUDA); then the gradient of the
        slices already sent (steps t0+1..t0+k of a window) starts its copy."""
        self._check_sender()
        t = time.perf_counter()
        self.engine.fence()
        self._grad = None
        if self.t0 is not None and 1 <= it - self.t0 <= len(self.cuts):
            a, b = self.cuts[0][0], self.cuts[it - self.t0 - 1][1]
            parts = []
            for p, lo, hi in self.spec.pieces(a, b):
                g = self.params[p.name].grad
                if g is None:
                    raise CheckmateError(f"parameter {p.name} has no gradient to checkpoint "
                                         "with")
                parts.append((p.offset + lo - a, _flat(g, lo, hi, p.name)))
            self._grad = (b - a, self.engine.copy(b - a, parts, stage=True))
        self.stats["seconds"] += time.perf_counter() - t

    def after_step(self, it: int, step: int, control: dict[str, Any]) -> None:
        """After iteration ``it``'s optimizer step (``step`` steps taken): the window's
        gradient and next slice, or a new window."""
        t = time.perf_counter()
        self._answers()
        self._check_sender()
        if self.t0 is not None:
            j = it - self.t0
            if self._grad is None:
                raise CheckmateError(f"gockpt: iteration {it} stepped without before_clip()")
            count, ticket = self._grad
            self._send(("iteration", it, count, _control(control)), [ticket])
            self._grad = None
            if j < len(self.cuts):
                self._piece(j, it, step)
            else:
                self.t0 = None  # the process now has all it needs for iteration it
                self._pending.append((it, len(self.errors)))
        if self.t0 is None and it % self.every == 0:
            self._wait_previous(it)
            self.t0 = it
            self.stats["windows"] += 1
            self._send(("begin", self.spec.to_json(), self.rank, it), [])
            self._piece(0, it, step)
        self.stats["seconds"] += time.perf_counter() - t

    def _wait_previous(self, it: int) -> None:
        """Before a window opens at ``it``: the checkpoint of the newest window that closed
        before ``it`` must be on disk (or reported lost). The writes are asynchronous;
        without this a disk slower than the interval would let them fall behind without
        bound, and a kill would lose far more than ``every + steps`` iterations. With it,
        once a window opens the newest checkpoint is at most ``2 * every - steps``
        iterations old (``every`` when ``steps == every``: the window that closes at ``it``
        itself is not waited for). The trainer waits only while the disk is behind
        (counted in ``stats``: ``stalls``, ``stall_seconds``)."""
        older = [p for p in self._pending if p[0] < it]
        if not older:
            return
        want, errors = older[-1]
        self._pending = [p for p in self._pending if p[0] >= it]

        def written() -> bool:
            self._answers()
            return (self.committed is not None and self.committed >= want) \
                or len(self.errors) > errors

        if written():
            return
        t = time.perf_counter()
        deadline = time.monotonic() + self.stall_limit
        while not written():
            self._check_sender()
            if not self._proc.is_alive():
                raise CheckmateError(f"gockpt: the checkpoint process of rank {self.rank} "
                                     f"is gone (exit code {self._proc.exitcode})")
            if time.monotonic() > deadline:
                log.warning("gockpt: rank %d: the checkpoint of iteration %d is not written "
                            "after %.0f s; window %d opens anyway (a kill now loses more "
                            "than %d iterations)", self.rank, want, self.stall_limit, it,
                            self.every + len(self.cuts))
                break
            self._conn.poll(0.01)
        self.stats["stalls"] += 1
        self.stats["stall_seconds"] += time.perf_counter() - t

    def _piece(self, j: int, it: int, step: int) -> None:
        """Slice j's copy, one host buffer per slot (slots with no state yet are zeros, as
        in ``ModelSpec.flat_from_state_dicts``)."""
        a, b = self.cuts[j]
        tickets = []
        for s in self.spec.slots:
            parts, missing = [], False
            for p, lo, hi in self.spec.pieces(a, b):
                t = self.params[p.name]
                v = t if s == "param" else self.optimizer.state.get(t, {}).get(s)
                if torch.is_tensor(v):
                    parts.append((p.offset + lo - a, _flat(v, lo, hi, p.name)))
                else:
                    missing = True
            tickets.append(self.engine.copy(b - a, parts, zero=missing))
        self._send(("piece", it, step, a, b - a), tickets)

    def _send(self, head: tuple, tickets: list[copyengine.Ticket]) -> None:
        """Queue a message for the sender thread (it keeps the order)."""
        self._queue.put((head, tickets))

    def _sender(self) -> None:
        """Send each queued message once its copies completed; release their buffers."""
        while True:
            item = self._queue.get()
            if item is None:
                return
            head, tickets = item
            try:
                if self._send_error is None:
                    self._conn.send(head)
                    for tk in tickets:
                        x = tk.numpy()
                        self._conn.send_bytes(memoryview(x).cast("B"))
                        self.stats["bytes"] += x.nbytes
            except (BrokenPipeError, EOFError, OSError, CheckmateError) as e:
                self._send_error = (f"gockpt: the checkpoint process of rank {self.rank} is "
                                    f"gone (exit code {self._proc.exitcode})"
                                    if not isinstance(e, CheckmateError) else str(e))
            finally:
                for tk in tickets:
                    try:
                        tk.release()
                    except CheckmateError:
                        pass  # a failed copy: reported through _send_error above

    def _check_sender(self) -> None:
        if self._send_error is not None:
            raise CheckmateError(self._send_error)

    def _answers(self) -> None:
        while self._conn.poll():
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                return
            if msg[0] == "committed":
                self.committed = int(msg[1])
                self.stats["persist_seconds"] += float(msg[2])
            elif msg[0] == "error":
                self.errors.append(str(msg[1]))
                log.warning("gockpt: rank %d lost a checkpoint: %s", self.rank, msg[1])

    def wait_committed(self, iteration: int, timeout: float) -> bool:
        """Wait (at most ``timeout`` s) until this rank's checkpoint process has written a
        checkpoint of ``iteration`` or later; whether it has. The copies are asynchronous,
        so a checkpoint is on disk some time after the step that ends its window."""
        deadline = time.monotonic() + timeout
        while True:
            self._answers()
            if self.committed is not None and self.committed >= iteration:
                return True
            if time.monotonic() > deadline:
                return False
            self._conn.poll(0.05)

    def close(self, timeout: float = 300.0) -> None:
        """Let the process finish the checkpoint it is writing, then stop it. A window still
        open is dropped (its state transfer never completed)."""
        if self._closed:
            return
        self._closed = True
        self._grad = None
        self._queue.put((("stop",), []))
        self._queue.put(None)
        self._thread.join(timeout)
        self.engine.close()
        self._proc.join(timeout)
        self._answers()
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
            log.warning("gockpt: rank %d's checkpoint process did not stop within %.0f s",
                        self.rank, timeout)
        self._conn.close()


def _device_of(model: torch.nn.Module) -> torch.device:
    """The one device the model's parameters live on (GoCkpt copies from one device)."""
    devs = {p.device for p in model.parameters()}
    if len(devs) != 1:
        raise CheckmateError(f"gockpt: the model's parameters must live on one device, found "
                             f"{', '.join(sorted(str(d) for d in devs)) or 'none'}")
    return devs.pop()


def _flat(t: torch.Tensor, lo: int, hi: int, name: str) -> torch.Tensor:
    """Flat elements [lo, hi) of a float32 tensor as a view (never a silent copy)."""
    t = t.detach()
    if t.dtype != torch.float32 or not t.is_contiguous():
        raise CheckmateError(f"gockpt: {name} must be a contiguous float32 tensor, got "
                             f"{t.dtype}{'' if t.is_contiguous() else ' (not contiguous)'}")
    return t.view(-1)[lo:hi]


def _control(body: dict[str, Any]) -> dict[str, Any]:
    """The fields of ``checkmate.shadow.control_message.Control`` from a control-message body."""
    return {"iteration": int(body["iteration"]), "lrs": [float(x) for x in body["lrs"]],
            "clip_coef": body.get("clip_coef"), "skip": bool(body.get("skip", False)),
            "buffers": dict(body.get("buffers") or {}), "extra": dict(body.get("extra") or {}),
            "hyper": body.get("hyper")}


def wait_idle(root: str | Path, world: int, timeout: float = 60.0) -> bool:
    """Wait (at most ``timeout`` s) until no rank's GoCkpt process of an earlier incarnation
    lives: a killed trainer's process still writes what it received. True when idle."""
    import fcntl

    deadline = time.monotonic() + timeout
    for rank in range(world):
        path = gockpt_worker.lock_path(root, rank)
        if not path.exists():
            continue
        with open(path, "a") as f:
            while True:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    fcntl.flock(f, fcntl.LOCK_UN)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        log.warning("gockpt: rank %d's checkpoint process of the previous "
                                    "attempt is still busy after %.0f s", rank, timeout)
                        return False
                    time.sleep(0.05)
    return True


def restore(root: str | Path, spec: ModelSpec, iteration: int | None = None,
            settle: float = 60.0) -> tuple[int, int, dict, dict, dict]:
    """The newest iteration every partition under ``root`` wrote (or ``iteration``), as
    ``(iteration, optimizer steps, model_sd, optim_sd, extra)`` for a job whose spec is
    ``spec``; CheckmateError in one line when there is none or the job differs. Waits (at
    most ``settle`` s) for the processes of a killed incarnation to finish their writes."""
    from checkmate.shadow import checkpoint_load

    wait_idle(root, len(list(Path(root).glob(".rank*.lock"))), settle)
    try:
        full = checkpoint_load.load_full_state(root, iteration)
    except CheckmateError as e:
        raise CheckmateError(f"gockpt: nothing to resume from in {root}: {e}") from None
    why = difference(full.spec, spec)
    if why is not None:
        raise CheckmateError(f"gockpt resume: {why} (resume with the model and optimizer the "
                             "job started with, or start it anew)")
    buffers = full.spec.decode_buffers(full.buffers)
    model_sd, optim_sd = full.spec.state_dicts(full.slots, full.step, buffers, full.lrs)
    return full.iteration, full.step, model_sd, optim_sd, full.extra
