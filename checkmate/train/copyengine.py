"""Device-to-host copies that overlap training: the one engine every copy goes through.

GoCkpt's slices and gradients, CheckFreq's snapshot and the DDP/FSDP2 senders' gradient
shares (checkmate.train.share_copy) leave the training device while the next steps compute.
Three rules keep such a copy correct, and the engine enforces them for all of them:

- **Order.** A copy reads the tensors as the training stream left them when it was issued
  (``mark`` records an event on the training stream and the copy stream waits for it), and
  copies run in the order they were issued.
- **No write before the read.** A copy of live state (parameters, optimizer slots, a
  reduced gradient) must finish before the training stream changes that state:
  ``fence()`` makes the training stream wait for every such copy issued so far. On CUDA
  this is a device-side wait (``Stream.wait_event``): the host does not block. A copy of a
  tensor that is about to change at once (a gradient that clipping scales in place) is
  ``stage``d: the training stream takes a device-to-device copy first, and the slow
  device-to-host transfer runs from that private copy.
- **No read before the copy completed; no refill before the read finished.** A copy's host
  buffer is only reachable through ``Ticket.wait()``, which blocks until the copy
  finished. Host buffers come from a ``BufferPool`` (pinned for CUDA), reused by size and
  never handed out while a holder has them: ``Ticket.release()`` (or ``BufferPool.release``
  for buffers a caller took itself) gives them back.

Engines: ``CudaCopyEngine`` (a side stream, pinned host buffers, events),
``ThreadCopyEngine`` (the CPU stand-in for a stream: one worker thread runs the copies in
issue order, its events are threading.Events and ``fence`` blocks the caller where CUDA
would wait on the device; what it does not model is a device's separate memory: a staged
copy is a host memory copy) and ``SyncCopyEngine`` (copies at once, for callers that want
no thread). ``engine_for(device)`` picks one. An engine's three primitives -- ``mark``,
``enqueue`` and ``order_current_after`` -- are all a backend implements; ``copy``,
``copy_into`` and ``fence`` are built on them once.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch

from checkmate.errors import CheckmateError

#: (destination, source) -- one tensor copy; the destination is host memory.
Pair = tuple[torch.Tensor, torch.Tensor]
#: (offset in the host buffer, a 1-D float32 source tensor) -- one part of ``copy``.
Part = tuple[int, torch.Tensor]


class Event(Protocol):
    """A point in a stream: a CUDA event, or the CPU stand-in's ``HostEvent``."""

    def synchronize(self) -> None: ...
    def query(self) -> bool: ...


class BufferPool:
    """Host buffers (torch tensors; pinned for CUDA copies) reused by size and dtype.

    ``acquire`` returns a buffer no holder has; ``release`` returns it. Two bounds make a
    caller wait when the consumer of the copies is slower than training (so copies cannot
    pile up without bound): ``limit``, the bytes held out at once (buffers taken for no
    owner), and, for a buffer taken for an ``owner``, ``depth``, the buffers that owner has
    at most (the share copier's parameters: one being sent while the next iteration's copy
    fills another). An owner's buffers all have one size. A wait past ``timeout`` is one
    CheckmateError.
    """

    def __init__(self, pin: bool = False, limit: int | None = None,
                 device: torch.device | None = None) -> None:
        self.pin, self.limit, self.device = pin, limit, device
        self._free: dict[tuple[Any, int, torch.dtype], list[torch.Tensor]] = {}
        self._out: dict[int, tuple[Any, int, torch.dtype]] = {}  # id(buffer) -> its key
        self._out_bytes = 0
        self._owned: dict[Any, tuple[int, int]] = {}  # owner -> (its size, buffers made)
        self._cv = threading.Condition()
        #: Buffers allocated so far (reuse keeps this small), and acquires that waited.
        self.allocated = 0
        self.waits = 0

    def acquire(self, n: int, dtype: torch.dtype = torch.float32,
                timeout: float | None = 600.0, *, owner: Any = None, depth: int = 2
                ) -> torch.Tensor:
        key = (owner, int(n), dtype)
        nbytes = n * torch.empty((), dtype=dtype).element_size()
        with self._cv:
            if owner is not None:
                size = self._owned.setdefault(owner, (n, 0))[0]
                if size != n:
                    raise CheckmateError(f"{owner}: its share is {n} elements, was {size}")

                def ready() -> bool:
                    return bool(self._free.get(key)) or self._owned[owner][1] < depth
            else:
                def ready() -> bool:
                    return (self.limit is None or self._out_bytes == 0
                            or self._out_bytes + nbytes <= self.limit)
            if not ready():
                self.waits += 1
                if not self._cv.wait_for(ready, timeout):
                    raise CheckmateError(f"copy engine: no host buffer came back within "
                                         f"{timeout:.0f} s (the consumer of the copies "
                                         f"stalled)")
            free = self._free.get(key)
            buf = free.pop() if free else None
            if buf is None and owner is not None:
                self._owned[owner] = (n, self._owned[owner][1] + 1)
            self._out_bytes += nbytes
        if buf is None:
            if self.device is not None:
                buf = torch.empty(n, dtype=dtype, device=self.device)
            else:
                buf = torch.empty(n, dtype=dtype, pin_memory=self.pin)
            with self._cv:
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


