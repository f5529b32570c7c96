"""One iteration of a session: ``begin`` (iteration number, RNG seed) and ``step`` (unscale,
clip, optimizer and scheduler step, buffer broadcast, and rank 0's control message).

The control message is what a shadow (or GoCkpt's process) needs to repeat the step bit for
bit and to restore from it; the checks before a step refuse one that the shadows could not
repeat (a changed param group, a hyperparameter change they do not follow, no reduced
gradient).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from checkmate.errors import CheckmateError
from checkmate.train.check_schedule import CheckSchedule
from checkmate.train.ddp import CheckmateDDP
from checkmate.train.world import mesh_of as world_mesh


def rng_seed(seed: int, rank: int, iteration: int) -> int:
    """The torch seed of (rank, iteration): a fixed function, so restores redraw the same."""
    return (seed * 1_000_003 + rank * 7_919 + iteration * 104_729) % (2**63 - 1)


class _Step:
    """Part of :class:`CheckmateSession` (session.py): one training iteration."""

    def begin(self, iteration: int) -> None:
        """Start ``iteration`` (1-based): tag datagrams with it and reseed the RNG."""
        if self.model is None:
            raise CheckmateError("call start() first")
        self.iteration = iteration
        if isinstance(self.model, CheckmateDDP):  # a user's own DDP reads sess.iteration
            self.model.iteration = iteration
        torch.manual_seed(rng_seed(self.layout.seed, self.layout.rank, iteration))

    def step(self, extra: dict[str, Any] | None = None) -> float | None:
        """Clip, step the optimizer and scheduler, and (rank 0) send the control message.

        With a ``scaler`` (fp16 loss scaling; the loop calls ``scaler.scale(loss).backward()``
        and nothing else of the scaler): unscale the gradients, agree on every rank whether
        one is inf/nan, and then either clip and step, or skip the step as GradScaler does
        (no optimizer step, no scheduler step, no step counted); ``scaler.update()`` either
        way. The shadows got the scaled gradient: the control message carries the float32
        ``inv_scale`` they multiply it by and the ``skip``.

        Returns the clip coefficient applied (None without clipping or on a skipped step).
        """
        from checkmate.train import amp

        hyper = self._step_hyper()  # before anything changes: a refused step leaves no trace
        self._before_grads_change()
        # A mesh job's groups skip alike: the flag is agreed over the whole job.
        over = ((self.layout.world, self.group) if self.mesh is None
                else (dist.get_world_size(), self.mesh.world))
        inv_scale, skip = (amp.unscale(self.scaler, self.optimizer, *over)
                           if self.scaler is not None else (None, False))
        if self.gockpt is not None:
            self.gockpt.before_clip(self.iteration)
        coef = self._clip() if self.max_grad_norm is not None and not skip else None
        lrs = [float(g["lr"]) for g in self.optimizer.param_groups]
        if self.scaler is not None:
            self.scaler.step(self.optimizer)  # skips by itself: the agreed found_inf
            self.scaler.update()
        else:
            self.optimizer.step()
        if self.scheduler is not None and not skip:
            self.scheduler.step()
        self._sync_buffers()
        self.last_clip = coef
        if self.injector is not None:
            self.injector("before-control", self.iteration)
        steps = self.opt_step + (0 if skip else 1)
        schedule = self._check_schedule()
        digests = self._verify() if schedule is not None and schedule.due(self.iteration) \
            else None
        if self.gockpt is not None:
            self.gockpt.after_step(self.iteration, steps,
                                   self._control_body(lrs, coef, hyper, extra, None, skip))
        if self.layout.rank == 0 and self.layout.mode != "off":
            data = self.sender.control(self.iteration, self._control_body(
                lrs, coef, hyper, extra, inv_scale, skip, digests))
            self.control_bytes = len(data)
            if self.replica_log is not None:
                self.replica_log.add_control(self.iteration, data)
        self.opt_step = steps
        self.done_iteration = self.iteration
        if self.monitor is not None:
            self.monitor.capture(self.iteration, self.opt_step)
        return coef

    def _verify(self) -> list[list[str]] | None:
        """A checked iteration, after the step and before the control message: the ranks'
        copies agree (checkmate.train.replica_check; a divergence ends here, before the
        shadows commit the iteration), then the digests the shadows check their state
        against (checkmate.train.shadow_check; None without shadows). Its time goes to the
        check schedule (checkmate.train.check_schedule), which may choose the next one."""
        t0 = time.perf_counter()
        rows = self._check_now()  # a divergence raises on every rank: no schedule then
        schedule = self._check_schedule()
        if schedule is not None:
            schedule.checked(self.iteration, time.perf_counter() - t0, self.group)
        return rows

    def _check_schedule(self) -> CheckSchedule | None:
        """The session's check schedule (None: ``verify_every`` 0), begun at the iteration
        the session trains on from."""
        if not self.verify_every:
            return None
        s = getattr(self, "_schedule", None)
        if s is None or s.every != self.verify_every:
            s = self._schedule = CheckSchedule(self.verify_every, self.done_iteration)
        return s

    def _replica_columns(self) -> list[list[int]] | None:
        """The sets of data-parallel ranks that hold the same state (None: none do)."""
        return [list(range(self.layout.world))] if self.replicates_state else None

    def _check_now(self) -> list[list[str]] | None:
        columns = self._replica_columns()
        if columns is not None:
            from checkmate.train.replica_check import agree

            agree(self.module, self.optimizer, self.group, self.layout.world, self.iteration,
                  self.verified_iteration, columns, restore=self.on_divergence == "restore")
            self.verified_iteration = self.iteration
        if self.layout.mode == "off":
            return None
        from checkmate.train.shadow_check import gathered

        return gathered(self)

    def _before_grads_change(self) -> None:
        """Called by ``step`` before anything writes the gradients (unscale, clip): a
        gradient path that still reads them (an asynchronous device-to-host copy) orders
        itself before. Nothing to do for the ring, whose pieces are sent by then."""

    def _check_new_step(self) -> None:
        """A session over a user's own gradient path sees no backward of its own: one
        step per begin() is all it can check here."""
        it = self.iteration
        if it <= self.done_iteration:
            raise CheckmateError(f"step() again for iteration {it}: call begin(iteration) "
                                 "before each iteration's forward and backward")

    def _control_body(self, lrs: list[float], coef: float | None, hyper: list[dict[str, Any]],
                      extra: dict[str, Any] | None, inv_scale: float | None = None,
                      skip: bool = False, digests: list[list[str]] | None = None
                      ) -> dict[str, Any]:
        """This step's control message: what a shadow (or GoCkpt's process) needs to repeat
        it and to restore from it. ``inv_scale``: the float32 factor the trainers unscaled
        the replicated (scaled) gradient by; GoCkpt's process gets None (it captures the
        gradient after the unscale). ``skip``: the step was skipped (inf/nan gradient).
        ``digests``: every rank's digests of its share of each partition after this step,
        which the shadows check what they commit against (checkmate.train.shadow_check)."""
        return {
            **({"digests": digests} if digests is not None else {}),
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
                **({"mesh": world_mesh(self.mesh.place)} if self.mesh is not None else {}),
            },
        }

    def _clip(self) -> float | None:
        """Clip to ``max_grad_norm``; the float32 factor applied (None: no gradients)."""
        from checkmate.optim.clip import clip_grad_norm_, clip_mesh

        if self.mesh is not None and self.mesh.count > 1:
            # By the norm of the whole model: every group applies (and sends) one factor.
            from checkmate.train.tensor_parallel import counts_in_norm, local

            params = [p for p in self.module.parameters() if p.grad is not None]
            first = self.mesh.first_tp_rank
            return clip_mesh([local(p.grad) for p in params],
                             [counts_in_norm(p, first) for p in params], self.max_grad_norm,
                             self.mesh.cross)
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
            dist.broadcast(flat, group=self.group, group_src=0)
            if self.layout.rank != 0:
                off = 0
                with torch.no_grad():
                    for b in bufs:
                        n = b.numel()
                        b.copy_(flat[off:off + n].view(b.shape).to(b.dtype))
                        off += n
