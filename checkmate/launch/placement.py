"""Where a job's workers run: how many on this node and on which device kind, from the
CUDA devices this process sees.

One decision for ``checkmate launch`` (its ``--nproc-per-node`` and ``--device``) and for
``testbed device-check`` (which decides its checks' device here and hands it to the
launches it starts), so the two cannot disagree about what a machine has. It imports
torch only to count devices, and nothing of the project beyond checkmate.errors: the
device check runs it on a GPU machine that lacks the project's other dependencies.
"""

from __future__ import annotations

from dataclasses import dataclass

from checkmate.errors import CheckmateError

#: What ``--device`` takes: auto (cuda when a CUDA device is visible), cuda, cpu.
DEVICES = ("auto", "cuda", "cpu")


def cuda_device_count() -> int:
    """CUDA devices this process sees (torch.cuda.device_count(); 0 without CUDA). Tests
    replace this function to play a machine with GPUs."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@dataclass(frozen=True)
class Placement:
    """The decision: ``nproc`` workers on ``device`` (cuda or cpu), ``gpus`` visible."""

    device: str
    nproc: int
    gpus: int

    @property
    def gpus_used(self) -> int:
        """GPUs the workers occupy (several workers may share one: LOCAL_RANK % gpus)."""
        return min(self.gpus, self.nproc) if self.device == "cuda" else 0


def place(device: str = "auto", nproc: int | None = None, gpus: int | None = None
          ) -> Placement:
    """The workers' count and device kind for ``device`` (one of DEVICES) and ``nproc``
    (None: one worker per CUDA device) on a machine with ``gpus`` CUDA devices (None:
    count them). One CheckmateError line for cuda without a device, or no count to take."""
    if device not in DEVICES:
        raise CheckmateError(f"--device must be one of {', '.join(DEVICES)}, got {device!r}")
    gpus = cuda_device_count() if gpus is None else gpus
    if device == "cuda" and not gpus:
        raise CheckmateError("--device cuda but no CUDA device is visible")
    kind = "cuda" if device == "cuda" or (device == "auto" and gpus) else "cpu"
    if nproc is None:
        if not gpus:
            raise CheckmateError("the following arguments are required: --nproc-per-node "
                                 "(no CUDA device is visible to take one worker per device)")
        nproc = gpus
    if nproc < 1:
        raise CheckmateError(f"--nproc-per-node must be at least 1, got {nproc}")
    return Placement(kind, nproc, gpus)