class HostEvent:
    """The CPU stand-in's event: set when its copies ran; a failed copy is raised by
    ``synchronize`` (where a CUDA error would surface)."""

    def __init__(self, done: bool = False) -> None:
        self._ev = threading.Event()
        self.error: BaseException | None = None
        if done:
            self._ev.set()

    def set(self, error: BaseException | None = None) -> None:
        self.error = error
        self._ev.set()

    def wait(self) -> None:
        """Until the copies ran (failed or not)."""
        self._ev.wait()

    def synchronize(self) -> None:
        self._ev.wait()
        if self.error is not None:
            raise CheckmateError(f"copy engine: a copy failed: {self.error}")

    def query(self) -> bool:
        return self._ev.is_set()


class Ticket:
    """One issued copy: ``wait()`` for its host buffer, ``release()`` when read."""

    def __init__(self, engine: CopyEngine, done: Event, host: torch.Tensor | None,
                 staging: torch.Tensor | None = None) -> None:
        self._engine, self._event, self._host, self._staging = engine, done, host, staging
        self._released = False

    def done(self) -> bool:
        """Whether the copy has completed (never blocks)."""
        return bool(self._event.query())

    def wait(self) -> torch.Tensor | None:
        """The host buffer (None for ``copy_into``), once the copy completed (blocks until
        then)."""
        if self._released:
            raise CheckmateError("copy engine: a ticket was read after its release")
        self._event.synchronize()
        return self._host

    def numpy(self) -> np.ndarray:
        """``wait()`` as a numpy view (valid until ``release``)."""
        host = self.wait()
        if host is None:
            raise CheckmateError("copy engine: a copy_into ticket has no buffer of its own")
        return host.numpy()

    def release(self) -> None:
        """Give the buffers back for reuse; the copy must have completed."""
        if self._released:
            return
        try:
            self._event.synchronize()
        except CheckmateError:
            pass  # failed or not, the copy is over: its buffers may be reused
        self._released = True
        if self._staging is not None:
            self._engine.staging.release(self._staging)
        if self._host is not None:
            self._engine.pool.release(self._host)


def _run_copies(pairs: Sequence[Pair]) -> None:
    with torch.no_grad():
        for dst, src in pairs:
            dst.copy_(src.detach(), non_blocking=dst.is_pinned() and src.is_cuda)


