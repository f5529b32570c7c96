"""End to end in host mode (no switch, loopback, no root): `testbed run` kill-restore.

Real trainer processes (torch.distributed gloo rendezvous, ckm ring over UDP), real shadow
processes; every trainer is SIGKILLed mid-run, restored from the shadows, and the final
state must equal a failure-free run's bit for bit.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def _run(tmp_path: Path, scenario: str, net: str, extra: list[str] = ()) -> tuple[int, dict, str]:
    out = tmp_path / "report.json"
    p = subprocess.run(
        [sys.executable, "-m", "checkmate.testbed.cli", "run", "--scenario", scenario,
         "--mode", "host", "--loopback-net", net, "--json", str(out), *extra],
        capture_output=True, text=True, timeout=400)
    report = json.loads(out.read_text()) if out.exists() else {}
    return p.returncode, report, p.stderr + p.stdout


def _net() -> str:
    """A random loopback /24, so that two suite runs at once do not share addresses."""
    return f"127.79.{random.randrange(1, 255)}"


@pytest.mark.parametrize("model,phase", [("cnn", "before-control")])
def test_kill_restore_host_mode_bit_identical(tmp_path, model, phase):
    """after-step: the launcher kills all trainers once rank 0 reported iteration 7.
    before-control: rank 0 dies between its step 7 and the control message, so the shadows
    cannot commit 7 while the other ranks finished it: exactly one iteration is repeated.
    (gpt after-step, the plain case, is the correlated-failure test's trainer kill below.)"""
    net = _net()
    sc = tmp_path / "short.yaml"
    sc.write_text(f"name: short-{model}\nmodel: {model}\nsteps: 14\nseed: 3\nkill_at: 7\n"
                  f"kill_phase: {phase}\n")
    rc, report, text = _run(tmp_path, str(sc), net)
    assert rc == 0, text[-3000:]
    assert report["ok"] and report["bit_identical"] is True
    ff, kr = report["runs"]["failure-free"], report["runs"]["kill-restore"]
    assert ff["last_loss"] < ff["first_loss"]
    assert ff["shadows_match_trainers"] and kr["shadows_match_trainers"]
    if phase == "after-step":
        assert 0 <= report["repeated_iterations"] <= 1
        assert kr["killed_at"] >= 7 and kr["restored_from"] >= 6
    else:
        assert kr["restored_from"] == 6 and report["repeated_iterations"] == 1
    # host mode: each rank sent its completed chunks to the shadows itself (~1/N gradient)
    assert all(r["copy_bytes"] > 0 for r in ff["ring"])


def test_bad_scenario_is_one_line_error(tmp_path):
    rc, _, text = _run(tmp_path, "no-such-scenario", _net())
    assert rc == 2 and "Traceback" not in text and "no scenario" in text
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: gpt\nsteps: 10\nkill_at: 50\n")
    rc, _, text = _run(tmp_path, str(bad), _net())
    assert rc == 2 and "kill_at" in text and "Traceback" not in text


def test_restore_cli_errors_are_one_line():
    for argv in ([], ["--shadow", "nohost:x"], ["--shadow", "127.0.0.1:1"]):
        p = subprocess.run([sys.executable, "-m", "checkmate.train.restore", *argv],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 2, p.stderr
        assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_shadow_killed_and_restarted_empty_is_reseeded_live(tmp_path):
    """A shadow SIGKILLed mid-run comes back empty; the trainers re-seed it slice by slice
    while they keep training, and it ends bit-identical to them (the job is protected)."""
    sc = tmp_path / "restart.yaml"
    # Steps enough for the restarted process to start (seconds) at tens of ms per iteration.
    sc.write_text("name: restart\nmodel: gpt\nsteps: 150\nseed: 4\n"
                  "shadow_kills: [{partition: 1, at: 4}]\n")
    rc, report, text = _run(tmp_path, str(sc), _net())
    assert rc == 0, text[-3000:]
    chaos = report["runs"]["chaos"]
    assert report["ok"] and report["bit_identical"] is True
    assert chaos["shadow_restarts"] == 1 and chaos["reseeds"] == 1
    assert chaos["protected"] is True and chaos["shadows_match_trainers"] is True
    (rejoin,) = chaos["rejoins"]
    assert rejoin["rejoined_at"] is not None and rejoin["rejoined_at"] <= 150, rejoin
    # The time to current: re-seed asked for -> committed. About 0.3-0.5 s here (4 slices
    # over 4 iterations, kernels from Numba's cache); the bound leaves room for a loaded
    # machine and would catch a compile in the way (5-8 s).
    assert rejoin["reseed_seconds"] is not None and rejoin["reseed_seconds"] < 4.0, rejoin
    assert rejoin["warm_seconds"] is not None, rejoin  # the empty start compiled or loaded


def test_job_ending_with_a_dead_shadow_says_so_in_one_line(tmp_path):
    """A shadow killed and never restarted: every rank finishes its training, rank 0 says in
    one line that the last iteration is not protected, the ranks exit 3 together -- no hang,
    no gloo traceback -- and `testbed run` fails."""
    sc = tmp_path / "dead.yaml"
    sc.write_text("name: dead\nmodel: gpt\nsteps: 12\nseed: 2\nfinish_timeout: 3\n"
                  "shadow_kills: [{partition: 0, at: 4, restart: false}]\n")
    rc, report, text = _run(tmp_path, str(sc), _net(), ["--workdir", str(tmp_path / "w")])
    assert rc != 0
    logs = {p.name: p.read_text() for p in (tmp_path / "w").glob("run-*/chaos/trainer-*.log")}
    assert len(logs) == 4, sorted(logs)
    assert not any("Traceback" in t for t in logs.values()), logs
    rank0 = logs["trainer-t0.log"]
    assert rank0.count("is not protected") == 2  # the warning and the worker's error line
    assert "iteration 12 finished but is not protected" in rank0


def test_shadow_and_every_trainer_killed_together_resume_bit_exact_from_disk(tmp_path):
    """A correlated failure (a rack losing a shadow and the trainers): partition 1's shadow
    is SIGKILLed at iteration 25 and restarts from its disk while every trainer is SIGKILLed
    at 31, before the shadow is current again. No iteration is in every shadow's memory any
    more (partition 0 retains 28-31, the restarted one its newest checkpoint); the resume
    must take the newest iteration every partition holds on disk or in memory, say so in one
    line, and end bit-identical to the failure-free run."""
    sc = tmp_path / "correlated.yaml"
    # persist_every 5 while a write takes about a second here under load: every partition
    # writes every multiple of 5 (a step waits for room behind the writes, shadow/persist.py)
    # and a partition ahead keeps what a lagging one writes next, so they hold a common one.
    sc.write_text("name: correlated\nmodel: gpt\nsteps: 45\nseed: 6\npersist_every: 5\n"
                  "shadow_kills: [{partition: 1, at: 25, disk: true}]\nkill_at: 31\n")
    rc, report, text = _run(tmp_path, str(sc), _net(), ["--workdir", str(tmp_path / "w")])
    assert rc == 0, text[-3000:]
    assert report["ok"] and report["bit_identical"] is True, report.get("problems")
    chaos = report["runs"]["chaos"]
    assert chaos["killed_at"] >= 31 and chaos["shadow_restarts"] == 1
    assert chaos["restored_sources"][0] == "disk", chaos
    assert chaos["restored_from"] % 5 == 0 and chaos["restored_from"] <= 25, chaos
    assert chaos["protected"] is True and chaos["shadows_match_trainers"] is True
    (log,) = (tmp_path / "w").glob("run-*/chaos/trainer-t0-resumed.log")
    line = [ln for ln in log.read_text().splitlines() if "resuming at iteration" in ln]
    assert line == [f"checkmate: resuming at iteration {chaos['restored_from']}: partition 0 "
                    "from disk (memory holds " + line[0].split("memory holds ")[1]], line


def test_every_shadow_killed_is_reported_at_once_and_protection_returns(tmp_path):
    """Both shadows SIGKILLed at iteration 20 and restarted from disk while training runs:
    rank 0 says once that the job is unprotected (naming the first uncovered iteration),
    once that protection returned by itself, and the job ends protected and bit-identical.
    (400 steps: on a loaded 2-core machine a shadow restart alone took 20 s, 150 steps.)"""
    sc = tmp_path / "alldown.yaml"
    sc.write_text("name: alldown\nmodel: gpt\nsteps: 400\nseed: 7\npersist_every: 5\n"
                  "shadow_kills: [{partition: 0, at: 20, disk: true}, "
                  "{partition: 1, at: 20, disk: true}]\n")
    rc, report, text = _run(tmp_path, str(sc), _net(), ["--workdir", str(tmp_path / "w")])
    assert rc == 0, text[-3000:]
    chaos = report["runs"]["chaos"]
    assert report["ok"] and report["bit_identical"] is True, report.get("problems")
    assert chaos["shadow_restarts"] == 2 and chaos["protected"] is True
    (log,) = (tmp_path / "w").glob("run-*/chaos/trainer-t0.log")
    lines = log.read_text().splitlines()
    lost = [ln for ln in lines if "UNPROTECTED since iteration" in ln]
    back = [ln for ln in lines if "protected again" in ln]
    assert len(lost) == 1 and len(back) == 1, lost + back
    since = int(lost[0].split("UNPROTECTED since iteration ")[1].split(":")[0])
    # The newest iteration every shadow had committed before the kill, plus one: a shadow
    # lagging under load makes it earlier than the kill (seen: 8 for a kill at 20).
    assert 1 <= since <= 21, lost
    assert "has not answered for" in lost[0]
    assert lines.index(lost[0]) < lines.index(back[0])
