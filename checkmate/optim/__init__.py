"""Optimizers whose arithmetic the trainer and the shadow share (Numba kernels)."""
