"""The controller against a P4Runtime server running a compiler-built Checkmate program.

Nobody here has a Tofino or a bmv2 build, so the switch is a TEST DOUBLE (tests/fakes.py,
FakeSwitch: what it models and what not is in its docstring), loaded with the P4Info the
open-source p4c emitted for p4/ (tests/fixtures/p4c/: hash-based ids, TNA counters as
Tofino externs). The controller talks to it over a real gRPC channel on loopback, exactly
as it would to simple_switch_grpc, Stratum or the SDE's server, and has to find every
table, action, parameter and counter by name.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from fakes import (
    FakeSwitch,
    compiled_p4info,
    fixture_p4info,
    ip,
    stale_p4info,
    unchecked_p4info,
)
from google.protobuf import text_format

from checkmate.config import cluster as config
from checkmate.control import p4proto
from checkmate.control import plan as plan_mod
from checkmate.control.drivers import p4tables
from checkmate.control.drivers.p4runtime import P4RuntimeDriver
from checkmate.control.drivers.tofino import TofinoDriver
from checkmate.control.p4rt_client import P4RuntimeClient, TargetUnreachable
from checkmate.errors import CheckmateError

REPO = Path(__file__).resolve().parents[1]
PB = p4proto.p4runtime()


def mac(s: str) -> int:
    return int(s.replace(":", ""), 16)


def p4_cfg(target: str, address: str, **changes) -> config.ClusterConfig:
    cfg = config.load(config.default_path())
    cfg = replace(cfg, switch=replace(cfg.switch, target=target, address=address))
    return replace(cfg, **changes) if changes else cfg


@pytest.fixture
def bmv2():
    sw = FakeSwitch(compiled_p4info("v1model"))
    try:
        yield sw
    finally:
        sw.stop()


def driver(cfg, sw_arch="v1model"):
    client = P4RuntimeClient(cfg.switch.address, timeout=3)
    return P4RuntimeDriver(cfg, sw_arch, client)


# Hand-written expectation for testbed/default.yaml: 4 trainers (10.77.0.10-13, ports 1-4),
# shadows s0/s1 (10.77.0.100/101, ports 5/6), job 7. Ring hop r -> r+1; group id
# 0x1000 + dst_rank*256 + partition; shadow replica rid = partition + 1; copies only from
# the source trainer's port (10.77.0.1x is port x + 1).
RING = [("10.77.0.10", "10.77.0.11", 1), ("10.77.0.11", "10.77.0.12", 2),
        ("10.77.0.12", "10.77.0.13", 3), ("10.77.0.13", "10.77.0.10", 0)]


def src_port(src_ip: str) -> int:
    return int(src_ip.rsplit(".", 1)[1]) - 10 + 1


EXPECTED_REPLICATE = {
    ((("dst_ip", ip(d)), ("job_id", 7), ("partition", p), ("src_ip", ip(s))), "replicate",
     (("group", 0x1000 + rank * 256 + p), ("ingress_port", src_port(s))))
    for s, d, rank in RING for p in (0, 1)
}
EXPECTED_GROUPS = {
    1: {(1, 0), (2, 0), (3, 0), (4, 0), (5, 0), (6, 0), (64, 0)},
    0x1000: {(1, 0), (5, 1)}, 0x1001: {(1, 0), (6, 2)},
    0x1100: {(2, 0), (5, 1)}, 0x1101: {(2, 0), (6, 2)},
    0x1200: {(3, 0), (5, 1)}, 0x1201: {(3, 0), (6, 2)},
    0x1300: {(4, 0), (5, 1)}, 0x1301: {(4, 0), (6, 2)},
}
SW_MAC = "02:00:0a:4d:00:01"


def rewrite(rid, dmac, dip, epoch=0, token=0):
    return ((("egress_rid", rid),), "rewrite_shadow",
            tuple(sorted([("smac", mac(SW_MAC)), ("dmac", mac(dmac)), ("ip", ip(dip)),
                          ("udp_port", 47001), ("epoch", epoch), ("token", token)])))


def test_deploy_writes_exact_entries_and_groups(bmv2):
    cfg = p4_cfg("bmv2", bmv2.address)
    d = driver(cfg)
    try:
        res = d.apply(plan_mod.build(cfg))
    finally:
        d.close()
    assert bmv2.table("ckm_replicate") == EXPECTED_REPLICATE
    assert bmv2.group_map() == EXPECTED_GROUPS
    assert bmv2.table("shadow_rewrite") == {
        rewrite(1, "02:00:0a:4d:00:64", "10.77.0.100"),
        rewrite(2, "02:00:0a:4d:00:65", "10.77.0.101"),
    }
    l2 = {(m[0][1], p[0][1]) for m, a, p in bmv2.table("l2_fwd")}
    assert l2 == {(mac(f"02:00:0a:4d:00:{x:02x}"), port) for x, port in
                  [(0x0a, 1), (0x0b, 2), (0x0c, 3), (0x0d, 4), (0x64, 5), (0x65, 6)]} | {
        (mac(SW_MAC), 64)}
    assert bmv2.table("ckm_punt") == {
        ((("dst_ip", ip("10.77.0.1")), ("udp_dst_port", 48023)), "to_cpu", (("port", 64),))}
    assert all(u.type == PB.Update.INSERT for u in bmv2.updates)
    # groups, replicate, rewrite, l2_fwd, punt, port_bind (six hosts and the CPU port)
    assert res.writes == len(bmv2.updates) == 8 + 9 + 2 + 7 + 1 + 7
    assert len(bmv2.table("port_bind")) == 7 and p4tables.SOURCE_UNCHECKED not in res.notes
    # Groups are written before the entries that point at them.
    kinds = ["g" if u.entity.HasField("packet_replication_engine_entry") else "t"
             for u in bmv2.updates]
    assert kinds == sorted(kinds)


def test_redeploy_writes_nothing(bmv2):
    cfg = p4_cfg("bmv2", bmv2.address)
    for _ in range(2):
        d = driver(cfg)
        try:
            res = d.apply(plan_mod.build(cfg))
        finally:
            d.close()
    assert res.writes == 0
    assert len(bmv2.updates) == 34


def test_changed_config_removes_stale_entries(bmv2):
    cfg = p4_cfg("bmv2", bmv2.address)
    d = driver(cfg)
    try:
        d.apply(plan_mod.build(cfg))
        before = len(bmv2.updates)
        # Drop trainer t3 and shadow s1: three trainers, one partition.
        small = replace(cfg, hosts=tuple(h for h in cfg.hosts if h.name not in ("t3", "s1")))
        res = d.apply(plan_mod.build(small))
    finally:
        d.close()
    new = bmv2.updates[before:]
    ring3 = [("10.77.0.10", "10.77.0.11", 1), ("10.77.0.11", "10.77.0.12", 2),
             ("10.77.0.12", "10.77.0.10", 0)]
    assert bmv2.table("ckm_replicate") == {
        ((("dst_ip", ip(d_)), ("job_id", 7), ("partition", 0), ("src_ip", ip(s))),
         "replicate", (("group", 0x1000 + r * 256), ("ingress_port", src_port(s))))
        for s, d_, r in ring3}
    # Unpinned hosts take port 1 + their index in the config: s0 is now port 4.
    assert bmv2.group_map() == {1: {(1, 0), (2, 0), (3, 0), (4, 0), (64, 0)},
                                0x1000: {(1, 0), (4, 1)}, 0x1100: {(2, 0), (4, 1)},
                                0x1200: {(3, 0), (4, 1)}}
    assert bmv2.table("shadow_rewrite") == {rewrite(1, "02:00:0a:4d:00:64", "10.77.0.100")}
    deletes = [u for u in new if u.type == PB.Update.DELETE]
    # Kept keys: t0->t1 and t1->t2 of partition 0 (t2->t0 is new). Deleted: the other 6
    # replicate entries, the s1 rewrite, the l2 entries of t3 and s1, and the groups of
    # destination t3 plus every partition-1 group.
    del_tables = sorted(u.entity.table_entry.table_id for u in deletes
                        if u.entity.HasField("table_entry"))
    del_groups = sorted(u.entity.packet_replication_engine_entry.multicast_group_entry
                        .multicast_group_id for u in deletes
                        if u.entity.HasField("packet_replication_engine_entry"))
    tid = {t.preamble.alias: t.preamble.id for t in bmv2.p4info.tables}
    assert del_tables.count(tid["ckm_replicate"]) == 6
    assert del_tables.count(tid["shadow_rewrite"]) == 1
    assert del_tables.count(tid["l2_fwd"]) == 2
    assert del_groups == [0x1001, 0x1101, 0x1201, 0x1300, 0x1301]
    assert len(res.removed) == len(deletes)
    # The entry for t2 -> t3 went before group 0x1300 was deleted.
    idx_entry = next(i for i, u in enumerate(new) if u.type == PB.Update.DELETE
                     and u.entity.HasField("table_entry"))
    idx_group = next(i for i, u in enumerate(new) if u.type == PB.Update.DELETE
                     and u.entity.HasField("packet_replication_engine_entry"))
    assert idx_entry < idx_group


def test_registration_overrides_shadow_and_stamps_session(bmv2):
    cfg = p4_cfg("bmv2", bmv2.address)
    reg = plan_mod.Registration(1, "s1", "10.77.0.101", "02:00:0a:4d:00:65", 47011, 9, 12345)
    d = driver(cfg)
    try:
        d.apply(plan_mod.build(cfg))
        n = len(bmv2.updates)
        res = d.apply(plan_mod.build(cfg, {reg.host: reg}))
    finally:
        d.close()
    assert rewrite(1, "02:00:0a:4d:00:64", "10.77.0.100") in bmv2.table("shadow_rewrite")
    new_rw = ((("egress_rid", 2),), "rewrite_shadow", tuple(sorted([
        ("smac", mac(SW_MAC)), ("dmac", mac("02:00:0a:4d:00:65")), ("ip", ip("10.77.0.101")),
        ("udp_port", 47011), ("epoch", 9), ("token", 12345)])))
    assert new_rw in bmv2.table("shadow_rewrite")
    # Only that one rewrite changed (replicate entries carry only the group and the
    # source's port, not the shadow's session).
    assert len(bmv2.updates) - n == 1 and bmv2.updates[-1].type == PB.Update.MODIFY
    assert res.writes == 1


def test_status_reads_entries_counters_and_groups(bmv2):
    cfg = p4_cfg("bmv2", bmv2.address)
    d = driver(cfg)
    try:
        d.apply(plan_mod.build(cfg))
        key = next(k for k, te in bmv2.entries.items()
                   if te.table_id == d.schema.table_id("ckm_replicate"))
        bmv2.direct_counts[key] = (42, 42 * 9000)
        # ckm_stats by index (STAT_* in checkmate_common.p4), l2_miss at index 0.
        for i, n in enumerate((5, 3, 1, 1, 2, 4, 6)):
            bmv2.counts[("CkmIngress.ckm_stats", i)] = (n, n * 100)
        bmv2.counts[("CkmIngress.l2_miss", 0)] = (9, 900)
        bmv2.counts[("CkmEgress.rewrite_miss", 0)] = (2, 200)
        st = d.status()
    finally:
        d.close()
    hits = [e for e in st["entries"] if e["packets"] == 42]
    assert len(hits) == 1 and hits[0]["bytes"] == 378000
    assert hits[0]["entry"].startswith("ckm_replicate")
    assert len(st["entries"]) == 25  # port_bind's 7 included
    assert st["ckm_stats"] == {"plain": 5, "replicated": 3, "no_entry": 1, "malformed": 1,
                               "handshake": 2, "spoofed": 4, "parser_error": 6,
                               "ckm": 5 + 3 + 1 + 2 + 4, "l2_miss": 9, "rewrite_miss": 2,
                               "bad_src_mac": 0, "bad_src_ip": 0}
    assert set(st["groups"]) == set(EXPECTED_GROUPS)
    assert st["notes"] == []


def test_build_without_the_source_check_is_said_unprotected():
    """p4c's output from before the per-port source check (fakes.UNCHECKED_AT) is still
    programmed, and deploy and status both say loudly that sources go unchecked."""
    sw = FakeSwitch(unchecked_p4info("v1model"))
    cfg = p4_cfg("bmv2", sw.address)
    d = driver(cfg)
    try:
        res = d.apply(plan_mod.build(cfg))
        st = d.status()
    finally:
        d.close()
        sw.stop()
    assert res.notes == [p4tables.SOURCE_UNCHECKED] and res.writes == 27
    assert st["notes"] == [p4tables.SOURCE_UNCHECKED] and len(st["entries"]) == 18


def test_ports_are_bound_to_their_hosts_sources(tmp_path):
    """With a build that has the source check (the hand-written P4Info of the current
    sources), deploy binds every host's port and the CPU port to their MAC and IPv4
    address, a redeploy writes nothing, and status reports the check's drops."""
    sw = FakeSwitch(fixture_p4info("handwritten_v1model.p4info.txtpb"))
    cfg = p4_cfg("bmv2", sw.address)
    d = driver(cfg)
    try:
        res = d.apply(plan_mod.build(cfg))
        assert p4tables.SOURCE_UNCHECKED not in res.notes
        want = {((("ingress_port", port),), "bind_source",
                 (("ip", ip(f"10.77.0.{x}")), ("mac", mac(f"02:00:0a:4d:00:{x:02x}"))))
                for x, port in [(10, 1), (11, 2), (12, 3), (13, 4), (100, 5), (101, 6)]}
        want.add(((("ingress_port", 64),), "bind_source",
                  (("ip", ip("10.77.0.1")), ("mac", mac(SW_MAC)))))
        assert sw.table("port_bind") == want
        assert d.apply(plan_mod.build(cfg)).writes == 0
        sw.counts[("CkmIngress.src_check", 0)] = (7, 700)
        sw.counts[("CkmIngress.src_check", 1)] = (3, 300)
        st = d.status()
    finally:
        d.close()
        sw.stop()
    assert st["ckm_stats"]["bad_src_mac"] == 7 and st["ckm_stats"]["bad_src_ip"] == 3
    assert st["notes"] == []


