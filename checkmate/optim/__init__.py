"""Optimizers whose arithmetic the trainer and the shadow share: one update rule
(:mod:`checkmate.optim.rule`), run by the Numba kernels on CPU tensors and by a Triton
kernel generated from it (or an exact torch executor) on CUDA tensors.

- :class:`SGD`, :class:`Adam`, :class:`AdamW`: torch.optim drop-ins for the trainer, on CPU
  or CUDA parameters (``executor=`` one of :data:`EXECUTORS` forces a path);
- :class:`FlatOptimizer`: one partition's flat float32 state for the shadow;
- :func:`clip_grad_norm_`: torch's clipping that also returns the factor it applied;
- :mod:`checkmate.optim.ops`: the step functions on flat numpy arrays both build on.
"""

from checkmate.optim.clip import clip_coef_of, clip_grad_norm_
from checkmate.optim.device import EXECUTORS
from checkmate.optim.flat import FlatOptimizer
from checkmate.optim.grads import KERNEL_GRAD_DTYPES, as_kernel_grad, widen
from checkmate.optim.hyper import DEFAULTS, KINDS, slots
from checkmate.optim.ops import adam_step, sgd_step, warm_up
from checkmate.optim.torch_optim import SGD, Adam, AdamW

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
