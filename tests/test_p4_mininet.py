"""bmv2 simple_switch programmed over its Thrift runtime, and the mininet testbed around it.

The driver tests run a real simple_switch (the toolchain's) in a namespace the test makes,
load the compiled v1model JSON through Thrift and program the plan; the end-to-end test
trains through bmv2 in a mininet network, kills every trainer and restores them, and reads
bmv2's replication and source-check counters back. Without the toolchain, mininet or root
they skip and say what is missing. The command lines and names are checked everywhere."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from checkmate.config import cluster as config
from checkmate.control import pipeline
from checkmate.control import plan as plan_mod
from checkmate.control.drivers import bmv2_thrift as thrift_mod
from checkmate.control.drivers import for_switch, p4tables
from checkmate.errors import CheckmateError
from checkmate.testbed import mininet_bmv2 as mb
from checkmate.testbed.topology import config_to_dict

SIMPLE_SWITCH = mb.shutil.which("simple_switch") and mb.shutil.which("p4c-bm2-ss")


@pytest.fixture
def cfg() -> config.ClusterConfig:
    return config.load(config.default_path())


def test_ports_follow_the_controllers_numbers(cfg):
    plan = plan_mod.build(cfg)
    ports = mb.ports(cfg)
    assert {(n, i) for n, i in ports[:-1]} == {(p.port, cfg.switch_ifname(p.host))
                                               for p in plan.ports}
    # the last port is the CPU port, where the plan punts handshakes and sends the switch MAC
    assert ports[-1] == (64, "ckm-cpu") and plan.punt.cpu_port == 64
    assert (cfg.switch.mac, 64) in {(e.mac, e.port) for e in plan.l2}
    assert all(len(i) <= 15 for _, i in ports) and all(len(i) <= 15 for i in mb.cpu_ifnames(cfg))


def test_switch_command_line(cfg, tmp_path):
    argv = mb.switch_argv(cfg, tmp_path)
    assert argv[0] == "simple_switch"
    pairs = [argv[i + 1] for i, a in enumerate(argv) if a == "-i"]
    assert pairs == ["1@ckmp-t0", "2@ckmp-t1", "3@ckmp-t2", "4@ckmp-t3", "5@ckmp-s0",
                     "6@ckmp-s1", "64@ckm-cpu"]
    # no program on the command line: the controller loads it, so swapping must be on
    assert "--no-p4" in argv and not any(a.endswith(".json") for a in argv)
    assert argv[argv.index("--") + 1:] == ["--enable-swap", "--priority-queues", "8"]
    assert argv[argv.index("--notifications-addr") + 1] == f"ipc://{tmp_path / 'bmv2.ipc'}"
    b = mb.bmv2_config(cfg).switch
    assert (b.target, b.runtime, b.address) == ("bmv2", "thrift", f"127.0.0.1:{mb.THRIFT_PORT}")
    assert type(for_switch(mb.bmv2_config(cfg))).__name__ == "Bmv2ThriftDriver"
    # the runtime survives the YAML every testbed process reads
    back = config.parse(yaml.safe_load(yaml.safe_dump(config_to_dict(mb.bmv2_config(cfg)))))
    assert back.switch == b


def test_the_testbed_compiles_into_the_folder_the_driver_loads_from():
    if not SIMPLE_SWITCH:
        pytest.skip("no bmv2 toolchain (simple_switch, p4c-bm2-ss) on PATH")
    path = mb.compile_p4()
    assert path == (pipeline.program_dir("v1model") / "checkmate_v1model.json").resolve()
    assert pipeline.device_config("v1model") == path.read_bytes()


def test_skip_reason_names_every_missing_piece(monkeypatch):
    monkeypatch.setattr(mb.shutil, "which", lambda t: None if t == "simple_switch" else t)
    monkeypatch.setattr(mb, "_have_module", lambda n: True)
    assert mb.missing() == "simple_switch is not installed"
    monkeypatch.setattr(mb.shutil, "which", lambda t: None)
    monkeypatch.setattr(mb, "_have_module", lambda n: False)
    assert mb.missing() == ("thrift (python package), mininet (python package), mnexec, "
                            "p4c-bm2-ss, simple_switch are not installed")


def test_port_bitmap_puts_port_zero_last():
    """bmv2's simple_pre_lag reads the map from the right (runtime_CLI's parse of a port
    list, tools/runtime_CLI.py)."""
    assert thrift_mod.port_map([0]) == "1"
    assert thrift_mod.port_map([3]) == "1000"
    assert thrift_mod.port_map([64]) == "1" + "0" * 64


def test_a_thrift_address_that_is_not_host_port_is_one_line(cfg):
    bad = replace(cfg, switch=replace(mb.bmv2_config(cfg).switch, address="localhost"))
    with pytest.raises(CheckmateError, match="is not host:port"):
        for_switch(bad)


@pytest.mark.skipif(thrift_mod.genpy_dir() is None, reason="no bmv2 Thrift clients on PATH")
def test_a_switch_that_does_not_answer_is_one_line(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({**BMV2_CLUSTER, "switch": {
        **BMV2_CLUSTER["switch"], "address": "127.0.0.1:1"}}))
    r = subprocess.run([sys.executable, "-m", "checkmate.control.cli", "status", "--switch",
                        "sw0", "--config", str(cfg)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        "control: error: bmv2 switch sw0 at 127.0.0.1:1: connecting failed: "
        "TTransportException: Could not connect to any of [('127.0.0.1', 1)]"], r.stderr


# ------------------------------------------------------------ a real simple_switch


def _compiled() -> dict:
    return json.loads(mb.compile_p4().read_text())


@pytest.fixture(scope="module")
def program():
    if not SIMPLE_SWITCH:
        pytest.skip("no bmv2 toolchain (simple_switch, p4c-bm2-ss) on PATH")
    return _compiled()


def test_the_json_schema_refuses_another_build(program):
    thrift_mod.JsonSchema(program, "the compiled program")  # the real one passes
    other = json.loads(json.dumps(program))
    for a in other["actions"]:
        if a["name"] == "CkmIngress.replicate":
            a["runtime_data"][0]["bitwidth"] = 8
    with pytest.raises(CheckmateError, match=r"action CkmIngress.replicate parameters "
                                             r"\[\('group', 8\)"):
        thrift_mod.JsonSchema(other, "switch sw0's program")
    for p in other["pipelines"]:
        p["tables"] = [t for t in p["tables"] if t["name"] != "CkmIngress.ckm_replicate"]
    with pytest.raises(CheckmateError, match="lacks table.s. CkmIngress.ckm_replicate"):
        thrift_mod.JsonSchema(other, "x")


NS = "ckt-bmv2"


@pytest.fixture
def switch(program, tmp_path):
    """simple_switch with no program in a namespace of its own; yields its config."""
    if os.geteuid() != 0:
        pytest.skip("a namespace for the switch needs root")
    subprocess.run(["ip", "netns", "del", NS], capture_output=True)
    subprocess.run(["ip", "netns", "add", NS], check=True)
    proc = None
    try:
        subprocess.run(["ip", "netns", "exec", NS, "ip", "link", "set", "lo", "up"],
                       check=True)
        proc = subprocess.Popen(["ip", "netns", "exec", NS, "simple_switch", "--thrift-port",
                                 str(mb.THRIFT_PORT), "--notifications-addr",
                                 f"ipc://{tmp_path / 'n.ipc'}", "--no-p4", "--",
                                 "--enable-swap"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 15
        while not _answers_in(NS):
            assert time.monotonic() < deadline, "simple_switch did not open its Thrift port"
            time.sleep(0.1)
        yield mb.bmv2_config(config.load(config.default_path()))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
        subprocess.run(["ip", "netns", "del", NS], capture_output=True)


def _answers_in(ns: str) -> bool:
    r = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c",
                        "import socket; socket.create_connection(('127.0.0.1', 9090), 1)"],
                       capture_output=True)
    return r.returncode == 0


DEPLOY = r"""
import json, sys
from dataclasses import replace
from checkmate.config import cluster as config
from checkmate.control import plan as plan_mod
from checkmate.control.drivers import for_switch, p4tables
from checkmate.testbed import mininet_bmv2 as mb
cfg = mb.bmv2_config(config.load(config.default_path()))
reg = plan_mod.Registration(1, "s1", "10.77.0.101", "02:00:0a:4d:00:65", 47011, 9, 12345)
out = {}
d = for_switch(cfg)
out["first"] = d.apply(plan_mod.build(cfg)).summary()
out["again"] = d.apply(plan_mod.build(cfg)).summary()
plan = plan_mod.build(cfg, {reg.host: reg})
res = d.apply(plan)
out["registered"] = [res.summary(), res.changed]
out["same"] = d.read_entries() == {e.key: e for e in p4tables.entries(plan)}
out["groups"] = {str(k): v for k, v in d.read_groups().items()}
out["want_groups"] = {str(k): list(v) for k, v in p4tables.groups(plan).items()}
small = replace(cfg, hosts=tuple(h for h in cfg.hosts if h.name != "s1"))
smaller = plan_mod.build(small)
res = d.apply(smaller)
out["shrunk"] = [res.summary(), res.removed]
out["shrunk_same"] = (d.read_entries() == {e.key: e for e in p4tables.entries(smaller)}
                      and d.read_groups() == p4tables.groups(smaller))
