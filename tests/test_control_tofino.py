"""Tofino specifics of the controller: dev ports, the bfrt_python port/PFC script, and the
packing of bf-p4c output (the P4Runtime side is in test_control_p4runtime.py).

The script is run against a TEST DOUBLE of bfshell's ``bfrt`` object that holds the tables
the script uses with the keys and data fields of the SDE 9.x BF Runtime (tf1.tm.ppg.cfg
keyed by pipe and ppg_id with boolean icos_0..icos_7; tf1.tm.port.flowcontrol keyed by
dev_port; tf1.tm.pool.cfg keyed by pool; port.port keyed by DEV_PORT) and refuses unknown
fields and wrong key sets, as bfrt_python does. Not modelled: the value ranges the SDE
checks (cell counts against the buffer size, PPG ids against the pipe's free PPGs), the
port state machine, and anything the script does not call.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from checkmate import config
from checkmate.control import devports, pfc, pipeline
from checkmate.control import plan as plan_mod
from checkmate.control.drivers import tofino
from checkmate.errors import CheckmateError

TOFINO0 = Path(__file__).resolve().parents[1] / "testbed" / "tofino0.yaml"


class _Table:
    def __init__(self, name: str, keys: set[str], fields: set[str], log: list) -> None:
        self.name, self.keys, self.fields, self.log = name, keys, fields, log
        self.entries: dict[tuple, dict] = {}

    def _split(self, kw: dict) -> tuple[tuple, dict]:
        keys = {k for k in kw if k in self.keys}
        if keys != self.keys:
            raise KeyError(f"{self.name}: key fields {sorted(self.keys)}, got {sorted(keys)}")
        unknown = set(kw) - self.keys - self.fields
        if unknown:
            raise KeyError(f"{self.name}: no field(s) {sorted(unknown)}")
        return tuple(sorted((k, kw[k]) for k in self.keys)), {
            k: v for k, v in kw.items() if k not in self.keys}

    def add(self, **kw) -> None:
        key, data = self._split(kw)
        if key in self.entries:
            raise KeyError(f"{self.name}: {key} exists")
        self.entries[key] = data
        self.log.append((self.name, "add", key))

    def add_with_dev_port(self, **kw) -> None:  # ppg.cfg's action-style add
        self.add(**kw)

    def mod(self, **kw) -> None:
        key, data = self._split(kw)
        self.entries.setdefault(key, {}).update(data)
        self.log.append((self.name, "mod", key))


class FakeBfrt:
    """bfshell's ``bfrt`` for the tables the port script touches (module docstring)."""

    def __init__(self) -> None:
        self.log: list = []
        ns = type("ns", (), {})
        self.port = ns()
        self.port.port = _Table("port.port", {"DEV_PORT"}, {
            "SPEED", "FEC", "PORT_ENABLE", "TX_MTU", "RX_MTU", "TX_PFC_EN_MAP",
            "RX_PFC_EN_MAP", "AUTO_NEGOTIATION", "TX_PAUSE_FRAME_EN", "RX_PAUSE_FRAME_EN"},
            self.log)
        self.tf1 = ns()
        self.tf1.tm = tm = ns()
        tm.ppg, tm.port, tm.pool = ns(), ns(), ns()
        tm.ppg.cfg = _Table("tf1.tm.ppg.cfg", {"pipe", "ppg_id"}, {
            "dev_port", *(f"icos_{i}" for i in range(8)), "pfc_enable", "guaranteed_cells",
            "hysteresis_cells", "pfc_skid_max_cells", "pool_id", "pool_max_cells",
            "dynamic_baf", "ingress_drop_limit"}, self.log)
        tm.port.flowcontrol = _Table("tf1.tm.port.flowcontrol", {"dev_port"},
                                     {"mode_tx", "mode_rx", "cos_to_icos"}, self.log)
        tm.pool.cfg = _Table("tf1.tm.pool.cfg", {"pool"}, {"size_cells"}, self.log)


@pytest.fixture
def cfg() -> config.ClusterConfig:
    return config.load(TOFINO0)


def run_script(plan: plan_mod.Plan) -> FakeBfrt:
    bfrt = FakeBfrt()
    exec(compile(tofino.bfrt_script(plan), "bfrt", "exec"), {"bfrt": bfrt})  # noqa: S102
    return bfrt