def test_switch_with_hash_ids_is_programmed_by_name(bmv2):
    """The double runs p4c's P4Info, whose ids are hashes no file here spells: every entry
    the controller wrote carries exactly the compiler's table, field, action and
    parameter ids."""
    cfg = p4_cfg("bmv2", bmv2.address)
    d = driver(cfg)
    try:
        d.apply(plan_mod.build(cfg))
    finally:
        d.close()
    info = compiled_p4info("v1model")
    tid = {t.preamble.name: t.preamble.id for t in info.tables}
    aid = {a.preamble.name: a.preamble.id for a in info.actions}
    used = {(te.table_id, te.action.action.action_id) for te in bmv2.entries.values()}
    assert used == {(tid["CkmIngress.port_bind"], aid["CkmIngress.bind_source"]),
                    (tid["CkmIngress.l2_fwd"], aid["CkmIngress.forward"]),
                    (tid["CkmIngress.ckm_punt"], aid["CkmIngress.to_cpu"]),
                    (tid["CkmIngress.ckm_replicate"], aid["CkmIngress.replicate"]),
                    (tid["CkmEgress.shadow_rewrite"], aid["CkmEgress.rewrite_shadow"])}
    assert tid["CkmIngress.l2_fwd"] == 37451960  # p4c's, not a sequential 0x02000001
    assert bmv2.pipeline_sets == 0  # it had a program: the controller did not replace it


