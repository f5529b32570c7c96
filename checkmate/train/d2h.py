"""Asynchronous device-to-host copies of this rank's gradient share, for the senders.

On GPUs the reduced gradient (a DDP bucket after its allreduce, an FSDP2 shard after its
reduce-scatter) lives in device memory, and the shadows need it in host memory. A
``ShareCopier`` moves only this rank's share there without the training thread waiting:

1. ``submit`` (in DDP's comm hook, or at FSDP's step) records an event on the current
   stream (the reduction is queued before it), makes a side copy stream wait for that event,
   queues one non-blocking copy per owned segment into host buffers (pinned, allocated once
   per parameter and reused), records a second event on the copy stream, and hands the job
   to the sender thread. Nothing here waits for the device.
2. The sender thread waits for the copy's event (the host waits *here*, off the training
   thread), sends the segments, and only then returns the buffers for reuse: a buffer is
   never overwritten before its send finished, and never sent before its copy completed.
3. ``fence`` (at the start of ``sess.step``, before unscale, clip and the optimizer write
   the gradients) makes the training stream wait for every copy submitted so far: a device
   wait, not a host one, so the next writes to the gradient memory are ordered after the
   reads of the copies.

The only host wait on the training thread is back-pressure: when all ``depth`` buffers of a
parameter are still held by unsent jobs (the sender is ``depth`` iterations behind),
``submit`` waits for one (``stats["waits"]`` counts it).

The copy machinery is a ``Stager``: ``CudaStager`` for CUDA tensors, and ``ThreadStager``,
a CPU stand-in with the same interface whose "stream" is one worker thread and whose events
are ``threading.Event``s, so the ordering logic here runs and is tested without a GPU.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from checkmate.errors import CheckmateError
from checkmate.train.segments import Segment

#: Host buffers per parameter: one being sent while the next iteration's copy fills another.
DEPTH = 2


class Event(Protocol):
    def synchronize(self) -> None: ...


class Stager(Protocol):
    """Where copies run. ``mark`` and ``copy`` return at once; only ``Event.synchronize``
    (and, for the CPU stand-in, ``order_current_after``) waits."""

    def host_buffer(self, n: int) -> torch.Tensor: ...
    def mark(self) -> Event: ...
    def copy(self, after: Event, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Event: ...
    def order_current_after(self, event: Event) -> None: ...


class CudaStager:
    """Copies on a side CUDA stream of ``device`` into pinned host memory."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device)

    def host_buffer(self, n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.float32, pin_memory=True)

    def mark(self) -> Event:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def copy(self, after: Event, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Event:
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(after)
            for src, dst in pairs:
                dst.copy_(src, non_blocking=True)
                # the source was allocated on the training stream: keep the allocator from
                # handing its memory out again before this stream has read it
                src.record_stream(self.stream)
            done = torch.cuda.Event(blocking=True)  # the sender thread sleeps, not spins
            done.record(self.stream)
        return done

    def order_current_after(self, event: Event) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)


class _HostEvent:
    def __init__(self) -> None:
        self._ev = threading.Event()

    def set(self) -> None:
        self._ev.set()

    def synchronize(self) -> None:
        self._ev.wait()

    def query(self) -> bool:
        return self._ev.is_set()


