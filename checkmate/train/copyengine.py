"""Device-to-host copies that overlap training: one interface, a CUDA and a CPU engine.

GoCkpt's slices and gradients and CheckFreq's snapshot leave the training device while the
next steps compute. Three rules keep such a copy correct, and the engines enforce them:

- **Order.** A copy reads the tensors as the training stream left them when ``copy`` was
  called (the copy stream first waits for the training stream), and copies run in the
  order they were issued.
- **No write before the read.** A copy of live state (parameters, optimizer slots) must
  finish before the training stream changes that state: ``fence()`` makes the training
  stream wait for every such copy issued so far. On CUDA this is a device-side wait
  (``Stream.wait_event``): the host does not block. A copy of a tensor that is about to
  change at once (a gradient that clipping scales in place) is ``stage``d: the training
  stream takes a device-to-device copy first, and the slow device-to-host transfer runs
  from that private copy.
- **No read before the copy completed.** A copy's host buffer is only reachable through
  ``Ticket.wait()``, which blocks until the copy finished; ``Ticket.release()`` hands the
  buffer back to the pool, which reuses it for a later copy of the same size and never
  hands out a buffer whose ticket is still held.

Engines: ``CudaCopyEngine`` (a side stream, pinned host buffers, events),
``ThreadCopyEngine`` (the CPU stand-in for a stream: one worker thread runs the copies in
issue order, ``fence`` waits for them; what it does not model is a device's separate
memory: a staged copy is a host memory copy) and ``SyncCopyEngine`` (copies at once, for
callers that want no thread). ``engine_for(device)`` picks one.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from checkmate.errors import CheckmateError


class BufferPool:
    """Host buffers (torch tensors; pinned for CUDA copies) reused by size and dtype.

    ``acquire`` returns a buffer no holder has; ``release`` returns it. ``limit`` bounds the
    bytes held out at once: an ``acquire`` past it waits until a release (so copies cannot
    pile up without bound when the consumer is slower than training).
    """

    def __init__(self, pin: bool = False, limit: int | None = None,
                 device: torch.device | None = None) -> None:
        self.pin, self.limit, self.device = pin, limit, device
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self._out: dict[int, tuple[int, torch.dtype]] = {}  # id(buffer) -> key, held out
        self._out_bytes = 0
        self._cv = threading.Condition()
        #: Buffers allocated so far (reuse keeps this small).
        self.allocated = 0

    def acquire(self, n: int, dtype: torch.dtype = torch.float32,
                timeout: float | None = 600.0) -> torch.Tensor:
        key = (int(n), dtype)
        nbytes = n * torch.empty((), dtype=dtype).element_size()
        with self._cv:
            if self.limit is not None and not self._cv.wait_for(
                    lambda: self._out_bytes == 0 or self._out_bytes + nbytes <= self.limit,
                    timeout):
                raise CheckmateError(f"copy engine: no host buffer came back within "
                                     f"{timeout:.0f} s (the consumer of the copies stalled)")
            free = self._free.get(key)
            buf = free.pop() if free else None
            self._out_bytes += nbytes
        if buf is None:
            if self.device is not None:
                buf = torch.empty(n, dtype=dtype, device=self.device)
            else:
                buf = torch.empty(n, dtype=dtype, pin_memory=self.pin)
            self.allocated += 1
        with self._cv:
            self._out[id(buf)] = key
        return buf

    def release(self, buf: torch.Tensor) -> None:
        with self._cv:
            key = self._out.pop(id(buf), None)
            if key is None:
                raise CheckmateError("copy engine: a buffer was released twice")
            self._out_bytes -= buf.numel() * buf.element_size()
            self._free.setdefault(key, []).append(buf)
            self._cv.notify_all()

    @property
    def held(self) -> int:
        """Buffers held out now."""
        with self._cv:
            return len(self._out)


class Ticket:
    """One issued copy: ``wait()`` for its host buffer, ``release()`` when read."""

    def __init__(self, engine: CopyEngine, host: torch.Tensor, owned: bool,
                 staging: torch.Tensor | None = None) -> None:
        self._engine, self._host, self._owned, self._staging = engine, host, owned, staging
        self._done = threading.Event()
        self._event: Any = None  # a CUDA event where the copy runs on a stream
        self._error: BaseException | None = None
        self._released = False

    def _finish(self, error: BaseException | None = None) -> None:
        self._error = error
        self._done.set()

    def done(self) -> bool:
        """Whether the copy has completed (never blocks)."""
        if self._event is not None and not self._done.is_set() and self._event.query():
            self._done.set()
        return self._done.is_set()

    def wait(self) -> torch.Tensor:
        """The host buffer, once the copy completed (blocks until then)."""
        if self._released:
            raise CheckmateError("copy engine: a ticket was read after its release")
        if self._event is not None:
            self._event.synchronize()
            self._done.set()
        self._done.wait()
        if self._error is not None:
            raise CheckmateError(f"copy engine: a copy failed: {self._error}")
        return self._host

    def numpy(self) -> np.ndarray:
        """``wait()`` as a numpy view (valid until ``release``)."""
        return self.wait().numpy()

    def release(self) -> None:
        """Give the buffers back for reuse; the copy must have completed."""
        if self._released:
            return
        self.wait()
        self._released = True
        if self._staging is not None:
            self._engine.staging.release(self._staging)
        if self._owned:
            self._engine.pool.release(self._host)


Part = tuple[int, torch.Tensor]  # (offset in the host buffer, a 1-D source tensor)


class CopyEngine:
    """The interface (see the module docstring). Subclasses implement ``_issue``/``fence``."""

    pin = False

    def __init__(self, limit: int | None = None) -> None:
        self.pool = BufferPool(pin=self.pin, limit=limit)
        self.staging = BufferPool()
        self._live: list[Ticket] = []  # copies of live state not yet fenced

    def copy(self, n: int, parts: Sequence[Part], *, stage: bool = False,
             zero: bool = False) -> Ticket:
        """Copy ``parts`` into a pooled host buffer of ``n`` float32 elements (``zero``:
        elements no part covers are 0). ``stage``: snapshot the sources on the training
        stream first (their owner changes them right away). Returns at once."""
        for off, src in parts:
            if src.dtype != torch.float32 or src.dim() != 1 or not 0 <= off <= n - src.numel():
                raise CheckmateError(f"copy engine: a part must be a 1-D float32 tensor "
                                     f"inside the buffer, got {src.dtype} "
                                     f"{tuple(src.shape)} at {off} of {n}")
        host = self.pool.acquire(n)
        if zero:
            host.zero_()
        return self._start(host, True, list(parts), stage)

    def copy_into(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Ticket:
        """Copy each ``(dst, src)`` pair into caller-owned host tensors (CheckFreq's
        snapshot, allocated once); a copy of live state, fenced like ``copy``."""
        return self._start(None, False, list(pairs), False)

    def _start(self, host: torch.Tensor | None, owned: bool, parts: list, stage: bool
               ) -> Ticket:
        raise NotImplementedError

    def fence(self) -> None:
        """The training stream waits until every copy of live state issued so far has read
        its sources (call it before the state changes: the next optimizer step)."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop the engine's thread, if any (copies issued so far complete first)."""


