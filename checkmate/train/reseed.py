"""The trainer's side of a live re-seed (checkmate.shadow.reseed has the shadow's side).

One trainer re-seeds a partition while training runs: right after each optimizer step it
copies one slice of the partition's state (parameters and optimizer slots) out of the live
tensors -- a memcpy of ``partition size / slices`` elements per slot on the training thread,
the only cost training sees -- and a background thread sends it to the shadow over the TCP
service. The first slice is preceded by the ``reseed`` op with the spec, so an empty,
restarted shadow learns the job from it. The shadow compiles its kernels before answering,
and only then is the first slice captured: its iteration starts the re-seed, so no gradient
after it is dropped while the shadow compiles. Training never waits for the transfer.
"""

from __future__ import annotations

import logging
import queue
import threading

import numpy as np
import torch

from checkmate.errors import CheckmateError
from checkmate.protocol.frames import Addr
from checkmate.spec.model import ModelSpec
from checkmate.train.shadow_client import ShadowClient

log = logging.getLogger("checkmate.train")

#: Slices a partition's state is sent in (one per iteration) unless the layout says otherwise.
RESEED_SLICES = 4


def _host(t: torch.Tensor, lo: int, hi: int) -> np.ndarray:
    """Flat elements [lo, hi) of a tensor as numpy: a view on the CPU, a device-to-host
    copy of just that range from an accelerator."""
    t = t.detach().reshape(-1)[lo:hi]
    return (t if t.device.type == "cpu" else t.to("cpu")).numpy()


def capture_range(spec: ModelSpec, params: dict[str, torch.Tensor],
                  optimizer: torch.optim.Optimizer, a: int, b: int) -> dict[str, np.ndarray]:
    """Copies of every slot over flat range [a, b) from the live model and optimizer.

    Slots an optimizer has no state for yet (before its first step) are zeros, as in
    ``ModelSpec.flat_from_state_dicts``.
    """
    out = {s: np.zeros(b - a, np.float32) for s in spec.slots}
    for p, lo, hi in spec.pieces(a, b):
        dst = p.offset + lo - a
        t = params[p.name]
        out["param"][dst:dst + hi - lo] = _host(t, lo, hi)
        st = optimizer.state.get(t, {})
        for s in spec.slots:
            v = st.get(s) if s != "param" else None
            if torch.is_tensor(v):
                out[s][dst:dst + hi - lo] = _host(v, lo, hi)
    return out


def capture_gradient(spec: ModelSpec, params: dict[str, torch.Tensor], a: int, b: int
                     ) -> np.ndarray:
    """A float32 copy of the (reduced, unclipped) gradient over flat range [a, b)."""
    out = np.empty(b - a, np.float32)
    for p, lo, hi in spec.pieces(a, b):
        g = params[p.name].grad
        if g is None:
            raise CheckmateError(f"parameter {p.name} has no gradient to checkpoint with")
        dst = p.offset + lo - a
        out[dst:dst + hi - lo] = _host(g, lo, hi)
    return out


class ReseedSender:
    """Captures one partition slice by slice and ships the slices in the background."""

    def __init__(self, spec: ModelSpec, params: dict[str, torch.Tensor],
                 optimizer: torch.optim.Optimizer, partition: int, addr: Addr,
                 slices: int = RESEED_SLICES, reason: str = "") -> None:
        self.spec, self.params, self.optimizer = spec, params, optimizer
        self.partition, self.addr, self.reason = partition, addr, reason
        start, end = spec.bounds(partition)
        n = max(1, min(slices, end - start))
        self.cuts = [(start + (end - start) * i // n, start + (end - start) * (i + 1) // n)
                     for i in range(n)]
        self.next = 0
        self.ready = threading.Event()  # the shadow is prepared: capturing may start
        self.t0: int | None = None
        self.error = ""
        self.committed = False
        self.sent_bytes = 0
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"ckm-reseed-{partition}",
                                        daemon=True)
        self._thread.start()

    @property
    def capturing(self) -> bool:
        return self.next < len(self.cuts) and not self.error and self.ready.is_set()

    @property
    def finished(self) -> bool:
        return not self._thread.is_alive()

    def capture(self, iteration: int, step: int) -> None:
        """After the optimizer step of ``iteration`` (``step`` steps taken): the next slice."""
        if not self.capturing:
            return
        if self.next == 0:
            self.t0 = iteration
        a, b = self.cuts[self.next]
        self.next += 1
        self._q.put(("piece", iteration, step, a, b,
                     capture_range(self.spec, self.params, self.optimizer, a, b)))
        if self.next == len(self.cuts):
            self._q.put(None)

    def cancel(self) -> None:
        self.error = self.error or "cancelled"
        self._q.put(None)

    def _run(self) -> None:
        try:
            with ShadowClient(self.addr, timeout=30.0) as c:
                # Prepare first (spec, kernel compilation at the shadow); the first slice,
                # captured after this returns, fixes the start iteration.
                c.request({"op": "reseed", "spec": self.spec.to_json(),
                           "reason": self.reason})
                self.ready.set()
                while True:
                    item = self._q.get()
                    if item is None or self.error:
                        return
                    _, it, step, a, b, arrays = item
                    parts = [arrays[s] for s in self.spec.slots]
                    reply, _ = c.request({"op": "reseed_piece", "iteration": it, "step": step,
                                          "offset": a, "count": b - a,
                                          "slots": list(self.spec.slots)}, parts)
                    self.sent_bytes += sum(p.nbytes for p in parts)
                    self.committed = bool(reply.get("committed"))
        except CheckmateError as e:
            self.error = str(e)
            log.warning("re-seed of partition %d stopped: %s", self.partition, e)
