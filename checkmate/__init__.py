"""Checkmate: per-iteration checkpoints from gradients replicated in the network."""

__version__ = "0.1.0"
