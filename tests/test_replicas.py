"""Two shadows per partition (``checkmate launch --replicas 2``, issue 38's first part).

Everything is real: the launcher's local shadows (four processes: two replicas of each of
two partitions), two trainers of examples/train_elastic.py. (1) The first replica of
partition 0 is SIGKILLed while training runs: the job stays protected by its sibling (one
line says the partition is down to its last replica); then a trainer SIGKILLs itself, the
launcher restarts the group, and the restore reads partition 0 from the surviving replica.
The run ends bit-identical to one without shadows or failures. (2) A replica is SIGKILLed
and started again empty: it takes its state from its sibling (the trainers send no re-seed)
and is current, and checked against the trainers, at the end.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
from fakes import same_state

from checkmate.errors import CheckmateError
from checkmate.testbed import replica_cases

SCRIPT, STEPS = replica_cases.SCRIPT, replica_cases.STEPS


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The final state of the same job without shadows or failures."""
    try:
        return torch.load(replica_cases.reference(tmp_path_factory.mktemp("reference")))
    except CheckmateError as e:
        pytest.fail(str(e))


def test_replicas_need_shadows_started_here_for_a_data_parallel_job(capsys):
    from checkmate.launch.cli import main

    for extra in (["--shadow", "127.0.0.1"], ["--mode", "switch", "--controller", "x"],
                  ["--pp", "2"]):
        assert main(["launch", "--nproc-per-node", "2", "--replicas", "2", *extra,
                     str(SCRIPT)]) == 2
        err = capsys.readouterr().err
        assert "--replicas applies to the shadows started here, for a data-parallel job: " \
            "in host mode, or in switch mode with --colocate" in err, err
        assert "Traceback" not in err


def test_the_environment_cuts_the_shadow_list_into_replica_sets():
    from checkmate.train import env as envmod

    base = {"RANK": "0", "WORLD_SIZE": "1", envmod.TRAINERS: "127.0.0.1:47000",
            envmod.SHADOWS: ",".join(f"127.0.0.1:{47100 + i}" for i in range(6))}
    job = envmod.read({**base, envmod.REPLICAS: "3"})
    assert job.shadow_tcp == [("127.0.0.1", 47100), ("127.0.0.1", 47101)]
    assert job.replica_tcp == [[("127.0.0.1", 47102), ("127.0.0.1", 47103)],
                               [("127.0.0.1", 47104), ("127.0.0.1", 47105)]]
    assert [[t.partition for t in s] for s in job.replica_shadows] == [[0, 1], [0, 1]]
    with pytest.raises(CheckmateError, match="CHECKMATE_REPLICAS must divide the 6 shadows"):
        envmod.read({**base, envmod.REPLICAS: "4"})


def _run_killing(tmp: Path, args: list[str], at: int, shadows: list[int],
                 kill_at: str | None = None) -> str:
    """The chaos cases' launcher run (checkmate.testbed.replica_cases.run_killing): it
    must end well, without a traceback."""
    try:
        return replica_cases.run_killing(tmp, args, at, shadows, kill_at)
    except CheckmateError as e:
        pytest.fail(str(e))


@pytest.mark.slow
def test_a_replica_restarted_empty_takes_its_state_from_its_sibling(tmp_path):
    """The launcher starts a replica that exited again (empty); the trainers point it at
    its current sibling, whose newest version it installs; at the end it is current and
    passes the state check."""
    steps = 24
    out = _run_killing(tmp_path, [str(SCRIPT), "--steps", str(steps), "--sleep", "0.2"], 4,
                       [103])  # replica 1 of partition 1
    assert re.search(r"shadow 127\.\d+\.\d+\.103 \(partition 1 replica 1\) exited \(signal "
                     r"SIGKILL\): started it again", out), out[-5000:]
    assert "re-seeding the shadow of partition 1 replica 1 from its sibling replica 0 (the " \
           "trainers send nothing)" in out, out[-5000:]
    assert "while training runs" not in out, out[-5000:]  # no re-seed from the trainers
    assert "not protected" not in out, out[-5000:]  # every replica that answered checked
    shadow_log = (tmp_path / "run" / "shadow-3.log").read_text(errors="replace")
    assert "re-seeded from the sibling at" in shadow_log, shadow_log[-3000:]
    # finish() checked every replica that answers, the restarted one included: the launcher
    # says so only when each partition's replicas agree with the trainers at the end
    assert f"the shadows hold iteration {steps} " in out and "(checked)" in out, out[-2000:]


