"""The shadow's TCP service against peers without the job secret and against hostile ones:
a real ShadowNode on loopback, real sockets. Nothing may be said before authenticating,
and idle, oversized, nested and numerous connections leave threads and memory flat."""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
import time

import pytest

from checkmate.protocol import auth
from checkmate.protocol.frames import ShadowError, recv_frame, send_frame
from checkmate.shadow import service as service_mod
from checkmate.shadow.node import NodeOptions, ShadowNode
from checkmate.spec.model import ModelSpec
from checkmate.train.shadow_client import ShadowClient

JOB = 7


@pytest.fixture
def node():
    n = ShadowNode(NodeOptions(partition=0, partitions=1, job=JOB, bind="127.0.0.1", port=0,
                               restore_bind="127.0.0.1", restore_port=0)).start()
    spec = ModelSpec.build(JOB, [("w", (64, 64))], "adamw",
                           [{"params": ["w"], "lr": 1e-3, "weight_decay": 0.0}], 1)
    with ShadowClient(("127.0.0.1", n.tcp_port)) as c:
        c.send_spec(spec)
    try:
        yield n
    finally:
        n.stop()


def _raw(n: ShadowNode) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", n.tcp_port), timeout=5)
    hello, _ = recv_frame(s, 0, 4096)
    assert isinstance(hello.get("challenge"), str)
    return s


def _closed(s: socket.socket, timeout: float = 5.0) -> bool:
    """True once the shadow closed ``s`` (reads EOF), after any refusal it sent."""
    s.settimeout(timeout)
    try:
        while s.recv(65536):
            pass
        return True
    except (TimeoutError, OSError):
        return False


def _rss() -> int:
    """Resident bytes of this process (the node runs in it)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _drops(n: ShadowNode) -> dict:
    return dict(n.drops)


def test_a_request_before_authenticating_is_refused_counted_and_closed(node):
    s = _raw(node)
    send_frame(s, {"op": "status"})
    reply, _ = recv_frame(s)
    assert reply == {"ok": False, "error": "not authenticated", "nbytes": 0}
    assert _closed(s)
    s.close()
    assert _drops(node)["tcp_unauthenticated"] == 1


def test_a_client_with_another_secret_is_refused_and_learns_nothing(node):
    with ShadowClient(("127.0.0.1", node.tcp_port), secret=bytes(32)) as c, \
            pytest.raises(ShadowError, match="refused the connection: not authenticated"):
        c.status()
    # and a "shadow" that cannot prove the secret is not believed by a client
    fake = socket.socket()
    fake.bind(("127.0.0.1", 0))
    fake.listen(1)

    def impostor() -> None:
        conn, _ = fake.accept()
        send_frame(conn, {"ok": True, "challenge": auth.new_nonce()})
        recv_frame(conn)
        send_frame(conn, {"ok": True, "proof": "0" * 64})
        time.sleep(0.5)
        conn.close()
    t = threading.Thread(target=impostor, daemon=True)
    t.start()
    with ShadowClient(fake.getsockname()) as c, \
            pytest.raises(ShadowError, match="could not prove it holds the job secret"):
        c.status()
    t.join(5)
    fake.close()
    assert _drops(node)["tcp_unauthenticated"] == 1


def test_silent_and_trickling_peers_are_cut_off(node, monkeypatch):
    monkeypatch.setattr(service_mod, "AUTH_SECONDS", 0.5)
    silent = _raw(node)
    trickle = _raw(node)
    body = json.dumps({"op": "auth", "nonce": "a" * 32, "proof": "b" * 64}).encode()
    trickle.sendall(struct.pack("!I", len(body)))
    t0 = time.monotonic()
    for b in body[:20]:  # one byte every 0.1 s: each read succeeds, the frame never ends
        try:
            trickle.sendall(bytes([b]))
        except OSError:
            break
        time.sleep(0.1)
    assert _closed(silent) and _closed(trickle)
    assert time.monotonic() - t0 < 4
    assert _drops(node)["tcp_unauthenticated"] == 2
    silent.close()
    trickle.close()


def test_connections_beyond_the_cap_are_closed_and_threads_stay_flat(node, monkeypatch):
    monkeypatch.setattr(service_mod, "AUTH_SECONDS", 30.0)
    base = threading.active_count()
    held = [_raw(node) for _ in range(service_mod.MAX_CONNECTIONS)]
    extra = []
    for _ in range(20):
        s = socket.create_connection(("127.0.0.1", node.tcp_port), timeout=5)
        extra.append(s)
    assert all(_closed(s) for s in extra)  # closed without a challenge
    assert threading.active_count() <= base + service_mod.MAX_CONNECTIONS
    assert _drops(node)["tcp_conn_cap"] == 20
    for s in held + extra:
        s.close()
    # once they are gone, a real client gets in again
    deadline = time.monotonic() + 5
    while True:
        try:
            with ShadowClient(("127.0.0.1", node.tcp_port)) as c:
                assert c.status()["partition"] == 0
            break
        except ShadowError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_announced_payloads_beyond_what_the_partition_needs_allocate_nothing(node):
    before = _rss()
    socks = []
    for _ in range(4):  # as in the issue: 4 connections announcing 256 MiB each
        s = _raw(node)
        socks.append(s)
        send_frame(s, {"op": "seed", "iteration": 0, "slot": "param", "offset": 0,
                       "count": 64 << 20, "step": 0, "nbytes": 256 << 20})
        reply, _ = recv_frame(s)
        assert reply["ok"] is False and "not authenticated" in reply["error"]
    c = ShadowClient(("127.0.0.1", node.tcp_port))
    c._sock = c._connect()
    head = {"op": "seed", "iteration": 0, "slot": "param", "offset": 0, "count": 64 << 20,
            "step": 0}
    text = json.dumps({**head, "nbytes": 256 << 20}).encode()
    c._sock.sendall(struct.pack("!I", len(text)) + text)  # the header alone, no payload
    reply, _ = recv_frame(c._sock)
    assert reply["ok"] is False and "exceeds the 16384 byte limit for 'seed'" in reply["error"]
    c.close()
    assert _rss() - before < 32 << 20
    for s in socks:
        s.close()


def test_nested_json_headers_are_refused_and_the_service_lives_on(node):
    deep = ("[" * 5000 + "]" * 5000).encode()
    s = _raw(node)
    s.sendall(struct.pack("!I", len(deep[:4000])) + deep[:4000])
    assert _closed(s)
    s.close()
    c = ShadowClient(("127.0.0.1", node.tcp_port))
    c._sock = c._connect()
    text = b'{"op": "status", "x": ' + b"[" * 100000 + b"]" * 100000 + b"}"
    c._sock.sendall(struct.pack("!I", len(text)) + text)
    reply, _ = recv_frame(c._sock)
    assert reply["ok"] is False and "nested too deeply" in reply["error"]
    c.close()
    with ShadowClient(("127.0.0.1", node.tcp_port)) as c2:
        assert c2.status()["partition"] == 0
