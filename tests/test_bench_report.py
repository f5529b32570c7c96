"""`testbed bench report` and the scheme harness's arithmetic, without running a bench.

The report is rendered from a schemes JSON written here by hand (the numbers are made up;
the bench itself is not a timed test): the Markdown must carry the table, the targets with
the verdict their ratios give, the stand-in statement and four real PNG plots.
"""

from __future__ import annotations

import json

import pytest


def _rows(md: str) -> dict[str, list[str]]:
    """The report's table rows by scheme key (``dcp@1``): the cells after the first."""
    return {x.split("|")[1].strip(): [c.strip() for c in x.split("|")[2:]]
            for x in md.splitlines() if x.startswith("| ") and "@" in x}


def _line(md: str, text: str) -> str:
    """The report's first line holding ``text``."""
    return next(x for x in md.splitlines() if text in x)


def _schemes_json(checkmate: float, dcp: float, torchsave: float) -> dict:
    from checkmate.testbed.bench.schemes import planned

    med = {"none@1": 1.0, "torchsave@1": torchsave, "torchsave@8": 0.9, "dcp@1": dcp,
           "dcp@8": 0.95, "gockpt@1": 0.5, "gockpt@8": 0.9, "checkmate@1": checkmate,
           "none-switch@1": 1.1, "checkmate-switch@1": 1.0}
    return {"width": 1024, "layers": 2, "stand_in": 0.5, "steps": 26, "warmup": 8,
            "rounds": 2, "interval": 8, "mtbf_s": 3 * 3600.0, "load_s": 30.0,
            "rates": {k: [v, v] for k, v in med.items()}, "median": med,
            "plan": planned(med, 3 * 3600.0, 30.0),
            "trainer_cpu_ms": {k: 800.0 for k in med},
            "shadow_cpu_ms": {k: 0.0 for k in med},
            "state_mb": {"params_m": 25.4, "params_mb": 101.6, "state_mb": 304.8}}


def test_planned_derives_stall_and_best_interval_from_the_every_iteration_runs():
    d = _schemes_json(0.9, 0.8, 0.5)
    p = d["plan"]
    assert p["dcp"]["stall_s"] == pytest.approx(1 / 0.8 - 1)  # seconds per checkpoint
    assert p["torchsave"]["stall_s"] == pytest.approx(1.0)
    assert p["torchsave"]["best_interval"] > p["dcp"]["best_interval"] > 1
    assert p["checkmate"]["best_interval"] == 1  # every step by construction
    # Checkmate's effective throughput carries its per-step cost; the switch pair is
    # judged against its own no-checkpoint run
    assert p["checkmate"]["effective_vs_none"] < 0.9
    assert p["checkmate-switch"]["stall_s"] == pytest.approx(1 / 1.0 - 1 / 1.1)
    assert "none-switch" not in p and "none" not in p


@pytest.mark.parametrize("checkmate,verdicts", [(0.9, ("not met", "met")),
                                                (2.0, ("met", "met"))])
def test_report_renders_table_targets_and_plots(tmp_path, checkmate, verdicts):
    from checkmate.testbed.bench import report

    src = tmp_path / "schemes.json"
    src.write_text(json.dumps(_schemes_json(checkmate, 0.8, 0.5)))
    out = tmp_path / "evaluation.md"
    assert report.main(["--from", str(src), "--out", str(out)]) == 0
    md = out.read_text()
    assert "| checkmate@1 |" in md and "| gockpt@8 |" in md
    assert "Accelerator stand-in: every figure below comes from it" in md
    dcp_line = _line(md, "/ dcp every iteration")
    ts_line = _line(md, "/ torchsave every iteration")
    assert f"**{checkmate / 0.8:.3f}**" in dcp_line
    assert dcp_line.endswith(f": {'**not met**' if verdicts[0] == 'not met' else 'met'}.")
    assert ts_line.endswith(": met.")  # 0.9 / 0.5 = 1.8 >= 1.5
    pngs = sorted((tmp_path / "figures").glob("*.png"))
    assert len(pngs) == 4
    for png in pngs:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
        assert f"figures/{png.name}" in md


