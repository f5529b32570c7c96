"""`control` CLI: bad input is one line on stderr and a non-zero exit, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from checkmate import config


def control(*args: str, state: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if state is not None:
        env["CHECKMATE_CONTROL_STATE"] = str(state)
    return subprocess.run([sys.executable, "-m", "checkmate.control.cli", *args],
                          capture_output=True, text=True, timeout=60, env=env)


def one_error_line(r: subprocess.CompletedProcess, needle: str) -> None:
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("control: error: ") and needle in lines[0], lines[0]


def write_cfg(tmp_path: Path, **switch) -> Path:
    data = yaml.safe_load(Path(config.default_path()).read_text())
    data["switch"].update(switch)
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
    path = write_cfg(tmp_path, target="tofino", address="192.0.2.1:9559")
    r = control("deploy", "--switch", "sw0", "--config", str(path), "--dry-run",
                state=tmp_path / "s.json")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("ckm_replicate [") == 8
    assert "bfrt_python port script:" in r.stdout and "port.add(DEV_PORT=6," in r.stdout


@pytest.mark.parametrize("args,needle", [
    (["deploy", "--switch", "nope"], "unknown switch 'nope' (the config has 'sw0')"),
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
    path = write_cfg(tmp_path, target="tofino")
    one_error_line(control("deploy", "--switch", "sw0", "--config", str(path),
                           state=tmp_path / "s.json"), "switch.address")
    path = write_cfg(tmp_path, target="tofino", address="127.0.0.1:1")
    one_error_line(control("deploy", "--switch", "sw0", "--config", str(path),
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
