"""`control` CLI: bad input is one line on stderr and a non-zero exit, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from checkmate.config import cluster as config


def control(*args: str, state: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if state is not None:
        env["CHECKMATE_CONTROL_STATE"] = str(state)
        env["CHECKMATE_P4_BUILD"] = str(state.parent / "build")  # scripts out of the repo
    return subprocess.run([sys.executable, "-m", "checkmate.control.cli", *args],
                          capture_output=True, text=True, timeout=60, env=env)


def one_error_line(r: subprocess.CompletedProcess, needle: str) -> None:
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("control: error: ") and needle in lines[0], lines[0]


TOFINO0 = Path(__file__).resolve().parents[1] / "testbed" / "tofino0.yaml"


def write_cfg(tmp_path: Path, base: Path | None = None, **switch) -> Path:
    data = yaml.safe_load((base or Path(config.default_path())).read_text())
    data["switch"].update(switch)
    for k, v in list(data["switch"].items()):
        if v is None:
            del data["switch"][k]
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def test_dry_run_prints_plan_without_a_switch(tmp_path):
    r = control("deploy", "--switch", "sw0", "--dry-run", state=tmp_path / "s.json")
    assert r.returncode == 0, r.stderr
    assert "replication entries (8):" in r.stdout
    assert "group 4096: port 1 rid 0, port 5 rid 1" in r.stdout
    assert "headroom 74480 B" in r.stdout


def test_tofino_dry_run_prints_p4runtime_entries_and_bfrt_script(tmp_path):
    """`control deploy --switch tofino0 --dry-run` as documented: no --config (the shipped
    tofino0 config is found by its switch's name), no switch; the script lands in the build
    folder."""
    env_build = tmp_path / "build"
    r = subprocess.run([sys.executable, "-m", "checkmate.control.cli", "deploy", "--switch",
                        "tofino0", "--dry-run"], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "CHECKMATE_CONTROL_STATE": str(tmp_path / "s.json"),
                            "CHECKMATE_P4_BUILD": str(env_build)})
    assert r.returncode == 0, r.stderr
    assert "plan for switch tofino0 (tofino)" in r.stdout
    assert r.stdout.count("ckm_replicate [") == 8
    assert "P4Runtime entries (tna):" in r.stdout
    script = (env_build / "tofino0-ports.bfrt.py").read_text()
    assert f"bfrt_python port script (written to {env_build / 'tofino0-ports.bfrt.py'}):" \
        in r.stdout
    assert script in r.stdout and "port.add(DEV_PORT=132," in script
    assert "tm.ppg.cfg.add_with_dev_port(pipe=1, ppg_id=2, dev_port=132," in script
    # the host commands map the DSCP the sockets mark to the PFC priority
    assert "dscp-prio 24:3" in r.stdout
    # no compiled build in this folder: the dry run says what a deploy would lack
    assert "pipeline config: none to push yet (" in r.stdout and "make p4" in r.stdout


def test_tofino_deploy_without_a_switch_is_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "checkmate.control.cli", "deploy", "--switch",
                        "tofino0"], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "CHECKMATE_CONTROL_STATE": str(tmp_path / "s.json"),
                            "CHECKMATE_P4_BUILD": str(tmp_path / "build")})
    one_error_line(r, "no P4Runtime server answers at localhost:9559")
    assert (tmp_path / "build" / "tofino0-ports.bfrt.py").is_file()


def test_tofino_needs_valid_dev_ports(tmp_path):
    """bmv2's port habit (1 + index) is refused on Tofino, as are misaligned lanes."""
    path = write_cfg(tmp_path, target="tofino", address="192.0.2.1:9559", cpu_port=320)
    one_error_line(control("deploy", "--switch", "sw0", "--config", str(path), "--dry-run",
                           state=tmp_path / "s.json"), "host t0 has no switch_port")
    data = yaml.safe_load(TOFINO0.read_text())
    data["hosts"][1]["switch_port"] = 6  # a 100G port must start on a multiple of 4
    path.write_text(yaml.safe_dump(data))
    one_error_line(control("deploy", "--switch", "tofino0", "--config", str(path),
                           "--dry-run", state=tmp_path / "s.json"),
                   "host t1: a 100G port uses 4 lanes")


@pytest.mark.parametrize("args,needle", [
    (["deploy", "--switch", "nope"],
     "unknown switch 'nope' (the shipped configs have 'sw0', 'tofino0'"),
    (["status", "--switch", "nope"], "unknown switch 'nope'"),
    (["deploy"], "the following arguments are required: --switch"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["deploy", "--switch", "sw0", "--config", "/nonexistent.yaml"], "cannot read config"),
])
def test_bad_arguments(args, needle, tmp_path):
    one_error_line(control(*args, state=tmp_path / "s.json"), needle)


def test_malformed_configs(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("job: {id: 7\n  oops")
    one_error_line(control("deploy", "--switch", "sw0", "--config", str(bad)), "not valid YAML")
    bad.write_text(yaml.safe_dump({"job": {"id": 7}, "switch": {"name": "sw0"}, "hosts": []}))
    one_error_line(control("deploy", "--switch", "sw0", "--config", str(bad)),
                   "hosts must be a non-empty list")


def test_tofino_without_address_or_reachable_switch(tmp_path):
    path = write_cfg(tmp_path, TOFINO0, address=None)
    one_error_line(control("deploy", "--switch", "tofino0", "--config", str(path),
                           state=tmp_path / "s.json"), "switch.address")
    path = write_cfg(tmp_path, TOFINO0, address="127.0.0.1:1")
    one_error_line(control("deploy", "--switch", "tofino0", "--config", str(path),
                           state=tmp_path / "s.json"), "no P4Runtime server answers")


def test_kernel_switch_down(tmp_path):
    data = yaml.safe_load(Path(config.default_path()).read_text())
    data["network"]["prefix"] = "tbnx"
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    for cmd in ("deploy", "status"):
        one_error_line(control(cmd, "--switch", "sw0", "--config", str(path),
                               state=tmp_path / "s.json"), "kernel switch sw0 is not up")


def test_corrupt_state_file(tmp_path):
    state = tmp_path / "s.json"
    state.write_text("{not json")
    one_error_line(control("deploy", "--switch", "sw0", "--dry-run", state=state),
                   "controller state")