def test_stale_compiler_build_on_switch_is_refused_by_name():
    """p4c's output for an older program (fakes.STALE_AT) lacks the replicate entry's
    ingress_port parameter: the controller names what is missing and writes nothing."""
    sw = FakeSwitch(stale_p4info("v1model"))
    try:
        cfg = p4_cfg("bmv2", sw.address)
        d = driver(cfg)
        with pytest.raises(CheckmateError, match=r"another build.*ingress_port"):
            d.apply(plan_mod.build(cfg))
        d.close()
    finally:
        sw.stop()
    assert sw.updates == []


def _v1model_build(root: Path, p4info_text: str) -> bytes:
    d = root / "checkmate_v1model"
    d.mkdir(parents=True)
    (d / "p4info.txtpb").write_text(p4info_text)
    program = b'{"program": "checkmate_v1model.p4", "pipelines": []}'
    (d / "checkmate_v1model.json").write_bytes(program)
    return program


def test_switch_without_pipeline_gets_the_compiled_program(tmp_path, monkeypatch):
    """PI's answer to "no pipeline" is FAILED_PRECONDITION: the controller then pushes the
    compiler's P4Info and JSON from the build folder and programs the switch by name."""
    monkeypatch.setenv("CHECKMATE_P4_BUILD", str(tmp_path))
    program = _v1model_build(tmp_path, text_format.MessageToString(compiled_p4info("v1model")))
    sw = FakeSwitch(None)
    try:
        cfg = p4_cfg("bmv2", sw.address)
        d = driver(cfg)
        try:
            res = d.apply(plan_mod.build(cfg))
        finally:
            d.close()
    finally:
        sw.stop()
    assert sw.pipeline_sets == 1 and sw.device_config == program
    assert {t.preamble.name for t in sw.p4info.tables} >= {"CkmIngress.ckm_replicate"}
    assert sw.table("ckm_replicate") == EXPECTED_REPLICATE
    assert res.writes == 34


