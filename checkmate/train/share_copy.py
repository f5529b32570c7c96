"""The DDP/FSDP2 senders' gradient share: copied to the host by the copy engine, sent by a
thread of its own.

On GPUs the reduced gradient (a DDP bucket after its allreduce, an FSDP2 shard after its
reduce-scatter) lives in device memory, and the shadows need it in host memory. A
``ShareCopier`` moves only this rank's share there without the training thread waiting,
through the one copy engine (checkmate.train.copyengine), which owns the stream, the
events, the pinned buffers and the ordering rules:

1. ``submit`` (in DDP's comm hook, or at FSDP's step) takes one pooled host buffer per
   parameter (``BufferPool.acquire`` for that parameter as owner, at most ``depth`` of
   them) and issues one ``copy_into`` of every owned segment: the copy stream waits for
   the reduction queued on the training stream, nothing here waits for the device. The
   job goes to the sender thread.
2. The sender thread waits for the copy's ticket (the host waits *here*, off the training
   thread), sends the segments, and only then returns the buffers to the pool: a buffer is
   never overwritten before its send finished, and never sent before its copy completed.
3. ``fence`` (at the start of ``sess.step``, before unscale, clip and the optimizer write
   the gradients) is the engine's: the training stream waits for every copy submitted so
   far, a device wait, not a host one.

The only host wait on the training thread is back-pressure: when all ``depth`` buffers of a
parameter are still held by unsent jobs (the sender is ``depth`` iterations behind),
``submit`` waits for one (``stats["waits"]`` counts it).

``ShareSender`` is what DDPSession and FSDPSession share: the copier's setup, the CPU path
that reads the share in place, the fence before the gradients change, and the close.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from checkmate.errors import CheckmateError
from checkmate.train.copyengine import CopyEngine, CudaCopyEngine, Ticket
from checkmate.train.segments import Segment

#: Host buffers per parameter: one being sent while the next iteration's copy fills another.
DEPTH = 2

#: (key, flat source tensor, owned segments of it) -- one parameter's share in a submit.
SharePart = tuple[str, torch.Tensor, list[Segment]]
#: (flat offset, partition, float32 values) -- what the send callback gets.
Run = tuple[int, int, np.ndarray]


@dataclass
class _Job:
    iteration: int
    index: int
    ticket: Ticket
    runs: list[tuple[int, int, torch.Tensor]]  # (flat offset, partition, host view)
    held: list[torch.Tensor] = field(default_factory=list)


class ShareCopier:
    """Host copies of this rank's share, sent by a thread of their own (module docstring).

    Args:
        engine: the copy engine (CudaCopyEngine, or ThreadCopyEngine on the CPU); the
            copier takes its buffers from ``engine.pool``, so give it an engine of its own.
        send: ``send(iteration, index, runs)`` in the sender thread, once per submit, after
            the copy completed; its host arrays are valid only during the call (copy what
            must outlive it, as ``segments.send_runs`` does).
        depth: host buffers per key at most.
    """

    def __init__(self, engine: CopyEngine, send: Callable[[int, int, list[Run]], None],
                 depth: int = DEPTH) -> None:
        if depth < 1:
            raise CheckmateError(f"depth must be >= 1, got {depth}")
        self.engine = engine
        self._send = send
        self.depth = depth
        self._q: queue.Queue = queue.Queue()
        self.error: str | None = None
        #: submits, host buffers allocated, back-pressure waits, jobs sent.
        self.stats = {"submits": 0, "buffers": 0, "waits": 0, "sent": 0}
        self._thread = threading.Thread(target=self._loop, daemon=True, name="ckm-d2h-send")
        self._thread.start()

    def submit(self, iteration: int, index: int, parts: list[SharePart]) -> None:
        """Queue the copy of every part's segments and their send; returns at once (but for
        back-pressure, see the module docstring)."""
        self._raise()
        pool = self.engine.pool
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        runs: list[tuple[int, int, torch.Tensor]] = []
        held: list[torch.Tensor] = []
        for key, src, segs in parts:
            n = sum(s[1] for s in segs)
            if not n:
                continue
            buf = pool.acquire(n, owner=key, depth=self.depth)
            held.append(buf)
            pos = 0
            for lo, count, off, part in segs:
                view = buf[pos:pos + count]
                pairs.append((view, src[lo:lo + count]))
                runs.append((off, part, view))
                pos += count
        self.stats["buffers"], self.stats["waits"] = pool.allocated, pool.waits
        if not pairs:
            return
        ticket = self.engine.copy_into(pairs)
        self.stats["submits"] += 1
        self._q.put(_Job(iteration, index, ticket, runs, held))

    def fence(self) -> None:
        """The current stream waits for every copy submitted so far (see the module
        docstring); a sender failure is raised here as one CheckmateError."""
        self.engine.fence()
        self._raise()

    def drain(self) -> None:
        """Wait until every submitted job was sent (or failed)."""
        self._q.join()
        self._raise()

    def close(self) -> None:
        """Send what is queued, then stop the thread and the engine."""
        if self._thread.is_alive():
            self._q.put(None)
            self._thread.join()
        self.engine.close()

    def _raise(self) -> None:
        if self.error is not None:
            raise CheckmateError(f"sending the gradient share to the shadows failed: "
                                 f"{self.error}")

    def _loop(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                self._q.task_done()
                return
            try:
                job.ticket.wait()
                if self.error is None:
                    self._send(job.iteration, job.index,
                               [(off, part, v.numpy()) for off, part, v in job.runs])
                    self.stats["sent"] += 1
            except Exception as e:  # noqa: BLE001 -- reported at the next submit or fence
                self.error = f"iteration {job.iteration}: {type(e).__name__}: {e}"
            finally:
                job.ticket.release()
                for buf in job.held:
                    self.engine.pool.release(buf)
                self._q.task_done()


def share_engine_for(tensor: torch.Tensor) -> CopyEngine | None:
    """The copy engine for gradients on ``tensor``'s device: CUDA's, or None on the CPU
    (the host memory is already there: the senders read it directly)."""
    if tensor.device.type == "cuda":
        return CudaCopyEngine(tensor.device)
    return None


class ShareSender:
    """DDPSession's and FSDPSession's share path (a mixin over CheckmateSession): a
    ``ShareCopier`` for device memory, or the share read in place on the CPU.

    The session sets ``copy_engine`` (None: picked by the parameters' device at start) and
    calls ``_start_copier`` from its ``_start_comm``, then ``_send_share_parts`` per reduced
    bucket or step.
    """

    copy_engine: CopyEngine | None
    copier: ShareCopier | None
    _closed: bool

    def _start_copier(self, sample: torch.Tensor,
                      send: Callable[[int, int, list[Run]], None]) -> None:
        """A copier over ``copy_engine`` (picked by ``sample``'s device when None)."""
        if self.copy_engine is None:
            self.copy_engine = share_engine_for(sample)
        if self.copy_engine is not None:
            self.copier = ShareCopier(self.copy_engine, send)

    def _send_share_parts(self, it: int, index: int, parts: list[SharePart],
                          send: Callable[[int, int, list[Run]], None]) -> None:
        """Queue ``parts`` on the copier, or read them in place (CPU memory) and send."""
        if self.copier is not None:
            self.copier.submit(it, index, parts)
            return
        runs: list[Run] = []  # (flat offset, partition, values)
        for name, g, segs in parts:
            if g.device.type != "cpu":
                raise CheckmateError(f"gradient of {name} is on {g.device}: device memory "
                                     "reaches the shadows through a copy engine "
                                     "(checkmate.train.copyengine)")
            arr = g.numpy()
            runs.extend((off, part, arr[lo:lo + n]) for lo, n, off, part in segs)
        send(it, index, runs)

    def _before_grads_change(self) -> None:
        if self.copier is not None:
            self.copier.fence()  # a device-side wait: the copies read the gradients first

    def close(self) -> None:
        if self.copier is not None and not self._closed:
            self.copier.close()  # what is queued goes out before the sockets close
        super().close()  # type: ignore[misc]
