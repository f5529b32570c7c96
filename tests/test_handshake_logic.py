"""Handshake service logic without root: the service programs a bmv2-target switch, which
here is the P4Runtime TEST DOUBLE of tests/fakes.py (no bmv2 build exists on
this machine), over a real gRPC channel; requests arrive over a real UDP socket on
loopback."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from fakes import ip
from handshake_service import KEY, answer, make_service, reg_body, req, rewrite_of

from checkmate.protocol import auth, handshake, wire


def test_register_programs_switch_and_epochs_grow_across_restarts(switch, tmp_path):
    state = tmp_path / "state.json"
    svc = make_service(switch, state)
    svc.deploy()
    h, body = answer(svc.handle(req(7, 3, reg_body(port=47005), 1)))
    assert h.flags & wire.Flags.ACK and h.seq == 3
    assert body["epoch"] == 1 and h.token == body["token"]
    rw = rewrite_of(switch, 2)
    assert (rw["epoch"], rw["token"], rw["udp_port"], rw["ip"]) == (
        1, body["token"], 47005, ip("10.77.0.101"))
    n = len(switch.updates)
    _, again = answer(svc.handle(req(7, 4, reg_body(), 1)))
    assert again["epoch"] == 2
    assert len(switch.updates) == n + 1  # one MODIFY of the rewrite entry, nothing else
    svc.driver.close()
    # A restarted service continues above the largest epoch it ever handed out.
    svc2 = make_service(switch, state)
    _, third = answer(svc2.handle(req(7, 5, reg_body(0, "s0"), 0)))
    assert third["epoch"] == 3
    _, sess = answer(svc2.handle(req(7, 6, {"op": "session",
                                                                   "job": 7})))
    assert {p: d["epoch"] for p, d in sess["partitions"].items()} == {"0": 3, "1": 2}
    svc2.driver.close()


def test_failed_switch_write_is_nacked_and_not_stored(switch, tmp_path):
    state = tmp_path / "state.json"
    svc = make_service(switch, state)
    svc.deploy()
    switch.stop()
    svc.driver.close()  # next request reconnects, and finds nobody
    h, body = answer(svc.handle(req(7, 1, reg_body(), 1)))
    assert h.flags & wire.Flags.NACK and body["op"] == "error"
    assert "P4Runtime" in body["reason"]
    assert svc.store.max_epoch == 0 and not state.exists()


def test_garbage_and_replies_are_dropped_and_counted(switch, tmp_path):
    svc = make_service(switch, tmp_path / "s.json")
    assert svc.handle(b"\x00" * 10) is None
    assert svc.handle(wire.encode(wire.Header(job_id=7))) is None  # ckm, not handshake
    q = handshake.parse(req(7, 1, {"op": "session"}))
    assert svc.handle(handshake.reply(KEY, q, {"op": "session"})) is None
    assert svc.stats["malformed"] == 2 and svc.stats["unexpected_reply"] == 1
    h, body = answer(svc.handle(req(7, 2, reg_body(host="nobody"), 1)))
    assert h.flags & wire.Flags.NACK and "nobody" in body["reason"]
    h, body = answer(svc.handle(req(
        7, 2, {**reg_body(), "mac": "zz"}, 1)))
    assert h.flags & wire.Flags.NACK and "bad mac" in body["reason"]
    h, body = answer(svc.handle(req(7, 3, reg_body(), 1), "10.0.0.9"))
    assert h.flags & wire.Flags.NACK and "sent from 10.0.0.9" in body["reason"]
    assert svc.store.max_epoch == 0
    # From loopback a local tool may register on a shadow's behalf.
    h, body = answer(svc.handle(req(7, 4, reg_body(), 1), "127.0.0.1"))
    assert h.flags & wire.Flags.ACK and body["epoch"] == 1
    svc.driver.close()


def test_register_cannot_repoint_copies_to_another_mac(switch, tmp_path):
    """Even with the secret, a register naming another MAC than the shadow's configured one
    is refused: the switch binds the shadow's port to that MAC (a copy addressed elsewhere
    would go nowhere), and the source address it comes from is the switch's to verify."""
    svc = make_service(switch, tmp_path / "s.json")
    svc.deploy()
    h, body = answer(svc.handle(req(7, 2, {**reg_body(), "mac": "02:00:0a:4d:00:0c"}, 1),
                                "10.77.0.101"))
    assert h.flags & wire.Flags.NACK and "s1's MAC is 02:00:0a:4d:00:65" in body["reason"]
    assert svc.store.max_epoch == 0 and svc.stats["refused"] == 1
    h, body = answer(svc.handle(req(7, 3, {**reg_body(), "mac": "02:00:0A:4D:00:65"}, 1),
                                "10.77.0.101"))
    assert h.flags & wire.Flags.ACK and body["epoch"] == 1  # the same MAC, any case
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
        c.sendto(req(7, 42, body, 0), ("127.0.0.1", port))
        h, body = answer(c.recv(65535))
    finally:
        c.close()
        svc.close()
        t.join(timeout=5)
        svc.driver.close()
    assert not t.is_alive()
    assert h.seq == 42 and body["op"] == "registered" and body["epoch"] == 1
    rw = rewrite_of(switch, 1)
    assert rw["epoch"] == 1 and rw["ip"] == ip("10.77.0.100")  # s0's configured address


