"""`testbed bench colocate`'s command line: bad core lists are one line, before any process
starts (the bench itself is run by hand; its figures are in docs/benchmarks.md)."""

from __future__ import annotations

import pytest

from checkmate.testbed.bench import colocate


@pytest.mark.parametrize("argv,needle", [
    (["--trainer-cores", "0", "--spare-cores", "0"], "share core(s) 0"),
    (["--trainer-cores", "0-1", "--spare-cores", "1"], "share core(s) 1"),
    (["--spare-cores", "4096"], "not on this machine"),
    (["--trainer-cores", "x"], "expected a CPU list"),
    (["--rounds", "1"], "--rounds >= 2"),
])
def test_a_bad_command_line_is_one_line(capsys, argv, needle):
    assert colocate.main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