@pytest.mark.slow
def test_a_lost_replica_leaves_the_job_protected_and_a_restart_reads_its_sibling(
        tmp_path, reference):
    """The first replica of partition 0 killed at iteration 3 and left down; a trainer dies
    at 15, well after the trainers see the replica down (2 s without an answer)."""
    out = _run_killing(tmp_path, ["--max-restarts", "1", "--shadow-restarts", "0",
                                  str(SCRIPT), "--steps", str(STEPS), "--sleep", "0.25",
                                  "--out", str(tmp_path / "got.pt")], 3, [100], "1:15")
    assert "starting 4 shadow(s) (2 replicas of each of 2 partitions)" in out, out[-3000:]
    assert re.search(r"shadow 127\.\d+\.\d+\.100 \(partition 0 replica 0\) exited \(signal "
                     r"SIGKILL\) after 0 restart\(s\) \(--shadow-restarts\): left down", out), \
        out[-5000:]
    assert "partition 0 is down to its last current replica of 2" in out, out[-5000:]
    assert "UNPROTECTED" not in out, out[-5000:]
    m = re.search(r"read from replica per partition: (\d) (\d)", out)
    assert m and m.groups() == ("1", "0"), out[-5000:]  # partition 0 from its sibling
    assert "resumed from the shadows at iteration" in out, out[-5000:]
    assert f"the shadows hold iteration {STEPS} " in out and "(checked)" in out, out[-2000:]
    got = torch.load(tmp_path / "got.pt")
    assert same_state(reference["model"], got["model"]), "model"
    assert same_state(reference["optimizer"], got["optimizer"]), "optimizer"


def test_the_replicas_bench_refuses_a_bad_command_line_in_one_line(capsys):
    from checkmate.testbed.bench import replicas

    assert replicas.main(["--rounds", "1"]) == 2
    err = capsys.readouterr().err
    assert "need 1 <= --world <= 8, --rounds >= 2" in err and "Traceback" not in err, err


@pytest.mark.slow
def test_both_replicas_and_a_trainer_lost_resume_from_their_checkpoints(tmp_path,
                                                                         reference):
    """Both replicas of partition 0 SIGKILLed, and a trainer a moment later (a correlated
    failure): the launcher starts the two shadows again from their checkpoints, the
    restart resumes where partition 0's disk allows, says so, and the run ends
    bit-identical."""
    out = _run_killing(tmp_path, ["--max-restarts", "1", "--persist-every", "1", str(SCRIPT),
                                  "--steps", str(STEPS), "--sleep", "0.25", "--out",
                                  str(tmp_path / "got.pt")], 9, [100, 102], "0:10")
    assert out.count("(partition 0 replica ") >= 2 and "started it again" in out, out[-5000:]
    # partition 0's shadows came back from their checkpoints, and the restart resumed
    for k in (0, 2):  # replica 0 and replica 1 of partition 0
        shadow_log = (tmp_path / "run" / f"shadow-{k}.log").read_text(errors="replace")
        assert "restored partition 0 from" in shadow_log, shadow_log[-2000:]
    assert "checkmate: resuming at iteration" in out, out[-5000:]
    assert "resumed from the shadows at iteration" in out, out[-5000:]
    got = torch.load(tmp_path / "got.pt")
    assert same_state(reference["model"], got["model"]), "model"
    assert same_state(reference["optimizer"], got["optimizer"]), "optimizer"


@pytest.mark.slow
def test_a_tied_model_under_ddp_keeps_both_replicas_bit_identical(tmp_path):
    """Shared parameters with replicas: examples/train_lm.py (its output layer is its input
    embedding, one parameter under two names) through DDP on 2 ranks, two replicas of each
    of 2 partitions. Replica 1 of partition 0 is killed at iteration 4 and started again
    empty: it takes its sibling's state; rank 1 dies after 14: the restart reads the
    replicas. The end equals a run without shadows or failure, every replica checked."""
    lm = Path(__file__).resolve().parents[1] / "examples" / "train_lm.py"
    steps = 24
    args = [str(lm), "--path", "ddp", "--steps", str(steps), "--sleep", "0.15"]
    ref = subprocess.run([*replica_cases.LAUNCH, "--mode", "off", "--progress-every", "0",
                          *args, "--out", str(tmp_path / "ref.pt")], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "NUMBA_NUM_THREADS": "1"})
    assert ref.returncode == 0, (ref.stdout + ref.stderr)[-3000:]
    out = _run_killing(tmp_path, ["--max-restarts", "1", *args, "--out",
                                  str(tmp_path / "got.pt")], 4, [102], "1:14")
    assert "re-seeding the shadow of partition 0 replica 1 from its sibling replica 0 (the " \
           "trainers send nothing)" in out, out[-5000:]
    assert "resumed from the shadows at iteration" in out, out[-5000:]
    assert f"the shadows hold iteration {steps} " in out and "(checked)" in out, out[-2000:]
    want, got = torch.load(tmp_path / "ref.pt"), torch.load(tmp_path / "got.pt")
    assert same_state(want["model"], got["model"]), "model"
    assert same_state(want["optimizer"], got["optimizer"]), "optimizer"
    assert "lm_head.weight" in got["model"]  # the tied name is saved and compared too
