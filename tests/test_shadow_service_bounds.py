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
from checkmate.shadow import gate
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
    monkeypatch.setattr(gate, "AUTH_SECONDS", 0.5)
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


def _from(n: ShadowNode, source: str, timeout: float = 5) -> socket.socket:
    """A TCP connection to the node from loopback address ``source``."""
    s = socket.socket()
    s.settimeout(timeout)
    s.bind((source, 0))
    s.connect(("127.0.0.1", n.tcp_port))
    return s


def _status_from(n: ShadowNode, source: str) -> dict:
    """A real client's status request from ``source``: ShadowClient's handshake (its proof
    checked) on a socket bound there."""
    s = _from(n, source)
    try:
        hello, _ = recv_frame(s, 0, 4096)
        key = auth.service_key(auth.load_secret())
        nonce = auth.new_nonce()
        send_frame(s, {"op": "auth", "nonce": nonce,
                       "proof": auth.client_proof(key, hello["challenge"], nonce)})
        reply, _ = recv_frame(s, 0, 4096)
        assert reply.get("ok"), reply
        assert auth.same(reply["proof"], auth.server_proof(key, hello["challenge"], nonce))
        send_frame(s, {"op": "status"})
        status, _ = recv_frame(s)
        return status
    finally:
        s.close()


def _threads_settle_to(limit: int, within: float = 3.0) -> None:
    """Assert this process's thread count falls to ``limit`` within ``within`` seconds: a
    served client's handler exits when it reads the client's close, which a loaded machine
    may schedule a moment after the next client connects; a thread per flooding connection
    would never settle."""
    deadline = time.monotonic() + within
    while threading.active_count() > limit:
        assert time.monotonic() < deadline, [t.name for t in threading.enumerate()]
        time.sleep(0.02)


def test_a_flood_from_one_source_displaces_only_itself(node, monkeypatch):
    """60 connections from 127.0.0.1 that never authenticate: only the newest
    PER_SOURCE_PENDING stay open, the older ones are closed and counted, no thread is
    started for any of them, and a client from 127.0.0.2 is served at once."""
    monkeypatch.setattr(gate, "AUTH_SECONDS", 30.0)
    base = threading.active_count()
    held = [_from(node, "127.0.0.1") for _ in range(60)]
    t0 = time.monotonic()
    assert _status_from(node, "127.0.0.2")["partition"] == 0
    assert time.monotonic() - t0 < 2
    closed = [s for s in held if _closed(s, 0.5)]
    assert len(closed) == 60 - gate.PER_SOURCE_PENDING
    assert _drops(node)["tcp_evicted"] == 60 - gate.PER_SOURCE_PENDING
    assert threading.active_count() <= base + 1  # the served client's thread at most
    assert node.status()["tcp_service"]["authenticating"] == gate.PER_SOURCE_PENDING
    for s in held:
        s.close()


def test_clients_are_served_while_a_flood_from_other_sources_reconnects(node, monkeypatch):
    """The issue's starvation: attackers on 40 addresses (more slots than the service has)
    keep reconnecting as fast as they can, half of them sending a partial header and
    stalling, the other half nothing. Every one of 10 real clients from another address is
    served within 2 s; threads and memory stay flat."""
    monkeypatch.setattr(gate, "AUTH_SECONDS", 30.0)
    sources = [f"127.0.1.{i}" for i in range(1, 41)]
    stop = threading.Event()
    opened = [0]
    half = struct.pack("!I", 4000) + b'{"op": "auth", "nonce": "'

    def flood(srcs: list[str]) -> None:
        held: list[socket.socket] = []
        while not stop.is_set():
            for i, src in enumerate(srcs):
                try:
                    s = _from(node, src, 1)
                    if i % 2:
                        s.sendall(half)
                    held.append(s)
                    opened[0] += 1
                except OSError:
                    pass
            while len(held) > 2 * len(srcs) * gate.PER_SOURCE_PENDING:
                held.pop(0).close()
        for s in held:
            s.close()

    floods = [threading.Thread(target=flood, args=(sources[i::2],), daemon=True)
              for i in range(2)]
    base = threading.active_count() + len(floods)
    rss = _rss()
    for t in floods:
        t.start()
    try:
        deadline = time.monotonic() + 10
        while _drops(node).get("tcp_evicted", 0) < 100:  # every slot taken, and then some
            assert time.monotonic() < deadline, _drops(node)
            time.sleep(0.1)
        waits = []
        for _ in range(10):
            t0 = time.monotonic()
            assert _status_from(node, "127.0.0.2")["partition"] == 0
            waits.append(time.monotonic() - t0)
            _threads_settle_to(base + 1)  # the served client's thread at most, none per attacker
        assert max(waits) < 2, waits
        assert node.status()["tcp_service"]["authenticating"] <= gate.MAX_PENDING
        assert _rss() - rss < 32 << 20
    finally:
        stop.set()
        for t in floods:
            t.join(10)
    assert opened[0] > gate.MAX_PENDING
    assert node.status()["tcp_service"]["alive"]


