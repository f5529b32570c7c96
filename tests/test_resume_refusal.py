"""A resume that is refused reaches every rank as one line: real shadows, `checkmate launch`.

A job trains a tiny model against two shadows started by hand; a second launch with
``--resume`` ties the model's head to its embedding (a tie the checkpoint does not have).
Rank 0 refuses it, and must not exit (taking the attempt's store with it) before the other
rank has read the refusal: every rank says the one line, no traceback, no C++ frames.
"""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from checkmate.config import cluster as cfgmod

TIED = textwrap.dedent("""
    import os
    import sys

    import torch
    from torch import nn

    from checkmate.optim import SGD
    from checkmate.train import CheckmateSession


    class Net(nn.Module):
        def __init__(self, tie: bool) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.emb = nn.Embedding(8, 4)
            self.head = nn.Linear(4, 8, bias=False)
            if tie:
                self.head.weight = self.emb.weight

        def forward(self, x):
            return self.head(self.emb(x))


    torch.set_num_threads(1)
    model = Net(tie=sys.argv[2] == "tied")
    opt = SGD(model.parameters(), lr=0.1)
    sess = CheckmateSession.from_env(model, opt, None)
    for it in range(sess.done_iteration + 1, int(sys.argv[1]) + 1):
        sess.begin(it)
        x = torch.randint(8, (4,))
        opt.zero_grad()
        nn.functional.cross_entropy(sess.model(x), x).backward()
        sess.step()
    sess.finish()
    sess.close()
    """)


@pytest.mark.slow
def test_a_resume_with_changed_ties_is_refused_in_one_line_on_every_rank(tmp_path,
                                                                         serve_shadows):
    script = tmp_path / "tied.py"
    script.write_text(TIED)
    net = f"127.83.{random.randrange(1, 255)}"
    with serve_shadows([f"{net}.100", f"{net}.101"], config=False) as ips:
        base = [sys.executable, "-m", "checkmate.launch.cli", "launch", "--nproc-per-node", "2",
                "--shadow", ips[0], "--shadow", f"{ips[1]}:{cfgmod.RESTORE_PORT}"]
        p = subprocess.run([*base, str(script), "3", "untied"], capture_output=True,
                           text=True, timeout=300)
        assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
        p = subprocess.run([*base, "--resume", str(script), "6", "tied"], capture_output=True,
                           text=True, timeout=300)
    out = p.stdout + p.stderr
    print(out)
    assert p.returncode != 0, out[-3000:]
    assert "Traceback" not in out and "frame #" not in out, out[-6000:]
    for rank in range(2):
        lines = [ln for ln in out.splitlines() if ln.startswith(f"checkmate: rank {rank}")]
        assert len(lines) == 1, out[-6000:]
        assert "tied parameters" in lines[0] and "head.weight = emb.weight" in lines[0], lines
