"""fp16 loss scaling (``torch.amp.GradScaler``) under Checkmate: the trainers' side.

The loop scales the loss as usual (``scaler.scale(loss).backward()``) and gives the scaler to
the session (``CheckmateSession(..., scaler=scaler)``); ``sess.step()`` does the rest of
torch's recipe (``unscale_``, clip, ``step``, ``update``) so that the trainers and the
shadows cannot disagree about it:

- The reduced gradient the shadows receive is the *scaled* one (it is replicated while
  backward runs). ``unscale_`` multiplies every gradient by the float32 ``inv_scale``
  (torch's ``_amp_foreach_non_finite_check_and_unscale_``: one float32 multiply per element,
  correctly rounded on every device); the control message carries that ``inv_scale`` and a
  shadow does the same multiply before its optimizer kernel (which then multiplies by the
  clip coefficient: two float32 multiplies in the trainers' order, never one by their
  product).
- A step whose gradient holds an inf or nan is skipped: every rank learns whether any rank
  found one (a MAX allreduce of the found-inf flags on the session's gloo group, as torch's
  ShardedGradScaler does; torch already reduces the flags of FSDP2's DTensor gradients over
  their mesh, this makes every path agree, e.g. a gradient changed on one rank after DDP's
  reduction), the scaler skips
  ``optimizer.step()`` on every rank, the scheduler does not step and no optimizer step is
  counted, and the control message says ``skip``: the shadows commit the iteration without
  stepping.
- The scaler's state after ``update()`` (scale, growth tracker) travels in the control
  message's ``extra``, so a restore resumes it with the rest of the job.

bf16 autocast needs none of this: its parameters and gradients stay float32.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from checkmate.errors import CheckmateError


def check_scaler(scaler: Any) -> Any:
    """``scaler`` if it is an enabled ``torch.amp.GradScaler`` (None for None or a disabled
    one, which does nothing); anything else is one CheckmateError line."""
    if scaler is None:
        return None
    if not isinstance(scaler, torch.amp.GradScaler):
        raise CheckmateError(f"scaler must be a torch.amp.GradScaler, got "
                             f"{type(scaler).__module__}.{type(scaler).__name__}")
    return scaler if scaler.is_enabled() else None


def inv_scale_of(scaler: torch.amp.GradScaler) -> float:
    """The float32 factor ``unscale_`` multiplies the gradients by, as torch computes it
    (``scale.double().reciprocal().float()``), as an exactly representable Python float."""
    scale = torch.tensor(scaler.get_scale(), dtype=torch.float64)
    return float(scale.reciprocal().to(torch.float32))


def unscale(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, world: int,
            group: Any) -> tuple[float, bool]:
    """Unscale ``optimizer``'s gradients and agree on every rank whether to skip the step;
    returns ``(inv_scale, skip)``. A single host wait for the found-inf flags, where
    ``scaler.step`` would wait for them anyway."""
    try:
        scaler.unscale_(optimizer)
    except (RuntimeError, AssertionError) as e:  # torch asserts a scale() was called
        raise CheckmateError(
            f"GradScaler: {str(e).splitlines()[0]} -- with a scaler given to the session, "
            "sess.step() unscales, clips (max_grad_norm), steps and updates; call only "
            "scaler.scale(loss).backward() yourself, before sess.step()") from None
    found = scaler._found_inf_per_device(optimizer)  # torch's own record, read by step()
    local = torch.zeros(1, dtype=torch.float32)
    for v in found.values():
        local += v.detach().to("cpu", torch.float32).reshape(1)
    if world > 1:
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
    skip = bool(local.item() != 0)
    if skip and found and not any(float(v.item()) != 0 for v in found.values()):
        next(iter(found.values())).fill_(1.0)  # another rank found one: skip here too
    return inv_scale_of(scaler), skip