st = d.status()
out["status"] = {"entries": len(st["entries"]), "stats": st["ckm_stats"], "notes": st["notes"]}
d.close()
print(json.dumps(out))
"""


def test_the_controller_programs_a_real_simple_switch_over_thrift(switch):
    """Deploy into bmv2 with no program: the compiled JSON is loaded, every entry and group
    written; a second deploy writes nothing; a shadow's registration changes its rewrite
    entry only; a group the plan drops is removed with its members. What bmv2 reports back
    is what the plan holds, and its counters read (all zero: no traffic)."""
    r = subprocess.run(["ip", "netns", "exec", NS, sys.executable, "-c", DEPLOY],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    plan = plan_mod.build(switch)
    n = len(p4tables.entries(plan)) + len(plan.groups)
    assert out["first"] == f"{n} added, 0 changed, 0 removed"
    assert out["again"] == "0 added, 0 changed, 0 removed"
    assert out["registered"][0] == "0 added, 1 changed, 0 removed"
    assert out["registered"][1][0].startswith("shadow_rewrite [egress_rid=0x2]")
    assert out["same"] is True and out["groups"] == out["want_groups"]
    # without s1: its entries and multicast groups go, and bmv2 holds the smaller plan
    small = plan_mod.build(replace(switch, hosts=tuple(h for h in switch.hosts
                                                       if h.name != "s1")))
    groups_gone = len(plan.groups) - len(small.groups)
    assert groups_gone > 0 and out["shrunk_same"] is True
    assert sum(r.startswith("multicast group ") for r in out["shrunk"][1]) == groups_gone
    assert any(r.startswith("l2_fwd [dst_mac=0x2000a4d0065]") for r in out["shrunk"][1])
    assert out["status"]["entries"] == len(p4tables.entries(small))
    assert out["status"]["stats"]["ckm"] == 0 and "bad_src_ip" in out["status"]["stats"]
    assert out["status"]["notes"] == []  # this build has the per-port source check


def test_status_of_a_switch_with_no_program_is_one_line(switch):
    r = subprocess.run(["ip", "netns", "exec", NS, sys.executable, "-c",
                        "from checkmate.config import cluster as c\n"
                        "from checkmate.testbed import mininet_bmv2 as mb\n"
                        "from checkmate.control.drivers import for_switch\n"
                        "for_switch(mb.bmv2_config(c.load(c.default_path()))).status()"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert r.stderr.strip().splitlines()[-1].endswith(
        "switch sw0 has no P4 program loaded; `control deploy --switch sw0` loads and "
        "programs it")


# ------------------------------------------------------------ training through bmv2

#: Its own prefix and subnet: the kernel testbed's tests may run beside it.
BMV2_CLUSTER = {
    "job": {"id": 7, "name": "bmv2"},
    "switch": {"name": "sw0", "target": "bmv2", "runtime": "thrift",
               "address": f"127.0.0.1:{mb.THRIFT_PORT}"},
    "network": {"subnet": "10.78.0.0/24", "mtu": 9000, "prefix": "ckv"},
    "hosts": [{"name": "t0", "role": "trainer", "rank": 0, "ip": "10.78.0.10"},
              {"name": "t1", "role": "trainer", "rank": 1, "ip": "10.78.0.11"},
              {"name": "t2", "role": "trainer", "rank": 2, "ip": "10.78.0.12"},
              {"name": "s0", "role": "shadow", "partition": 0, "ip": "10.78.0.100"},
              {"name": "s1", "role": "shadow", "partition": 1, "ip": "10.78.0.101"},
              # a second shadow of each partition (issue 38): bmv2 copies to both
              {"name": "s2", "role": "shadow", "partition": 0, "ip": "10.78.0.102"},
              {"name": "s3", "role": "shadow", "partition": 1, "ip": "10.78.0.103"}],
}
SCENARIO = {"name": "bmv2-kill-restore", "model": "gpt", "steps": 12, "seed": 0,
            "kill_at": 6,
            "attacks": [{"kind": "mac_hijack", "from": "t2", "target": "t0", "at": 2}],
            # partition 1's first shadow is lost for good: its sibling carries it
            "shadow_kills": [{"partition": 1, "replica": 0, "at": 3, "restart": False}]}


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.skipif(mb.missing() is not None,
                    reason=f"bmv2 testbed unavailable: {mb.missing()}")
@pytest.mark.skipif(os.geteuid() != 0, reason="mininet needs root")
def test_training_through_bmv2_is_killed_restored_bit_identical(tmp_path):
    """`testbed run --switch bmv2`: three trainers and two partitions of two shadows each
    (issue 38's replicas in switch mode) in a mininet network around simple_switch;
    partition 1's first shadow is killed for good at iteration 3, every trainer at 6; the
    restart reads partition 1 from its second shadow, and the run ends bit-identical to a
    failure-free run through the same switch. bmv2's multicast groups copied the gradients
    to every shadow of a partition (each replica set still running equals the trainers,
    with next to no repair), and a host claiming another's MAC and IP from iteration 2 on
    had every frame dropped where it entered, counted per reason by bmv2's source check."""
    cluster, scenario = tmp_path / "cluster.yaml", tmp_path / "scenario.yaml"
    cluster.write_text(yaml.safe_dump(BMV2_CLUSTER))
    scenario.write_text(yaml.safe_dump(SCENARIO))
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "checkmate.testbed.run", "--scenario",
                        str(scenario), "--config", str(cluster), "--json",
                        str(tmp_path / "r.json"), "--workdir", str(tmp_path / "w")],
                       capture_output=True, text=True, timeout=300)
    out = tmp_path / "r.json"
    report = json.loads(out.read_text()) if out.exists() else {}
    assert r.returncode == 0, report.get("problems") or (r.stdout[-3000:], r.stderr[-3000:])
    assert report["ok"] and report["bit_identical"], report["problems"]
    assert report["runs"]["chaos"]["killed_at"] == 6  # a run with an attack is a chaos run
    assert report["runs"]["chaos"]["restored_from"] >= 5
    assert report["switch_replicated_packets"] > 0
    for label, alive in (("failure-free", 4), ("chaos", 3)):  # groups fed both replicas
        # bmv2 drops copies under load and repair fills them (repair bytes up to 10% of the
        # copied bytes seen beside CI's other worker, 0 alone); a replica left out of the
        # groups would get all of its partition by repair (overhead 1 or more)
        run = report["runs"][label]
        assert run["shadows_match_trainers"] and run["commits_missing"] == {}, run
        assert run["repair_overhead"] < 0.5, run
        assert len(run["shadow_receivers"]) == alive, run
    resumed = next((tmp_path / "w").glob("run-*/chaos/trainer-t0-resumed.log")).read_text()
    assert re.search(r"resuming at iteration \d+: every shadow holds it in memory \(read "
                     r"from replica per partition: 0 1\)", resumed), resumed[-2000:]
    attack = report["attacks"][0]
    assert attack["rounds"] >= 10
    # every frame bmv2's program saw was dropped and counted per reason: what was sent, less
    # the few a loaded simple_switch loses before its pipeline (Bmv2Testbed.INGRESS_LOSS)
    for key, per_round in (("bad_src_mac", 3), ("bad_src_ip", 1)):
        sent = per_round * attack["rounds"]
        assert sent * (1 - mb.Bmv2Testbed.INGRESS_LOSS) <= attack[key] <= sent, attack
    assert not Path("/run/netns/ckv-t0").exists()  # the testbed is gone
    print(f"bmv2 kill-restore: {time.monotonic() - t0:.1f} s, "
          f"{report['switch_replicated_packets']} datagrams copied by bmv2")