class ThreadStager:
    """CPU stand-in for ``CudaStager``: the copy "stream" is one worker thread that runs the
    copies in submission order, each after its ``after`` event, taking ``delay`` seconds
    (to widen the window in which a wrong order would show). Events are threading.Events.

    It does not model device memory, pinned pages, or a stream running behind the host:
    ``mark`` is complete at once (CPU work is done when it returns), and
    ``order_current_after`` blocks the calling thread, where a CUDA stream would wait on the
    device."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self._q: queue.Queue = queue.Queue()
        self.copies = 0
        threading.Thread(target=self._run, daemon=True, name="ckm-d2h-standin").start()

    def host_buffer(self, n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.float32)

    def mark(self) -> Event:
        ev = _HostEvent()
        ev.set()
        return ev

    def copy(self, after: Event, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Event:
        done = _HostEvent()
        self._q.put((after, pairs, done))
        return done

    def order_current_after(self, event: Event) -> None:
        event.synchronize()

    def _run(self) -> None:
        while True:
            after, pairs, done = self._q.get()
            after.synchronize()
            if self.delay:
                time.sleep(self.delay)
            for src, dst in pairs:
                dst.copy_(src)
            self.copies += 1
            done.set()


#: (key, flat source tensor, owned segments of it) -- one parameter's share in a submit.
Part = tuple[str, torch.Tensor, list[Segment]]
#: (flat offset, partition, float32 values) -- what the send callback gets.
Run = tuple[int, int, np.ndarray]


@dataclass
class _Job:
    iteration: int
    index: int
    done: Event
    runs: list[tuple[int, int, torch.Tensor]]  # (flat offset, partition, host view)
    held: list[tuple[str, torch.Tensor]] = field(default_factory=list)


class ShareCopier:
    """Host copies of this rank's share, sent by a thread of their own (module docstring).

    Args:
        stager: where the copies run (CudaStager, or ThreadStager on the CPU).
        send: ``send(iteration, index, runs)`` in the sender thread, once per submit, after
            the copy completed; its host arrays are valid only during the call (copy what
            must outlive it, as ``segments.send_runs`` does).
        depth: host buffers per key at most.
    """

    def __init__(self, stager: Stager, send: Callable[[int, int, list[Run]], None],
                 depth: int = DEPTH) -> None:
        if depth < 1:
            raise CheckmateError(f"depth must be >= 1, got {depth}")
        self.stager = stager
        self._send = send
        self.depth = depth
        self._free: dict[str, list[torch.Tensor]] = defaultdict(list)
        self._allocated: dict[str, int] = defaultdict(int)
        self._cond = threading.Condition()
        self._q: queue.Queue = queue.Queue()
        self._pending: list[Event] = []
        self.error: str | None = None
        #: submits, host buffers allocated, back-pressure waits, jobs sent.
        self.stats = {"submits": 0, "buffers": 0, "waits": 0, "sent": 0}
        self._thread = threading.Thread(target=self._loop, daemon=True, name="ckm-d2h-send")
        self._thread.start()

    def submit(self, iteration: int, index: int, parts: list[Part]) -> None:
        """Queue the copy of every part's segments and their send; returns at once (but for
        back-pressure, see the module docstring)."""
        self._raise()
        ready = self.stager.mark()
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        job = _Job(iteration, index, ready, [])
        for key, src, segs in parts:
            n = sum(s[1] for s in segs)
            if not n:
                continue
            buf = self._take(key, n)
            job.held.append((key, buf))
            pos = 0
            for lo, count, off, part in segs:
                view = buf[pos:pos + count]
                pairs.append((src[lo:lo + count], view))
                job.runs.append((off, part, view))
                pos += count
        if not pairs:
            return
        job.done = self.stager.copy(ready, pairs)
        with self._cond:  # a backend may run the hook's callback on a thread of its own
            self._pending.append(job.done)
        self.stats["submits"] += 1
        self._q.put(job)

    def fence(self) -> None:
        """The current stream waits for every copy submitted so far (see the module
        docstring); a sender failure is raised here as one CheckmateError."""
        with self._cond:
            pending, self._pending = self._pending, []
        for ev in pending:
            self.stager.order_current_after(ev)
        self._raise()

    def drain(self) -> None:
        """Wait until every submitted job was sent (or failed)."""
        self._q.join()
        self._raise()

    def close(self) -> None:
        """Send what is queued, then stop the thread."""
        if self._thread.is_alive():
            self._q.put(None)
            self._thread.join()

    def _raise(self) -> None:
        if self.error is not None:
            raise CheckmateError(f"sending the gradient share to the shadows failed: "
                                 f"{self.error}")

    def _take(self, key: str, n: int) -> torch.Tensor:
        with self._cond:
            while True:
                free = self._free[key]
                if free:
                    buf = free.pop()
                    if buf.numel() != n:
                        raise CheckmateError(f"{key}: its share is {n} elements, was "
                                             f"{buf.numel()}")
                    return buf
                if self._allocated[key] < self.depth:
                    self._allocated[key] += 1
                    self.stats["buffers"] += 1
                    return self.stager.host_buffer(n)
                self.stats["waits"] += 1
                self._cond.wait()

    def _loop(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                self._q.task_done()
                return
            try:
                job.done.synchronize()
                if self.error is None:
                    self._send(job.iteration, job.index,
                               [(off, part, v.numpy()) for off, part, v in job.runs])
                    self.stats["sent"] += 1
            except Exception as e:  # noqa: BLE001 -- reported at the next submit or fence
                self.error = f"iteration {job.iteration}: {type(e).__name__}: {e}"
            finally:
                with self._cond:
                    for key, buf in job.held:
                        self._free[key].append(buf)
                    self._cond.notify_all()
                self._q.task_done()


def stager_for(tensor: torch.Tensor) -> Stager | None:
    """The stager for gradients on ``tensor``'s device: CUDA's, or None on the CPU (the
    host memory is already there: the senders read it directly)."""
    if tensor.device.type == "cuda":
        return CudaStager(tensor.device)
    return None