def test_stale_compiled_p4info_is_refused_before_the_push(tmp_path, monkeypatch):
    monkeypatch.setenv("CHECKMATE_P4_BUILD", str(tmp_path))
    _v1model_build(tmp_path, text_format.MessageToString(
        stale_p4info("v1model")))
    sw = FakeSwitch(None)
    try:
        cfg = p4_cfg("bmv2", sw.address)
        d = driver(cfg)
        with pytest.raises(CheckmateError, match=r"compiler output .*ingress_port"):
            d.apply(plan_mod.build(cfg))
        d.close()
    finally:
        sw.stop()
    assert sw.pipeline_sets == 0 and sw.updates == []


def test_pipeline_missing_without_build_is_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("CHECKMATE_P4_BUILD", str(tmp_path))
    sw = FakeSwitch(None)
    try:
        cfg = p4_cfg("bmv2", sw.address)
        d = driver(cfg)
        with pytest.raises(CheckmateError, match="no compiled P4Info in .*compile"):
            d.apply(plan_mod.build(cfg))
        d.close()
    finally:
        sw.stop()


def test_status_of_a_switch_without_pipeline_loads_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("CHECKMATE_P4_BUILD", str(tmp_path))
    _v1model_build(tmp_path, text_format.MessageToString(compiled_p4info("v1model")))
    sw = FakeSwitch(None)
    try:
        d = driver(p4_cfg("bmv2", sw.address))
        with pytest.raises(CheckmateError, match="no P4 program loaded; `control deploy"):
            d.status()
        d.close()
    finally:
        sw.stop()
    assert sw.pipeline_sets == 0


