"""The checkpoint schemes a benchmark compares Checkmate with, in the trainer's loop.

``Baseline(kind, directory, rank, every)``: ``save(it, model, optimizer)`` after each
iteration's step checkpoints when ``it % every == 0``; ``before_step()`` right before the
next optimizer step waits for whatever must finish before the state changes again;
``finish()`` waits for the last write. Kinds:

- ``none``, ``checkmate``, ``gockpt``: nothing here (no checkpoint; the shadows; the
  session's GoCkpt process, checkmate.gockpt);
- ``torchsave``: rank 0 ``torch.save`` of model and optimizer, synchronous (data-parallel
  replicas are identical, so one rank writes);
- ``dcp``: ``torch.distributed.checkpoint.async_save`` with its defaults (a thread; the
  state is staged before it returns), waiting for the previous save first, as its docs say;
- ``dcp-process``: ``async_save`` in torch 2.13's process mode with the ``DefaultStager``
  (shared memory, staging in the background, pinned memory and non-blocking copies where an
  accelerator exists): the step waits only for staging to finish before the state changes;
- ``checkfreq``: CheckFreq's two phases: rank 0 snapshots model and optimizer into CPU
  buffers allocated once (synchronous: the copy is the stall), then a background thread
  persists the snapshot with ``torch.save``; a snapshot first waits for the previous persist
  (one checkpoint in flight). On a CPU trainer the snapshot is a memory copy.

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


def _copy_into(dst: Any, src: Any) -> Any:
    """Copy a state dict's tensors into ``dst``'s (same structure), or clone when ``dst`` is
    None: the snapshot buffers are allocated once."""
    if torch.is_tensor(src):
        if dst is None:
            return src.detach().to("cpu", copy=True)
        dst.copy_(src.detach())
        return dst
    if isinstance(src, dict):
        return {k: _copy_into(None if dst is None else dst.get(k), v) for k, v in src.items()}
    if isinstance(src, list):
        return [_copy_into(None if dst is None else dst[i], v) for i, v in enumerate(src)]
    return src


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
                self._wait()
                self._snapshot = _copy_into(self._snapshot, {
                    "model": model.state_dict(), "optim": optimizer.state_dict()})
                fut: Future = Future()
                snap = {**self._snapshot, "iteration": it}
                threading.Thread(target=self._persist, args=(snap, it, fut), daemon=True,
                                 name="ckm-checkfreq").start()
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

    def _persist(self, snap: dict[str, Any], it: int, fut: Future) -> None:
        try:
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
        """dcp-process: the background staging must be done before the state changes."""
        if self._staging is not None:
            self._staging.result()
            self._staging = None

    def finish(self) -> None:
        self.before_step()
        self._wait()
        if self._stager is not None:
            self._stager.close()
            self._stager = None
