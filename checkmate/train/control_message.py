"""The per-iteration control message"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from checkmate.errors import CheckmateError
from checkmate.train.ddp import CheckmateDDP


class _ControlMessage:
    """Part of :class:`CheckmateSession` (session.py):
    The per-iteration control message"""

    def _control_body(self, lrs: list[float], coef: float | None, hyper: list[dict[str, Any]],
                      extra: dict[str, Any] | None, inv_scale: float | None = None,
                      skip: bool = False) -> dict[str, Any]:
        """This step's control message: what a shadow (or GoCkpt's process) needs to repeat
        it and to restore from it. ``inv_scale``: the float32 factor the trainers unscaled
        the replicated (scaled) gradient by; GoCkpt's process gets None (it captures the
        gradient after the unscale). ``skip``: the step was skipped (inf/nan gradient)."""
        return {
            "iteration": self.iteration, "lrs": lrs, "clip_coef": coef, "skip": skip,
            "inv_scale": inv_scale, "hyper": hyper,
            "buffers": self.spec.encode_buffers(dict(self.module.named_buffers())),
            "extra": {
                "scheduler": (self.scheduler.state_dict()
                              if self.scheduler is not None else None),
                "hyper": hyper,  # for a restore's param groups (extra is persisted)
                "scaler": (self.scaler.state_dict() if self.scaler is not None else None),
                "user": extra or {},
                "world": self.layout.world,  # a resume on another size says so
            },
        }

    def _clip(self) -> float | None:
        """Clip to ``max_grad_norm``; the float32 factor applied (None: no gradients)."""
        from checkmate.optim.clip import clip_grad_norm_

        return clip_grad_norm_(self.module.parameters(), self.max_grad_norm)[1]

    def _step_hyper(self) -> list[dict[str, Any]]:
        """Check that this step may be taken and return the control message's ``hyper``:
        every group's hyperparameters now, so a mid-run change reaches the shadows."""
        from checkmate.optim import hyper as H

        it, kind = self.iteration, self.spec.kind
        # A user's own DDP (checkmate.train.ddp_hook) is checked by DDPSession.step.
        if isinstance(self.model, CheckmateDDP) and self.model.reduced_iteration != it:
            raise CheckmateError(
                f"iteration {it}: step() without a reduced gradient (the last backward() ran "
                "inside no_sync(), or none ran); run the last accumulation pass outside it")
        groups = self.optimizer.param_groups
        if len(groups) != len(self.spec.groups):
            raise CheckmateError(f"iteration {it}: the optimizer has {len(groups)} param "
                                 f"groups, the job started with {len(self.spec.groups)}")
        out = []
        for gi, (g, sg) in enumerate(zip(groups, self.spec.groups, strict=True)):
            now = H.control_hyper(kind, g)
            H.check_change(kind, H.resolve(kind, sg.hyper(kind)), now,
                           f"iteration {it}: param group {gi}")
            out.append(now)
        return out

    def _sync_buffers(self) -> None:
        # Every rank takes rank 0's buffers (BatchNorm statistics) after each step, as DDP's
        # broadcast_buffers does; they are also what the control message gives the shadows.
        # Buffers are not gradients, so they go over the rendezvous group, not the ring.
        # On host memory: the group is gloo (a GPU job's buffers come to the host once here;
        # rank 0's control message encodes them from there too).
        bufs = [b for b in self.module.buffers() if b.numel()]
        if bufs and self.layout.world > 1:
            flat = torch.cat([b.detach().reshape(-1).to("cpu", torch.float64) for b in bufs])
            dist.broadcast(flat, src=0, group=self.group)
            if self.layout.rank != 0:
                off = 0
                with torch.no_grad():
                    for b in bufs:
                        n = b.numel()
                        b.copy_(flat[off:off + n].view(b.shape).to(b.dtype))
                        off += n
