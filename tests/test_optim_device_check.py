"""The device check's optimizer functions (checkmate.optim.device_check) on CPU tensors:
the same code the GPU machine runs, here on the exact torch path against the shadows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from checkmate.optim import device_check as dc


@pytest.mark.parametrize("case", dc.CASES, ids=[c[0] for c in dc.CASES])
def test_every_case_is_bit_identical_on_the_exact_torch_path(case) -> None:
    name, kind, hp = case
    r = dc.check_case(kind, hp, n=20_000, steps=12, device="cpu", executor="torch")
    assert r.ok, r.detail
    assert "torch" in r.detail and "20000 elements" in r.detail


@pytest.mark.parametrize("grad_dtype", ["bfloat16", "float16"])
def test_16bit_gradients_without_clipping(grad_dtype: str) -> None:
    r = dc.check_case("adamw", dict(dc.CASES[-1][2]), n=20_000, steps=4, device="cpu",
                      executor="torch", grad_dtype=grad_dtype, clip=False)
    assert r.ok, r.detail


def test_a_wrong_step_is_reported(monkeypatch) -> None:
    """The comparison can fail: a step size one ulp off is caught."""
    from checkmate.optim import exact_torch
    real = exact_torch.adam

    def no_clip(param, grad, m, v, vmax, s, flags):
        s = np.array(s, np.float32)
        s[10] = np.nextafter(s[10], np.float32(0))
        real(param, grad, m, v, vmax, s, flags)

    monkeypatch.setattr(exact_torch, "adam", no_clip)
    r = dc.check_case("adam", {"lr": 1e-3}, n=5_000, steps=2, device="cpu", executor="torch")
    assert not r.ok and "differ" in r.detail


def test_bench_reports_both_optimizers_and_the_ratio() -> None:
    out = dc.bench_adamw(sizes=[3000, 17], steps=2, device="cpu", executor="torch")
    assert out["params"] == 3017 and out["executor"] == "torch"
    assert out["torch_fused_ms"] > 0 and out["checkmate_ms"] > 0
    assert out["ratio"] == pytest.approx(out["checkmate_ms"] / out["torch_fused_ms"])
    assert torch.get_default_dtype() == torch.float32


def test_run_all_prints_one_line_per_check_and_a_summary() -> None:
    lines: list[str] = []
    assert dc.run_all(n=12_000, steps=3, device="cpu", executor="torch", print_line=lines.append)
    assert len(lines) == len(dc.CASES) + 3 + 1
    assert all(": ok (" in line for line in lines[:-1])
    assert lines[-1] == f"optim: {len(lines) - 1}/{len(lines) - 1} checks passed"


def test_cli_bad_input_is_one_line_and_exit_2(capsys) -> None:
    assert dc.main(["--device", "cpu", "--executor", "triton", "--n", "100", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("checkmate.optim.device_check: error:")
