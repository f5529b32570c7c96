"""Optimizers whose arithmetic the trainer and the shadow share: one update rule
(:mod:`checkmate.optim.rule`), run by the Numba kernels on CPU tensors and by a Triton
kernel generated from it (or an exact torch executor) on CUDA tensors.

- :class:`SGD`, :class:`Adam`, :class:`AdamW`: torch.optim drop-ins for the trainer, on CPU
  or CUDA parameters (``executor=`` one of :data:`EXECUTORS` forces a path);
- :class:`FlatOptimizer`: one partition's flat float32 state for the shadow;
- :func:`clip_grad_norm_`: torch's clipping that also returns the factor it applied;
- :mod:`checkmate.optim.ops`: the step functions on flat numpy arrays both build on.
"""

import importlib
from typing import Any

# Imported on first use (PEP 562): the shadow imports checkmate.optim.grads and the Numba
# kernels only, and must not pay for importing torch (seconds per process, minutes under
# the soft-RoCE guest's emulation) for the trainer-side classes it never touches.
_WHERE = {
    "clip_coef_of": "clip", "clip_grad_norm_": "clip", "EXECUTORS": "device",
    "FlatOptimizer": "flat", "KERNEL_GRAD_DTYPES": "grads", "as_kernel_grad": "grads",
    "widen": "grads", "DEFAULTS": "hyper", "KINDS": "hyper", "slots": "hyper",
    "adam_step": "ops", "sgd_step": "ops", "warm_up": "ops", "SGD": "torch_optim",
    "Adam": "torch_optim", "AdamW": "torch_optim",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])


__all__ = [
    "DEFAULTS",
    "EXECUTORS",
    "KERNEL_GRAD_DTYPES",
    "KINDS",
    "SGD",
    "Adam",
    "AdamW",
    "FlatOptimizer",
    "adam_step",
    "as_kernel_grad",
    "clip_coef_of",
    "clip_grad_norm_",
    "sgd_step",
    "slots",
    "warm_up",
    "widen",
]
