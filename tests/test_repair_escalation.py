"""Repair that escalates and stops: real shadow nodes on loopback (real UDP and TCP).

A fault that drops one iteration of a partition and every repair answer for it (the
"trainer" here is a UDP socket that takes the requests and never answers: it models a path
that loses them, nothing else): the shadow asks a bounded number of times, then asks to be
re-seeded within ``REPAIR_ESCALATE`` seconds and stops asking. When nothing is heard from
the trainers any more, repair requests pause.
"""

from __future__ import annotations

import socket
import time

import numpy as np
from shadow_cluster import Cluster, make_spec

from checkmate.shadow import assembler
from checkmate.train.repair import owners_body
from checkmate.train.shadow_client import ShadowClient


def _count(sock: socket.socket) -> int:
    n = 0
    sock.setblocking(False)
    while True:
        try:
            sock.recv(65536)
        except BlockingIOError:
            return n
        n += 1


def _setup():
    spec = make_spec()
    c = Cluster(spec)
    trainer = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    trainer.bind(("127.0.0.1", 0))
    c.seed()
    body = owners_body([trainer.getsockname()], [], 0)
    for a in c.addrs:
        with ShadowClient(a) as cl:
            cl.request(body)
    return spec, c, trainer


def test_an_iteration_never_repaired_becomes_a_reseed_request(tmp_path):
    spec, c, trainer = _setup()
    try:
        for it in range(1, 7):  # iteration 2 of partition 0 never arrives
            g = c.rng.standard_normal(spec.total).astype(np.float32)
            c.send(it, g, drop=(lambda p, h: p == 0) if it == 2 else None)
        t0 = time.monotonic()
        asked, wanted = 0, ""
        with ShadowClient(c.addrs[0]) as cl:
            while time.monotonic() - t0 < assembler.REPAIR_ESCALATE + 5:
                # the trainers are alive: their monitors report progress every 0.5 s
                st = cl.request({"op": "status", "progress": 6})[0]
                asked += _count(trainer)
                wanted = st["reseed"]["wanted"]
                if wanted:
                    break
                time.sleep(0.5)
            took = time.monotonic() - t0
            assert wanted == (f"iteration 2 not repaired within "
                              f"{assembler.REPAIR_ESCALATE:g}s ("
                              f"{st['repair']['requests']} requests)"), st
            assert assembler.REPAIR_ESCALATE <= took <= assembler.REPAIR_ESCALATE + 3, took
            # Bounded backoff: a few tens of requests in all, not hundreds.
            assert 3 <= asked <= 40, asked
            time.sleep(1.5)  # after escalating, no more requests
            cl.request({"op": "status", "progress": 6})
            assert _count(trainer) <= 1
        # Partition 1 got everything: it is not affected.
        with ShadowClient(c.addrs[1]) as cl:
            assert cl.status()["latest"] == 6
    finally:
        c.close()
        trainer.close()


def test_repair_pauses_when_the_trainers_are_gone(monkeypatch):
    monkeypatch.setattr(assembler, "TRAINERS_GONE", 1.5)
    monkeypatch.setattr(assembler, "REPAIR_ESCALATE", 60.0)
    spec, c, trainer = _setup()
    try:
        for it in range(1, 4):  # iteration 3 of partition 1 loses its control message:
            g = c.rng.standard_normal(spec.total).astype(np.float32)  # the job's last one
            c.send(it, g, ctrl=it != 3)
        time.sleep(1.2)
        assert _count(trainer) >= 1  # asked while the trainers could still be there
        time.sleep(1.5)  # ... then nothing heard for TRAINERS_GONE: it stops asking
        _count(trainer)
        time.sleep(1.5)
        assert _count(trainer) == 0
        with ShadowClient(c.addrs[1]) as cl:
            st = cl.status()
            assert st["latest"] == 2 and not st["reseed"]["wanted"], st
            # A progress report: the trainers are back, asking resumes.
            cl.request({"op": "status", "progress": 3})
            time.sleep(0.6)
            assert _count(trainer) >= 1
    finally:
        c.close()
        trainer.close()