def _run_copy(host: torch.Tensor | None, parts: list) -> None:
    """The copies themselves (host = None: ``parts`` are ``(dst, src)`` pairs)."""
    with torch.no_grad():
        if host is None:
            for dst, src in parts:
                dst.copy_(src.detach(), non_blocking=dst.is_pinned() and src.is_cuda)
        else:
            for off, src in parts:
                host[off:off + src.numel()].copy_(src.detach(),
                                                  non_blocking=host.is_pinned() and src.is_cuda)


def _stage(engine: CopyEngine, parts: list) -> tuple[list, torch.Tensor | None]:
    """Snapshot the sources of a staged copy into one pooled buffer on their device (the
    training stream's copy); the transfer then reads the snapshot."""
    if not parts:
        return parts, None
    total = sum(src.numel() for _, src in parts)
    dev = parts[0][1].device
    if engine.staging.device != dev and dev.type != "cpu":
        engine.staging = BufferPool(device=dev)
    buf = engine.staging.acquire(total)
    out, pos = [], 0
    with torch.no_grad():
        for off, src in parts:
            k = src.numel()
            buf[pos:pos + k].copy_(src.detach())
            out.append((off, buf[pos:pos + k]))
            pos += k
    return out, buf


class SyncCopyEngine(CopyEngine):
    """Copies at once in the caller's thread: ``copy`` returns a completed ticket."""

    def _start(self, host, owned, parts, stage):
        t = Ticket(self, host, owned)
        try:
            _run_copy(host, parts)
            t._finish()
        except BaseException as e:
            t._finish(e)
        return t

    def fence(self) -> None:
        pass


