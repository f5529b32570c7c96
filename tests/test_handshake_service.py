"""The handshake service in a namespace testbed (prefix "tb"): shadows register from their
own namespace over real UDP, the service programs the kernel switch, copies carry the
session; and the service handles bad input and SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from fakes import DATAGRAM_RECEIVER

from checkmate.config import cluster as config
from checkmate.dataplane.switch import KernelSwitch
from checkmate.protocol import auth, handshake, wire

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces and BPF"),
]

#: Runs inside a host namespace: send one datagram (hex argv[1]) to the controller, print
#: the reply as JSON, or "TIMEOUT".
CLIENT = r"""
import json, socket, sys
from checkmate.protocol import handshake
from checkmate.config import cluster as config
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(float(sys.argv[3]))
s.sendto(bytes.fromhex(sys.argv[1]), (sys.argv[2], config.CONTROLLER_PORT))
try:
    data = s.recv(65535)
except TimeoutError:
    print("TIMEOUT"); sys.exit(0)
m = handshake.parse(data)
print(json.dumps({"flags": int(m.header.flags), "seq": m.header.seq, "epoch": m.header.epoch,
                  "body": m.body, "authentic": m.mac != handshake.NO_MAC}))
"""



def req(job: int, seq: int, body: dict, partition: int = 0, secret: bytes | None = None
        ) -> bytes:
    """A request made with the job secret the testbed uses ($CHECKMATE_SECRET_FILE)."""
    key = auth.handshake_key(secret if secret is not None else auth.load_secret())
    return handshake.request(key, job, seq, body, partition)[0]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Testbed whose `up` starts `control serve` in the switch namespace (helper A's path)."""
    from checkmate.testbed.topology import Testbed

    data = yaml.safe_load(Path(config.default_path()).read_text())
    data["network"]["prefix"] = "tb"
    path = tmp_path_factory.mktemp("hs") / "tb.yaml"
    path.write_text(yaml.safe_dump(data))
    cfg = config.load(path)
    with Testbed(cfg, controller=True, config_path=path) as tb:
        _wait_serving(tb)
        yield tb


