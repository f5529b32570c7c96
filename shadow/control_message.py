"""The per-iteration control message as a shadow reads it: one JSON document from rank 0
with the learning rates, clip factor, loss-scale inverse and skip, hyperparameters,
buffers and the scheduler state, checked before any of it is applied."""

from __future__ import annotations

import base64
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from checkmate.optim.grads import as_kernel_grad, widen
from checkmate.protocol import jsonbound
from checkmate.protocol.state_digest import valid_rows

#: Largest control message accepted whatever the spec (JSON with base64 buffers).
MAX_CONTROL = 64 << 20
#: Bytes a control message may hold besides its buffers: the trainer state in ``extra``
#: (scheduler, GradScaler, the user's data position, DDP's bucket layout), ``hyper``, the
#: learning rates. Trainers refuse to send more (checkmate.train.control_message).
CONTROL_BASE = 1 << 20
#: ... and per parameter (``extra["ddp_buckets"]`` lists them) and per param group.
CONTROL_PER_PARAM = 64
CONTROL_PER_GROUP = 1024
#: Bytes per element of each buffer dtype a spec may list (checkmate.spec.model).
_BUFFER_ITEM = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int64": 8,
                "int32": 4, "uint8": 1, "bool": 1}


def buffer_sizes(spec: Any) -> dict[str, int]:
    """Bytes of each buffer the control message carries, by name (the spec's list)."""
    return {b.name: b.numel * _BUFFER_ITEM.get(b.dtype, 8) for b in spec.buffers}


def control_limit(spec: Any) -> int:
    """The longest control message (JSON and its 32-byte MAC) a job with ``spec`` sends: its
    buffers in base64 (4 bytes per 3, plus the name) and the fixed allowances above. A
    fragment announcing a longer message is refused before anything is reserved."""
    bufs = sum(4 * (n + 2) // 3 + len(name) + 8 for name, n in buffer_sizes(spec).items())
    return min(MAX_CONTROL, CONTROL_BASE + bufs + CONTROL_PER_PARAM * len(spec.params)
               + CONTROL_PER_GROUP * len(spec.groups))


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
    #: Per rank, its digest of its share of each partition after this step (a checked
    #: iteration: checkmate.protocol.state_digest), or None.
    digests: list[list[str]] | None = None

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


def parse_control(data: bytes, iteration: int, groups: int,
                  buffers: Mapping[str, int] | None = None) -> Control:
    """Validate a control message body; ValueError says what is wrong. ``buffers``: the
    spec's buffers and their sizes in bytes (buffer_sizes); a buffer it does not list, or
    of another size, is refused (None: not checked, for tools without a spec)."""
    body = jsonbound.loads(data, MAX_CONTROL)
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
    spec_buffers = buffers
    buffers = body.get("buffers") or {}
    extra = body.get("extra") or {}
    if not isinstance(buffers, dict) or not isinstance(extra, dict):
        raise ValueError("control buffers and extra must be objects")
    if spec_buffers is not None:
        _check_buffers(buffers, spec_buffers)
    digests = body.get("digests")
    if digests is not None and not valid_rows(digests):
        raise ValueError("control digests must be one list per rank of one 32-hex-digit "
                         "digest per partition")
    return Control(iteration, [float(x) for x in lrs],
                   None if clip is None else float(clip), skip, buffers, extra,
                   _parse_hyper(body.get("hyper"), groups),
                   None if inv is None else float(inv), digests)


def _check_buffers(buffers: dict[str, Any], sizes: Mapping[str, int]) -> None:
    """Every buffer is one the spec lists, as base64 of exactly its size (the state a
    checkpoint holds must be the model's, never a name nobody restores into)."""
    for name, text in buffers.items():
        n = sizes.get(name)
        if n is None:
            raise ValueError(f"control buffer {str(name)[:80]!r} is not in the spec")
        ok = isinstance(text, str) and len(text) == 4 * ((n + 2) // 3)
        if ok:
            try:
                ok = len(base64.b64decode(text, validate=True)) == n
            except ValueError:
                ok = False
        if not ok:
            raise ValueError(f"control buffer {name!r} is not base64 of {n} bytes")
