"""The protection monitor: one poller at a time on its shadow connections (finish() polls
from the training thread while the monitor's own thread may be polling)."""

from __future__ import annotations

import select
import socket
import threading
import time
from types import SimpleNamespace

from checkmate.protocol import auth
from checkmate.protocol.frames import recv_frame, send_frame
from checkmate.train.protection import ProtectionMonitor


def _status_server(sock: socket.socket, seen: dict) -> None:
    """Answer status requests on one connection, slowly, noting whether a second request
    arrived while one was still unanswered. Authenticates the client as a shadow does;
    models nothing else of the shadow's service."""
    conn, _ = sock.accept()
    with conn:
        key = auth.service_key(auth.load_secret())
        challenge = auth.new_nonce()
        send_frame(conn, {"ok": True, "challenge": challenge})
        hello, _ = recv_frame(conn)
        assert auth.same(hello["proof"], auth.client_proof(key, challenge, hello["nonce"]))
        send_frame(conn, {"ok": True, "proof": auth.server_proof(key, challenge,
                                                                 hello["nonce"])})
        while True:
            try:
                header, _ = recv_frame(conn)
            except Exception:  # noqa: BLE001 - the client went away or sent garbage
                return
            seen["requests"] += 1
            time.sleep(0.05)
            if select.select([conn], [], [], 0)[0]:
                seen["overlaps"] += 1
            send_frame(conn, {"ok": True, "latest": 5, "seeded": True, "peers": True,
                              "reseed": {}, "state_check": {"verified_iteration": 4,
                                                            "diverged": ""}}, b"")


def test_concurrent_polls_never_share_a_connection():
    srv = socket.create_server(("127.0.0.1", 0))
    seen = {"requests": 0, "overlaps": 0}
    t = threading.Thread(target=_status_server, args=(srv, seen), daemon=True)
    t.start()
    lay = SimpleNamespace(rank=0, world=1, shadow_tcp=[srv.getsockname()],
                          tcp_sets=[[srv.getsockname()]])
    sess = SimpleNamespace(layout=lay, done_iteration=5, model=None)
    mon = ProtectionMonitor(sess, poll=60.0, lag_warn=4)  # its own thread is not started
    pollers = [threading.Thread(target=mon.poll_once) for _ in range(4)]
    for p in pollers:
        p.start()
    for p in pollers:
        p.join(10)
    mon.close()
    srv.close()
    assert seen["requests"] == 4
    assert seen["overlaps"] == 0
    assert mon.views[0].reachable and mon.views[0].latest == 5
    got = mon.protection()
    assert got["verified"] == 4 and got["shadows"][0]["diverged"] == ""
