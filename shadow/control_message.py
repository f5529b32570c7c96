"""The per-iteration control message as a shadow reads it: one JSON document from rank 0
with the learning rates, clip factor, loss-scale inverse and skip, hyperparameters,
buffers and the scheduler state, checked before any of it is applied."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from checkmate.optim.grads import as_kernel_grad, widen

#: Largest control message accepted (JSON with base64 buffers).
MAX_CONTROL = 64 << 20


@dataclass


class Control:
    """A parsed, validated per-iteration control message."""

    iteration: int
    lrs: list[float]
    clip_coef: float | None
    skip: bool
    buffers: dict[str, str]
    extra: dict[str, Any]
    #: Per group, the hyperparameters other than lr this step used (None: unchanged).
    hyper: list[dict[str, Any]] | None = None
    #: The float32 factor the trainers unscaled the (scaled, fp16) gradient by before the
    #: step (torch.amp.GradScaler; None: not scaled). See ``step_gradient``.
    inv_scale: float | None = None

    def step_gradient(self, grad: np.ndarray) -> np.ndarray:
        """The gradient the optimizer steps with: ``grad`` itself, or with ``inv_scale``
        its float32 product with it -- GradScaler's unscale, one correctly rounded float32
        multiply per element, before the kernel's clip multiply as on the trainers."""
        if self.inv_scale is None:
            return grad
        return widen(as_kernel_grad(grad)) * np.float32(self.inv_scale)


#: Keys a control message's ``hyper`` entry may carry (checkmate.optim.hyper names).
HYPER_KEYS = ("betas", "eps", "weight_decay", "amsgrad", "momentum", "dampening",
              "nesterov", "maximize")


def _parse_hyper(hyper: Any, groups: int) -> list[dict[str, Any]] | None:
    """Shape check of ``hyper``; the optimizer validates the values against its kind."""
    if hyper is None:
        return None
    if not isinstance(hyper, list) or len(hyper) != groups or not all(
            isinstance(h, dict) for h in hyper):
        raise ValueError(f"control hyper must be {groups} objects, got {hyper!r}")
    for h in hyper:
        for k, v in h.items():
            ok = k in HYPER_KEYS and (
                isinstance(v, list) and len(v) == 2 and all(_finite(x) for x in v)
                if k == "betas" else isinstance(v, bool) or _finite(v))
            if not ok:
                raise ValueError(f"control hyper has a bad entry {k!r}: {v!r}")
    return [dict(h) for h in hyper]


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def parse_control(data: bytes, iteration: int, groups: int) -> Control:
    """Validate a control message body; ValueError says what is wrong."""
    body = json.loads(data)
    if not isinstance(body, dict):
        raise ValueError("control message is not a JSON object")
    if body.get("iteration") != iteration:
        raise ValueError(f"control body says iteration {body.get('iteration')!r}, "
                         f"header says {iteration}")
    lrs = body.get("lrs")
    if (not isinstance(lrs, list) or len(lrs) != groups or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
            for x in lrs)):
        raise ValueError(f"control lrs must be {groups} finite numbers, got {lrs!r}")
    clip = body.get("clip_coef")
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float))
                             or not math.isfinite(clip)):
        raise ValueError(f"control clip_coef must be a number or null, got {clip!r}")
    skip = body.get("skip", False)
    if not isinstance(skip, bool):
        raise ValueError("control skip must be true or false")
    inv = body.get("inv_scale")
    if inv is not None and (isinstance(inv, bool) or not isinstance(inv, (int, float))
                            or not math.isfinite(inv) or inv <= 0
                            or float(np.float32(inv)) != inv):
        raise ValueError(f"control inv_scale must be a positive float32 number or null, "
                         f"got {inv!r}")
    buffers = body.get("buffers") or {}
    extra = body.get("extra") or {}
    if not isinstance(buffers, dict) or not isinstance(extra, dict):
        raise ValueError("control buffers and extra must be objects")
    return Control(iteration, [float(x) for x in lrs],
                   None if clip is None else float(clip), skip, buffers, extra,
                   _parse_hyper(body.get("hyper"), groups),
                   None if inv is None else float(inv))