class ThreadCopyEngine(CopyEngine):
    """The CPU stand-in for a copy stream: one thread runs the copies in issue order.

    ``delay`` (seconds per copy) is for tests: it widens the window in which a reader that
    did not wait, or a writer that did not fence, would see a half-done copy.
    """

    def __init__(self, limit: int | None = None, delay: float = 0.0) -> None:
        super().__init__(limit)
        self.delay = delay
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="ckm-copy", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        import time

        while True:
            item = self._q.get()
            if item is None:
                return
            t, host, parts = item
            try:
                if self.delay:
                    time.sleep(self.delay)
                _run_copy(host, parts)
                t._finish()
            except BaseException as e:  # reported by the ticket's wait()
                t._finish(e)

    def _start(self, host, owned, parts, stage):
        staging = None
        if stage:
            parts, staging = _stage(self, parts)
        t = Ticket(self, host, owned, staging)
        if not stage:
            self._live.append(t)
        self._q.put((t, host, parts))
        return t

    def fence(self) -> None:
        for t in self._live:
            t._done.wait()
        self._live = []

    def close(self) -> None:
        self._q.put(None)
        self._thread.join()


class CudaCopyEngine(CopyEngine):
    """A side stream copies into pinned host buffers; events order it against training."""

    pin = True

    def __init__(self, device: torch.device, limit: int | None = None) -> None:
        super().__init__(limit)
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.staging = BufferPool(device=device)
        self.stream = torch.cuda.Stream(device=device)

    def _start(self, host, owned, parts, stage):
        train = torch.cuda.current_stream(self.device)
        staging = None
        if stage:
            parts, staging = _stage(self, parts)  # on the training stream
        t = Ticket(self, host, owned, staging)
        self.stream.wait_stream(train)  # read the sources as training left them
        with torch.cuda.stream(self.stream):
            _run_copy(host, parts)
            for p in parts:
                src = p[1]
                if src.is_cuda:
                    src.record_stream(self.stream)  # the allocator keeps it for this stream
            ev = torch.cuda.Event()
            ev.record(self.stream)
        t._event = ev
        if not stage:
            self._live.append(t)
        return t

    def fence(self) -> None:
        train = torch.cuda.current_stream(self.device)
        for t in self._live:
            train.wait_event(t._event)  # a device-side wait: the host goes on
        self._live = []


def engine_for(device: torch.device, limit: int | None = None) -> CopyEngine:
    """The engine for state that lives on ``device``: a CUDA stream for CUDA tensors, the
    thread stand-in for CPU tensors."""
    if device.type == "cuda":
        return CudaCopyEngine(device, limit)
    if device.type == "cpu":
        return ThreadCopyEngine(limit)
    raise CheckmateError(f"copy engine: no engine for {device.type} tensors (cuda or cpu)")
