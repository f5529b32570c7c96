"""Tofino specifics of the controller: dev ports, the bfrt_python port/PFC script, and the
packing of bf-p4c output (the P4Runtime side is in test_control_p4runtime.py).

The script is run against a TEST DOUBLE of bfshell's ``bfrt`` object built from the SDE's
own published definitions, not from what our code believes. Source: the open-source Tofino
SDE, github.com/p4lang/open-p4studio at commit 1f97778f9ad5c8165bfce552fffe27c69887756b
(paths below are under pkgsrc/bf-drivers/):

- tables, keys, data fields, action fields, types, choices, read-only fields and the
  supported operations: src/bf_rt/bf_rt_tm/bf_rt_tm_tf1.json (line of each table in TM)
  and src/bf_rt/bf_rt_port/bf_rt_port_tf1.json (``$PORT``, lines 4-205);
- how bfrt_python turns them into methods: src/bf_rt/bf_rt_python/bfrtcli.py (``add``
  only when the table supports tableEntryAdd, line 1530; ``add_with_<action>``, line 1500;
  ``mod`` / ``mod_with_<action>``, lines 1621-1681; ``set_default``, line 1583; every
  method takes the target as ``pipe=``, line 1511);
- the state a switch starts in: src/traffic_mgr/init/tm_tofino.h and tm_tofino_default.h
  (pool sizes, via control/drivers/tofino_tm.py which cites each line),
  tm_tofino_default.c:167-172 (pool PFC limit: the pool size for IG_APP_POOL_0, 0 for the
  others), tm_api_pool.c:285 (skid pool 0) and :388-390 (the global gmin pool is settable
  on Tofino 2 and later only).

Not modelled: the port state machine, PPG id exhaustion, queue tables, hysteresis rounding
to 8 cells, and the hardware's own admission arithmetic; `audit` checks the carving a
lossless class needs against these definitions (module tests below).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from checkmate.config import cluster as config
from checkmate.control import devports, pfc, pipeline
from checkmate.control import plan as plan_mod
from checkmate.control.drivers import tofino, tofino_tm
from checkmate.errors import CheckmateError

TOFINO0 = Path(__file__).resolve().parents[1] / "testbed" / "tofino0.yaml"
#: `control deploy --switch tofino0 --dry-run`'s script as of fc59cb5, before issue 26.
OLD_SCRIPT = Path(__file__).resolve().parent / "fixtures" / "tofino0-ports.fc59cb5.bfrt.txt"
IG_APP_POOLS = tuple(f"IG_APP_POOL_{i}" for i in range(4))
UINT32 = 1 << 32


@dataclass(frozen=True)
class F:
    """One BF Runtime field: its json type, choices and flags."""

    type: str  # "uint32", "uint8", "bool", "string", "bytes3", "uint8[]"
    choices: tuple[str, ...] = ()
    read_only: bool = False
    mandatory: bool = False

    def check(self, table: str, name: str, value) -> None:
        ok = {
            "uint32": lambda v: isinstance(v, int) and not isinstance(v, bool)
            and 0 <= v < UINT32,
            "uint8": lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 256,
            "bytes3": lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 8,
            "bool": lambda v: isinstance(v, bool),
            "string": lambda v: isinstance(v, str) and (not self.choices or v in self.choices),
            "uint8[]": lambda v: isinstance(v, list) and all(
                isinstance(x, int) and 0 <= x < 256 for x in v),
        }[self.type](value)
        if not ok:
            raise ValueError(f"{table}: {name}={value!r} is not a valid {self.type}"
                             + (f" (choices {list(self.choices)})" if self.choices else ""))


@dataclass
class TableDef:
    name: str
    cite: str
    keys: dict[str, F]
    data: dict[str, F] = field(default_factory=dict)
    actions: dict[str, dict[str, F]] = field(default_factory=dict)
    methods: frozenset[str] = frozenset()  # bfrt_python methods the SDE generates
    pipe_target: bool = False  # target attributes include pipe_id


_U32 = F("uint32")
_BOOL = F("bool")
SCHEMA = {t.name: t for t in (
    TableDef("port.port", "bf_rt_port_tf1.json:4-205", {"DEV_PORT": _U32}, {
        "SPEED": F("string", ("BF_SPEED_NONE", "BF_SPEED_1G", "BF_SPEED_10G", "BF_SPEED_25G",
                              "BF_SPEED_40G", "BF_SPEED_40G_NB", "BF_SPEED_40G_NON_BREAKABLE",
                              "BF_SPEED_50G", "BF_SPEED_100G", "BF_SPEED_200G",
                              "BF_SPEED_400G")),
        "FEC": F("string", ("BF_FEC_TYP_NONE", "BF_FEC_TYP_FIRECODE", "BF_FEC_TYP_REED_SOLOMON",
                            "BF_FEC_TYP_FC", "BF_FEC_TYP_RS")),
        "N_LANES": _U32, "PORT_ENABLE": _BOOL, "TX_MTU": _U32, "RX_MTU": _U32,
        "TX_PFC_EN_MAP": _U32, "RX_PFC_EN_MAP": _U32, "TX_PAUSE_FRAME_EN": _BOOL,
        "RX_PAUSE_FRAME_EN": _BOOL, "CUT_THROUGH_EN": _BOOL,
        "AUTO_NEGOTIATION": F("string", ("PM_AN_DEFAULT", "PM_AN_FORCE_ENABLE",
                                         "PM_AN_FORCE_DISABLE"))},
        methods=frozenset({"add", "mod"})),
    TableDef("tf1.tm.ppg.cfg", "bf_rt_tm_tf1.json:466-745", {"ppg_id": F("uint8")}, {
        **{f"icos_{i}": _BOOL for i in range(8)},
        "guaranteed_cells": _U32, "hysteresis_cells": _U32,
        "pool_id": F("string", IG_APP_POOLS), "pool_max_cells": _U32,
        "dynamic_baf": F("string", ("1.5%", "3%", "6%", "11%", "20%", "33%", "50%", "66%",
                                    "80%", "DISABLE")),
        "ppg_counter_id": F("uint8", read_only=True)},
        actions={"dev_port": {"dev_port": _U32, "pfc_enable": _BOOL,
                              "pfc_skid_max_cells": _U32},
                 "mirror_port": {}},
        methods=frozenset({"add", "mod"}), pipe_target=True),
    TableDef("tf1.tm.port.flowcontrol", "bf_rt_tm_tf1.json:1444-1540", {"dev_port": _U32}, {
        "mode_tx": F("string", ("NONE", "PFC", "PAUSE")),
        "mode_rx": F("string", ("NONE", "PFC", "PAUSE"), read_only=True),
        "cos_to_icos": F("uint8[]")}, methods=frozenset({"mod"})),
    TableDef("tf1.tm.pool.cfg", "bf_rt_tm_tf1.json:765-838", {"pool": F("string", (
        *IG_APP_POOLS, *(f"EG_APP_POOL_{i}" for i in range(4)), "IG_SKID_POOL",
        "IG_EG_NEGATIVE_MIRROR_POOL", "EG_PRE_FIFO", "IG_EG_GUARANTEED_MIN",
        "EG_UNICAST_CUT_THROUGH", "EG_MULTICAST_CUT_THROUGH"))}, {"size_cells": _U32},
        methods=frozenset({"mod"})),
    TableDef("tf1.tm.pool.skid", "bf_rt_tm_tf1.json:840-882", {},
             {"resume_limit_cells": _U32}, methods=frozenset({"set_default"})),
    TableDef("tf1.tm.pool.app", "bf_rt_tm_tf1.json:884-980", {"pool": F("string", (
        *IG_APP_POOLS, *(f"EG_APP_POOL_{i}" for i in range(4))))},
        actions={"color_drop_disable": {}, "color_drop_enable": {
            "green_limit_cells": _U32, "yellow_limit_cells": _U32, "red_limit_cells": _U32}},
        methods=frozenset({"mod"})),
    TableDef("tf1.tm.pool.app_pfc", "bf_rt_tm_tf1.json:1050-1120", {
        "pool": F("string", IG_APP_POOLS), "cos": F("bytes3")},
        {"pfc_limit_cells": F("uint32", mandatory=True)}, methods=frozenset({"mod"})),
)}


class RefusedError(Exception):
    """What bfrt_python / BF Runtime would answer with an error."""


class SdeTable:
    """One table of the double: methods generated from its TableDef as bfrtcli.py does."""

    def __init__(self, tdef: TableDef, state: dict) -> None:
        self.tdef, self.entries = tdef, state.setdefault(tdef.name, {})
        for method in tdef.methods:
            if method == "set_default":
                self.set_default = self._set_default
                continue
            if tdef.data or not tdef.actions:
                setattr(self, method, self._bind(method, None))
            for action in tdef.actions:
                setattr(self, f"{method}_with_{action}", self._bind(method, action))

    def _bind(self, method: str, action: str | None):
        def call(pipe: int | None = None, **kw) -> None:
            self._write(method, action, pipe, kw)
        return call

    def _fields(self, action: str | None) -> dict[str, F]:
        return {**self.tdef.data, **(self.tdef.actions.get(action, {}) if action else {})}

    def _write(self, method: str, action: str | None, pipe: int | None, kw: dict) -> None:
        t = self.tdef
        if pipe is not None and not t.pipe_target:
            raise RefusedError(f"{t.name}: no pipe target ({t.cite})")
        if t.pipe_target and pipe is None and method == "add":
            raise RefusedError(f"{t.name}: entries live in one pipe: pass pipe= ({t.cite})")
        missing = set(t.keys) - set(kw)
        if missing:
            raise RefusedError(f"{t.name}: key field(s) {sorted(missing)} missing ({t.cite})")
        fields = self._fields(action)
        for name, value in kw.items():
            f = t.keys.get(name) or fields.get(name)
            if f is None:
                raise RefusedError(f"{t.name}: no field {name!r} ({t.cite})")
            if f.read_only:
                raise RefusedError(f"{t.name}: {name} is read-only ({t.cite})")
            f.check(t.name, name, value)
        for name, f in fields.items():
            if f.mandatory and name not in kw:
                raise RefusedError(f"{t.name}: {name} is mandatory ({t.cite})")
        key = (pipe, *((k, kw[k]) for k in sorted(t.keys)))
        data = {k: v for k, v in kw.items() if k not in t.keys}
        if action is not None:
            data["$action"] = action
        if method == "add":
            if key in self.entries:
                raise RefusedError(f"{t.name}: entry {key} exists")
            self.entries[key] = data
        else:
            self.entries.setdefault(key, {}).update(data)

    def _set_default(self, **kw) -> None:
        self._write("set_default", None, None, kw)


class SdeBfrt:
    """bfshell's ``bfrt`` for the tables of SCHEMA, starting from the SDE's default TM
    carving (module docstring); ``pool_cells`` is the pool sizes after the script ran."""

    def __init__(self) -> None:
        self.state: dict = {}
        ns = type("ns", (), {})
        for name, tdef in SCHEMA.items():
            node = self
            *path, leaf = name.split(".")
            for part in path:
                if not hasattr(node, part):
                    setattr(node, part, ns())
                node = getattr(node, part)
            setattr(node, leaf, SdeTable(tdef, self.state))
        self.pool_cells = {
            "IG_APP_POOL_0": tofino_tm.DEFAULT_APP_POOL_0_CELLS,
            "IG_APP_POOL_1": 0, "IG_APP_POOL_2": 0, "IG_APP_POOL_3": 0,
            "IG_SKID_POOL": tofino_tm.DEFAULT_SKID_CELLS,
            "IG_EG_NEGATIVE_MIRROR_POOL": tofino_tm.DEFAULT_MIRROR_CELLS,
        }

    def run(self, script: str) -> SdeBfrt:
        exec(compile(script, "bfrt", "exec"), {"bfrt": self})  # noqa: S102
        for key, data in self.state.get("tf1.tm.pool.cfg", {}).items():
            pool = dict(key[1:])["pool"]
            if pool == "IG_EG_GUARANTEED_MIN":  # tm_api_pool.c:388-390
                raise RefusedError("IG_EG_GUARANTEED_MIN: Tofino 2 and later only")
            self.pool_cells[pool] = data["size_cells"]
        return self

    def pool_pfc_limit(self, pool: str, cos: int) -> int:
        """tm_tofino_default.c:167-172: the pool size for IG_APP_POOL_0, else 0."""
        for key, data in self.state.get("tf1.tm.pool.app_pfc", {}).items():
            if dict(key[1:]) == {"pool": pool, "cos": cos}:
                return data["pfc_limit_cells"]
        return tofino_tm.DEFAULT_APP_POOL_0_CELLS if pool == "IG_APP_POOL_0" else 0

    def color_drop(self, pool: str) -> bool:
        """Color drop is on by default (tm_api_pool.c:76); mod_with_color_drop_disable
        turns it off."""
        entry = self.state.get("tf1.tm.pool.app", {}).get((None, ("pool", pool)), {})
        return entry.get("$action") != "color_drop_disable"

    def audit(self) -> list[str]:
        """What a lossless class needs of the TM, read against the SDE's semantics; one
        line per violation."""
        bad: list[str] = []
        ppgs = [d for d in self.state.get("tf1.tm.ppg.cfg", {}).values() if d.get("pfc_enable")]
        if not ppgs:
            return ["no PFC-enabled PPG"]
        pools = {d.get("pool_id", "IG_APP_POOL_0") for d in ppgs}
        for pool in sorted(pools):
            members = [d for d in ppgs if d.get("pool_id", "IG_APP_POOL_0") == pool]
            want = sum(d.get("pool_max_cells", 0) for d in members)
            if self.pool_cells[pool] < want:
                bad.append(f"{pool}: {self.pool_cells[pool]} cells < its PPGs' "
                           f"pool_max_cells {want}")
            if pool != "IG_APP_POOL_0" and self.color_drop(pool):
                bad.append(f"{pool}: color drop left on, a lossless pool would drop")
        for d in ppgs:
            if d.get("pool_max_cells", 0) == 0:  # bf_rt_tm_tf1.json:674
                bad.append(f"PPG on dev_port {d['dev_port']}: pool_max_cells 0, its pool_id "
                           "is inactive and the pool buys it nothing")
            icos = [i for i in range(8) if d.get(f"icos_{i}")]
            for pool in {d.get("pool_id", "IG_APP_POOL_0")}:
                for cos in icos:  # identity cos_to_icos
                    if self.pool_pfc_limit(pool, cos) == 0:
                        bad.append(f"{pool}: PFC limit 0 for cos {cos} (SDE default for "
                                   "pools other than 0)")
        for d in ppgs:  # bf_rt_tm_tf1.json:689: past pool_max_cells a PPG with a BAF
            # grows into whatever buffer is free, so pool_max no longer bounds its share
            if d.get("dynamic_baf") != "DISABLE":
                bad.append(f"PPG on dev_port {d['dev_port']}: dynamic_baf not DISABLE, its "
                           "share of the pool is unbounded by pool_max_cells")
        skid = sum(d.get("pfc_skid_max_cells", 0) for d in ppgs)
        if self.pool_cells["IG_SKID_POOL"] < skid:
            bad.append(f"IG_SKID_POOL: {self.pool_cells['IG_SKID_POOL']} cells < the "
                       f"lossless PPGs' headroom {skid}")
        if any(d.get("pfc_skid_max_cells", 0) == 0 for d in ppgs):
            bad.append("a PFC-enabled PPG has no skid (headroom) cells")
        lossless = sum(self.pool_cells[p] for p in pools if p != "IG_APP_POOL_0")
        pool0 = self.pool_cells["IG_APP_POOL_0"]
        if pool0 < tofino_tm.DEFAULT_APP_POOL_0_CELLS - lossless:
            bad.append(f"IG_APP_POOL_0 (every default PPG, all lossy traffic) shrunk to "
                       f"{pool0} cells from the SDE's {tofino_tm.DEFAULT_APP_POOL_0_CELLS}, "
                       f"more than the lossless pool's {lossless}")
        gmin = sum(d.get("guaranteed_cells", 0) for d in ppgs)
        total = sum(self.pool_cells.values()) + tofino_tm.DEFAULT_GMIN_CELLS + gmin
        if total > tofino_tm.BUFFER_CELLS:
            bad.append(f"ingress carving {total} cells > Tofino's {tofino_tm.BUFFER_CELLS}")
        return bad


@pytest.fixture
def cfg() -> config.ClusterConfig:
    return config.load(TOFINO0)


def run_script(plan: plan_mod.Plan) -> SdeBfrt:
    return SdeBfrt().run(tofino.bfrt_script(plan))


def test_bfrt_script_programs_ports_pfc_and_the_ckm_priority_group(cfg):
    plan = plan_mod.build(cfg)
    bfrt = run_script(plan)
    assert bfrt.audit() == []
    ports = {dict(k[1:])["DEV_PORT"]: v for k, v in bfrt.state["port.port"].items()}
    assert sorted(ports) == [0, 4, 8, 12, 128, 132]
    assert all(p["SPEED"] == "BF_SPEED_100G" and p["FEC"] == "BF_FEC_TYP_REED_SOLOMON"
               and p["TX_PFC_EN_MAP"] == p["RX_PFC_EN_MAP"] == 1 << pfc.CKM_PRIORITY
               for p in ports.values())
    fc = bfrt.state["tf1.tm.port.flowcontrol"]
    assert {dict(k[1:])["dev_port"] for k in fc} == set(ports)
    assert all(v == {"mode_tx": "PFC", "cos_to_icos": list(range(8))} for v in fc.values())
    ppgs = bfrt.state["tf1.tm.ppg.cfg"]
    # pipe is the target, ppg_id the key: t0..t3 in pipe 0, the shadows in pipe 1
    assert {(k[0], dict(k[1:])["ppg_id"], v["dev_port"]) for k, v in ppgs.items()} == {
        (0, 1, 0), (0, 2, 4), (0, 3, 8), (0, 4, 12), (1, 1, 128), (1, 2, 132)}
    s = pfc.pfc_settings(100, 3, 9000)
    for v in ppgs.values():
        assert [v[f"icos_{i}"] for i in range(8)] == [i == pfc.CKM_PRIORITY for i in range(8)]
        assert v["pfc_enable"] is True and v["pool_id"] == "IG_APP_POOL_1"
        assert v["guaranteed_cells"] == 114  # one 9042 B frame in 80 B cells
        assert v["pool_max_cells"] == s.xoff_cells == 340
        assert v["hysteresis_cells"] == s.xoff_cells - s.xon_cells == 226
        assert v["pfc_skid_max_cells"] == s.headroom_cells == 931
        assert v["dynamic_baf"] == "DISABLE"
    # docs/pfc.md: lossless pool 6 x 340, skid 6 x 931, the default pool untouched
    assert bfrt.pool_cells["IG_APP_POOL_1"] == 6 * 340 == 2040
    assert bfrt.pool_cells["IG_SKID_POOL"] == 6 * 931 == 5586
    assert bfrt.pool_cells["IG_APP_POOL_0"] == 89260
    assert bfrt.pool_pfc_limit("IG_APP_POOL_1", pfc.CKM_PRIORITY) == 2040
    assert not bfrt.color_drop("IG_APP_POOL_1")


def test_sde_defaults_are_the_headers_arithmetic():
    """tm_tofino_default.h:42-74 with tm_tofino.h:33-39: 100K carved cells less the gmin
    of 73 default PPGs x 4 pipes at 40 cells and 20 mirror cells per port."""
    assert tofino_tm.DEFAULT_GMIN_CELLS == 40 * 73 * 4 == 11680
    assert tofino_tm.DEFAULT_MIRROR_CELLS == 1460
    assert tofino_tm.DEFAULT_APP_POOL_0_CELLS == 102400 - 11680 - 1460 == 89260


def test_the_double_refuses_the_script_of_fc59cb5():
    """The script before issue 26, run as it was: BF Runtime refuses it (mode_rx is
    read-only on Tofino 1), and once that line is gone its carving fails the audit: the
    default pool cut to 7626 cells, no skid pool, PPGs with pool_max_cells 0."""
    old = OLD_SCRIPT.read_text()
    assert "tm.pool.cfg.mod(pool='IG_APP_POOL_0', size_cells=7626)" in old
    with pytest.raises(RefusedError, match="mode_rx is read-only"):
        SdeBfrt().run(old)
    bad = SdeBfrt().run(old.replace(", mode_rx='PFC'", "")).audit()
    assert any(b.startswith("IG_APP_POOL_0 (every default PPG, all lossy traffic) shrunk to "
                            "7626 cells") for b in bad), bad
    assert any(b.startswith("IG_SKID_POOL: 0 cells < the lossless PPGs' headroom 5586")
               for b in bad), bad
    assert sum("pool_max_cells 0" in b for b in bad) == 6, bad
    assert sum("dynamic_baf not DISABLE" in b for b in bad) == 6, bad


@pytest.mark.parametrize("line,needle", [
    ("bfrt.tf1.tm.ppg.cfg.add_with_dev_port(pipe=0, ppg_id=1, icos_mask=8)", "no field"),
    ("bfrt.tf1.tm.ppg.cfg.add_with_dev_port(dev_port=5, pfc_enable=True, pipe=0)",
     r"key field\(s\) \['ppg_id'\]"),
    ("bfrt.tf1.tm.ppg.cfg.add_with_dev_port(ppg_id=1, dev_port=5)", "pass pipe="),
    ("bfrt.tf1.tm.ppg.cfg.add_with_dev_port(ppg_id=1, pipe=0, pool_id='IG_SKID_POOL')",
     "choices"),
    ("bfrt.tf1.tm.pool.cfg.add(pool='IG_APP_POOL_1', size_cells=1)", "no attribute 'add'"),
    ("bfrt.tf1.tm.pool.cfg.mod(pool='IG_APP_POOL_9', size_cells=1)", "choices"),
    ("bfrt.tf1.tm.pool.cfg.mod(pool='IG_EG_GUARANTEED_MIN', size_cells=1)", "Tofino 2"),
    ("bfrt.tf1.tm.pool.app_pfc.mod(pool='IG_APP_POOL_1', cos=3)", "mandatory"),
    ("bfrt.tf1.tm.pool.skid.mod(resume_limit_cells=8)", "no attribute 'mod'"),
    ("bfrt.tf1.tm.port.flowcontrol.mod(dev_port=0, mode_tx='PFC', pipe=0)", "no pipe"),
    ("bfrt.port.port.add(DEV_PORT=0, SPEED='BF_SPEED_100')", "choices"),
])
def test_the_double_refuses_what_the_sde_refuses(line, needle):
    with pytest.raises((RefusedError, ValueError, AttributeError), match=needle):
        SdeBfrt().run(line)


def test_the_audit_finds_each_missing_piece(cfg):
    """Each part of the carving, dropped from today's script, is named by the audit."""
    script = tofino.bfrt_script(plan_mod.build(cfg))
    cases = {
        "tm.pool.cfg.mod(pool='IG_SKID_POOL'": "IG_SKID_POOL: 0 cells",
        "tm.pool.cfg.mod(pool='IG_APP_POOL_1'": "IG_APP_POOL_1: 0 cells",
        "tm.pool.app_pfc.mod(": "PFC limit 0 for cos 3",
        "tm.pool.app.mod_with_color_drop_disable(": "color drop left on",
    }
    for prefix, needle in cases.items():
        cut = "\n".join(ln for ln in script.splitlines() if not ln.startswith(prefix))
        assert cut != script
        bad = SdeBfrt().run(cut).audit()
        assert any(needle in b for b in bad), (prefix, bad)
    bad = SdeBfrt().run(script.replace(", dynamic_baf='DISABLE'", "")).audit()
    assert sum("dynamic_baf not DISABLE" in b for b in bad) == 6, bad


