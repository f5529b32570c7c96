"""Two shadows per partition (``checkmate launch --replicas 2``, issue 38's first part).

Everything is real: the launcher's local shadows (four processes: two replicas of each of
two partitions), two trainers of examples/train_elastic.py. The first replica of partition
0 is SIGKILLed while training runs: the job stays protected by its sibling (one line says
the partition is down to its last replica); then a trainer SIGKILLs itself, the launcher
restarts the group, and the restore reads partition 0 from the surviving replica. The run
ends bit-identical to one without shadows or failures.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from checkmate.errors import CheckmateError
from checkmate.testbed.multinode import descendants

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_elastic.py"
LAUNCH = [sys.executable, "-m", "checkmate.launch.cli", "launch", "--nproc-per-node", "2"]


def _same(a: object, b: object, where: str = "") -> None:
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            _same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}/{i}")
    else:
        assert a == b, where


def test_replicas_need_shadows_started_here_for_a_data_parallel_job(capsys):
    from checkmate.launch.cli import main

    for extra in (["--shadow", "127.0.0.1"], ["--mode", "switch", "--controller", "x"],
                  ["--pp", "2"]):
        assert main(["launch", "--nproc-per-node", "2", "--replicas", "2", *extra,
                     str(SCRIPT)]) == 2
        err = capsys.readouterr().err
        assert "--replicas applies to the shadows started here in host mode" in err, err
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


@pytest.mark.slow
def test_a_lost_replica_leaves_the_job_protected_and_a_restart_reads_its_sibling(tmp_path):
    steps = 20
    env = {**os.environ, "NUMBA_NUM_THREADS": "1"}
    ref = subprocess.run([*LAUNCH, "--mode", "off", "--progress-every", "0", str(SCRIPT),
                          "--steps", str(steps), "--out", str(tmp_path / "ref.pt")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert ref.returncode == 0, (ref.stdout + ref.stderr)[-3000:]
    log = tmp_path / "launch.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [*LAUNCH, "--shadows", "2", "--replicas", "2", "--max-restarts", "1",
             "--progress-every", "1", "--dir", str(tmp_path / "run"), str(SCRIPT), "--steps",
             str(steps), "--sleep", "0.25", "--out", str(tmp_path / "got.pt")],
            stdout=f, stderr=subprocess.STDOUT, env={**env, "CHECKMATE_KILL_AT": "1:12"})
    killed: list[int] = []

    def kill_first_replica() -> None:
        """At iteration 4: SIGKILL the first replica of partition 0 (a process this test
        started, through its launcher), found by its bind address."""
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            text = log.read_text(errors="replace")
            net = re.search(r"shadow\(s\) .*on (127\.\d+\.\d+)\.100\+", text)
            if net and "checkmate: iteration 4 loss" in text:
                for pid in descendants(proc.pid):
                    try:
                        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                    except OSError:
                        continue
                    if b"checkmate.shadow.cli" in cmd and \
                            f"{net.group(1)}.100".encode() in cmd:
                        os.kill(pid, signal.SIGKILL)
                        killed.append(pid)
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_first_replica, daemon=True)
    killer.start()
    try:
        proc.wait(300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    killer.join(5)
    out = log.read_text(errors="replace")
    assert proc.returncode == 0, out[-5000:]
    assert killed, out[-3000:]
    assert "Traceback" not in out, out[-5000:]
    assert "starting 4 shadow(s) (2 replicas of each of 2 partitions)" in out, out[-3000:]
    assert "partition 0 is down to its last current replica of 2" in out, out[-5000:]
    assert "UNPROTECTED" not in out, out[-5000:]
    m = re.search(r"read from replica per partition: (\d) (\d)", out)
    assert m and m.groups() == ("1", "0"), out[-5000:]  # partition 0 from its sibling
    assert "resumed from the shadows at iteration" in out, out[-5000:]
    assert f"the shadows hold iteration {steps} " in out and "(checked)" in out, out[-2000:]
    got, want = torch.load(tmp_path / "got.pt"), torch.load(tmp_path / "ref.pt")
    _same(want["model"], got["model"], "model")
    _same(want["optimizer"], got["optimizer"], "optimizer")
