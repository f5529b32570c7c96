"""The checkpoint schemes a benchmark compares Checkmate with, in the trainer's loop.

``Baseline(kind, directory, rank, every)``: ``save(it, model, optimizer)`` after each
iteration's step checkpoints when ``it % every == 0``; ``before_step()`` right before the
next optimizer step waits for whatever must finish before the state changes again;
``finish()`` waits for the last write. Kinds:

- ``none``, ``checkmate``, ``gockpt``: nothing here (no checkpoint; the shadows; the
  session's GoCkpt process, checkmate.gockpt.trainer);
- ``torchsave``: rank 0 ``torch.save`` of model and optimizer, synchronous (data-parallel
  replicas are identical, so one rank writes);
- ``dcp``: ``torch.distributed.checkpoint.async_save`` with its defaults (a thread; the
  state is staged before it returns), waiting for the previous save first, as its docs say;
- ``dcp-process``: ``async_save`` in torch 2.13's process mode with the ``DefaultStager``
  (shared memory, staging in the background, pinned memory and non-blocking copies where an
  accelerator exists): the step waits only for staging to finish before the state changes;
- ``checkfreq``: CheckFreq's two phases: rank 0 snapshots model and optimizer into host
  buffers allocated once (pinned on CUDA), then a background thread persists the snapshot
  with ``torch.save``. The snapshot overlaps the next iteration's compute, as CheckFreq's
  does: it runs on a copy stream (CUDA) or a copy thread (CPU; checkmate.train.copyengine), and
  only ``before_step`` -- right before the next update changes the state -- waits for it
  (on CUDA a device-side wait, so the host does not block). A snapshot first waits for the
  previous persist (one checkpoint in flight: the buffers are reused).

Every scheme keeps its newest three checkpoints on disk (a full state per save would fill
any disk at one save per iteration).
"""

from __future__ import annotations

import shutil
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from checkmate.errors import CheckmateError

PASSIVE = ("none", "checkmate", "gockpt")
KINDS = PASSIVE + ("torchsave", "dcp", "dcp-process", "checkfreq")


def _pairs(dst: Any, src: Any, out: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """The snapshot structure for a state dict: ``dst``'s host tensors (allocated when
    ``dst`` is None or no longer fits: pinned where the source is on CUDA), and each
    ``(host, source)`` pair to copy appended to ``out``."""
    if torch.is_tensor(src):
        src = src.detach()
        if (dst is None or not torch.is_tensor(dst) or dst.shape != src.shape
                or dst.dtype != src.dtype):
            dst = torch.empty(src.shape, dtype=src.dtype, pin_memory=src.is_cuda)
        out.append((dst, src))
        return dst
    if isinstance(src, dict):
        old = dst if isinstance(dst, dict) else {}
        return {k: _pairs(old.get(k), v, out) for k, v in src.items()}
    if isinstance(src, list):
        old = dst if isinstance(dst, list) and len(dst) == len(src) else [None] * len(src)
        return [_pairs(old[i], v, out) for i, v in enumerate(src)]
    return src


def _device_of(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


class Baseline:
    """One scheme's checkpoints in one trainer process (see the module docstring)."""

    def __init__(self, kind: str, directory: str | None, rank: int, every: int = 1) -> None:
        if kind not in KINDS:
            raise CheckmateError(f"ckpt must be one of {', '.join(KINDS)}, got {kind!r}")
        if kind not in ("none", "checkmate") and not directory:
            raise CheckmateError(f"ckpt {kind} needs ckpt_dir")
        if every < 1:
            raise CheckmateError(f"ckpt_every must be >= 1, got {every}")
        self.kind, self.dir, self.rank, self.every = kind, Path(directory or "."), rank, every
        self._pending: Any = None  # the previous save's completion (dcp, checkfreq)
        self._staging: Any = None  # dcp-process: staging must end before the next step
        self._stager: Any = None
        self._snapshot: Any = None  # checkfreq's buffers
        self._engine: Any = None  # checkfreq's copy engine (checkmate.train.copyengine)
        self._snap_ticket: Any = None  # checkfreq: the snapshot the next step waits for
        self._written: list[Path] = []
        #: Checkpoints started.
        self.saves = 0

    def save(self, it: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if self.kind in PASSIVE or it % self.every:
            return
        self.saves += 1
        if self.kind == "torchsave":
            if self.rank == 0:
                self._torch_save({"model": model.state_dict(), "optim": optimizer.state_dict(),
                                  "iteration": it}, it)
        elif self.kind == "checkfreq":
            if self.rank == 0:
                from checkmate.train.copyengine import engine_for

                self._wait()  # the previous persist is done: its buffers are free again
                if self._engine is None:
                    self._engine = engine_for(_device_of(model))
                pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
                self._snapshot = _pairs(self._snapshot, {
                    "model": model.state_dict(), "optim": optimizer.state_dict()}, pairs)
                ticket = self._engine.copy_into(pairs)  # returns at once
                self._snap_ticket = ticket
                fut: Future = Future()
                snap = {**self._snapshot, "iteration": it}
                threading.Thread(target=self._persist, args=(snap, it, fut, ticket),
                                 daemon=True, name="ckm-checkfreq").start()
                self._pending = fut
        else:
            self._dcp(it, {"model": model.state_dict(), "optim": optimizer.state_dict()})

    def _dcp(self, it: int, state: dict[str, Any]) -> None:
        import torch.distributed.checkpoint as dcp

        self._wait()
        path = self.dir / f"step-{it}"
        if self.kind == "dcp":
            self._pending = dcp.async_save(state, checkpoint_id=str(path))
        else:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

            if self._stager is None:
                gpu = torch.cuda.is_available()
                self._stager = DefaultStager(StagingOptions(
                    use_pinned_memory=gpu, use_shared_memory=True, use_async_staging=True,
                    use_non_blocking_copy=gpu))
            r = dcp.async_save(state, checkpoint_id=str(path),
                               async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                               async_stager=self._stager)
            self._staging, self._pending = r.staging_completion, r.upload_completion
        self._keep(path)

    def _torch_save(self, state: dict[str, Any], it: int) -> None:
        path = self.dir / f"step-{it}.pt"
        tmp = path.with_suffix(".tmp")
        torch.save(state, tmp)
        tmp.replace(path)
        self._keep(path)

    def _persist(self, snap: dict[str, Any], it: int, fut: Future, ticket: Any = None
                 ) -> None:
        try:
            if ticket is not None:
                ticket.wait()  # never persist a snapshot before its copy completed
            self._torch_save(snap, it)
            fut.set_result(it)
        except BaseException as e:  # reported by the next _wait, in the training thread
            fut.set_exception(e)

    def _keep(self, path: Path) -> None:
        """Remember ``path``; remove checkpoints older than the newest two (rank 0)."""
        self._written.append(path)
        while len(self._written) > 3 and self.rank == 0:
            old = self._written.pop(0)
            if old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink(missing_ok=True)

    def _wait(self) -> None:
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def before_step(self) -> None:
        """Right before the next update: checkfreq's snapshot must have read the state (a
        fence: on CUDA the training stream waits, the host does not); dcp-process's
        background staging must be done."""
        if self._snap_ticket is not None:
            self._engine.fence()
            self._snap_ticket = None
        if self._staging is not None:
            self._staging.result()
            self._staging = None

    def finish(self) -> None:
        self.before_step()
        self._wait()
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        if self._engine is not None:
            self._engine.close()
            self._engine = None
