"""`testbed device-check` in its CPU mode: it runs end to end without a GPU, names every
CUDA part it skips, and its optimizer comparison fails when the two sides differ.

The CUDA checks themselves need a GPU (docs/gpu.md); here the optimizer harness runs on
CPU tensors at a small size. The launcher parts on CPU (``--cpu-launch``) take minutes on
this machine and are run by hand (docs/gpu.md gives the command), not in this file.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from checkmate.optim.device_check import CASE_NAMES
from checkmate.testbed import device_check as dc
from checkmate.testbed import device_common as common
from checkmate.testbed import device_runs as runs


def test_cpu_smoke_runs_end_to_end_and_names_every_skipped_cuda_part(tmp_path):
    doc = tmp_path / "gpu.md"
    doc.write_text(f"# t\n\n{dc.BEGIN}\nnot yet run on a GPU\n{dc.END}\ntail\n")
    p = subprocess.run([sys.executable, "-m", "checkmate.testbed.cli", "device-check",
                        "--cpu-smoke", "--cpu-n", "3001", "--cpu-steps", "3", "--budget", "300",
                        "--doc", str(doc)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.strip().splitlines()
    assert lines[0].startswith("device-check: python ")
    for name in CASE_NAMES:
        assert f"PASS optim-cpu[{name}]: cpu tensors == shadow kernel bit for bit" in p.stdout
        assert any(ln.startswith(f"SKIP optim[{name}]: CUDA vs shadow kernel: ")
                   for ln in lines), name
    for name in ("optim-speed", "ddp", "fsdp", "schemes", "nccl-plugin"):
        assert any(ln.startswith(f"SKIP {name}: ") for ln in lines), name
    n = len(CASE_NAMES)
    assert lines[-1].startswith(f"device-check summary: {n} passed, 0 failed, {n + 5} skipped "
                                "in "), lines[-1]
    assert "Traceback" not in p.stderr
    text = doc.read_text()  # the table went between the markers, the rest is kept
    assert "| optim-cpu[adam] | PASS |" in text and text.endswith(f"{dc.END}\ntail\n")
    assert "not yet run on a GPU" not in text


def test_the_optimizer_comparison_fails_when_the_shadow_differs(monkeypatch):
    from checkmate.optim import FlatOptimizer

    ok = runs.optim_case("adamw-clip", "cpu", 2003, 3)
    assert ok.status == "PASS" and ok.figures["clipped"] > 0, ok.line()
    real = FlatOptimizer.step

    def off_by_a_rate(self, grad, lrs, clip_coef=None, hyper=None):
        return real(self, grad, [lr * 1.001 for lr in lrs], clip_coef, hyper)

    monkeypatch.setattr(FlatOptimizer, "step", off_by_a_rate)
    bad = runs.optim_case("adamw-clip", "cpu", 2003, 3)
    assert bad.status == "FAIL" and "elements of param differ" in bad.reason, bad.line()


def test_same_bits_compares_bits_not_values():
    z = torch.zeros(3)
    assert common.same_bits({"a": [z, 1]}, {"a": [z.clone(), 1]}) is None
    assert common.same_bits(z, -z) is not None  # -0.0 == 0.0 as values, not as bits
    nan = torch.full((2,), float("nan"))
    assert common.same_bits(nan, nan.clone()) is None  # same NaN bits are the same state
    assert common.same_bits(z, z.double()) is not None
    assert "keys differ" in common.same_bits({"a": z}, {"b": z})
    assert common.same_bits(torch.tensor(1.0), torch.tensor(1.0)) is None  # 0-dim tensors


def test_bad_arguments_are_one_line():
    p = subprocess.run([sys.executable, "-m", "checkmate.testbed.cli", "device-check",
                        "--only", "optim,warp"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines() == [
        "testbed device-check: error: --only takes ddp, fsdp, nccl-plugin, optim, optim-speed, "
        "schemes; "
        "got optim,warp"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (no GPU here)")
def test_one_optimizer_case_on_cuda_equals_the_shadow_kernel():
    r = runs.optim_case("adam-amsgrad", "cuda", 1_000_003, 5)
    assert r.status == "PASS", r.line()


def test_doc_table_escapes_pipes_and_keeps_figures(tmp_path):
    doc = tmp_path / "gpu.md"
    env = {"card": "X", "torch": "t", "cuda": "c", "nccl": "n", "numba": "m", "triton": "r",
           "python": "p"}
    dc.write_doc(doc, [common.Result("a", "PASS", "x | y", {"k": np.float64(1.5).item()})], env, 3)
    text = doc.read_text()
    assert "| a | PASS | x / y `{\"k\": 1.5}` |" in text and "**X**" in text


def test_the_check_places_its_work_as_the_launcher_does_and_tells_the_launcher(monkeypatch):
    """One nproc/device decision (checkmate.launch.placement): the check's device is the
    launcher's answer, and its launches are given it instead of deciding again."""
    from checkmate.launch import placement

    monkeypatch.setattr(placement, "cuda_device_count", lambda: 1)
    on_gpu = runs.placement(cpu=False)
    assert (on_gpu.device, on_gpu.nproc, on_gpu.gpus_used) == ("cuda", runs.JOB_RANKS, 1)
    assert runs.placement(cpu=True).device == "cpu"  # --cpu-smoke on a GPU machine
    monkeypatch.setattr(placement, "cuda_device_count", lambda: 0)
    assert runs.placement(cpu=False).device == "cpu"
    argv = runs._launch_argv(runs.JOB_RANKS, 2, "host", Path("/d"), "ddp", [], device="cpu")
    at = argv.index("--device")
    assert argv[at + 1] == "cpu" and argv[argv.index("--nproc-per-node") + 1] == "2"