def test_a_ratio_whose_rounds_spread_wider_than_its_difference_is_unresolved(tmp_path,
                                                                            capsys):
    """Per-round ratios against the same round's baseline: torchsave differs from none by 10%
    with rounds within 2% (resolved); dcp by 3% with rounds 10% apart (unresolved); the
    Checkmate / dcp target ratio straddles its target over the rounds. Two rounds are
    fewer than the method's five, and the report says so."""
    from checkmate.testbed.bench import report

    d = _schemes_json(0.9, 0.8, 0.5)
    d["rates"].update({"none@1": [1.0, 1.0], "torchsave@1": [0.89, 0.91],
                       "dcp@1": [0.92, 1.02], "checkmate@1": [1.7, 2.2]})
    assert report.paired(d, "dcp@1", "none@1") == pytest.approx([0.92, 1.02])
    from checkmate.testbed.bench import rounds

    assert rounds.resolved([0.89, 0.91], 1.0) and not rounds.resolved([0.92, 1.02], 1.0)
    assert not rounds.resolved([0.9], 1.0)  # one round: no spread to judge by
    src = tmp_path / "schemes.json"
    src.write_text(json.dumps(d))
    out = tmp_path / "evaluation.md"
    assert report.main(["--from", str(src), "--out", str(out)]) == 0
    md = out.read_text()
    rows = _rows(md)
    assert rows["torchsave@1"][1:4] == ["0.900", "0.890-0.910", "yes"], rows["torchsave@1"]
    assert rows["dcp@1"][1:4] == ["0.970", "0.920-1.020", "**unresolved**"], rows["dcp@1"]
    assert rows["none@1"][1:4] == ["1.000", "-", "-"]
    dcp_line = _line(md, "/ dcp every iteration")
    assert "(unresolved: rounds 1.848-2.157)" in dcp_line, dcp_line
    assert "**Made with 2 rounds, fewer than the 5 the method asks for**" in md
    assert capsys.readouterr().out.strip().splitlines()[-1] == "report ratio: 2.002"


def test_report_of_a_bad_file_is_one_line(tmp_path, capsys):
    from checkmate.testbed.bench import report

    bad = tmp_path / "x.json"
    bad.write_text('{"median": {}}')
    assert report.main(["--from", str(bad), "--out", str(tmp_path / "e.md")]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a `testbed bench schemes --json` file" in err[0]


def test_a_failed_run_costs_its_own_cell_and_the_rounds_go_on(capsys):
    """run_rounds alternates the order every other round; a run that fails is recorded
    (None in its round, its error kept) and the other runs still happen; the medians are
    over the rounds that succeeded."""
    from checkmate.errors import CheckmateError
    from checkmate.testbed.bench.schemes import medians, run_rounds

    configs = [("none", 1), ("dcp-process", 1), ("checkmate", 1)]
    order: list[tuple[str, int]] = []

    def one(scheme: str, every: int, rnd: int):
        from checkmate.testbed.bench.schemes import Measured

        order.append((scheme, rnd))
        if scheme == "dcp-process" and rnd == 2:
            raise CheckmateError("trainer 1 exited 1: unexpected pos 704 vs 598")
        rate = {"none": 1.0, "dcp-process": 0.8, "checkmate": 0.9}[scheme] + rnd / 100
        return Measured(rate, 100.0 + rnd, 5.0, 30.0 + rnd)

    got = run_rounds(configs, 4, one)
    assert order[:3] == [("none", 0), ("dcp-process", 0), ("checkmate", 0)]
    assert order[3:6] == [("checkmate", 1), ("dcp-process", 1), ("none", 1)]
    assert len(order) == 12  # the failure in round 3 stopped nothing
    assert got.rates["dcp-process@1"] == [0.8, 0.81, None, pytest.approx(0.83)]
    assert got.trainer_cpu["dcp-process@1"][2] is None
    assert got.trainer_sys["checkmate@1"] == [30.0, 31.0, 32.0, 33.0]
    assert got.trainer_sys["dcp-process@1"][2] is None
    assert got.failed == {"dcp-process@1": [
        {"round": 3, "error": "trainer 1 exited 1: unexpected pos 704 vs 598"}]}
    med = medians(got.rates)
    assert med["dcp-process@1"] == pytest.approx(0.81)  # median of 0.80, 0.81, 0.83
    assert med["none@1"] == pytest.approx(1.015)
    assert "round 3 dcp-process@1          FAILED: trainer 1 exited 1" in capsys.readouterr().out
    # a configuration that failed in every round has no median at all
    assert medians({"x@1": [None, None], "y@1": [2.0]}) == {"y@1": 2.0}


def test_the_report_names_failed_runs_and_leaves_them_out_of_the_ratios(tmp_path):
    from checkmate.testbed.bench import report

    d = _schemes_json(0.9, 0.8, 0.5)
    d["rounds"] = 5
    d["rates"] = {k: [v] * 5 for k, v in d["median"].items()}
    d["rates"]["none@1"] = [1.0, 1.0, 2.0, 1.0, 1.0]
    d["rates"]["dcp@1"] = [0.8, 0.8, None, 0.8, 0.8]
    d["failed"] = {"dcp@1": [{"round": 3, "error": "trainer 2 exited 1: unexpected pos\n"
                                                  "Traceback (most recent call last):"}]}
    assert report.paired(d, "dcp@1", "none@1") == pytest.approx([0.8] * 4)
    src = tmp_path / "schemes.json"
    src.write_text(json.dumps(d))
    out = tmp_path / "evaluation.md"
    assert report.main(["--from", str(src), "--out", str(out)]) == 0
    md = out.read_text()
    rows = _rows(md)
    assert rows["dcp@1"][1:3] == ["0.800", "0.800-0.800 (1 failed)"], rows["dcp@1"]
    assert "**1 runs failed**" in md
    assert "- dcp@1, round 3: trainer 2 exited 1: unexpected pos" in md.splitlines()
    assert "Traceback" not in md
