"""A shadow node registering with the real handshake service (helper B's HandshakeService),
which programs the P4Runtime TEST DOUBLE of tests/fakes.py (no switch hardware
or bmv2 here), over real loopback UDP. The node must end up with the session the service
minted, and datagrams stamped with an older session must be dropped."""

from __future__ import annotations

import numpy as np
from shadow_cluster import LRS, Cluster

from checkmate.spec.model import ModelSpec
from checkmate.train.shadow_client import ShadowClient


def test_node_registers_with_handshake_service_and_filters_old_sessions(service):
    job = service.cfg.job_id
    spec = ModelSpec.build(job, [("w", (200,)), ("v", (100,))], "adamw",
                           [{"params": ["w"], "lr": LRS[0]}, {"params": ["v"], "lr": LRS[1]}],
                           2)
    per_node = {p: {"host": h.name, "ip": h.ip, "mac": h.mac}
                for p, h in ((p, service.cfg.shadow_for(p)) for p in (0, 1))}
    ctl = service.sock.getsockname()
    first = Cluster(spec, controller=ctl, per_node=per_node)
    first.close()
    c = Cluster(spec, controller=ctl, per_node=per_node)  # restarted: new, larger epochs
    try:
        sess = service._session()["partitions"]
        e0, e1 = sess["0"]["epoch"], sess["1"]["epoch"]
        assert e1 > e0 > 2  # the first registrations had 1 and 2
        sts = [ShadowClient(a).status() for a in c.addrs]
        assert [s["epoch"] for s in sts] == [e0, e1]
        tok = [sess[str(p)]["token"] for p in (0, 1)]
        assert [n.receiver.token for n in c.nodes] == tok
        c.seed(2)
        g = c.rng.standard_normal(spec.total).astype(np.float32)
        for p in (0, 1):  # first the session of the previous registration, then the new
            c.send(1, g, parts=[p], epoch=sess[str(p)]["epoch"] - 2, token=tok[p])
            c.send(1, g, parts=[p], epoch=sess[str(p)]["epoch"], token=tok[p])
        c.step_ref(1, g)
        sts = c.wait(lambda sts: all(s["latest"] == 1 for s in sts))
        assert all(s["drops"].get("epoch", 0) > 0 for s in sts)
        full = c.refs[1]
        got = np.concatenate([ShadowClient(a).fetch(1).slots["param"] for a in c.addrs])
        assert np.array_equal(got, full["param"])
    finally:
        c.close()