def test_authenticated_connections_beyond_the_cap_are_told_busy(node, monkeypatch):
    monkeypatch.setattr(service_mod, "MAX_CONNECTIONS", 3)
    held = [ShadowClient(("127.0.0.1", node.tcp_port)) for _ in range(3)]
    for c in held:
        assert c.status()["partition"] == 0  # connected, and kept open
    with ShadowClient(("127.0.0.1", node.tcp_port)) as extra, \
            pytest.raises(ShadowError, match="busy"):
        extra.status()
    assert _drops(node)["tcp_conn_cap"] >= 1
    held[0].close()
    deadline = time.monotonic() + 5
    while True:  # a freed slot is taken by the next client
        try:
            with ShadowClient(("127.0.0.1", node.tcp_port)) as c:
                assert c.status()["partition"] == 0
            break
        except ShadowError:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    for c in held[1:]:
        c.close()


def test_stalled_authenticated_frames_pin_what_they_sent_not_what_they_announced(node):
    """The issue's 8 stalled connections announcing 64 MiB headers pinned 512 MB: now a
    header's buffer grows with the bytes that arrive."""
    before = _rss()
    clients = []
    for _ in range(8):
        c = ShadowClient(("127.0.0.1", node.tcp_port))
        c._sock = c._connect()
        c._sock.sendall(struct.pack("!I", 64 << 20) + b'{"op": "status", "x": "' + b"a" * 1000)
        clients.append(c)
    time.sleep(0.5)
    assert _rss() - before < 32 << 20
    for c in clients:
        c.close()
    with ShadowClient(("127.0.0.1", node.tcp_port)) as c:
        assert c.status()["partition"] == 0


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


def test_a_failing_gate_loop_is_restarted_counted_and_shown(node, monkeypatch):
    """A bug in the authentication loop (here: the first accept after the patch raises)
    must not leave a silently dead door: the loop restarts, status says so, and clients are
    served again."""
    real = gate.Gate._accept
    calls = [0]

    def broken(self):
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("injected")
        return real(self)

    monkeypatch.setattr(gate.Gate, "_accept", broken)
    # the connection that met the bug waits in the backlog for the restarted loop
    with ShadowClient(("127.0.0.1", node.tcp_port), timeout=10) as c:
        assert c.status()["partition"] == 0
    svc = node.status()["tcp_service"]
    assert svc["alive"] and svc["restarts"] == 1 and "RuntimeError: injected" in svc["error"]
    assert _drops(node)["tcp_gate_restarts"] == 1
    with ShadowClient(("127.0.0.1", node.tcp_port)) as c:
        assert c.status()["tcp_service"]["restarts"] == 1


# ----- refused means unchanged (issue 35 item 4) --------------------------------------
RUN_A, RUN_B = "a" * 32, "b" * 32


def _state(n: ShadowNode, c: ShadowClient) -> dict:
    """Everything a request could change: what status says and the node's own state."""
    st = c.status()
    spec = c.request({"op": "spec"})[0]["spec"] if n.state.spec is not None else None
    seed = n.state._seed
    return {**{k: st[k] for k in ("job", "range", "seeded", "seeded_iteration", "latest",
                                  "retained", "committed", "pending", "epoch", "run",
                                  "peers", "reseed")},
            "spec": spec, "node_run": n.run, "node_peers": n._peers,
            "trainers": list(n.repair.trainers), "owners": list(n.repair.owners),
            "reseed_pending": n.state._reseed_pending, "reseed_obj": n.state.reseed,
            "seed_part": None if seed is None else (seed["iteration"], seed["step"], {
                s: cov.total for s, cov in seed["cov"].items()}),
            "mac_key": n.receiver.mac_key, "control_key": n.state.control_key}


def _refused(n: ShadowNode, c: ShadowClient, header: dict, payload: bytes = b"",
             match: str = "") -> None:
    before = _state(n, c)
    count = n.drops["tcp_refused"] + n.drops["tcp_malformed"]  # the latter closes
    with pytest.raises(ShadowError, match=match):
        c.request(header, payload)
    # every refusal counted, once
    assert n.drops["tcp_refused"] + n.drops["tcp_malformed"] == count + 1, header
    assert _state(n, c) == before, header


def _spec2(partitions: int = 1) -> ModelSpec:
    return ModelSpec.build(JOB, [("w", (8, 8))], "adamw",
                           [{"params": ["w"], "lr": 1e-3, "weight_decay": 0.0}], partitions)