class CopyEngine:
    """The interface (see the module docstring). A backend implements ``mark``,
    ``enqueue`` and ``order_current_after``."""

    pin = False

    def __init__(self, limit: int | None = None) -> None:
        self.pool = BufferPool(pin=self.pin, limit=limit)
        self.staging = BufferPool()
        self._live: list[Event] = []  # copies of live state not yet fenced
        self._lock = threading.Lock()  # a backend may issue from a thread of its own

    # ------------------------------------------------------------ the backend's primitives
    def mark(self) -> Event:
        """An event on the training stream: what was queued there so far."""
        raise NotImplementedError

    def enqueue(self, after: Event, pairs: list[Pair]) -> Event:
        """Run the ``(dst, src)`` copies on the copy stream once ``after`` completed;
        returns at once, with the event of their completion."""
        raise NotImplementedError

    def order_current_after(self, event: Event) -> None:
        """The training stream waits for ``event`` (on CUDA a device-side wait)."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop the engine's thread, if any (copies issued so far complete first)."""

    # ------------------------------------------------------------ built on them
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
        staging = None
        if stage:
            parts, staging = self._stage(list(parts))
        done = self.enqueue(self.mark(), [(host[off:off + src.numel()], src)
                                          for off, src in parts])
        if not stage:
            self._add_live(done)
        return Ticket(self, done, host, staging)

    def copy_into(self, pairs: Sequence[Pair]) -> Ticket:
        """Copy each ``(dst, src)`` pair into caller-owned host tensors (CheckFreq's
        snapshot, allocated once; the senders' share buffers, taken from ``pool`` for an
        owner); a copy of live state, fenced like ``copy``. Returns at once."""
        done = self.enqueue(self.mark(), list(pairs))
        self._add_live(done)
        return Ticket(self, done, None)

    def fence(self) -> None:
        """The training stream waits until every copy of live state issued so far has read
        its sources (call it before the state changes: the next optimizer step)."""
        with self._lock:
            live, self._live = self._live, []
        for ev in live:
            self.order_current_after(ev)

    def _add_live(self, done: Event) -> None:
        with self._lock:
            self._live.append(done)

    def _stage(self, parts: list[Part]) -> tuple[list[Part], torch.Tensor | None]:
        """Snapshot the sources of a staged copy into one pooled buffer on their device (the
        training stream's copy); the transfer then reads the snapshot."""
        if not parts:
            return parts, None
        total = sum(src.numel() for _, src in parts)
        dev = parts[0][1].device
        if self.staging.device != dev and dev.type != "cpu":
            self.staging = BufferPool(device=dev)
        buf = self.staging.acquire(total)
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

    def mark(self) -> Event:
        return HostEvent(done=True)

    def enqueue(self, after: Event, pairs: list[Pair]) -> Event:
        after.synchronize()
        done = HostEvent()
        try:
            _run_copies(pairs)
            done.set()
        except BaseException as e:  # noqa: BLE001 -- raised by the ticket's wait()
            done.set(e)
        return done

    def order_current_after(self, event: Event) -> None:
        pass  # complete when enqueue returned


class ThreadCopyEngine(CopyEngine):
    """The CPU stand-in for a copy stream: one thread runs the copies in issue order, each
    after its ``after`` event.

    ``delay`` (seconds per copy) is for tests: it widens the window in which a reader that
    did not wait, or a writer that did not fence, would see a half-done copy. ``mark`` is
    complete at once (CPU work is done when it returns), and ``order_current_after``
    blocks the calling thread, where a CUDA stream would wait on the device.
    """

    def __init__(self, limit: int | None = None, delay: float = 0.0) -> None:
        super().__init__(limit)
        self.delay = delay
        #: Copies (``enqueue`` calls) run so far.
        self.copies = 0
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="ckm-copy", daemon=True)
        self._thread.start()

    def mark(self) -> Event:
        return HostEvent(done=True)

    def enqueue(self, after: Event, pairs: list[Pair]) -> Event:
        done = HostEvent()
        self._q.put((after, pairs, done))
        return done

    def order_current_after(self, event: Event) -> None:
        if isinstance(event, HostEvent):
            event.wait()  # a failed copy is its ticket's to report
        else:
            event.synchronize()

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            after, pairs, done = item
            try:
                after.synchronize()
                if self.delay:
                    time.sleep(self.delay)
                _run_copies(pairs)
                self.copies += 1
                done.set()
            except BaseException as e:  # noqa: BLE001 -- raised by the ticket's wait()
                done.set(e)

    def close(self) -> None:
        if self._thread.is_alive():
            self._q.put(None)
            self._thread.join()


class CudaCopyEngine(CopyEngine):
    """A side stream copies into pinned host buffers; events order it against training."""

    pin = True

    def __init__(self, device: torch.device, limit: int | None = None) -> None:
        super().__init__(limit)
        device = torch.device(device)
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.staging = BufferPool(device=device)
        self.stream = torch.cuda.Stream(device=device)

    def mark(self) -> Event:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def enqueue(self, after: Event, pairs: list[Pair]) -> Event:
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(after)  # read the sources as training left them
            _run_copies(pairs)
            for _, src in pairs:
                if src.is_cuda:
                    # allocated on the training stream: the allocator must not hand its
                    # memory out again before this stream has read it
                    src.record_stream(self.stream)
            done = torch.cuda.Event(blocking=True)  # a waiting thread sleeps, not spins
            done.record(self.stream)
        return done

    def order_current_after(self, event: Event) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)  # the host goes on


def engine_for(device: torch.device, limit: int | None = None) -> CopyEngine:
    """The engine for state that lives on ``device``: a CUDA stream for CUDA tensors, the
    thread stand-in for CPU tensors."""
    if device.type == "cuda":
        return CudaCopyEngine(device, limit)
    if device.type == "cpu":
        return ThreadCopyEngine(limit)
    raise CheckmateError(f"copy engine: no engine for {device.type} tensors (cuda or cpu)")