def test_other_program_on_switch_is_refused():
    info = compiled_p4info("v1model")
    (l2,) = [t for t in info.tables if t.preamble.name == "CkmIngress.l2_fwd"]
    l2.preamble.name = "MyIngress.ipv4_lpm"
    sw = FakeSwitch(info)
    try:
        cfg = p4_cfg("bmv2", sw.address)
        d = driver(cfg)
        with pytest.raises(CheckmateError, match="another P4 program"):
            d.apply(plan_mod.build(cfg))
        d.close()
    finally:
        sw.stop()
    assert sw.updates == []


def test_second_controller_with_lower_election_is_not_primary(bmv2):
    first = P4RuntimeClient(bmv2.address, election=10, timeout=3)
    first.connect()
    try:
        second = P4RuntimeClient(bmv2.address, election=5, timeout=3)
        with pytest.raises(CheckmateError, match="not primary"):
            second.connect()
    finally:
        first.close()


# -- Tofino -----------------------------------------------------------------------------
def tofino_cfg(address: str) -> config.ClusterConfig:
    """The shipped tofino0 config (dev ports 0/4/8/12 for t0..t3, 128/132 for s0/s1)."""
    cfg = config.load(REPO / "testbed" / "tofino0.yaml")
    return replace(cfg, switch=replace(cfg.switch, address=address))


TOFINO_PORT = {"10.77.0.10": 0, "10.77.0.11": 4, "10.77.0.12": 8, "10.77.0.13": 12}
TOFINO_REPLICATE = {
    ((("dst_ip", ip(d)), ("job_id", 7), ("partition", p), ("src_ip", ip(s))), "replicate",
     (("group", 0x1000 + rank * 256 + p), ("ingress_port", TOFINO_PORT[s])))
    for s, d, rank in RING for p in (0, 1)
}


