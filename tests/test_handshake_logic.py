"""Handshake service logic without root: the service programs a bmv2-target switch, which
here is the P4Runtime TEST DOUBLE of test_control_p4runtime.py (no bmv2 build exists on
this machine), over a real gRPC channel; requests arrive over a real UDP socket on
loopback."""

from __future__ import annotations

import socket
import threading
from dataclasses import replace

import pytest
from test_control_p4runtime import FakeSwitch, ip, load_p4info

from checkmate import config, handshake, wire
from checkmate.control.drivers.p4runtime import P4RuntimeDriver
from checkmate.control.p4rt_client import P4RuntimeClient
from checkmate.control.service import HandshakeService
from checkmate.control.sessions import SessionStore


@pytest.fixture
def switch():
    sw = FakeSwitch(load_p4info("v1model"))
    try:
        yield sw
    finally:
        sw.stop()


def make_service(sw: FakeSwitch, state, port: int = 0) -> HandshakeService:
    cfg = config.load(config.default_path())
    cfg = replace(cfg, switch=replace(cfg.switch, target="bmv2", address=sw.address))
    drv = P4RuntimeDriver(cfg, "v1model", P4RuntimeClient(sw.address, timeout=2))
    return HandshakeService(cfg, drv, SessionStore(state), bind_ip="127.0.0.1", port=port,
                            log=lambda msg: None)


def reg_body(partition=1, host="s1", port=47001) -> dict:
    return {"op": "register", "job": 7, "partition": partition, "host": host,
            "ip": f"10.77.0.{100 + partition}", "mac": f"02:00:0a:4d:00:{100 + partition:02x}",
            "port": port}


def rewrite_of(sw: FakeSwitch, rid: int) -> dict:
    for m, _, params in sw.table("shadow_rewrite"):
        if dict(m)["egress_rid"] == rid:
            return dict(params)
    raise AssertionError(f"no rewrite for rid {rid}")


def test_register_programs_switch_and_epochs_grow_across_restarts(switch, tmp_path):
    state = tmp_path / "state.json"
    svc = make_service(switch, state)
    svc.deploy()
    h, body = handshake.parse(svc.handle(handshake.request(7, 3, reg_body(port=47005), 1)))
    assert h.flags & wire.Flags.ACK and h.seq == 3
    assert body["epoch"] == 1 and h.token == body["token"]
    rw = rewrite_of(switch, 2)
    assert (rw["epoch"], rw["token"], rw["udp_port"], rw["ip"]) == (
        1, body["token"], 47005, ip("10.77.0.101"))
    n = len(switch.updates)
    _, again = handshake.parse(svc.handle(handshake.request(7, 4, reg_body(), 1)))
    assert again["epoch"] == 2
    assert len(switch.updates) == n + 1  # one MODIFY of the rewrite entry, nothing else
    svc.driver.close()
    # A restarted service continues above the largest epoch it ever handed out.
    svc2 = make_service(switch, state)
    _, third = handshake.parse(svc2.handle(handshake.request(7, 5, reg_body(0, "s0"), 0)))
    assert third["epoch"] == 3
    _, sess = handshake.parse(svc2.handle(handshake.request(7, 6, {"op": "session",
                                                                   "job": 7})))
    assert {p: d["epoch"] for p, d in sess["partitions"].items()} == {"0": 3, "1": 2}
    svc2.driver.close()


def test_failed_switch_write_is_nacked_and_not_stored(switch, tmp_path):
    state = tmp_path / "state.json"
    svc = make_service(switch, state)
    svc.deploy()
    switch.stop()
    svc.driver.close()  # next request reconnects, and finds nobody
    h, body = handshake.parse(svc.handle(handshake.request(7, 1, reg_body(), 1)))
    assert h.flags & wire.Flags.NACK and body["op"] == "error"
    assert "P4Runtime" in body["reason"]
    assert svc.store.max_epoch == 0 and not state.exists()


def test_garbage_and_replies_are_dropped_and_counted(switch, tmp_path):
    svc = make_service(switch, tmp_path / "s.json")
    assert svc.handle(b"\x00" * 10) is None
    assert svc.handle(wire.encode(wire.Header(job_id=7))) is None  # ckm, not handshake
    req_h = wire.decode_header(handshake.request(7, 1, {"op": "session"}))
    assert svc.handle(handshake.reply(req_h, {"op": "session"})) is None
    assert svc.stats["malformed"] == 2 and svc.stats["unexpected_reply"] == 1
    h, body = handshake.parse(svc.handle(handshake.request(7, 2, reg_body(host="nobody"), 1)))
    assert h.flags & wire.Flags.NACK and "nobody" in body["reason"]
    h, body = handshake.parse(svc.handle(handshake.request(
        7, 2, {**reg_body(), "mac": "zz"}, 1)))
    assert h.flags & wire.Flags.NACK and "bad mac" in body["reason"]
    h, body = handshake.parse(svc.handle(handshake.request(7, 3, reg_body(), 1), "10.0.0.9"))
    assert h.flags & wire.Flags.NACK and "sent from 10.0.0.9" in body["reason"]
    assert svc.store.max_epoch == 0
    # From loopback a local tool may register on a shadow's behalf.
    h, body = handshake.parse(svc.handle(handshake.request(7, 4, reg_body(), 1), "127.0.0.1"))
    assert h.flags & wire.Flags.ACK and body["epoch"] == 1
    svc.driver.close()


def test_serves_over_udp_until_stopped(switch, tmp_path):
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    svc = make_service(switch, tmp_path / "s.json", port=port)
    svc.bind()
    t = threading.Thread(target=svc.serve_forever, daemon=True)
    t.start()
    c = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    c.settimeout(5)
    try:
        body = reg_body(0, "s0")
        del body["ip"]  # defaults to the sender's address
        c.sendto(handshake.request(7, 42, body, 0), ("127.0.0.1", port))
        h, body = handshake.parse(c.recv(65535))
    finally:
        c.close()
        svc.close()
        t.join(timeout=5)
        svc.driver.close()
    assert not t.is_alive()
    assert h.seq == 42 and body["op"] == "registered" and body["epoch"] == 1
    rw = rewrite_of(switch, 1)
    assert rw["epoch"] == 1 and rw["ip"] == ip("127.0.0.1")
