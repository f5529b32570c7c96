"""`testbed bench optimizer` runs end to end on a small size and reports its headline."""

from __future__ import annotations

import re

import pytest

from checkmate.testbed.bench import optimizer


def test_bench_prints_table_and_one_headline(capsys) -> None:
    assert optimizer.main(["--sizes", "200K", "--rounds", "5"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert re.fullmatch(r"ours vs fastest torch AdamW params/s ratio: \d+\.\d\d", out[-1])
    assert sum("ratio:" in line for line in out) == 1
    text = "\n".join(out)
    for name in ("ours (checkmate.optim.AdamW)", "torch AdamW fused=True",
                 "torch AdamW foreach=True", "bandwidth bound"):
        assert name in text


@pytest.mark.parametrize("argv,match", [
    (["--sizes", "ten"], "bad size 'ten'"),
    (["--sizes", "0"], "size must be >= 1"),
    (["--sizes", ","], "at least one size"),
    (["--rounds", "-2"], "--rounds"),
])
def test_bench_rejects_bad_arguments(argv: list[str], match: str) -> None:
    from checkmate.errors import CheckmateError

    with pytest.raises(CheckmateError, match=match):
        optimizer.main(argv)