def _tofino_deploy(sw: FakeSwitch, cfg: config.ClusterConfig):
    d = TofinoDriver(cfg, P4RuntimeClient(sw.address, timeout=3))
    try:
        return d.apply(plan_mod.build(cfg)), d
    finally:
        d.close()


def test_tofino_deploys_tables_on_compiled_tna_and_writes_bfrt_script(tmp_path, monkeypatch):
    """p4c's TNA P4Info: tables with "pipe.", actions without, counters as externs."""
    monkeypatch.setenv("CHECKMATE_P4_BUILD", str(tmp_path))
    sw = FakeSwitch(compiled_p4info("tna"))
    try:
        res, _ = _tofino_deploy(sw, tofino_cfg(sw.address))
    finally:
        sw.stop()
    assert sw.table("ckm_replicate") == TOFINO_REPLICATE
    assert sw.group_map()[0x1000] == {(0, 0), (128, 1)}
    assert sw.group_map()[1] == {(0, 0), (4, 0), (8, 0), (12, 0), (128, 0), (132, 0), (320, 0)}
    script = (tmp_path / "tofino0-ports.bfrt.py").read_text()
    compile(script, "bfrt", "exec")  # valid python for bfrt_python
    assert any("bfrt_python" in n for n in res.notes)


def test_tofino_status_names_extern_counters_it_cannot_read(tmp_path, monkeypatch):
    monkeypatch.setenv("CHECKMATE_P4_BUILD", str(tmp_path))
    sw = FakeSwitch(compiled_p4info("tna"))
    try:
        cfg = tofino_cfg(sw.address)
        _tofino_deploy(sw, cfg)
        d = TofinoDriver(cfg, P4RuntimeClient(sw.address, timeout=3))
        try:
            st = d.status()
        finally:
            d.close()
    finally:
        sw.stop()
    assert len(st["entries"]) == 25 and all(e["packets"] is None for e in st["entries"])
    assert st["ckm_stats"] == {}
    assert any("--p4runtime-force-std-externs" in n for n in st["notes"])


def _tna_build(root: Path, binary: str | None = "p4info.bin") -> dict[str, bytes]:
    """A bf-p4c output folder as the documented command leaves it: p4info.txtpb and, when
    ``binary`` names it, the binary P4Info (p4c writes ``.bin``; ``.binpb`` is what other
    toolchains call it)."""
    d = root / "checkmate_tna"
    (d / "pipe").mkdir(parents=True)
    files = {"bfrt.json": b'{"tables": []}', "pipe/context.json": b'{"tables": [], "x": 1}',
             "pipe/tofino.bin": bytes(range(256)) * 4}
    for name, data in files.items():
        (d / name).write_bytes(data)
    (d / "p4info.txtpb").write_text(
        (REPO / "tests" / "fixtures" / "p4c" / "checkmate_tna.p4info.txtpb").read_text())
    if binary is not None:
        (d / binary).write_bytes(compiled_p4info("tna").SerializeToString())
    return files


