"""bmv2 under mininet. The end-to-end test needs mininet, p4c and bmv2, which are not
installed on this machine (and cannot be): it skips with the reason. The mapping from
config to switch ports and the switch command line is checked everywhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from checkmate import config, wire
from checkmate.control import plan as plan_mod
from checkmate.testbed import mininet_bmv2 as mb


@pytest.fixture
def cfg() -> config.ClusterConfig:
    return config.load(config.default_path())


def test_links_use_the_controllers_port_numbers(cfg):
    links = mb.links(cfg)
    plan = plan_mod.build(cfg)
    assert {(lk.host, lk.port) for lk in links[:-1]} == {(p.host, p.port) for p in plan.ports}
    cpu = links[-1]
    assert (cpu.host, cpu.port, cpu.ip, cpu.mac) == ("ctl", 64, "10.77.0.1", cfg.switch.mac)
    # The CPU link is where the plan punts handshakes and where L2 sends the switch MAC.
    assert plan.punt.cpu_port == cpu.port
    assert (cfg.switch.mac, 64) in {(e.mac, e.port) for e in plan.l2}
    assert all(len(lk.intf) <= 15 for lk in links)  # Linux interface name limit


def test_switch_command_line(cfg, tmp_path):
    argv = mb.switch_argv(cfg, tmp_path / "p.json")
    assert argv[0] == "simple_switch_grpc"
    pairs = [argv[i + 1] for i, a in enumerate(argv) if a == "-i"]
    assert pairs == ["1@sw0-eth1", "2@sw0-eth2", "3@sw0-eth3", "4@sw0-eth4", "5@sw0-eth5",
                     "6@sw0-eth6", "64@sw0-eth64"]
    assert "--priority-queues" in argv
    assert argv[-1] == f"0.0.0.0:{mb.GRPC_PORT}"
    assert mb.bmv2_config(cfg).switch.address == f"127.0.0.1:{mb.GRPC_PORT}"


RECEIVE = r"""
import json, socket, sys
from checkmate import wire
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("0.0.0.0", 47001)); s.settimeout(5)
data, peer = s.recvfrom(65535)
h, _ = wire.decode(data)
print(json.dumps({"partition": h.partition, "epoch": h.epoch, "iteration": h.iteration}))
"""


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.skipif(mb.missing() is not None,
                    reason=f"bmv2 topology unavailable: {mb.missing()}")
@pytest.mark.skipif(os.geteuid() != 0, reason="mininet needs root")
def test_bmv2_replicates_to_shadow(cfg, tmp_path):  # pragma: no cover - needs bmv2
    import yaml

    from checkmate.testbed.topology import config_to_dict

    bcfg = mb.bmv2_config(cfg)
    json_path = mb.compile_p4(tmp_path)
    net = mb.build_network(bcfg, json_path)
    try:
        path = tmp_path / "bmv2.yaml"
        path.write_text(yaml.safe_dump(config_to_dict(bcfg)))
        r = subprocess.run([sys.executable, "-m", "checkmate.control.cli", "deploy",
                            "--switch", "sw0", "--config", str(path)],
                           capture_output=True, text=True, timeout=60,
                           env={**os.environ, "CHECKMATE_CONTROL_STATE": str(tmp_path / "s")})
        assert r.returncode == 0, r.stderr
        rx = net.get("s0").popen([sys.executable, "-c", RECEIVE], stdout=subprocess.PIPE,
                                 text=True)
        dgram = wire.encode(wire.Header(flags=wire.Flags.REPLICATE, job_id=7, partition=0,
                                        count=2, iteration=5), b"\x00" * 8)
        net.get("t0").cmd(f"{sys.executable} -c \"import socket; socket.socket(2, 2).sendto("
                          f"bytes.fromhex('{dgram.hex()}'), ('10.77.0.11', 47000))\"")
        out, _ = rx.communicate(timeout=10)
        assert json.loads(out) == {"partition": 0, "epoch": 0, "iteration": 5}
    finally:
        net.stop()
    assert Path(json_path).exists()
