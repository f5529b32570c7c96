"""checkmate plan: the Young/Daly interval and the shadow sizing, against the formulas
worked by hand, and its CLI."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from checkmate.errors import CheckmateError
from checkmate.launch.plan import Scheme, plan, size, waste


def test_the_interval_is_the_whole_number_next_to_young_daly():
    # T_ckpt 20 s, T_step 1.5 s, MTBF 3 h: N* = sqrt(2*20 / (p * 1.5^2)) = 438.2
    pl = plan(Scheme("torch.save", 20.0, 60.0), 1.5, 3 * 3600)
    assert pl.n_star == pytest.approx(math.sqrt(2 * 20 * 10800 / 1.5 ** 2))
    assert pl.interval == 438
    p = 1 / 10800
    assert pl.waste == pytest.approx(20 / (438 * 1.5) + p * 438 * 1.5 / 2 + p * 60)
    assert pl.lost_per_failure_s == pytest.approx(438 * 1.5 / 2 + 60)
    assert pl.throughput == pytest.approx(1 / (1 + pl.waste))
    # no whole number does better
    assert all(waste(n, 1.5, 20, 60, 10800) >= pl.waste for n in range(1, 2000))


def test_cheap_checkpoints_and_checkmate_are_every_step():
    assert plan(Scheme("tiny", 1e-6, 0.0), 2.0, 3600).interval == 1  # N* < 1 clamps to 1
    cm = plan(Scheme("checkmate", 0.005, 30.0, every_step=True), 1.5, 10800)
    assert cm.interval == 1 and cm.lost_per_failure_s == pytest.approx(0.75 + 30)
    slow = plan(Scheme("dcp", 2.0, 30.0), 1.5, 10800)
    assert cm.throughput > slow.throughput


def test_sizing_names_the_requirement_that_binds():
    # 7B bf16 in 1.5 s: 14 GB per step at 2 GB/s per shadow -> 5 shadows, ingest-bound
    sz = size(7_000_000_000, 1.5, grad_bytes=2)
    assert (sz.shadows, sz.bound) == (5, "ingest")
    assert sz.partition_params == 1_400_000_000 and sz.ingest_util <= 1.0
    # a tight memory budget binds instead
    sz = size(7_000_000_000, 1.5, grad_bytes=2, shadow_memory=64e9)
    assert sz.bound == "memory" and sz.memory_bytes <= 64e9
    with pytest.raises(CheckmateError, match="optimizer must be one of"):
        size(10, 1.0, optimizer="lion")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "checkmate.launch.cli", "plan", *args],
                          capture_output=True, text=True, timeout=60)


def test_cli_prints_a_row_per_scheme_and_refuses_bad_input_in_one_line():
    r = _cli("--mtbf", "3h", "--step-time", "1.5", "--ckpt-cost", "torch.save=20s,60s",
             "--checkmate-cost", "5ms", "--params", "7B", "--grad-dtype", "bfloat16")
    assert r.returncode == 0, r.stderr
    rows = {ln.split()[0]: ln.split() for ln in r.stdout.splitlines()
            if ln.startswith(("torch.save", "checkmate"))}
    assert rows["torch.save"][2] == "438" and rows["checkmate"][2] == "1"
    assert "shadows for 7e+09 params" in r.stdout and "set by ingest" in r.stdout
    r = _cli("--mtbf", "3h", "--step-time", "1.5")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].endswith(
        "give at least one --ckpt-cost NAME=COST, --checkmate-cost or --params")
    assert len(r.stderr.strip().splitlines()) == 1
    r = _cli("--mtbf", "soon", "--step-time", "1")
    assert r.returncode == 2 and "not a duration: 'soon'" in r.stderr
    assert "Traceback" not in r.stderr
