"""Fuzzing: garbage and forged datagrams at a live shadow, and garbage and tampered
requests at the controller's handshake logic. Every one must be dropped and counted exactly
once, nothing may crash, and the shadow's commits must equal those of a twin that never saw
the attack. The forgeries include what an on-path host could make from real datagrams:
the right session (job, epoch, token) with another iteration or job, a cut payload or a
changed byte -- none carries a tag made with the job secret for what it claims.
"""

from __future__ import annotations

import socket
import time

import numpy as np
from fakes import wait_status

from checkmate.protocol import auth, handshake, wire
from checkmate.shadow.feed import control_body, control_datagrams, grad_datagrams
from checkmate.shadow.node import NodeOptions, ShadowNode
from checkmate.spec.model import ModelSpec
from checkmate.train.shadow_client import ShadowClient, seed_share

JOB, EPOCH, TOKEN = 7, 3, 0x5EED
N = 3000  # forged datagrams per kind


def _node() -> ShadowNode:
    return ShadowNode(NodeOptions(partition=0, partitions=1, job=JOB, bind="127.0.0.1",
                                  port=0, restore_bind="127.0.0.1", restore_port=0,
                                  epoch=EPOCH, token=TOKEN)).start()


def _iteration(it: int, grad: np.ndarray) -> list[bytes]:
    out = list(grad_datagrams(JOB, it, 0, 0, grad, chunk=512, epoch=EPOCH, token=TOKEN))
    body = control_body(it, [1e-3], None, False, {}, {"it": it})
    out += list(control_datagrams(JOB, it, body, epoch=EPOCH, token=TOKEN))
    return out


def _forgeries(rng: np.random.Generator, valid: list[bytes]) -> list[bytes]:
    out = []
    for _ in range(N):  # random bytes, random lengths
        out.append(rng.bytes(int(rng.integers(0, 9000))))
    for _ in range(N):  # a valid datagram, a session byte changed, more bytes at random
        d = bytearray(valid[int(rng.integers(len(valid)))])
        d[12:16] = (TOKEN ^ int(rng.integers(1, 2**32))).to_bytes(4, "big")
        for _ in range(int(rng.integers(0, 4))):
            d[int(rng.integers(len(d)))] = int(rng.integers(256))
        out.append(bytes(d))
    for _ in range(N):  # the right session, but a broken datagram
        d = bytearray(valid[int(rng.integers(len(valid) - 1))])  # a gradient datagram
        kind = int(rng.integers(4))
        if kind == 0:
            d[wire.HEADER_LEN + int(rng.integers(len(d) - wire.HEADER_LEN))] ^= 0x5A  # CRC
        elif kind == 1:
            d = d[:-int(rng.integers(1, 64))]  # count/length
        elif kind == 2:
            d[16:24] = int(rng.integers(10**6, 10**9)).to_bytes(8, "big")  # window
        else:
            d[4:8] = int(rng.integers(8, 2**32)).to_bytes(4, "big")  # another job
        out.append(bytes(d))
    return out