def test_every_refused_request_before_the_spec_changes_nothing():
    n = ShadowNode(NodeOptions(partition=0, partitions=1, job=JOB, bind="127.0.0.1", port=0,
                               restore_bind="127.0.0.1", restore_port=0)).start()
    try:
        with ShadowClient(("127.0.0.1", n.tcp_port)) as c:
            spec = _spec2().to_json()
            _refused(n, c, {"op": "reseed", "reason": "x"}, match="needs 'spec'")
            # before: the spec was set, then the bad iteration refused
            _refused(n, c, {"op": "reseed", "spec": spec, "iteration": "3"}, match="integer")
            _refused(n, c, {"op": "reseed", "spec": spec, "iteration": -1}, match=">= 0")
            _refused(n, c, {"op": "spec", "spec": _spec2(partitions=2).to_json()},
                     match="partitions")
            _refused(n, c, {"op": "seed", "iteration": 0, "slot": "param", "offset": 0,
                            "count": 1, "step": 0, "nbytes": 0}, match="no spec")
            _refused(n, c, {"op": "reseed_piece", "iteration": 0, "step": 0, "offset": 0,
                            "count": 1, "slots": ["param"]}, match="no spec")
            _refused(n, c, {"op": "peers", "trainers": [["127.0.0.1", 9]], "run": "A" * 32},
                     match="run")
            _refused(n, c, {"op": "peers", "trainers": [["127.0.0.1", 9]], "run": RUN_A,
                            "control": 1}, match="control rank")
            assert n.state.spec is None and n.run == ""
    finally:
        n.stop()


def test_every_refused_request_of_a_running_shadow_changes_nothing(node):
    """A seeded shadow with peers and run A: each state-changing request, refused, leaves
    it exactly as it was and is counted ``tcp_refused``. Before, a refused ``peers`` had
    already switched the run keys (and dropped what was being assembled) while status
    still said ``peers: true``, and a refused ``reseed`` had set its spec."""
    import numpy as np

    from checkmate.train.repair import owners_body
    from checkmate.train.shadow_client import seed_share

    spec = node.state.spec
    flat = {s: np.zeros(spec.total, np.float32) for s in spec.slots}
    addr = ("127.0.0.1", node.tcp_port)
    seed_share([addr], spec, flat, 0, 1)
    with ShadowClient(addr) as c:
        c.request(owners_body([("127.0.0.1", 9)], [(0, spec.total, 0)], 0, RUN_A))
        st = c.status()
        assert st["run"] == RUN_A and st["peers"] and st["seeded"]
        good = owners_body([("127.0.0.1", 9)], [(0, spec.total, 0)], 0, RUN_B)
        for bad, why in (({"owners": [[0, spec.total + 1, 0]]}, "owner range"),
                         ({"trainers": [["no-ip", 9]]}, "trainer address"),
                         ({"trainers": []}, "trainers"), ({"control": 5}, "control rank"),
                         ({"control": True}, "control rank"), ({"run": "B" * 32}, "run")):
            _refused(node, c, {**good, **bad}, match=why)
        _refused(node, c, {"op": "reseed"}, match="needs 'spec'")
        _refused(node, c, {"op": "reseed", "spec": _spec2().to_json()}, match="different")
        _refused(node, c, {"op": "reseed", "spec": spec.to_json(), "iteration": None},
                 match="integer")
        _refused(node, c, {"op": "spec", "spec": _spec2().to_json()}, match="different")
        seed = {"op": "seed", "iteration": 5, "slot": "param", "offset": 0, "count": 2,
                "step": 5}
        _refused(node, c, {**seed, "slot": "nope"}, b"\0" * 8, match="unknown slot")
        _refused(node, c, {**seed, "offset": spec.total - 1}, b"\0" * 8, match="outside")
        _refused(node, c, {**seed, "buffers": [1]}, b"\0" * 8, match="objects")
        _refused(node, c, {**seed, "step": -1}, b"\0" * 8, match=">= 0")
        piece = {"op": "reseed_piece", "iteration": 7, "step": 7, "offset": 0, "count": 2,
                 "slots": list(spec.slots)}
        data = b"\0" * 8 * len(spec.slots)
        _refused(node, c, piece, data, match="no re-seed")  # none asked for
        c.request({"op": "reseed", "spec": spec.to_json(), "reason": "test"})  # pending
        assert node.state._reseed_pending == "test"
        # before: a bad first piece began the re-seed at its iteration, then was refused
        _refused(node, c, {**piece, "step": -1}, data, match=">= 0")
        _refused(node, c, {**piece, "offset": spec.total - 1}, data, match="outside")
        _refused(node, c, {**piece, "slots": ["param"]}, b"\0" * 8, match="slots")
        _refused(node, c, {"op": "status", "progress": -1}, match="progress")
        _refused(node, c, {"op": "session"}, match="no controller")
        _refused(node, c, {"op": "fetch", "iteration": 99}, match="not retained")
        _refused(node, c, {"op": "frobnicate"}, match="unknown op")
        assert node.state._reseed_pending == "test" and node.state.reseed is None
        assert c.status()["run"] == RUN_A


def test_a_malformed_frame_after_authenticating_is_counted(node):
    with ShadowClient(("127.0.0.1", node.tcp_port)) as c:
        c.status()
        before = node.drops["tcp_malformed"]
        s = c._sock
        body = b"[1, 2]"  # JSON, not an object
        s.sendall(struct.pack(">I", len(body)) + body)
        assert _closed(s)
    assert node.drops["tcp_malformed"] == before + 1
