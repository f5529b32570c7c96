"""Registration converges: retries of one shadow instance get one session, under load.

The real handshake service on loopback UDP programs the P4Runtime TEST DOUBLE of
tests/fakes.py (no switch hardware here), made slow (each write waits, as a
switch does under load: the double models no other timing). Real shadow nodes register
while busy processes load every core.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from handshake_service import KEY, answer, req
from shadow_cluster import Cluster

from checkmate.control.sessions import SessionStore
from checkmate.protocol import handshake, wire
from checkmate.spec.model import ModelSpec

#: Seconds each switch write takes: well past the shadow's first retry (0.2 s).
SLOW_WRITE = 0.6


def _register(svc, seq, host, partition, port, instance):
    body = {"op": "register", "job": svc.cfg.job_id, "partition": partition, "host": host,
            "port": port, "instance": instance}
    return answer(svc.handle(req(svc.cfg.job_id, seq, body, partition), "127.0.0.1"))[1]


def test_the_same_instance_gets_the_same_session(service):
    a = _register(service, 1, "s1", 1, 47011, "aaaa")
    again = _register(service, 2, "s1", 1, 47011, "aaaa")  # a retry: same session
    assert (again["epoch"], again["token"]) == (a["epoch"], a["token"])
    assert service.stats["register_repeated"] == 1
    other = _register(service, 3, "s1", 1, 47011, "bbbb")  # a restarted shadow: new one
    assert other["epoch"] > a["epoch"] and other["token"] != a["token"]
    moved = _register(service, 4, "s1", 1, 47012, "bbbb")  # same id, another port: new
    assert moved["epoch"] > other["epoch"]
    # The instance survives the controller's restart (its state file).
    st = SessionStore(service.store.path)
    assert st.registrations["s1"].instance == "bbbb" and st.registrations["s1"].port == 47012
    bad = answer(service.handle(req(service.cfg.job_id, 5, {
        "op": "register", "job": service.cfg.job_id, "partition": 1, "host": "s1",
        "instance": "x" * 65}, 1), "127.0.0.1"))
    assert bad[0].flags & wire.Flags.NACK and "bad instance" in bad[1]["reason"]


def test_a_late_reply_to_an_earlier_try_is_accepted():
    """await_reply takes the answer to any try of the registration (one seq, every nonce)."""
    import socket

    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind(("127.0.0.1", 0))
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        first, n1 = handshake.request(KEY, 7, 40, {"op": "register"}, 1)
        _, n2 = handshake.request(KEY, 7, 40, {"op": "register"}, 1)
        late = handshake.reply(KEY, handshake.parse(first), {"op": "registered", "epoch": 3,
                                                             "token": 9})
        tx.sendto(late, rx.getsockname())
        m = handshake.await_reply(rx, 40, KEY, [n1, n2], 2.0)
        assert m is not None and m.body["epoch"] == 3
        tx.sendto(late, rx.getsockname())
        assert handshake.await_reply(rx, 40, KEY, [n2], 0.5) is None  # not this try's
    finally:
        rx.close()
        tx.close()


def test_shadows_started_on_a_loaded_machine_register_once_each(service):
    real_apply = service.driver.apply

    def slow_apply(plan):
        time.sleep(SLOW_WRITE)
        return real_apply(plan)

    service.driver.apply = slow_apply
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
               for _ in range(2 * (os.cpu_count() or 1))]
    clusters: list[Cluster] = []
    errors: list[BaseException] = []
    try:
        per_node = {p: {"host": h.name, "ip": h.ip, "mac": h.mac}
                    for p, h in ((p, service.cfg.shadow_for(p)) for p in (0, 1))}
        ctl = service.sock.getsockname()
        spec = ModelSpec.build(service.cfg.job_id, [("w", (200,)), ("v", (100,))], "adamw",
                               [{"params": ["w"], "lr": 0.01}, {"params": ["v"], "lr": 0.003}],
                               2)
        before = service.store.max_epoch

        def start(_: int) -> None:
            try:
                # One node per cluster object: the two shadows start at the same time.
                clusters.append(Cluster(spec, controller=ctl, per_node=per_node,
                                        register_deadline=60.0))
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        ts = [threading.Thread(target=start, args=(p,)) for p in range(2)]
        t0 = time.monotonic()
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        took = time.monotonic() - t0
        assert not errors, errors
        # 2 clusters x 2 partitions = 4 shadow starts; 4 new sessions, however many tries.
        assert service.store.max_epoch - before == 4, (service.store.max_epoch, before)
        assert service.stats["register_repeated"] >= 1, service.stats  # retries happened
        epochs = sorted(n.receiver.epoch for c in clusters for n in c.nodes)
        assert epochs == list(range(before + 1, before + 5)), epochs
        cur = service._session()["partitions"]
        last = {p: max((n for c in clusters for n in c.nodes if n.opts.partition == p),
                       key=lambda n: n.receiver.epoch) for p in (0, 1)}
        assert {p: cur[str(p)]["epoch"] for p in (0, 1)} == {
            p: n.receiver.epoch for p, n in last.items()}
        assert took < 60, took
    finally:
        for b in burners:
            b.kill()
        for b in burners:
            b.wait()
        for c in clusters:
            c.close()
