"""Shadow nodes on loopback driven the way trainers drive them: a job's spec (make_spec),
a Cluster of real ShadowNodes seeded and fed real datagrams beside a reference
FlatOptimizer, and the checks of restored state against that reference.

One concept, kept apart from fakes.py: these are no doubles but real shadows, and the
helpers share the spec's constants (JOB, LRS); the shadow, restore and persistence tests
all build on them.
"""

from __future__ import annotations

import socket
import time

import numpy as np
import torch

from checkmate.protocol import wire
from checkmate.shadow.feed import control_body, control_datagrams, grad_datagrams
from checkmate.shadow.kernels import make_optimizer
from checkmate.shadow.node import NodeOptions, ShadowNode
from checkmate.spec.model import ModelSpec
from checkmate.train.shadow_client import ShadowClient, seed_share

# -- the job's spec and its shadows on loopback ---------------------------------------
JOB = 11
LRS = [0.01, 0.003]


def make_spec(kind="adamw", partitions=2, grad_dtype="float32"):
    extra = {"momentum": 0.9} if kind == "sgd" else {"amsgrad": False}
    return ModelSpec.build(
        JOB, [("emb", (40, 8)), ("w1", (8, 16)), ("b1", (16,)), ("w2", (16, 3))], kind,
        [{"params": ["emb", "w2"], "lr": LRS[0], "weight_decay": 0.1, **extra},
         {"params": ["w1", "b1"], "lr": LRS[1], "weight_decay": 0.0, **extra}],
        partitions, buffers=[("bn.mean", (3,), "float32")], grad_dtype=grad_dtype)


class Cluster:
    """n shadows on loopback with ephemeral ports, seeded like trainers would seed them."""

    def __init__(self, spec, epochs=None, per_node=None, **opts):
        self.spec = spec
        self.job = spec.job
        self.nodes = []
        try:
            for p in range(spec.partitions):
                self.nodes.append(ShadowNode(NodeOptions(
                    p, spec.partitions, spec.job, bind="127.0.0.1", port=0,
                    restore_bind="127.0.0.1", restore_port=0,
                    epoch=(epochs or {}).get(p, 0), token=0,
                    **opts, **(per_node or {}).get(p, {}))).start())
        except BaseException:
            self.close()
            raise
        self.addrs = [("127.0.0.1", n.tcp_port) for n in self.nodes]
        self.tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        rng = np.random.default_rng(7)
        self.flat = {s: np.zeros(spec.total, np.float32) for s in spec.slots}
        self.flat["param"][:] = rng.standard_normal(spec.total).astype(np.float32)
        self.ref = make_optimizer(spec, 0, spec.total)
        self.ref.load(self.flat, 0)
        self.refs = {0: self.ref.snapshot()}
        self.rng = rng

    def seed(self, world=3):
        for r in range(world):
            seed_share(self.addrs, self.spec, self.flat, r, world)

    def send(self, it, grad, parts=None, clip=None, skip=False, drop=None, ctrl=True,
             **kw):
        for p in parts if parts is not None else range(self.spec.partitions):
            a, b = self.spec.bounds(p)
            addr = ("127.0.0.1", self.nodes[p].udp_port)
            for d in grad_datagrams(self.job, it, p, a, grad[a:b], chunk=50,
                                    dtype=self.spec.grad_dtype, **kw):
                h = wire.decode_header(d)
                if drop is None or not drop(p, h):
                    self.tx.sendto(d, addr)
            if ctrl:
                # the spec's buffers only: a control message naming another is refused
                bufs = {b.name: "AAAAAAAAAAAAAAAA" for b in self.spec.buffers
                        if b.name == "bn.mean"}
                body = control_body(it, LRS, clip, skip, bufs, {"it": it})
                for d in control_datagrams(self.job, it, body, frag=40, partition=p,
                                           **{k: kw[k] for k in ("epoch", "token") if k in kw}):
                    self.tx.sendto(d, addr)

    def step_ref(self, it, grad, clip=None, skip=False):
        g = grad
        if self.spec.grad_dtype != "float32":
            g = torch.from_numpy(grad).to(getattr(torch, self.spec.grad_dtype)).float().numpy()
        if not skip:
            self.ref.step(g, LRS, clip)
        self.refs[it] = self.ref.snapshot()

    def wait(self, cond, timeout=15.0):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            sts = [ShadowClient(a).status() for a in self.addrs]
            if cond(sts):
                return sts
            time.sleep(0.02)
        raise AssertionError(f"timed out; status: {sts}")

    def close(self):
        for n in self.nodes:
            n.stop()
        if hasattr(self, "tx"):
            self.tx.close()


# -- driving a cluster and checking what it restores (the restore and resume tests) ------
def run_iterations(c, its, grads=None):
    """Send iterations ``its`` (clip 0.5) and step the reference alongside; a gradient
    already in ``grads`` is resent as it was. Returns the gradients by iteration."""
    grads = {} if grads is None else grads
    for it in its:
        if it not in grads:
            grads[it] = c.rng.standard_normal(c.spec.total).astype(np.float32)
        c.send(it, grads[it], clip=0.5)
        c.step_ref(it, grads[it], 0.5)
    return grads


def assert_state(spec, model_sd, optim_sd, ref, step):
    """Restored model and optimizer state dicts equal the reference ``ref`` at ``step``,
    bit for bit."""
    ref_m, ref_o = spec.state_dicts(ref, step)
    for k in ref_m:
        assert torch.equal(model_sd[k], ref_m[k]), k
    assert optim_sd["state"].keys() == ref_o["state"].keys()
    for i in ref_o["state"]:
        for k in ref_o["state"][i]:
            assert torch.equal(optim_sd["state"][i][k], ref_o["state"][i][k]), (i, k)