def test_bfrt_script_programs_ports_pfc_and_the_ckm_priority_group(cfg):
    plan = plan_mod.build(cfg)
    bfrt = run_script(plan)
    ports = {k[0][1]: v for k, v in bfrt.port.port.entries.items()}
    assert sorted(ports) == [0, 4, 8, 12, 128, 132]
    assert all(p["SPEED"] == "BF_SPEED_100G" and p["FEC"] == "BF_FEC_TYP_REED_SOLOMON"
               and p["TX_PFC_EN_MAP"] == p["RX_PFC_EN_MAP"] == 1 << pfc.CKM_PRIORITY
               for p in ports.values())
    fc = bfrt.tf1.tm.port.flowcontrol.entries
    assert {k[0][1] for k in fc} == set(ports)
    assert all(v == {"mode_tx": "PFC", "mode_rx": "PFC", "cos_to_icos": list(range(8))}
               for v in fc.values())
    ppgs = bfrt.tf1.tm.ppg.cfg.entries
    # keyed by (pipe, ppg_id): t0..t3 in pipe 0, the shadows in pipe 1, ids from 1 per pipe
    assert {(dict(k)["pipe"], dict(k)["ppg_id"], v["dev_port"]) for k, v in ppgs.items()} == {
        (0, 1, 0), (0, 2, 4), (0, 3, 8), (0, 4, 12), (1, 1, 128), (1, 2, 132)}
    s = pfc.pfc_settings(100, 3, 9000)
    for v in ppgs.values():
        assert [v[f"icos_{i}"] for i in range(8)] == [i == pfc.CKM_PRIORITY for i in range(8)]
        assert v["pfc_enable"] is True and v["pool_id"] == tofino.CKM_POOL
        assert v["guaranteed_cells"] == s.xoff_cells == 340
        assert v["hysteresis_cells"] == s.xoff_cells - s.xon_cells == 226
        assert v["pfc_skid_max_cells"] == s.headroom_cells == 931
    (pool,) = bfrt.tf1.tm.pool.cfg.entries.values()
    assert pool == {"size_cells": 6 * (340 + 931)}  # xoff + headroom per port (docs/pfc.md)


def test_the_old_icos_mask_script_would_be_refused():
    """The double is strict: the field the earlier script used does not exist."""
    bfrt = FakeBfrt()
    with pytest.raises(KeyError, match="icos_mask"):
        bfrt.tf1.tm.ppg.cfg.add(pipe=0, ppg_id=1, icos_mask=8)
    with pytest.raises(KeyError, match="key fields"):
        bfrt.tf1.tm.ppg.cfg.add(dev_port=5, pfc_enable=True)


def test_script_is_written_on_dry_runs_too(cfg, tmp_path, monkeypatch):
    monkeypatch.setenv("CHECKMATE_P4_BUILD", str(tmp_path / "b"))
    path = tofino.write_script(plan_mod.build(cfg))
    assert path == tmp_path / "b" / "tofino0-ports.bfrt.py"
    assert path.read_text() == tofino.bfrt_script(plan_mod.build(cfg))


@pytest.mark.parametrize("port,speed,pipes,needle", [
    (2, 100, 4, "must start on a multiple of 4"),
    (64, 100, 4, "not a front-panel port"),
    (384 + 8, 100, 2, "pipe 3; this switch has 2 pipes"),
    (8, 200, 4, "Tofino 1 ports run at"),
])
def test_bad_dev_ports(port, speed, pipes, needle):
    with pytest.raises(CheckmateError, match=needle):
        devports.check_host_port(port, speed, pipes, "host x")


def test_good_dev_ports_and_cpu_ports():
    for port, speed in ((0, 100), (132, 100), (2, 50), (3, 25), (0x80 | 60, 40)):
        devports.check_host_port(port, speed, 4, "host x")
    devports.check_cpu_port(320, 4)
    devports.check_cpu_port(192, 2)
    devports.check_cpu_port(64, 4)
    with pytest.raises(CheckmateError, match="not a Tofino CPU port"):
        devports.check_cpu_port(64 + 256, 2)


def test_plan_refuses_misplaced_ports(cfg):
    hosts = tuple(replace(h, switch_port=1) if h.name == "t0" else h for h in cfg.hosts)
    with pytest.raises(CheckmateError, match="host t0: a 100G port uses 4 lanes"):
        plan_mod.build(replace(cfg, hosts=hosts))
    with pytest.raises(CheckmateError, match="switch.cpu_port 193 is not a Tofino CPU port"):
        plan_mod.build(replace(cfg, switch=replace(cfg.switch, cpu_port=64 + 129)))
    plan_mod.build(replace(cfg, switch=replace(cfg.switch, cpu_port=64)))  # Ethernet CPU


def test_stratum_packing_is_a_bf_pipeline_config():
    blob = pipeline.stratum_config("p", b"B" * 300, b"C", b"\x00\x01", [0, 2])
    # field 1 (p4_name), 2 (bfruntime_info, 300 bytes: two-byte length), 3 (profile)
    assert blob[:3] == b"\x0a\x01p" and blob[3:6] == b"\x12\xac\x02"
    profile = blob[6 + 300:]
    assert profile[0] == 0x1A
    assert profile[2:] == (b"\x0a\x04pipe" + b"\x12\x01C" + b"\x1a\x02\x00\x01"
                           + b"\x22\x02\x00\x02")
