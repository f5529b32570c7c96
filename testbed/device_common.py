"""What every part of the device check shares: a check's result line, the time budget,
the environment it reports, the bit-for-bit comparison, and running a child process."""

from __future__ import annotations

import os
import platform
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: The checkout, or (installed from the wheel) the installed package, which carries the NCCL
#: plugin's sources in nccl_plugin/ as the checkout does.
ROOT = Path(__file__).resolve().parents[1]
#: Where the results table (docs/gpu.md) and built files (build/) go: the checkout, also when
#: the check runs from an installed wheel (scripts/device-check.sh sets CHECKMATE_CHECKOUT).
CHECKOUT = Path(os.environ.get("CHECKMATE_CHECKOUT") or ROOT)
DOC = CHECKOUT / "docs" / "gpu.md"
#: Modules the launcher, the shadows and the sessions import (not the optimizer check).
PROJECT_DEPS = ("crc32c", "pydantic", "yaml", "numba")
#: Environment for two NCCL ranks on one GPU: each rank its own host id (set by the worker
#: from LOCAL_RANK), so NCCL sees two nodes and uses its network transport.
NCCL_ENV = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}


@dataclass


class Result:
    name: str
    status: str  # PASS, FAIL, SKIP
    reason: str
    figures: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        return f"{self.status:<4} {self.name}: {self.reason}"


class Budget:
    """The check's global time budget: what is left, and whether a step fits."""

    def __init__(self, seconds: float) -> None:
        self.total, self.t0 = seconds, time.monotonic()

    def left(self) -> float:
        return self.total - (time.monotonic() - self.t0)

    def fits(self, need: float) -> bool:
        return self.left() >= need


# ----------------------------------------------------------------------------- helpers


def _cuda() -> bool:
    """Whether a CUDA device is visible (the launcher's count: checkmate.launch.placement)."""
    from checkmate.launch.placement import cuda_device_count

    return cuda_device_count() > 0


def _missing(mods: tuple[str, ...]) -> list[str]:
    import importlib.util

    return [m for m in mods if importlib.util.find_spec(m) is None]


def environment() -> dict[str, str]:
    """The card and the versions the results belong to."""
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__,
           "cuda": str(torch.version.cuda), "card": "none (no CUDA device)", "nccl": "-"}
    if _cuda():
        env["card"] = torch.cuda.get_device_name(0)
        try:
            v = torch.cuda.nccl.version()
            env["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            env["nccl"] = f"unknown ({e})"
    for mod in ("numba", "triton"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            env[mod] = "absent"
    return env


def same_bits(a: Any, b: Any, where: str = "") -> str | None:
    """None when ``a`` and ``b`` (nested state dicts) are bit for bit equal, else where not."""
    import torch

    if torch.is_tensor(a):
        if not torch.is_tensor(b) or a.dtype != b.dtype or a.shape != b.shape:
            return f"{where}: dtype/shape differ"
        x = a.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        y = b.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        return None if torch.equal(x, y) else f"{where}: values differ"
    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            return f"{where}: keys differ"
        for k in a:
            why = same_bits(a[k], b[k], f"{where}/{k}")
            if why:
                return why
        return None
    if isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            return f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            why = same_bits(x, y, f"{where}/{i}")
            if why:
                return why
        return None
    return None if a == b else f"{where}: {a!r} != {b!r}"


def _short(text: str, n: int = 300) -> str:
    """The last meaningful line of a process's output, for a one-line FAIL."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    errs = [ln for ln in lines if "error" in ln.lower() or "Error" in ln]
    pick = (errs or lines or ["(no output)"])[-1]
    return pick[:n]


# ------------------------------------------------------------------ (a) the optimizers


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(argv: list[str], env: dict[str, str], timeout: float, cwd: Path | None = None
         ) -> tuple[int, str]:
    """Run a command in a session of its own; on timeout its whole process group (ours)
    is killed. Returns (exit status, output); status -999 for a timeout."""
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env={**os.environ, **env}, start_new_session=True, cwd=cwd)
    try:
        out, _ = p.communicate(timeout=max(1.0, timeout))
        return p.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        return -999, out + f"\n(timed out after {timeout:.0f} s)"
