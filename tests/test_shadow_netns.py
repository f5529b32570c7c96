"""`shadow serve` in its own network namespace, over a real veth link.

Two namespaces (tsn-sh: the shadow; tsn-tr: the controller and a trainer-side sender) joined
by a veth pair. The controller is helper B's real HandshakeService; it programs the
P4Runtime TEST DOUBLE of tests/fakes.py (there is no switch hardware or bmv2
here). The shadow finds the controller from the config (switch.ip:CONTROLLER_PORT),
registers its namespace address, and accepts only datagrams stamped with that session.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace

import numpy as np
import pytest
from shadow_cluster import LRS

from checkmate.config import cluster as config
from checkmate.protocol import auth
from checkmate.shadow.feed import control_body, send_iteration
from checkmate.spec.model import ModelSpec
from checkmate.testbed.netsock import call_in_netns, udp_socket_in
from checkmate.train.shadow_client import ShadowClient

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces"),
]

NS_SH, NS_TR = "tsn-sh", "tsn-tr"
CFG = """\
job: {id: 21, name: tdnet}
switch: {name: sw0, target: bmv2, ip: 10.79.9.1}
network: {subnet: 10.79.9.0/24, prefix: tsn}
hosts:
  - {name: t0, role: trainer, rank: 0, ip: 10.79.9.10}
  - {name: s0, role: shadow, partition: 0, ip: 10.79.9.100}
"""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def _cleanup() -> None:
    for ns in (NS_SH, NS_TR):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.fixture
def link():
    _cleanup()  # leftovers of a crashed run
    try:
        _ip("netns", "add", NS_SH)
        _ip("netns", "add", NS_TR)
        _ip("link", "add", "tdv-s", "netns", NS_SH, "type", "veth", "peer", "name", "tdv-t",
            "netns", NS_TR)
        for ns, dev, addr in ((NS_SH, "tdv-s", "10.79.9.100/24"),
                              (NS_TR, "tdv-t", "10.79.9.1/24")):
            _ip("-n", ns, "addr", "add", addr, "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        # the sender's address sits on the same link as the controller's
        _ip("-n", NS_TR, "addr", "add", "10.79.9.10/24", "dev", "tdv-t")
        yield
    finally:
        _cleanup()


@pytest.fixture
def controller(link, tmp_path):
    from fakes import FakeSwitch, compiled_p4info

    from checkmate.control.drivers.p4runtime import P4RuntimeDriver
    from checkmate.control.p4rt_client import P4RuntimeClient
    from checkmate.control.service import HandshakeService
    from checkmate.control.sessions import SessionStore

    cfg_path = tmp_path / "cluster.yaml"
    cfg_path.write_text(CFG)
    sw = FakeSwitch(compiled_p4info("v1model"))
    cfg = config.load(cfg_path)
    cfg = replace(cfg, switch=replace(cfg.switch, address=sw.address))
    drv = P4RuntimeDriver(cfg, "v1model", P4RuntimeClient(sw.address, timeout=2))
    svc = HandshakeService(cfg, drv, SessionStore(tmp_path / "sessions.json"),
                           auth.load_secret(), log=lambda msg: None)
    svc.deploy()
    call_in_netns(NS_TR, svc.bind)  # the service socket lives in the trainer-side namespace
    t = threading.Thread(target=svc.serve_forever, daemon=True)
    t.start()
    try:
        yield svc, cfg_path
    finally:
        svc.stop_event.set()
        t.join(5)
        drv.close()
        sw.stop()


def _status(port: int = 47100) -> dict:
    return call_in_netns(NS_TR, lambda: ShadowClient(("10.79.9.100", port), 5).status())


def test_shadow_in_namespace_registers_and_steps(controller, tmp_path):
    svc, cfg_path = controller
    proc = subprocess.Popen(
        ["ip", "netns", "exec", NS_SH, sys.executable, "-m", "checkmate.shadow.cli", "serve",
         "--partition", "0/1", "--config", str(cfg_path), "--register-timeout", "20"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "serving udp 0.0.0.0:47001 tcp 0.0.0.0:47100" in line, (
            line + proc.stderr.read() if proc.poll() is not None else line)
        sess = svc._session()["partitions"]["0"]
        assert sess["ip"] == "10.79.9.100" and sess["port"] == 47001
        st = _status()
        assert st["epoch"] == sess["epoch"] and st["seeded"] is False

        spec = ModelSpec.build(21, [("w", (3000,)), ("b", (10,))], "adamw",
                               [{"params": ["w"], "lr": LRS[0]}, {"params": ["b"], "lr": LRS[1]}],
                               1)
        rng = np.random.default_rng(5)
        p0 = rng.standard_normal(spec.total).astype(np.float32)

        def seed():
            with ShadowClient(("10.79.9.100", 47100), 10) as c:
                c.send_spec(spec)
                c.seed(0, "param", 0, p0, 0)
                for s in spec.slots[1:]:
                    c.seed(0, s, 0, np.zeros(spec.total, np.float32), 0)

        call_in_netns(NS_TR, seed)
        g = rng.standard_normal(spec.total).astype(np.float32)
        tx = udp_socket_in(NS_TR, ("10.79.9.10", 0))
        try:
            for tok in (sess["token"] ^ 1, sess["token"]):  # a forged token first
                send_iteration(tx, ("10.79.9.100", 47001), 21, 1, 0, 0, g,
                               control_body(1, LRS), epoch=sess["epoch"], token=tok)
        finally:
            tx.close()
        end = time.monotonic() + 20
        while (st := _status())["latest"] != 1 and time.monotonic() < end:
            time.sleep(0.05)
        assert st["latest"] == 1 and st["drops"]["token"] > 0, st

        from checkmate.shadow.kernels import make_optimizer

        ref = make_optimizer(spec, 0, spec.total)
        ref.load({"param": p0, **{s: np.zeros(spec.total, np.float32)
                                  for s in spec.slots[1:]}}, 0)
        ref.step(g, LRS, None)
        got = call_in_netns(NS_TR, lambda: ShadowClient(("10.79.9.100", 47100)).fetch(1))
        for s in spec.slots:
            assert np.array_equal(got.slots[s], ref.state[s]), s
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