def test_a_plan_the_buffer_cannot_hold_is_refused(cfg):
    """1000 m cables at 100G on six ports need far more skid than Tofino has."""
    plan = plan_mod.build(replace(cfg, switch=replace(cfg.switch, cable_m=10000)))
    with pytest.raises(CheckmateError, match="needs .* buffer cells .* Tofino has 286720"):
        tofino.bfrt_script(plan)


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


def test_docs_cell_table_is_the_codes():
    """docs/pfc.md's per-speed, per-cable table is what pfc and tofino_tm compute."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "pfc.md").read_text()
    table = doc[doc.index("<!-- pfc-cells-table -->"):doc.index("<!-- /pfc-cells-table -->")]
    rows = [r for r in table.splitlines() if re.match(r"\| \d+G \|", r)]
    assert len(rows) == 32
    for row in rows:
        speed, cable, mtu, *cells = (c.strip() for c in row.strip("|").split("|"))
        speed, cable, mtu = int(speed[:-1]), int(cable.split()[0]), int(mtu)
        s = pfc.pfc_settings(speed, cable, mtu)
        c = tofino_tm.ppg_cells(s, mtu)
        assert [int(x) for x in cells] == [s.headroom_bytes, c.skid, s.xoff_bytes, c.pool_max,
                                           s.xon_bytes, c.hysteresis, c.guaranteed], row
