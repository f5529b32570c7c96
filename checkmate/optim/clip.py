"""Gradient clipping on the trainer that reports the factor the shadows must apply.

The trainer clips with torch's own ``clip_grad_norm_`` (so its gradients are exactly
torch's) and sends the float32 factor in the control message; a shadow multiplies its
float32 gradient by that factor, which is the same single float32 multiply.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def clip_coef_of(total_norm: torch.Tensor, max_norm: float) -> float:
    """The factor ``clip_grad_norm_`` multiplied every gradient by, as a Python float that
    is exactly representable in float32 (the same tensor expression torch 2.13 uses)."""
    coef = max_norm / (total_norm + 1e-6)
    return float(torch.clamp(coef, max=1.0).to(torch.float32).item())


def clip_grad_norm_(parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> tuple[torch.Tensor, float | None]:
    """``torch.nn.utils.clip_grad_norm_`` plus the factor it applied.

    Returns:
        ``(total_norm, clip_coef)``; ``clip_coef`` is None when there were no gradients
        (torch then leaves everything untouched).
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    has_grads = any(p.grad is not None for p in params)
    total = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type,
                                           error_if_nonfinite=error_if_nonfinite,
                                           foreach=foreach)
    if not has_grads:
        return total, None
    return total, clip_coef_of(total, float(max_norm))


def clip_mesh(grads: list[torch.Tensor], counted: list[bool], max_norm: float,
              cross: object) -> float | None:
    """Clip a mesh job's part of the model by the norm of the whole model (torchtitan's
    rule): the squared 2-norm of the ``counted`` ones of this part's gradients (local
    tensors) is summed over ``cross`` (the process group of the parts that make up one
    replica: every pipeline stage, every tensor-parallel shard), so every part applies the
    same factor to all of ``grads``; returns it (None when no part has a gradient)."""
    import torch.distributed as dist

    use = [g for g, c in zip(grads, counted, strict=True) if c]
    norm = torch.nn.utils.get_total_norm(use, 2.0) if use else torch.zeros(())
    sq = torch.stack([norm.detach().to("cpu", torch.float64) ** 2,
                      torch.tensor(float(len(grads)), dtype=torch.float64)])
    dist.all_reduce(sq, group=cross)
    if sq[1] == 0:
        return None
    total = sq[0].sqrt().to(torch.float32)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # torch's clip_grads_with_norm_
    with torch.no_grad():
        for g in grads:
            g.mul_(coef.to(g.device))
    return clip_coef_of(total, float(max_norm))
