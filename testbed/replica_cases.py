"""Chaos cases with two shadows per partition (issue 38): one ``checkmate launch
--replicas 2`` (host mode: the launcher starts and supervises the four shadows) of
examples/train_elastic.py, shadows SIGKILLed through the launcher while training runs.

    testbed run --scenario replicas-kill-one|replicas-kill-both-and-trainer

replicas-kill-one: one replica of a random partition killed at a random iteration; the
launcher starts it again empty and it takes its state from its live sibling (the trainers
send nothing and never pause: no restart, no live re-seed); the job ends protected, every
replica checked against the trainers, bit-identical to a run without shadows or failures.
replicas-kill-both-and-trainer: both replicas of partition 0 killed and a trainer a moment
later (a correlated failure of everything that held partition 0's newest state): the
launcher starts both shadows again from their checkpoints (``--persist-every 1``), the
restart resumes from what partition 0's disk holds and says so, bit-identical at the end.

The launcher's shadows on loopback are found by their bind address among its descendants
(processes this command started); nothing else is signalled.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from checkmate.errors import CheckmateError

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_elastic.py"
LAUNCH = [sys.executable, "-m", "checkmate.launch.cli", "launch", "--nproc-per-node", "2"]
STEPS = 20


@dataclass(frozen=True)
class ReplicaCase:
    name: str
    description: str


CASES = {
    "replicas-kill-one": ReplicaCase(
        "replicas-kill-one", "2 replicas per partition, one killed and restarted empty: "
        "sibling re-seed, no pause, bit-identical"),
    "replicas-kill-both-and-trainer": ReplicaCase(
        "replicas-kill-both-and-trainer", "both replicas of a partition and a trainer "
        "killed: resume from disk, said so, bit-identical"),
}


def _descendants(pid: int) -> list[int]:
    from checkmate.testbed.multinode import descendants

    return descendants(pid)


def shadow_pids(launcher: int, ip: str) -> list[int]:
    """The launcher's shadow processes bound to ``ip``."""
    out = []
    for pid in _descendants(launcher):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"checkmate.shadow.cli" in cmd and ip.encode() in cmd:
            out.append(pid)
    return out


def _at_iteration(log: Path, proc: subprocess.Popen, it: int) -> str | None:
    """Wait until the launcher's output shows iteration ``it``; the shadows' /24."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        text = log.read_text(errors="replace")
        net = re.search(r"shadow\(s\) .*on (127\.\d+\.\d+)\.100\+", text)
        if net and f"checkmate: iteration {it} loss" in text:
            return net.group(1)
        time.sleep(0.05)
    return None


def run_killing(work: Path, args: list[str], at: int, shadows: list[int],
                kill_at: str | None = None) -> str:
    """``checkmate launch --shadows 2 --replicas 2 ARGS``; at iteration ``at`` SIGKILL its
    shadows whose bind address ends in each of ``shadows`` (.100 + 2 x replica +
    partition); ``kill_at``: a trainer's CHECKMATE_KILL_AT. Returns the launcher's output;
    CheckmateError when it did not end well, printed a traceback, or a kill missed."""
    work.mkdir(parents=True, exist_ok=True)
    log = work / "launch.log"
    env = {**os.environ, "NUMBA_NUM_THREADS": "1"}
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [*LAUNCH, "--shadows", "2", "--replicas", "2", "--progress-every", "1", "--dir",
             str(work / "run"), *args], stdout=f, stderr=subprocess.STDOUT,
            env=env if kill_at is None else {**env, "CHECKMATE_KILL_AT": kill_at})
    killed: list[int] = []
    try:
        net = _at_iteration(log, proc, at)
        if net is None:
            raise CheckmateError(f"the job never reached iteration {at}: "
                                 f"{log.read_text(errors='replace')[-300:]}")
        killed = [pid for last in shadows for pid in shadow_pids(proc.pid, f"{net}.{last}")]
        for pid in killed:
            os.kill(pid, signal.SIGKILL)
        proc.wait(300)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(30)
    out = log.read_text(errors="replace")
    if proc.returncode != 0 or len(killed) != len(shadows) or "Traceback" in out:
        raise CheckmateError(f"the launcher exited {proc.returncode} after killing "
                             f"{len(killed)} of {len(shadows)} shadow(s): {out[-600:]}")
    return out


def reference(work: Path, steps: int = STEPS) -> Path:
    """The same job's final state without shadows or failures."""
    work.mkdir(parents=True, exist_ok=True)
    out = work / "reference.pt"
    p = subprocess.run([*LAUNCH, "--mode", "off", "--progress-every", "0", str(SCRIPT),
                        "--steps", str(steps), "--out", str(out)], capture_output=True,
                       text=True, timeout=300, env={**os.environ, "NUMBA_NUM_THREADS": "1"})
    if p.returncode != 0:
        raise CheckmateError(f"the reference run failed: {(p.stdout + p.stderr)[-300:]}")
    return out


