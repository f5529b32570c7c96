"""Rewind (issue 35 item 6): ``checkmate launch --resume-at`` and ``checkmate checkpoints``.

Real shadows on loopback outlive two launches of a small job. The second resumes at an
older iteration than the newest the shadows hold and trains on differently (another
learning rate from there, as a user recovering from a loss spike would): its final state
equals a run that did so from the start, and the shadows followed it -- they hold the new
run's last iteration, bit for bit the trainers' state, not the old run's iterations with
the new gradients ignored. An iteration not held everywhere is one line on every rank.
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import textwrap

import torch

from checkmate.config import cluster as cfgmod

SCRIPT = textwrap.dedent("""
    import sys

    import torch
    from torch import nn

    from checkmate.optim import SGD
    from checkmate.train import CheckmateSession

    steps, lr_after, out = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = SGD(model.parameters(), lr=0.1, momentum=0.9)
    sess = CheckmateSession.from_env(model, opt, None)
    for it in range(sess.done_iteration + 1, steps + 1):
        if it > 8:  # the rate from iteration 9 on is the run's choice
            for g in opt.param_groups:
                g["lr"] = lr_after
        sess.begin(it)
        x = torch.randn(5, 6)
        opt.zero_grad()
        nn.functional.cross_entropy(sess.model(x), x[:, :3].argmax(1)).backward()
        sess.step()
    sess.finish()
    if sess.layout.rank == 0:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, out)
    sess.close()
    """)


def _run(argv: list[str]) -> tuple[int, str]:
    p = subprocess.run(argv, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "NUMBA_NUM_THREADS": "1"})
    return p.returncode, p.stdout + p.stderr


def test_resume_at_rewinds_the_shadows_and_they_follow_the_new_run(tmp_path, serve_shadows):
    from checkmate.train.shadow_client import restore_point

    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    launch = [sys.executable, "-m", "checkmate.launch.cli", "launch", "--nproc-per-node", "2",
              "--progress-every", "0"]
    rc, out = _run([*launch, "--mode", "off", str(script), "12", "0.05",
                    str(tmp_path / "reference.pt")])
    assert rc == 0, out[-3000:]
    net = f"127.89.{random.randrange(1, 255)}"
    with serve_shadows([f"{net}.100", f"{net}.101"], config=False) as ips:
        shadows = [f"--shadow={ip}" for ip in ips]
        # checked every 3 iterations, and the last (10) by finish()
        rc, out = _run([*launch, *shadows, "--verify-every", "3", str(script), "10", "0.1",
                        str(tmp_path / "a.pt")])
        assert rc == 0, out[-3000:]
        rc, listed = _run([sys.executable, "-m", "checkmate.launch.cli", "checkpoints",
                           *shadows])
        assert rc == 0, listed
        start = re.search(r"a resume can start at: ([0-9,-]+) \(newest 10;", listed)
        assert start and start[1] == "7-10", listed  # the last 4 retained, 8 among them
        assert f"partition 1 ({ips[1]}:{cfgmod.RESTORE_PORT}) memory " in listed, listed
        assert listed.count(", verified 9-10") == 2, listed
        assert "verified in every partition: 9-10 (newest 10: the shadows' state equalled " \
            "the trainers' there)" in listed, listed

        rc, out = _run([*launch, *shadows, "--resume-at", "8", str(script), "12", "0.05",
                        str(tmp_path / "b.pt")])
        assert rc == 0, out[-3000:]
        assert "resuming at iteration 8: rewound as asked (newest held by all: 10)" in out, out
        assert "rewound the shadows to iteration 8" in out, out
        trainers = torch.load(tmp_path / "b.pt")
        reference = torch.load(tmp_path / "reference.pt")
        assert all(torch.equal(trainers[k], reference[k]) for k in reference)
        held = restore_point([(ip, cfgmod.RESTORE_PORT) for ip in ips])
        assert held.iteration == 12
        assert all(torch.equal(held.model_sd[k], trainers[k]) for k in trainers), \
            "the shadows did not follow the rewound run"

        rc, out = _run([*launch, *shadows, "--resume-at", "2", str(script), "12", "0.05",
                        str(tmp_path / "c.pt")])
    assert rc != 0 and "Traceback" not in out, out[-3000:]
    for rank in range(2):
        lines = [ln for ln in out.splitlines() if ln.startswith(f"checkmate: rank {rank}")]
        assert len(lines) == 1, out[-3000:]
        assert "resume at iteration 2: not held by every partition; held by all: " in lines[0]
