"""The chaos report: per-case summary over repeats, and the generated block of
docs/reliability.md replaced without touching the prose around it."""

from __future__ import annotations

from checkmate.testbed import chaos


def _row(case: str, ok: bool, lag: int | None, over: float | None, rejoin: int | None,
         repeated: int = 1) -> dict:
    return {"case": case, "ok": ok, "bit_identical": ok, "kill_at": 30, "repeated": repeated,
            "lag_max": lag, "repair_overhead": over, "repairs": 3, "reseeds": 0,
            "restart_at": None, "rejoin": rejoin, "to_current_s": None if rejoin is None
            else rejoin / 100, "epochs": 2, "persist_errors": 0, "problems":
            "" if ok else "final state differs", "seconds": 1.0}


def test_summary_aggregates_repeats_of_a_case():
    rows = [_row("a", True, 1, 0.01, 70), _row("a", False, 4, 0.03, 90, 2),
            _row("a", True, 2, 0.02, 80), _row("b", True, None, None, None)]
    a, b = chaos.summary(rows)
    assert a == {"case": "a", "passed": "2/3", "lag_max": 4,
                 "repair_overhead_median": "2.00%", "rejoin_min/median/max": "70/80/90",
                 "to_current_s_max": 0.9, "repeated_max": 2, "persist_errors": 0}
    assert b["passed"] == "1/1" and b["lag_max"] is None and b["rejoin_min/median/max"] is None
    assert b["to_current_s_max"] is None


def test_report_block_replaces_only_the_generated_part(tmp_path):
    rows = [_row("a", True, 1, 0.01, None), _row("a", False, 3, 0.02, None)]
    block = chaos.markdown(rows, ["--repeat", "2"], 7)
    assert "testbed chaos --repeat 2" in block and "Seed 7." in block
    assert "1 of 2 runs passed." in block and "- a: final state differs" in block
    doc = tmp_path / "reliability.md"
    chaos.write_report(doc, block)  # a new file: only the block under a title
    assert doc.read_text().startswith("# Reliability") and chaos.BEGIN in doc.read_text()
    doc.write_text("# Prose\n\nbefore\n\n" + block + "\nafter\n")
    chaos.write_report(doc, chaos.markdown(rows[:1], [], 8))
    text = doc.read_text()
    assert text.startswith("# Prose\n\nbefore\n\n") and text.endswith("\nafter\n")
    assert "Seed 8." in text and "Seed 7." not in text and text.count(chaos.BEGIN) == 1


def test_every_case_draws_a_valid_scenario():
    """Each case's body, with its random parts drawn, is a scenario the runner accepts; the
    correlated case kills the trainers six iterations after the shadow, with persistence."""
    import random

    from checkmate.testbed.chaos import cases, draw

    rng = random.Random(3)
    for steps in (30, 300):
        for name, body in cases(steps).items():
            if body.get("multinode"):  # one launcher per node: testbed/multinode.py runs it
                from checkmate.testbed.multinode import SCENARIOS

                assert name in SCENARIOS
                continue
            if body.get("replicas"):  # one launcher with --replicas 2: replica_cases runs it
                from checkmate.testbed.replica_cases import CASES

                assert name in CASES
                continue
            sc = draw(name, body, steps, 0, 2, rng)
            assert sc.steps == body.get("steps", steps) <= steps, name
    sc = draw("shadow-and-trainers-kill", cases(300)["shadow-and-trainers-kill"], 300, 0, 2,
              rng)
    (k,) = sc.shadow_kills
    assert sc.kill_at == k.at + 6 and k.disk and sc.persist_every == 5
    sc = draw("all-shadows-restart-disk", cases(300)["all-shadows-restart-disk"], 300, 0, 2,
              rng)
    assert [k.partition for k in sc.shadow_kills] == [0, 1] and sc.persist_every
    assert len({k.at for k in sc.shadow_kills}) == 1 and all(k.disk for k in sc.shadow_kills)
    sc = draw("shadows-restart-under-load", cases(300)["shadows-restart-under-load"], 300, 0,
              2, rng)
    assert sc.cpu_load == 4 and not any(k.disk for k in sc.shadow_kills)


def test_the_shadow_flip_case_draws_its_flip_and_fails_unless_the_first_check_finds_it():
    import random

    from checkmate.testbed.chaos import cases, draw
    from checkmate.testbed.fault_verdicts import fault_found as check_found

    sc = draw("shadow-bit-flip", cases(300)["shadow-bit-flip"], 300, 0, 2, random.Random(5))
    p, at = sc.shadow_flip
    assert p in (0, 1) and 1 <= at <= sc.steps // 3 and sc.verify_every == 5 and sc.chaos
    found = -(-at // 5) * 5  # the first checked iteration at or after the flip

    def status(**check: object) -> list[dict]:
        return [{"partition": q, "state_check": check if q == p else {"found_at": None}}
                for q in (0, 1)]

    assert check_found(sc, status(found_at=found, diverged=""), p, at) == []
    assert "was not found" in check_found(sc, status(found_at=None, diverged=""), p, at)[0]
    assert "not by the first check" in check_found(sc, status(found_at=found + 5,
                                                              diverged=""), p, at)[0]
    assert "still differs" in check_found(sc, status(found_at=found, diverged="x"), p, at)[0]


def test_the_trainer_flip_case_wants_the_flipped_rank_named_and_a_rewind_to_the_check_before():
    import random

    from checkmate.testbed.chaos import cases, draw
    from checkmate.testbed.fault_verdicts import trainer_flip as check_trainer_flip

    sc = draw("trainer-bit-flip", cases(300)["trainer-bit-flip"], 300, 0, 2,
              random.Random(6), trainers=4)
    rank, at = sc.trainer_flip
    assert 0 <= rank < 4 and 1 <= at <= sc.steps // 3 and sc.verify_every == 5 and sc.chaos
    found = -(-at // 5) * 5
    line = f"iteration {found}: ... data-parallel rank(s) {rank} differ from the other 3"
    ok = {"iteration": found, "rewind": max(found - 5, 0), "line": line}
    assert check_trainer_flip(sc, ok) == []
    assert "was not found" in check_trainer_flip(sc, None)[0]
    assert "not by the first check" in check_trainer_flip(sc, {**ok, "iteration": found + 5})[0]
    assert "rewound to" in check_trainer_flip(sc, {**ok, "rewind": found})[0]
    assert "does not name rank" in check_trainer_flip(sc, {**ok, "line": "rank(s) 9 differ"})[0]


def test_multinode_verdict_reads_the_final_state_not_a_restore_beside_it(tmp_path):
    """rank 0 writes ``<host>.pt`` at the end and, after a restore, ``<host>.restored.
    <attempt>.<pid>.pt``; the bit-identity verdict must read the first (a glob for
    ``n*.pt`` took the restore in one chaos run and reported a good run as differing)."""
    from checkmate.testbed.multinode import final_states

    for name in ("n0.restored.0.2754.pt", "n0.pt", "n2.restored.1.99.pt"):
        (tmp_path / name).write_bytes(b"x")
    assert final_states(tmp_path, ["n0", "n1", "n2"]) == [tmp_path / "n0.pt"]
    assert final_states(tmp_path, ["n1"]) == []
