"""Compile, on this machine, the Numba code the soft-RoCE guest's checks run, into the
guest's Numba cache (checkmate.testbed.guest).

Why: under TCG, Numba compiling the shadow's optimizer and MAC kernels is slow: the
guest checks took 163 s with an empty cache against 108 s with a full one on a quiet
machine (and runs several times longer while another guest or the suite shared the two
cores); natively the compile takes well under a minute. Numba's cache is keyed by the
source file's path and stamp and by the target CPU; the guest sees this machine's files
at the same paths, so with ``NUMBA_CPU_NAME=generic`` on both sides (no host-specific CPU
features in the key or the code) the guest loads what was compiled here. Run as
``NUMBA_CACHE_DIR=... NUMBA_CPU_NAME=generic python -m checkmate.testbed.guest_warm``;
guest.run() does that before it boots.

The warm-up is the checks' own workload, minus the device: a UDP-fed shadow of the same
job spec takes one iteration and commits it, the reference optimizer steps, and the
compiled ingest (checkmate.shadow.ingest) is warmed for the verbs ring's types too, so every
kernel is compiled for the types it gets there.
"""

from __future__ import annotations

import socket
import sys
import time

import numpy as np

from checkmate.errors import CheckmateError
from checkmate.protocol import auth
from checkmate.shadow import ingest
from checkmate.shadow.kernels import make_optimizer
from checkmate.shadow.node import NodeOptions, ShadowNode
from checkmate.testbed.verbs_checks import JOB, LRS, Pair, _spec
from checkmate.train.shadow_client import ShadowClient, seed_share, wait_ready


def warm(timeout: float = 300.0) -> None:
    """One iteration through a UDP-fed shadow, one reference step, one ring MAC check."""
    spec = _spec()
    secret = auth.load_secret()
    node = ShadowNode(NodeOptions(0, 1, JOB, bind="127.0.0.1", port=0,
                                  restore_bind="127.0.0.1", restore_port=0, secret=secret,
                                  controller=None)).start()
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        rng = np.random.default_rng(5)
        flat = {s: np.zeros(spec.total, np.float32) for s in spec.slots}
        flat["param"][:] = rng.standard_normal(spec.total).astype(np.float32)
        ref = make_optimizer(spec, 0, spec.total)
        ref.load(flat, 0)
        wait_ready([("127.0.0.1", node.tcp_port)])  # the kernels this warm-up caches
        seed_share([("127.0.0.1", node.tcp_port)], spec, flat, 0, 1)
        grad = rng.standard_normal(spec.total).astype(np.float32)
        fake = Pair.__new__(Pair)  # only its datagram builder: no shadows, no device
        fake.secret = secret
        dgrams = Pair.datagrams(fake, 1, grad)
        for d in dgrams:
            tx.sendto(d, ("127.0.0.1", node.udp_port))
        ref.step(grad, LRS, None)
        end = time.monotonic() + timeout
        while True:
            with ShadowClient(("127.0.0.1", node.tcp_port)) as c:
                if c.status()["latest"] == 1:
                    break
            if time.monotonic() > end:
                raise CheckmateError(f"guest warm-up: the shadow did not commit within "
                                     f"{timeout:.0f} s")
            time.sleep(0.05)
        # the verbs ring's types (RingConsumer hands int64 arrays to the compiled ingest)
        ingest.warm()
    finally:
        tx.close()
        node.stop()


def main() -> int:
    try:
        t = time.monotonic()
        warm()
        print(f"guest warm-up: compiled in {time.monotonic() - t:.0f} s")
        return 0
    except CheckmateError as e:
        print(f"guest warm-up: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