def _same(ref: Path, got: Path) -> bool:
    import torch

    from checkmate.testbed.comparison import compare_states

    return not compare_states(torch.load(ref, weights_only=False),
                              torch.load(got, weights_only=False), ("model", "optimizer"))


def _kill_one(work: Path, rng: random.Random) -> tuple[dict, list[str]]:
    part, rep = rng.randrange(2), rng.randrange(2)
    at = rng.randrange(3, STEPS // 2)
    out = run_killing(work, [str(SCRIPT), "--steps", str(STEPS), "--sleep", "0.2", "--out",
                             str(work / "got.pt")], at, [100 + 2 * rep + part])
    need = {
        "restarted": f"(partition {part} replica {rep}) exited (signal SIGKILL): started it "
                     "again",
        "sibling re-seed": f"re-seeding the shadow of partition {part} replica {rep} from "
                           f"its sibling replica {1 - rep} (the trainers send nothing)",
        "checked at the end": f"the shadows hold iteration {STEPS} ",
    }
    problems = [f"the launcher never said {what}: {line!r}" for what, line in need.items()
                if line not in out]
    problems += [f"the launcher said {bad!r}" for bad in
                 ("while training runs", "not protected", "restarting the worker group")
                 if bad in out]
    return {"kill_at": at, "killed": f"partition {part} replica {rep}"}, problems


def _kill_both_and_trainer(work: Path, rng: random.Random) -> tuple[dict, list[str]]:
    at = rng.randrange(5, 12)
    out = run_killing(work, ["--max-restarts", "1", "--persist-every", "1", str(SCRIPT),
                             "--steps", str(STEPS), "--sleep", "0.25", "--out",
                             str(work / "got.pt")], at, [100, 102], f"0:{at + 1}")
    problems = []
    if out.count("(partition 0 replica ") < 2 or "started it again" not in out:
        problems.append("the launcher did not start both replicas of partition 0 again")
    for k in (0, 2):
        log = (work / "run" / f"shadow-{k}.log").read_text(errors="replace")
        if "restored partition 0 from" not in log:
            problems.append(f"shadow-{k} did not come back from its checkpoints")
    for line in ("checkmate: resuming at iteration", "resumed from the shadows at iteration"):
        if line not in out:
            problems.append(f"the launcher never said {line!r}")
    return {"kill_at": at, "killed": "both replicas of partition 0, then rank 0"}, problems


def execute(name: str, workdir: Path, rng: random.Random) -> dict[str, Any]:
    """Run case ``name`` and its reference; the report (``ok``, ``problems``)."""
    run = {"replicas-kill-one": _kill_one,
           "replicas-kill-both-and-trainer": _kill_both_and_trainer}[name]
    workdir.mkdir(parents=True, exist_ok=True)
    ref = reference(workdir / "reference")
    did, problems = run(workdir / "chaos", rng)
    same = _same(ref, workdir / "chaos" / "got.pt")
    if not same:
        problems.append("the final model and optimizer differ from the failure-free run")
    return {"scenario": name, "mode": "host", "ok": not problems, "bit_identical": same,
            "kill_at": did["kill_at"], "killed": did["killed"], "problems": problems,
            "runs": {}}
