"""The training API in one process against two real shadow processes on loopback.

A world of one (gloo in-process, ring of one rank, host replication) trains the CNN for a
few iterations; ``restore_trainer`` then loads the shadows' consistent point into fresh
objects, which must equal the trained ones bit for bit (three-step round trip: differ, load,
equal).
"""

from __future__ import annotations

import os
import random

import pytest
import torch
import torch.distributed as dist
from fakes import free_port

from checkmate.config import cluster as cfgmod
from checkmate.testbed.models import build
from checkmate.train import CheckmateSession, JobLayout, ShadowTarget, restore_trainer

pytestmark = pytest.mark.slow


@pytest.fixture
def shadows(serve_shadows):
    net = f"127.80.{random.randrange(1, 255)}"
    with serve_shadows([f"{net}.100", f"{net}.101"]) as ips:
        yield net, ips


def test_train_then_restore_trainer_round_trip(shadows):
    net, ips = shadows
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        steps = 4
        w = build("cnn", 5, steps)
        layout = JobLayout(
            job_id=7, rank=0, world=1, trainers=[(f"{net}.10", cfgmod.TRAINER_PORT)],
            shadows=[ShadowTarget(p, ip, cfgmod.SHADOW_PORT) for p, ip in enumerate(ips)],
            shadow_tcp=[(ip, cfgmod.RESTORE_PORT) for ip in ips], mode="host", seed=5)
        sess = CheckmateSession(w.model, w.optimizer, w.scheduler, layout, w.max_grad_norm)
        assert sess.start() == 0
        for it in range(1, steps + 1):
            sess.begin(it)
            x, y = w.batch(0, it)
            w.optimizer.zero_grad()
            w.loss(sess.model(x), y).backward()
            sess.step(extra={"data": {"iteration": it}})
        prot = sess.finish(timeout=30)
        assert prot["protected"] is True and prot["iteration"] == steps
        assert prot["newest_consistent"] == steps
        assert all(v["lag"] == 0 and v["reachable"] for v in prot["shadows"].values())
        assert prot["repair"] is not None and prot["reseeds"] == 0
        sess.close()

        fresh = build("cnn", 6, steps)  # another seed: differs before the restore
        assert not torch.equal(fresh.model.fc.weight, w.model.fc.weight)
        it, extra = restore_trainer(layout.shadow_tcp, fresh.model, fresh.optimizer,
                                    fresh.scheduler)
        assert it == steps and extra == {"data": {"iteration": steps}}
        for (n, a), (_, b) in zip(w.model.state_dict().items(),
                                  fresh.model.state_dict().items(), strict=True):
            assert torch.equal(a, b), n
        sa, sb = w.optimizer.state_dict(), fresh.optimizer.state_dict()
        for k in sa["state"]:
            for slot, t in sa["state"][k].items():
                assert torch.equal(t, sb["state"][k][slot]), (k, slot)
        assert [g["lr"] for g in sa["param_groups"]] == [g["lr"] for g in sb["param_groups"]]
        assert fresh.scheduler.state_dict() == w.scheduler.state_dict()
    finally:
        dist.destroy_process_group()
