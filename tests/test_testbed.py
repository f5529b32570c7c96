"""`testbed up/down/status/exec` through the real CLI: what up builds, down removes all of.

Namespace prefix "tau" (helper A's "ta" family), so these run beside test_dataplane's testbed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from checkmate.config import cluster as config

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for namespaces and BPF"),
]

PREFIX = "tau"


def _cli(*args: str, check_rc: int | None = 0) -> subprocess.CompletedProcess:
    res = subprocess.run([sys.executable, "-m", "checkmate.testbed.cli", *args],
                         capture_output=True, text=True, timeout=60)
    if check_rc is not None:
        assert res.returncode == check_rc, res.stderr
    return res


def _leftovers(prefix: str) -> list[str]:
    """Every kernel object or file a testbed of ``prefix`` could have left behind."""
    out = [f"netns {n}" for n in os.listdir("/run/netns") if n.startswith(prefix + "-")] \
        if os.path.isdir("/run/netns") else []
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    out += [f"link {ln.split(':')[1].strip()}" for ln in links.splitlines()
            if ln.split(":")[1].strip().startswith((prefix + "-", prefix + "p-"))]
    if Path(f"/sys/fs/bpf/{prefix}-sw0").exists():
        out.append("bpf pins")
    if Path(f"/run/checkmate/{prefix}").exists():
        out.append("state dir")
    return out


@pytest.fixture
def cfg_file(tmp_path):
    doc = yaml.safe_load(config.default_path().read_text())
    doc["network"]["prefix"] = PREFIX
    p = tmp_path / "tau.yaml"
    p.write_text(yaml.safe_dump(doc))
    try:
        yield p
    finally:
        from checkmate.testbed.topology import Testbed

        Testbed(config.load(p)).down()


def test_up_status_exec_down_leaves_nothing(cfg_file):
    cfg = config.load(cfg_file)
    _cli("up", "--config", str(cfg_file), "--no-controller")
    st = json.loads(_cli("status", "--config", str(cfg_file), "--json").stdout)
    assert st["up"] and st["switch"]["bpf_attached"]
    assert st["switch"]["namespace"] == f"{PREFIX}-sw0" and st["switch"]["ip"] == cfg.switch.ip
    # the switch's per-port counters, anti-spoofing and length checks included
    ports = st["switch"]["counters"]
    assert set(ports) == {cfg.switch_ifname(h.name) for h in cfg.hosts}
    assert all({"malformed", "no_entry", "spoofed"} <= set(c) for c in ports.values())
    text = _cli("status", "--config", str(cfg_file)).stdout
    assert text.count(" spoofed=") == len(cfg.hosts) and "switch ports:" in text
    assert {h["name"] for h in st["hosts"]} == {h.name for h in cfg.hosts}
    for h in st["hosts"]:
        want = cfg.host(h["name"])
        assert (h["role"], h["ip"], h["mac"], h["namespace"], h["interface"]) == (
            want.role, want.ip, want.mac, f"{PREFIX}-{want.name}", f"{PREFIX}-{want.name}")
        # the interface really carries the configured address, MAC and MTU
        show = _cli("exec", "--config", str(cfg_file), h["name"], "--", "ip", "-j", "addr",
                    "show", "dev", h["interface"]).stdout
        link = json.loads(show)[0]
        assert link["address"] == want.mac and link["mtu"] == cfg.network.mtu
        assert any(a.get("local") == want.ip and a.get("prefixlen") == 24
                   for a in link["addr_info"])
    # exit codes pass through
    assert _cli("exec", "--config", str(cfg_file), "t0", "--", "sh", "-c", "exit 7",
                check_rc=7).returncode == 7
    _cli("down", "--config", str(cfg_file))
    assert _leftovers(PREFIX) == []
    assert not json.loads(_cli("status", "--config", str(cfg_file), "--json").stdout)["up"]


def test_down_stops_recorded_processes_and_up_survives_stale_state(cfg_file):
    from checkmate.testbed.topology import Testbed, proc_start_time

    cfg = config.load(cfg_file)
    tb = Testbed(cfg)
    tb.up()
    sleeper = tb.spawn("s0", ["sleep", "300"], "sleeper")
    assert proc_start_time(sleeper.pid) is not None
    # a crashed `up`: state file garbage, namespaces and pins left behind
    (tb.state_dir / "state.json").write_text("{not json")
    _cli("up", "--config", str(cfg_file), "--no-controller")  # clears the stale objects
    assert json.loads(_cli("status", "--config", str(cfg_file), "--json").stdout)["up"]
    sleeper2 = tb.spawn("t1", ["sleep", "300"], "sleeper2")
    # the first sleeper lost its record with the garbage state; stop it ourselves (by PID)
    sleeper.kill()
    sleeper.wait()
    _cli("down", "--config", str(cfg_file))  # another process stops sleeper2 from the record
    assert sleeper2.wait(timeout=5) == -15  # SIGTERM from `testbed down`
    assert _leftovers(PREFIX) == []
    _cli("down", "--config", str(cfg_file))  # down twice: still fine


def test_down_leaves_a_recycled_pid_alone(cfg_file):
    from checkmate.testbed.topology import stop_pid

    other = subprocess.Popen(["sleep", "30"])
    try:
        assert not stop_pid(other.pid, start=1)  # wrong start time: not ours
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


def test_controller_started_in_switch_namespace_and_stopped(cfg_file):
    res = _cli("up", "--config", str(cfg_file))
    st = json.loads(_cli("status", "--config", str(cfg_file), "--json").stdout)
    pid = st["switch"]["controller_pid"]
    assert pid, res.stderr
    sw_ns = os.stat(f"/run/netns/{PREFIX}-sw0").st_ino
    assert os.stat(f"/proc/{pid}/ns/net").st_ino == sw_ns
    _cli("down", "--config", str(cfg_file))
    deadline = time.monotonic() + 5
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{pid}").exists() or \
        Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z"
    assert _leftovers(PREFIX) == []


@pytest.mark.parametrize("args", [
    ["up", "--config", "/nonexistent.yaml"],
    ["status", "--bogus"],
    ["exec", "nosuchhost", "--", "true"],
    ["exec", "t0"],
])
def test_bad_input_is_one_line(args):
    res = _cli(*args, check_rc=None)
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_bad_config_is_one_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("job: {id: 7}\nswitch: {name: sw0}\nhosts: []\n")
    res = _cli("up", "--config", str(p), check_rc=None)
    assert res.returncode == 2 and "hosts" in res.stderr and "Traceback" not in res.stderr


def test_demo_installs_ring_entries_sends_and_cleans_up(cfg_file):
    from checkmate.dataplane.switch import KernelSwitch

    cfg = config.load(cfg_file)
    _cli("up", "--config", str(cfg_file), "--no-controller")
    res = _cli("demo", "--config", str(cfg_file), "--count", "3")
    copies = 3 * len(cfg.trainers) * cfg.num_partitions
    assert f"shadow copies: {copies} of {copies} expected" in res.stdout
    sw = KernelSwitch(cfg)
    assert sw.replication_entries() == []  # the demo removed the entries it installed
    ports = sw.counters()["ports"]
    assert sum(p["replicated"] for p in ports.values()) == copies
    assert all(ports[cfg.switch_ifname(t.name)]["replicated"] == 3 * cfg.num_partitions
               for t in cfg.trainers)
    _cli("down", "--config", str(cfg_file))


def test_demo_without_testbed_is_one_line(cfg_file):
    res = _cli("demo", "--config", str(cfg_file), check_rc=2)
    assert "testbed up" in res.stderr and "Traceback" not in res.stderr
