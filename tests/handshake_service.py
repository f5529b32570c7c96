"""The controller's real handshake service over the P4Runtime switch double
(fakes.FakeSwitch), and the authenticated requests the handshake tests send it.

A module of its own, beside fakes.py, because it reads the session's job secret when it is
imported (KEY is a default argument of req): fakes.py stays importable without one (worker
scripts and child processes import it too).
"""

from __future__ import annotations

from dataclasses import replace

from fakes import FakeSwitch

from checkmate.config import cluster as config
from checkmate.control.drivers.p4runtime import P4RuntimeDriver
from checkmate.control.p4rt_client import P4RuntimeClient
from checkmate.control.service import HandshakeService
from checkmate.control.sessions import SessionStore
from checkmate.protocol import auth, handshake, wire


def make_service(sw: FakeSwitch, state, port: int = 0, groups: int = 1,
                 cfg: config.ClusterConfig | None = None) -> HandshakeService:
    """The service of the default config, or ``cfg`` (``groups``: its job's data-parallel
    groups)."""
    cfg = cfg or config.load(config.default_path())
    cfg = replace(cfg, switch=replace(cfg.switch, target="bmv2", address=sw.address),
                  groups=groups)
    drv = P4RuntimeDriver(cfg, "v1model", P4RuntimeClient(sw.address, timeout=2))
    return HandshakeService(cfg, drv, SessionStore(state), SECRET, bind_ip="127.0.0.1",
                            port=port, log=lambda msg: None)


SECRET = auth.load_secret()  # the session's (tests/conftest.py): shadows started here use it
KEY = auth.handshake_key(SECRET)


def req(job: int, seq: int, body: dict, partition: int = 0, key: bytes = KEY) -> bytes:
    return handshake.request(key, job, seq, body, partition)[0]


def answer(data: bytes | None) -> tuple[wire.Header, dict]:
    assert data is not None
    m = handshake.parse(data)
    return m.header, m.body


def reg_body(partition=1, host="s1", port=47001) -> dict:
    return {"op": "register", "job": 7, "partition": partition, "host": host,
            "ip": f"10.77.0.{100 + partition}", "mac": f"02:00:0a:4d:00:{100 + partition:02x}",
            "port": port}


def rewrite_of(sw: FakeSwitch, rid: int) -> dict:
    for m, _, params in sw.table("shadow_rewrite"):
        if dict(m)["egress_rid"] == rid:
            return dict(params)
    raise AssertionError(f"no rewrite for rid {rid}")