def ask(tb, host: str, datagram: bytes, timeout: float = 3.0) -> dict | None:
    r = tb.run_in(host, [sys.executable, "-c", CLIENT, datagram.hex(), tb.cfg.switch.ip,
                         str(timeout)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    out = r.stdout.strip()
    return None if out == "TIMEOUT" else json.loads(out)


def _wait_serving(tb) -> None:
    for seq in range(20):  # a fresh request each time: the controller refuses replays
        if ask(tb, "t0", req(tb.cfg.job_id, seq, {"op": "session", "job": tb.cfg.job_id}),
               timeout=0.5) is not None:
            return
    log = (Path("/run/checkmate/tb/controller.log")).read_text(errors="replace")
    pytest.fail(f"controller did not answer; log:\n{log}")


def register(tb, host: str, partition: int, port: int, seq: int) -> dict:
    h = tb.cfg.host(host)
    body = {"op": "register", "job": tb.cfg.job_id, "partition": partition, "host": host,
            "ip": h.ip, "mac": h.mac, "port": port}
    rep = ask(tb, host, req(tb.cfg.job_id, seq, body, partition))
    assert rep is not None
    return rep


def entries_of(tb, partition: int):
    return [e for e in KernelSwitch(tb.cfg).replication_entries() if e.partition == partition]


def test_serve_installed_ring_at_start(served):
    es = KernelSwitch(served.cfg).replication_entries()
    assert len(es) == 8 and {e.shadow_ifname for e in es} == {"tbp-s0", "tbp-s1"}


def test_register_installs_session_and_reregister_bumps_epoch(served):
    rep = register(served, "s1", 1, 47011, seq=5)
    assert rep["flags"] & wire.Flags.ACK and rep["seq"] == 5
    body = rep["body"]
    assert body["op"] == "registered" and body["partition"] == 1 and body["job"] == 7
    assert body["epoch"] >= 1 and 0 < body["token"] < 2**32
    assert rep["epoch"] == body["epoch"]
    es = entries_of(served, 1)
    assert len(es) == 4
    assert {(e.epoch, e.token, e.shadow_port, e.shadow_ifname) for e in es} == {
        (body["epoch"], body["token"], 47011, "tbp-s1")}
    # Partition 0 untouched (config address, no session yet).
    assert {(e.epoch, e.shadow_port) for e in entries_of(served, 0)} == {(0, 47001)}

    again = register(served, "s1", 1, 47012, seq=6)["body"]
    assert again["epoch"] > body["epoch"]
    assert {(e.epoch, e.token, e.shadow_port) for e in entries_of(served, 1)} == {
        (again["epoch"], again["token"], 47012)}

    q = ask(served, "t2", req(7, 9, {"op": "session", "job": 7}))
    parts = q["body"]["partitions"]
    assert set(parts) == {"1"} and parts["1"]["epoch"] == again["epoch"]
    assert parts["1"]["port"] == 47012 and parts["1"]["ip"] == "10.77.0.101"


def test_replicated_copy_carries_the_session(served):
    sess = register(served, "s0", 0, 47021, seq=11)["body"]
    rx = served.popen_in("s0", [sys.executable, "-c", DATAGRAM_RECEIVER, "47021"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert rx.stdout.readline().strip() == "READY"
        payload = b"\x00" * 16
        h = wire.Header(flags=wire.Flags.REPLICATE, job_id=7, partition=0, count=4,
                        iteration=3)
        dgram = wire.encode(h, payload)
        send = ("import socket,sys; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
                "s.sendto(bytes.fromhex(sys.argv[1]), ('10.77.0.11', 47000))")
        r = served.run_in("t0", [sys.executable, "-c", send, dgram.hex()], timeout=30)
        assert r.returncode == 0
        out, _ = rx.communicate(timeout=10)
    finally:
        if rx.poll() is None:
            rx.kill()
            rx.wait()
    got = json.loads(out.strip())
    assert got == {"epoch": sess["epoch"], "token": sess["token"], "partition": 0}


def test_bad_requests_are_refused_or_dropped(served):
    wrong_job = ask(served, "s0", req(99, 1, {"op": "session", "job": 99}))
    assert wrong_job["flags"] & wire.Flags.NACK and "unknown job" in wrong_job["body"]["reason"]
    bad_part = {"op": "register", "job": 7, "partition": 7, "host": "s0"}
    rep = ask(served, "s0", req(7, 2, bad_part))
    assert rep["flags"] & wire.Flags.NACK and "partition 7" in rep["body"]["reason"]
    trainer = ask(served, "t1", req(7, 3, {
        "op": "register", "job": 7, "partition": 0, "host": "t1"}))
    assert trainer["flags"] & wire.Flags.NACK
    assert "belongs to s0, not 't1'" in trainer["body"]["reason"]
    spoof = ask(served, "t1", req(7, 3, {
        "op": "register", "job": 7, "partition": 0, "host": "s0", "ip": "10.77.0.100"}))
    assert spoof["flags"] & wire.Flags.NACK and "sent from 10.77.0.11" in spoof["body"]["reason"]
    unknown = ask(served, "s0", req(7, 4, {"op": "reboot"}))
    assert unknown["flags"] & wire.Flags.NACK
    assert ask(served, "s0", b"not a ckm datagram at all", timeout=0.5) is None
    # Without the job secret: a refusal that proves and tells nothing, no session data.
    for body in ({"op": "session", "job": 7}, {"op": "register", "job": 7, "partition": 0,
                                               "host": "s0"}):
        stranger = ask(served, "t1", req(7, 6, body, secret=bytes(32)))
        assert stranger["flags"] & wire.Flags.NACK and not stranger["authentic"]
        assert stranger["body"] == {"op": "error", "reason": "not authenticated"}
    # Still serving afterwards.
    assert ask(served, "s0", req(7, 5, {"op": "session", "job": 7})) is not None


def test_serve_exits_cleanly_on_sigterm(tmp_path):
    """A serve we start ourselves (prefix "tbs"): with the switch down it fails with one
    line; with the testbed up it serves until SIGTERM and then exits 0."""
    from checkmate.testbed.topology import Testbed

    data = yaml.safe_load(Path(config.default_path()).read_text())
    data["network"]["prefix"] = "tbs"
    path = tmp_path / "tbs.yaml"
    path.write_text(yaml.safe_dump(data))
    cfg = config.load(path)
    env = {**os.environ, "CHECKMATE_CONTROL_STATE": str(tmp_path / "state.json")}
    argv = [sys.executable, "-m", "checkmate.control.cli", "serve", "--config", str(path)]
    # Switch not up: one clear line, non-zero exit.
    r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=30)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        "control: error: kernel switch sw0 is not up (namespace tbs-sw0); run `testbed up` "
        "first"]
    with Testbed(cfg) as tb:
        proc = subprocess.Popen(tb.argv_in("sw0", argv), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env)
        try:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not _listening(tb):
                time.sleep(0.1)
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0, err
    assert "listening on 10.77.0.1:48023" in out and "stopped" in out
    assert "Traceback" not in err


def _listening(tb) -> bool:
    r = tb.run_in("t0", [sys.executable, "-c", CLIENT,
                         req(7, 1, {"op": "session", "job": 7}).hex(),
                         tb.cfg.switch.ip, "0.3"], capture_output=True, text=True, timeout=30)
    return r.stdout.strip() not in ("", "TIMEOUT")


def test_sessions_survive_in_state_for_redeploy(served):
    """`control deploy` reads the service's state: a redeploy keeps the session stamps."""
    sess = register(served, "s1", 1, 47031, seq=21)["body"]
    cfgp = Path("/run/checkmate/tb")
    state = cfgp / "controller-sw0.json"
    assert json.loads(state.read_text())["max_epoch"] >= sess["epoch"]
    data = yaml.safe_load(Path(config.default_path()).read_text())
    data["network"]["prefix"] = "tb"
    path = cfgp / "deploy-test.yaml"
    path.write_text(yaml.safe_dump(data))
    try:
        r = subprocess.run([sys.executable, "-m", "checkmate.control.cli", "deploy",
                            "--switch", "sw0", "--config", str(path)],
                           capture_output=True, text=True, timeout=60,
                           env={k: v for k, v in os.environ.items()
                                if k != "CHECKMATE_CONTROL_STATE"})
    finally:
        path.unlink()
    assert r.returncode == 0, r.stderr
    assert "0 added, 0 changed, 0 removed" in r.stdout
    assert {(e.epoch, e.token, e.shadow_port) for e in entries_of(served, 1)} == {
        (sess["epoch"], sess["token"], 47031)}


def test_a_register_with_a_forged_source_address_repoints_nothing(served):
    """The issue's attack, with the job secret: t2 sends a valid register for s1's
    partition claiming s1's source address (and t2's own MAC, or s1's), asking for the
    copies on another port. The switch drops both at t2's port (its source binding), so
    the controller never sees them: partition 1's entries keep their shadow, port and
    session, and the drops are counted where they entered."""
    from scapy.layers.inet import IP, UDP
    from scapy.layers.l2 import Ether

    from checkmate.testbed.netsock import packet_socket_in

    cfg = served.cfg
    sw = KernelSwitch(cfg)
    s1, t2 = cfg.host("s1"), cfg.host("t2")
    register(served, "s1", 1, s1.port, seq=40)  # a session to protect
    before = entries_of(served, 1)
    counts = sw.counters()["ports"]["tbp-t2"]
    body = {"op": "register", "job": cfg.job_id, "partition": 1, "host": "s1", "ip": s1.ip,
            "mac": s1.mac, "port": 47999, "instance": "attacker"}
    frames = [bytes(Ether(src=mac, dst=cfg.switch.mac) / IP(src=s1.ip, dst=cfg.switch.ip)
                    / UDP(sport=40000, dport=config.CONTROLLER_PORT)
                    / req(cfg.job_id, 41 + i, body, 1))
              for i, mac in enumerate([t2.mac, s1.mac])]
    raw = packet_socket_in(cfg.netns("t2"), cfg.host_ifname("t2"))
    try:
        for f in frames:
            raw.send(f)
    finally:
        raw.close()
    time.sleep(0.5)
    assert entries_of(served, 1) == before
    assert all(e.shadow_port == s1.port for e in before)
    after = sw.counters()["ports"]["tbp-t2"]
    assert after["bad_src_ip"] - counts["bad_src_ip"] == 1
    assert after["bad_src_mac"] - counts["bad_src_mac"] == 1
