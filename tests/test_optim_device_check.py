"""The device check's optimizer comparison (checkmate.optim.device_check, which
`testbed device-check` runs as optim[CASE]) on CPU tensors: the same code the GPU machine
runs, here on the exact torch path against the shadows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from checkmate.optim import device_check as dc


@pytest.mark.parametrize("case", dc.CASES, ids=[c.name for c in dc.CASES])
def test_every_case_is_bit_identical_on_the_exact_torch_path(case) -> None:
    r = dc.check_case(case, n=20_000, steps=12, device="cpu", executor="torch")
    assert r.ok, r.detail
    assert "torch" in r.detail and "20000 elements" in r.detail
    if case.clip == "always":
        assert r.figures["clipped"] == 12
    elif case.clip == "some":
        assert 0 < r.figures["clipped"] < 12, r.figures
    else:
        assert r.figures["clipped"] == 0


@pytest.mark.parametrize("grad_dtype", ["bfloat16", "float16"])
def test_16bit_gradients_without_clipping(grad_dtype: str) -> None:
    case = dc.Case("t", "adamw", dc.CASE_NAMES["adamw-amsgrad-maximize"].groups, "none",
                   grad_dtype=grad_dtype)
    r = dc.check_case(case, n=20_000, steps=4, device="cpu", executor="torch")
    assert r.ok, r.detail


def test_the_cases_cover_every_option_group_layout_and_clipping() -> None:
    """Folding two comparisons into one kept every configuration: each optimizer option,
    one and two groups (same and different options), with and without a scheduler,
    clipping always, in some steps and never, 16-bit gradients."""
    opts = {k for c in dc.CASES for g in c.groups for k, v in g.items() if v}
    assert opts >= {"lr", "momentum", "dampening", "nesterov", "weight_decay", "maximize",
                    "amsgrad", "betas", "eps"}
    assert {len(c.groups) for c in dc.CASES} == {1, 2}
    assert any(len(c.groups) == 2 and c.groups[0].keys() != c.groups[1].keys()
               for c in dc.CASES)
    assert {c.scheduler for c in dc.CASES} == {True, False}
    assert {c.clip for c in dc.CASES} == set(dc.CLIPS)
    assert {c.grad_dtype for c in dc.CASES} == set(dc.GRAD_DTYPES)
    assert {c.kind for c in dc.CASES} == set(dc.CLASSES)
    assert len(dc.CASE_NAMES) == len(dc.CASES)  # names are unique


def test_a_wrong_step_is_reported(monkeypatch) -> None:
    """The comparison can fail: a step size one ulp off is caught."""
    from checkmate.optim import exact_torch
    real = exact_torch.adam

    def no_clip(param, grad, m, v, vmax, s, flags):
        s = np.array(s, np.float32)
        s[10] = np.nextafter(s[10], np.float32(0))
        real(param, grad, m, v, vmax, s, flags)

    monkeypatch.setattr(exact_torch, "adam", no_clip)
    r = dc.check_case(dc.CASE_NAMES["adam"], n=5_000, steps=2, device="cpu",
                      executor="torch")
    assert not r.ok and "elements of param differ" in r.detail, r.detail


def test_bench_reports_both_optimizers_and_the_ratio() -> None:
    out = dc.bench_adamw(sizes=[3000, 17], steps=2, device="cpu", executor="torch")
    assert out["params"] == 3017 and out["executor"] == "torch"
    assert out["torch_fused_ms"] > 0 and out["checkmate_ms"] > 0
    assert out["ratio"] == pytest.approx(out["checkmate_ms"] / out["torch_fused_ms"])
    ok, line = dc.speed_verdict(out)
    assert ok == (out["ratio"] <= 2.0) and f"ratio {out['ratio']:.2f}, target <= 2" in line
    assert dc.speed_verdict({**out, "ratio": 2.5})[0] is False
    assert torch.get_default_dtype() == torch.float32


def test_run_all_prints_one_line_per_check_and_a_summary() -> None:
    lines: list[str] = []
    assert dc.run_all(n=12_000, steps=3, device="cpu", executor="torch", print_line=lines.append)
    assert len(lines) == len(dc.CASES) + 1
    assert all(": ok (" in line for line in lines[:-1])
    assert [line.split(":")[0] for line in lines[:-1]] == [f"optim[{c.name}]" for c in dc.CASES]
    assert lines[-1] == f"optim: {len(lines) - 1}/{len(lines) - 1} checks passed"


def test_cli_bad_input_is_one_line_and_exit_2(capsys) -> None:
    assert dc.main(["--device", "cpu", "--executor", "triton", "--n", "100", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("checkmate.optim.device_check: error:")