def test_forged_and_garbage_datagrams_are_all_dropped_and_commits_stay_exact():
    spec = ModelSpec.build(JOB, [("w", (64, 32)), ("b", (32,))], "adamw",
                           [{"params": ["w", "b"], "lr": 1e-3, "weight_decay": 0.01}], 1)
    rng = np.random.default_rng(7)
    flat = {s: np.zeros(spec.total, np.float32) for s in spec.slots}
    flat["param"][:] = rng.standard_normal(spec.total).astype(np.float32)
    grads = {it: rng.standard_normal(spec.total).astype(np.float32) for it in (1, 2)}
    attacked, twin = _node(), _node()
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tx.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    try:
        for n in (attacked, twin):
            seed_share([("127.0.0.1", n.tcp_port)], spec, flat, 0, 1)
        ca = ShadowClient(("127.0.0.1", attacked.tcp_port))
        ct = ShadowClient(("127.0.0.1", twin.tcp_port))
        for n, c in ((attacked, ca), (twin, ct)):
            for d in _iteration(1, grads[1]):
                tx.sendto(d, ("127.0.0.1", n.udp_port))
            wait_status(c, lambda st: st["latest"] == 1)
        before = wait_status(ca, lambda st: True)
        forged = _forgeries(rng, _iteration(2, grads[2]))
        for i, d in enumerate(forged):
            tx.sendto(d, ("127.0.0.1", attacked.udp_port))
            if i % 200 == 0:
                time.sleep(0.002)  # stay within the socket buffer: a loss would hide a bug
        st = wait_status(ca, lambda st: st["received"] - before["received"] >= len(forged))
        dropped = sum(st["drops"].values()) - sum(before["drops"].values())
        assert st["received"] - before["received"] == len(forged)
        assert dropped == len(forged), (st["drops"], before["drops"])
        assert st["latest"] == 1 and st["pending"] == [] and not st["error"]
        # then the real iteration 2, to both: the attacked shadow must commit what the twin does
        for n, c in ((attacked, ca), (twin, ct)):
            for d in _iteration(2, grads[2]):
                tx.sendto(d, ("127.0.0.1", n.udp_port))
            wait_status(c, lambda st: st["latest"] == 2)
        got, want = ca.fetch(2), ct.fetch(2)
        for s in spec.slots:
            assert np.array_equal(got.slots[s], want.slots[s]), s
        assert got.step == want.step == 2
        ca.close()
        ct.close()
    finally:
        tx.close()
        attacked.stop()
        twin.stop()


def test_the_handshake_logic_survives_garbage_and_forged_requests(tmp_path):
    """Straight into HandshakeService.handle (no socket, so nothing is lost on the way):
    random bytes and valid requests with random bytes changed. None may raise, none may
    register anything, and each is counted once."""
    from checkmate.config import cluster as config
    from checkmate.control.drivers.base import ApplyResult
    from checkmate.control.service import HandshakeService
    from checkmate.control.sessions import SessionStore

    class NoSwitch:
        """Stands in for the switch driver; the test asserts it is never asked to write."""

        writes = 0

        def apply(self, plan):  # noqa: ANN001
            NoSwitch.writes += 1
            return ApplyResult()

        def close(self) -> None:
            pass

    cfg = config.load(config.default_path())
    secret = auth.load_secret()
    svc = HandshakeService(cfg, NoSwitch(), SessionStore(tmp_path / "s.json"), secret,
                           log=lambda msg: None)
    rng = np.random.default_rng(11)
    key = auth.handshake_key(secret)
    body = {"op": "register", "job": 7, "partition": 1, "host": "s1", "port": 47001}
    sent = 0
    for _ in range(N):
        rep = svc.handle(rng.bytes(int(rng.integers(0, 2000))), "10.77.0.101")
        assert rep is None or handshake.parse(rep).mac == handshake.NO_MAC
        sent += 1
    for i in range(N):
        d = bytearray(handshake.request(key, 7, i, body, 1)[0])
        for _ in range(int(rng.integers(1, 4))):
            d[int(rng.integers(len(d)))] ^= int(rng.integers(1, 256))
        rep = svc.handle(bytes(d), "10.77.0.101")
        if rep is not None:
            m = handshake.parse(rep)
            assert m.mac == handshake.NO_MAC, m.body  # nothing forged was accepted
        sent += 1
    counted = sum(v for k, v in svc.stats.items()
                  if k in ("malformed", "unexpected_reply", "unauthenticated", "refused"))
    assert counted == sent and svc.store.max_epoch == 0 and NoSwitch.writes == 0
    assert svc.stats.get("register", 0) == 0
    # and a holder of the secret can read the counts (`control status` shows them)
    rep = handshake.parse(svc.handle(handshake.request(key, 7, N + 1, {"op": "counters"},
                                                       1)[0], "10.77.0.101"))
    assert rep.mac != handshake.NO_MAC and rep.body["op"] == "counters"
    assert sum(rep.body["counters"].get(k, 0) for k in ("malformed", "unexpected_reply",
                                                        "unauthenticated", "refused")) == sent