def _bf_pipeline_config_class():
    """stratum.hal.barefoot.BfPipelineConfig built from its field list (bf.proto), to
    decode what the driver packed independently of the driver's own encoder."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    f = descriptor_pb2.FileDescriptorProto(name="bf_test.proto", package="stratum.test",
                                           syntax="proto3")
    msg = f.message_type.add(name="BfPipelineConfig")
    prof = msg.nested_type.add(name="Profile")
    T = descriptor_pb2.FieldDescriptorProto
    for num, name, typ, label in ((1, "profile_name", T.TYPE_STRING, T.LABEL_OPTIONAL),
                                  (2, "context", T.TYPE_BYTES, T.LABEL_OPTIONAL),
                                  (3, "binary", T.TYPE_BYTES, T.LABEL_OPTIONAL),
                                  (4, "pipe_scope", T.TYPE_UINT32, T.LABEL_REPEATED)):
        prof.field.add(name=name, number=num, type=typ, label=label)
    msg.field.add(name="p4_name", number=1, type=T.TYPE_STRING, label=T.LABEL_OPTIONAL)
    msg.field.add(name="bfruntime_info", number=2, type=T.TYPE_BYTES, label=T.LABEL_OPTIONAL)
    msg.field.add(name="profiles", number=3, type=T.TYPE_MESSAGE, label=T.LABEL_REPEATED,
                  type_name=".stratum.test.BfPipelineConfig.Profile")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    return message_factory.GetMessageClass(
        pool.FindMessageTypeByName("stratum.test.BfPipelineConfig"))


def test_tofino_pushes_the_real_compiled_build(tmp_path, monkeypatch):
    """The compiler's own TNA folder (make p4; compiled here when the toolchain is on
    PATH, else skipped): the driver pushes its binary P4Info and the packed tofino.bin,
    context.json and bfrt.json, and programs every table, port_bind included."""
    from checkmate.control import p4build, pipeline

    if p4build.compiler("tna")[0] is None:
        pytest.skip(f"no TNA compiler: {p4build.compiler('tna')[1]}")
    built = p4build.compile_program("tna", REPO / "build" / "p4" / "checkmate_tna").out
    shutil.copytree(built, tmp_path / "checkmate_tna")
    monkeypatch.setenv("CHECKMATE_P4_BUILD", str(tmp_path))
    sw = FakeSwitch(None)
    try:
        res, _ = _tofino_deploy(sw, tofino_cfg(sw.address))
    finally:
        sw.stop()
    assert sw.pipeline_sets == 1 and p4tables.SOURCE_UNCHECKED not in res.notes
    cfg = _bf_pipeline_config_class().FromString(sw.device_config)
    assert cfg.p4_name == pipeline.PROGRAMS["tna"]
    assert cfg.bfruntime_info == (built / "bfrt.json").read_bytes()
    (prof,) = cfg.profiles
    assert prof.binary == (built / "pipe" / "tofino.bin").read_bytes()
    assert prof.context == (built / "pipe" / "context.json").read_bytes()
    pushed = p4proto.p4info().P4Info.FromString((built / "p4info.bin").read_bytes())
    assert sw.p4info == pushed  # the binary P4Info, extern payloads and all
    assert sw.table("ckm_replicate") == TOFINO_REPLICATE
    assert len(sw.table("port_bind")) == len({h.switch_port for h in tofino_cfg("x").hosts}) + 1
    # `control deploy --switch tofino0 --dry-run` packs the same compiler output, touching
    # nothing: the bytes it names are the ones the switch got
    import hashlib

    r = subprocess.run([sys.executable, "-m", "checkmate.control.cli", "deploy", "--switch",
                        "tofino0", "--dry-run"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "CHECKMATE_P4_BUILD": str(tmp_path),
                            "CHECKMATE_CONTROL_STATE": str(tmp_path / "s.json")})
    assert r.returncode == 0, r.stderr
    shipped = tofino_cfg("x")
    want = pipeline.device_config("tna", shipped.switch.tofino_server,
                                  list(range(shipped.switch.tofino_pipes)))
    assert (f"pipeline config: {len(want)} bytes packed for {shipped.switch.tofino_server} "
            f"from {tmp_path / 'checkmate_tna'} (sha256 "
            f"{hashlib.sha256(want).hexdigest()[:16]})") in r.stdout, r.stdout[-2000:]


@pytest.mark.parametrize("binary", ["p4info.bin", "p4info.binpb"])
def test_tofino_pushes_bf_p4c_output_packed_for_stratum(tmp_path, monkeypatch, binary):
    monkeypatch.setenv("CHECKMATE_P4_BUILD", str(tmp_path))
    files = _tna_build(tmp_path, binary)
    sw = FakeSwitch(None)
    try:
        _tofino_deploy(sw, tofino_cfg(sw.address))
    finally:
        sw.stop()
    assert sw.pipeline_sets == 1
    cfg = _bf_pipeline_config_class().FromString(sw.device_config)
    assert cfg.p4_name == "checkmate_tna" and cfg.bfruntime_info == files["bfrt.json"]
    (prof,) = cfg.profiles
    assert prof.profile_name == "pipe" and list(prof.pipe_scope) == [0, 1, 2, 3]
    assert prof.context == files["pipe/context.json"]
    assert prof.binary == files["pipe/tofino.bin"]
    # The pushed P4Info is the compiler's binary one, extern payloads and all.
    assert sw.p4info.SerializeToString() == compiled_p4info("tna").SerializeToString()
    assert sw.table("ckm_replicate") == TOFINO_REPLICATE


def test_tofino_pushes_pi_packing_for_the_sde_server(tmp_path, monkeypatch):
    monkeypatch.setenv("CHECKMATE_P4_BUILD", str(tmp_path))
    files = _tna_build(tmp_path)
    sw = FakeSwitch(None)
    try:
        cfg = tofino_cfg(sw.address)
        _tofino_deploy(sw, replace(cfg, switch=replace(cfg.switch, tofino_server="sde")))
    finally:
        sw.stop()
    blob, parts = sw.device_config, []
    while blob:
        (n,) = struct.unpack("<i", blob[:4])
        parts.append(blob[4:4 + n])
        blob = blob[4 + n:]
    assert parts == [b"checkmate_tna", files["pipe/tofino.bin"], files["pipe/context.json"]]


def test_tofino_refuses_to_push_text_p4info_with_extern_payloads(tmp_path, monkeypatch):
    monkeypatch.setenv("CHECKMATE_P4_BUILD", str(tmp_path))
    _tna_build(tmp_path, binary=None)
    sw = FakeSwitch(None)
    try:
        with pytest.raises(CheckmateError, match=r"p4info\.bin; p4c refuses \.binpb"):
            _tofino_deploy(sw, tofino_cfg(sw.address))
    finally:
        sw.stop()
    assert sw.pipeline_sets == 0
    # ... but the operator still got the port script.
    assert (tmp_path / "tofino0-ports.bfrt.py").is_file()


def test_hand_written_p4info_spelling_works_too(tmp_path, monkeypatch):
    """The old hand-written TNA P4Info prefixes actions with "pipe." and has standard
    counters: the same names resolve, and status reads its counters."""
    monkeypatch.setenv("CHECKMATE_P4_BUILD", str(tmp_path))
    sw = FakeSwitch(fixture_p4info("handwritten_tna.p4info.txtpb"))
    try:
        cfg = tofino_cfg(sw.address)
        _tofino_deploy(sw, cfg)
        sw.counts[("pipe.CkmIngress.ckm_stats", 1)] = (7, 700)
        d = TofinoDriver(cfg, P4RuntimeClient(sw.address, timeout=3))
        try:
            st = d.status()
        finally:
            d.close()
    finally:
        sw.stop()
    assert sw.table("ckm_replicate") == TOFINO_REPLICATE
    assert st["ckm_stats"]["replicated"] == 7 and st["ckm_stats"]["ckm"] == 7


def test_unreachable_target_fails_fast():
    c = P4RuntimeClient("127.0.0.1:9", timeout=0.5)
    with pytest.raises(TargetUnreachable, match="no P4Runtime server"):
        c.connect()


def _run_cli(args, cfg_path, **env):
    return subprocess.run(
        [sys.executable, "-m", "checkmate.control.cli", *args, "--config", str(cfg_path)],
        capture_output=True, text=True, timeout=60, env={**os.environ, **env})


def _write_cfg(tmp_path, target, address) -> Path:
    import yaml

    data = yaml.safe_load(Path(config.default_path()).read_text())
    data["switch"].update(target=target, address=address)
    p = tmp_path / f"{target}.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def test_cli_deploy_and_status_against_double(bmv2, tmp_path):
    path = _write_cfg(tmp_path, "bmv2", bmv2.address)
    env = {"CHECKMATE_CONTROL_STATE": str(tmp_path / "state.json")}
    r = _run_cli(["deploy", "--switch", "sw0"], path, **env)
    assert r.returncode == 0, r.stderr
    assert "34 added, 0 changed, 0 removed" in r.stdout
    assert bmv2.table("ckm_replicate") == EXPECTED_REPLICATE
    r = _run_cli(["deploy", "--switch", "sw0"], path, **env)
    assert r.returncode == 0 and "0 added, 0 changed, 0 removed" in r.stdout
    r = _run_cli(["status", "--switch", "sw0"], path, **env)
    assert r.returncode == 0, r.stderr
    assert "ckm_replicate" in r.stdout and "multicast groups" in r.stdout
