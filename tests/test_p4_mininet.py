"""bmv2 under mininet. The end-to-end test needs mininet, p4c and bmv2, which are not
installed on this machine (and cannot be): it skips naming what is missing. The mapping
from config to switch ports, the switch and compiler command lines, the one build folder
and the pipeline push (against the P4Runtime double) are checked everywhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from fakes import FakeSwitch, compiled_p4info
from google.protobuf import text_format

from checkmate.config import cluster as config
from checkmate.control import pipeline
from checkmate.control import plan as plan_mod
from checkmate.protocol import wire
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


def test_switch_command_line(cfg):
    argv = mb.switch_argv(cfg)
    assert argv[0] == "simple_switch_grpc"
    pairs = [argv[i + 1] for i, a in enumerate(argv) if a == "-i"]
    assert pairs == ["1@sw0-eth1", "2@sw0-eth2", "3@sw0-eth3", "4@sw0-eth4", "5@sw0-eth5",
                     "6@sw0-eth6", "64@sw0-eth64"]
    assert "--priority-queues" in argv
    # no program on the command line: it arrives over P4Runtime
    assert "--no-p4" in argv and not any(a.endswith(".json") for a in argv)
    assert argv[-1] == f"0.0.0.0:{mb.GRPC_PORT}"
    assert mb.bmv2_config(cfg).switch.address == f"127.0.0.1:{mb.GRPC_PORT}"


def test_compiler_writes_where_the_driver_reads(tmp_path, monkeypatch):
    monkeypatch.setenv("CHECKMATE_P4_BUILD", str(tmp_path))
    argv = mb.compile_argv()
    out = tmp_path / "checkmate_v1model"
    assert argv[argv.index("-o") + 1] == str(out / "checkmate_v1model.json")
    assert argv[argv.index("--p4runtime-files") + 1] == str(out / "p4info.txtpb")
    src = Path(argv[-1])
    assert src == pipeline.p4_source("v1model") and src.is_file()
    assert (Path(argv[argv.index("-I") + 1]) / "checkmate_parser.p4").is_file()


def test_push_pipeline_sends_p4info_and_json(cfg, tmp_path, monkeypatch):
    """What the compiler left in the build folder reaches the switch through
    SetForwardingPipelineConfig (against the P4Runtime double, which starts empty like
    simple_switch_grpc --no-p4)."""
    monkeypatch.setenv("CHECKMATE_P4_BUILD", str(tmp_path))
    out = tmp_path / "checkmate_v1model"
    out.mkdir()
    info = compiled_p4info("v1model")
    (out / "p4info.txtpb").write_text(text_format.MessageToString(info))
    (out / "checkmate_v1model.json").write_bytes(b'{"program": "x"}')
    sw = FakeSwitch(None)
    try:
        bcfg = mb.bmv2_config(cfg)
        bcfg = replace(bcfg, switch=replace(bcfg.switch, address=sw.address))
        mb.push_pipeline(bcfg, timeout=3)
    finally:
        sw.stop()
    assert sw.pipeline_sets == 1 and sw.device_config == b'{"program": "x"}'
    assert sw.p4info == info


def test_skip_reason_names_every_missing_piece(monkeypatch):
    monkeypatch.setattr(mb.shutil, "which", lambda t: None if t == "simple_switch_grpc" else t)
    monkeypatch.setattr(mb, "_have_module", lambda n: True)
    assert mb.missing() == "simple_switch_grpc is not installed"
    monkeypatch.setattr(mb.shutil, "which", lambda t: None)
    monkeypatch.setattr(mb, "_have_module", lambda n: False)
    assert mb.missing() == ("mininet (python package), p4c-bm2-ss, simple_switch_grpc are "
                            "not installed")


RECEIVE = r"""
import json, socket, sys
from checkmate.protocol import wire
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
def test_bmv2_replicates_to_shadow(cfg, tmp_path, monkeypatch):  # pragma: no cover - bmv2
    import yaml

    from checkmate.testbed.topology import config_to_dict

    monkeypatch.setenv("CHECKMATE_P4_BUILD", str(tmp_path / "build"))  # compiler and deploy
    bcfg = mb.bmv2_config(cfg)
    json_path = mb.compile_p4()
    net = mb.build_network(bcfg)
    try:
        mb.push_pipeline(bcfg)
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


def test_p4_sources_ship_as_package_data():
    """A wheel carries every P4 file (checkmate/p4/...), and without an __init__.py: a
    top-level ``p4`` package in a clone would shadow the p4runtime wheel's ``p4``."""
    import fnmatch
    import tomllib

    root = Path(__file__).resolve().parents[1]
    tool = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert tool["package-dir"]["checkmate.p4"] == "p4" and "checkmate.p4" in tool["packages"]
    globs = tool["package-data"]["checkmate.p4"]
    files = [p.relative_to(root / "p4").as_posix() for p in (root / "p4").rglob("*.p4")]
    assert len(files) >= 6
    assert all(any(fnmatch.fnmatch(f, g) for g in globs) for f in files), files
    assert not (root / "p4" / "__init__.py").exists()
    assert pipeline.p4_source("tna").read_text() == (root / "p4" / "checkmate_tna.p4").read_text()
