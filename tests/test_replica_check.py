"""Replica agreement (issue 35 item 2): the data-parallel ranks compare a digest of their
state every K iterations, and a rank whose state was silently corrupted is named.

The launch test flips one bit of one rank's parameters after an optimizer step
(CHECKMATE_FLIP_AT, test only) in examples/train.py with 4 trainers and 2 shadows: without
the check the run ends without a word and with another model than a clean run's (the
corruption is real and silent); with ``--verify-every 3`` every rank names the corrupted
rank at the next check, the launcher restarts the group from the shadows at the check before
(what the corrupted copy's gradients did since is dropped with it) and the run ends
bit-identical to the clean one.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import torch
from fakes import same_state

from checkmate.optim import AdamW
from checkmate.train.replica_check import odd_ones, state_digest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train.py"
STEPS = 8
EVERY = 3  # --verify-every


def test_the_odd_ranks_are_the_ones_outside_the_majority():
    assert odd_ones([7, 7, 7, 7]) == ([], True)
    assert odd_ones([7, 7, 9, 7]) == ([2], True)
    assert odd_ones([7, 9]) == ([0, 1], False)  # two ranks: no majority to trust
    assert odd_ones([7, 7, 9, 9]) == ([0, 1, 2, 3], False)


def test_the_digest_sees_one_bit_of_a_parameter_or_of_the_optimizer_state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    before = state_digest(model, opt)
    assert state_digest(model, opt) == before  # a function of the state only
    with torch.no_grad():
        w = model[1].weight
        w.view(-1)[3:4].view(torch.int32).bitwise_xor_(1)
        assert state_digest(model, opt) != before
        w.view(-1)[3:4].view(torch.int32).bitwise_xor_(1)
        assert state_digest(model, opt) == before
        slot = opt.state[model[0].bias]["exp_avg_sq"]
        slot.view(-1)[:1].view(torch.int32).bitwise_xor_(1 << 20)
        assert state_digest(model, opt) != before


def test_a_rewind_is_for_the_next_attempt_only(tmp_path, monkeypatch):
    from checkmate.train import failures

    monkeypatch.delenv(failures.LOG_DIR, raising=False)
    failures.record_rewind(6)  # no log dir (a script run without the launcher): nothing kept
    assert failures.rewind_for(1) is None
    monkeypatch.setenv(failures.LOG_DIR, str(tmp_path))
    monkeypatch.setenv(failures.RESTART_COUNT, "2")
    failures.record_rewind(6)
    failures.record_rewind(6)  # every rank writes it: the same file, whole
    assert failures.rewind_for(3) == 6
    assert failures.rewind_for(2) is None and failures.rewind_for(4) is None
    assert [p.name for p in (tmp_path / "failures").iterdir()] == ["rewind-attempt-3.txt"]


def _launch(tmp: Path, name: str, args: list[str], env: dict[str, str] | None = None
            ) -> tuple[str, dict]:
    out = tmp / f"{name}.pt"
    p = subprocess.run(
        [sys.executable, "-m", "checkmate.launch.cli", "launch", "--nproc-per-node", "4",
         "--shadows", "2", "--max-restarts", "1", "--progress-every", "0", *args,
         str(EXAMPLE), "--steps", str(STEPS), "--out", str(out)],
        capture_output=True, text=True, timeout=400,
        env={**os.environ, "NUMBA_NUM_THREADS": "1", **(env or {})})
    text = p.stdout + p.stderr
    assert p.returncode == 0, text[-4000:]
    assert "Traceback" not in text, text[-4000:]
    return text, torch.load(out, weights_only=False)


def test_a_flipped_bit_on_one_rank_is_named_and_the_restart_is_bit_identical(tmp_path):
    """Checked every 3 iterations, the flip is found at the next check; the ranks fed the
    corrupted copy's gradients to the shadows since, so the restart rewinds to the check
    before it (or the start) and the run still ends as one without the fault."""
    rank, at = random.randrange(1, 4), random.randrange(1, 7)
    found = -(-at // EVERY) * EVERY  # the first check at or after the flip (3 or 6 < STEPS)
    flip = {"CHECKMATE_FLIP_AT": f"{rank}:{at}"}
    why = f"a bit of rank {rank} flipped after iteration {at}"
    clean, ref = _launch(tmp_path, "clean", [])
    # with the checks off: silent, and another model at the end (the default, auto, checks
    # at the end at least: it would have named it)
    silent, drifted = _launch(tmp_path, "silent", ["--verify-every", "0"], flip)
    assert "differ" not in silent and "restarting" not in silent, (why, silent[-3000:])
    assert not same_state(drifted["model"], ref["model"]), why
    # with it: named at once on every rank, restarted from the shadows, bit-identical
    checked, got = _launch(tmp_path, "checked", ["--verify-every", str(EVERY),
                                                 "--on-divergence", "restore"], flip)
    back = found - EVERY  # the newest verified iteration; 0: the start
    then = (f"a restart resumes from the shadows at iteration {back}, the newest the ranks "
            "verified" if back else "a restart begins the job again, as no iteration was "
            "verified")
    line = (f"iteration {found}: the model and optimizer state of data-parallel rank(s) "
            f"{rank} differ from the other 3 ranks' (silent data corruption on that rank, or a "
            f"step that is not deterministic); stopping: {then}")
    assert checked.count(line) == 4, (why, checked[-3000:])
    assert "restarting the worker group" in checked, (why, checked[-3000:])
    again = (f"attempt 1: resumed from the shadows at iteration {back}" if back
             else "attempt 1: seeded 2 shadow(s)")
    assert again in checked, (why, checked[-3000:])
    for part in ("model", "optimizer", "scheduler"):
        assert same_state(got[part], ref[part]), f"{part} differs ({why})"


def test_by_default_a_divergence_stops_the_job_in_one_line_per_rank(tmp_path):
    """``--on-divergence stop`` (the default): every rank says the line once, no attempt
    trains after it, and the launcher ends non-zero saying why."""
    rank = random.randrange(1, 4)
    p = subprocess.run(
        [sys.executable, "-m", "checkmate.launch.cli", "launch", "--nproc-per-node", "4",
         "--shadows", "2", "--max-restarts", "1", "--progress-every", "0", "--verify-every",
         str(EVERY), str(EXAMPLE), "--steps", str(STEPS), "--out", str(tmp_path / "o.pt")],
        capture_output=True, text=True, timeout=400,
        env={**os.environ, "NUMBA_NUM_THREADS": "1", "CHECKMATE_FLIP_AT": f"{rank}:2"})
    out = p.stdout + p.stderr
    assert p.returncode != 0 and "Traceback" not in out, out[-3000:]
    line = (f"iteration {EVERY}: the model and optimizer state of data-parallel rank(s) "
            f"{rank} differ from the other 3 ranks' (silent data corruption on that rank, or "
            "a step that is not deterministic); the job stops (--on-divergence stop; with "
            "restore it would resume from the shadows at the start)")
    assert out.count(line) == 5, out[-3000:]  # every rank's line, and the launcher's
    # the failure makes torch's agent start an attempt, which ends at once, training nothing
    assert "the data-parallel copies diverged and the job stops (--on-divergence stop): " \
        "the next attempt ends without training" in out, out[-3000:]
    assert "restarting the worker group" not in out and "attempt 1" not in out, out[-3000:]
    assert "checkmate launch: error: the job stopped after a divergence of the " \
        "data-parallel copies: checkmate: rank" in out, out[-3000:]