# ----- authentication -----------------------------------------------------------------------
def test_requests_without_the_job_secret_learn_nothing_and_are_counted(switch, tmp_path):
    svc = make_service(switch, tmp_path / "s.json")
    svc.deploy()
    _, ok = answer(svc.handle(req(7, 1, reg_body(), 1), "127.0.0.1"))
    assert ok["op"] == "registered"
    stranger = auth.handshake_key(bytes(32))
    for body, part in ((reg_body(), 1), ({"op": "session", "job": 7}, 0),
                       ({"op": "session", "job": 99}, 0)):
        m = handshake.parse(svc.handle(req(7, 2, body, part, key=stranger), "127.0.0.1"))
        assert m.header.flags & wire.Flags.NACK and m.mac == handshake.NO_MAC
        # no job id, epoch, token or reason beyond "not authenticated"
        assert m.body == {"op": "error", "reason": "not authenticated"}
        assert (m.header.job_id, m.header.epoch, m.header.token) == (0, 0, 0)
    assert svc.stats["unauthenticated"] == 3 and svc.store.max_epoch == 1
    svc.driver.close()


def test_a_replayed_or_stale_request_is_refused(switch, tmp_path, monkeypatch):
    svc = make_service(switch, tmp_path / "s.json")
    svc.deploy()
    captured = req(7, 1, reg_body(), 1)
    _, first = answer(svc.handle(captured, "127.0.0.1"))
    assert first["epoch"] == 1
    replay = handshake.parse(svc.handle(captured, "127.0.0.1"))
    assert replay.header.flags & wire.Flags.NACK and replay.mac == handshake.NO_MAC
    monkeypatch.setattr(auth, "now_ms", lambda: int((time.time() - 120) * 1000))
    stale = handshake.parse(svc.handle(req(7, 2, reg_body(), 1), "127.0.0.1"))
    assert stale.header.flags & wire.Flags.NACK and stale.mac == handshake.NO_MAC
    assert svc.stats["unauthenticated"] == 2 and svc.store.max_epoch == 1
    svc.driver.close()


def test_a_partition_is_registered_only_by_its_configured_shadow(switch, tmp_path):
    svc = make_service(switch, tmp_path / "s.json")
    svc.deploy()
    h, body = answer(svc.handle(req(7, 1, reg_body(1, "s0"), 1), "127.0.0.1"))
    assert h.flags & wire.Flags.NACK and "belongs to s1" in body["reason"]
    h, body = answer(svc.handle(req(7, 2, {**reg_body(), "ip": "10.77.0.50"}, 1),
                                "127.0.0.1"))
    assert h.flags & wire.Flags.NACK and "s1 is at 10.77.0.101" in body["reason"]
    # a trainer host (t1 = 10.77.0.11) asking for s1's partition from its own address
    h, body = answer(svc.handle(req(7, 3, reg_body(), 1), "10.77.0.11"))
    assert h.flags & wire.Flags.NACK and "sent from 10.77.0.11" in body["reason"]
    assert svc.store.max_epoch == 0 and svc.stats["refused"] == 3
    _, ok = answer(svc.handle(req(7, 4, reg_body(), 1), "10.77.0.101"))
    assert ok["epoch"] == 1
    svc.driver.close()


def test_a_reply_verifies_only_against_its_own_request(switch, tmp_path):
    svc = make_service(switch, tmp_path / "s.json")
    svc.deploy()
    data, nonce = handshake.request(KEY, 7, 5, {"op": "session", "job": 7})
    rep = svc.handle(data, "127.0.0.1")
    assert handshake.verify_reply(KEY, handshake.parse(rep), nonce)
    assert not handshake.verify_reply(KEY, handshake.parse(rep), auth.new_nonce())
    assert not handshake.verify_reply(auth.handshake_key(bytes(32)), handshake.parse(rep),
                                      nonce)
    m = handshake.parse(rep)  # a changed body
    m.raw = m.raw.replace(b"session", b"sessioN")
    assert not handshake.verify_reply(KEY, m, nonce)
    svc.driver.close()


def test_the_replay_guard_stays_bounded():
    g = auth.ReplayGuard(skew=30, cap=4)
    now = time.time()
    for i in range(4):
        g.check(f"{i:032x}", int(now * 1000), now)
    with pytest.raises(auth.AuthError, match="too many"):
        g.check("f" * 32, int(now * 1000), now)
    # a minute later the old nonces have left the window and make room
    later = now + 61
    g.check("e" * 32, int(later * 1000), later)
    assert len(g._seen) == 1
    with pytest.raises(auth.AuthError, match="replayed"):
        g.check("e" * 32, int(later * 1000), later)
