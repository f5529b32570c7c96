"""Gradient arrays in the form the kernels take, and exact widening to float32.

The kernels read three element types (see :mod:`checkmate.optim.kernels`):
``float32``; ``uint16`` holding bfloat16 bit patterns; ``int16`` holding float16 bit
patterns (Numba has no float16 type). Widening bfloat16/float16 to float32 is exact, so
it does not matter whether a caller widens before the kernel or lets the kernel do it.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import numpy as np

from checkmate.errors import CheckmateError

if TYPE_CHECKING:
    import torch

#: model-spec ``grad_dtype`` names -> numpy element type of the kernel's gradient array.
KERNEL_GRAD_DTYPES = {"float32": np.float32, "bfloat16": np.uint16, "float16": np.int16}


def as_kernel_grad(x: torch.Tensor | np.ndarray) -> np.ndarray:
    """A flat, zero-copy view of ``x`` the kernels accept.

    torch float32/bfloat16/float16 tensors and numpy float32/float16 arrays are mapped by
    type; a numpy ``uint16`` array is taken as bfloat16 bits and ``int16`` as float16 bits.

    Raises:
        CheckmateError: another dtype, a non-CPU tensor, or non-contiguous memory.
    """
    # A numpy array (what the shadow passes) never touches torch: a process that did not
    # import it holds no tensors, and importing it would cost the shadow seconds at start.
    # Otherwise `import torch`, not sys.modules: another thread may be importing it right
    # now, and the import statement waits for that to finish (a half-built module has no
    # torch.Tensor yet).
    if not isinstance(x, np.ndarray) and "torch" in sys.modules:
        import torch
    else:
        torch = None
    if torch is not None and isinstance(x, torch.Tensor):
        if x.device.type != "cpu" or x.is_sparse:
            raise CheckmateError(f"gradients must be dense CPU tensors, got {x.device} {x.layout}")
        if not x.is_contiguous():
            raise CheckmateError("gradients must be contiguous")
        t = x.detach().reshape(-1)
        if t.dtype == torch.float32:
            return t.numpy()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(np.uint16)
        if t.dtype == torch.float16:
            return t.view(torch.int16).numpy()
        raise CheckmateError(f"unsupported gradient dtype {t.dtype}")
    a = np.asarray(x)
    if not a.flags.c_contiguous:
        raise CheckmateError("gradients must be contiguous")
    a = a.reshape(-1)
    if a.dtype == np.float16:
        return a.view(np.int16)
    if a.dtype in (np.float32, np.uint16, np.int16):
        return a
    raise CheckmateError(f"unsupported gradient dtype {a.dtype}")


def widen(a: np.ndarray) -> np.ndarray:
    """float32 copy of a kernel gradient array (exact for all three element types)."""
    if a.dtype == np.float32:
        return a.copy()
    if a.dtype == np.uint16:
        return (a.astype(np.uint32) << 16).view(np.float32)
    if a.dtype == np.int16:
        return a.view(np.float16).astype(np.float32)
    raise CheckmateError(f"unsupported gradient dtype {a.dtype}")
