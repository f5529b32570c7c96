"""ckm sockets put their datagrams in the lossless class: DSCP 24 in the IPv4 header.

Checked on loopback with IP_RECVTOS, which hands the receiver the TOS byte each datagram
arrived with, for every socket that sends ckm datagrams from trainers and shadows.
"""

from __future__ import annotations

import socket

import pytest

from checkmate.control import pfc
from checkmate.control import plan as plan_mod
from checkmate.protocol import wire


@pytest.fixture
def receiver():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.IPPROTO_IP, socket.IP_RECVTOS, 1)
    s.bind(("127.0.0.1", 0))
    s.settimeout(5)
    yield s
    s.close()


def tos_of_next(sock: socket.socket) -> int:
    _, anc, _, _ = sock.recvmsg(65536, socket.CMSG_SPACE(4))
    ((level, kind, data),) = anc
    assert (level, kind) == (socket.IPPROTO_IP, socket.IP_TOS)
    return data[0]


def _datagram() -> bytes:
    return wire.encode(wire.Header(flags=wire.Flags.ACK, job_id=7, seq=1))


def test_constants():
    assert pfc.CKM_TOS == 0x60 and pfc.CKM_TOS >> 2 == pfc.CKM_DSCP == 24


def test_trainer_ring_socket_marks_ckm(receiver):
    from checkmate.train.transport import open_socket

    s = open_socket("127.0.0.1", 0)
    try:
        s.setblocking(True)
        s.sendto(_datagram(), receiver.getsockname())
    finally:
        s.close()
    assert tos_of_next(receiver) == pfc.CKM_TOS


def test_trainer_shadow_sender_marks_ckm(receiver):
    from checkmate.train.replicate import ShadowSender

    sender = ShadowSender(7, [])
    try:
        sender.sock.sendto(_datagram(), receiver.getsockname())
    finally:
        sender.close()
    assert tos_of_next(receiver) == pfc.CKM_TOS


def test_shadow_receiver_socket_marks_its_acks(receiver):
    from checkmate.shadow.receiver import open_socket

    s, _ = open_socket("127.0.0.1", 0)
    try:
        s.sendto(_datagram(), receiver.getsockname())
    finally:
        s.close()
    assert tos_of_next(receiver) == pfc.CKM_TOS


def test_trainer_repair_answers_mark_ckm(receiver):
    from checkmate.train.repair import RepairServer
    from checkmate.train.replica_log import ReplicaLog

    srv = RepairServer(("127.0.0.1", 0), 7, ReplicaLog(2), {})
    try:
        srv.sock.sendto(_datagram(), receiver.getsockname())
    finally:
        srv.close()
    assert tos_of_next(receiver) == pfc.CKM_TOS


def test_trainer_session_query_marks_ckm(receiver):
    """query_sessions (switch mode) asks the controller over the ckm class too."""
    from checkmate.errors import CheckmateError
    from checkmate.train.layout import query_sessions

    with pytest.raises(CheckmateError, match="did not answer"):
        query_sessions(receiver.getsockname(), 7, timeout=0.2, tries=1,
                       secret=bytes(32))
    assert tos_of_next(receiver) == pfc.CKM_TOS


def test_unmarked_socket_is_not_ckm_class(receiver):
    """The check can fail: a plain socket arrives with TOS 0."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.sendto(_datagram(), receiver.getsockname())
    assert tos_of_next(receiver) == 0


def test_host_commands_map_the_marked_dscp_to_the_pfc_priority():
    from checkmate.config import cluster as config

    cfg = config.load(config.default_path())
    cmds = plan_mod.host_commands(cfg)
    want = f"dscp-prio {pfc.CKM_TOS >> 2}:{pfc.CKM_PRIORITY}"
    for h in cfg.hosts:
        mine = [c for c in cmds if c.startswith(f"{h.name}: ")]
        assert any(want in c for c in mine), h.name
        assert any(f"prio-pfc all:off {pfc.CKM_PRIORITY}:on" in c for c in mine)
        assert any("--trust dscp" in c for c in mine)
