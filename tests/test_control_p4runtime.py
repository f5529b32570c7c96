"""The controller against a P4Runtime server.

Nobody here has a Tofino or a bmv2 build, so the switch is a TEST DOUBLE: an in-process gRPC
server implementing the p4.v1.P4Runtime service (arbitration, Write, Read, pipeline config)
that validates writes against the P4Info like a switch would (unknown ids, widths, duplicate
inserts, missing deletes are errors) and records every update. The controller talks to it
over a real gRPC channel on loopback, exactly as it would to simple_switch_grpc or a Tofino.
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
import threading
from concurrent import futures
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from google.protobuf import text_format

from checkmate import config
from checkmate.control import p4proto
from checkmate.control import plan as plan_mod
from checkmate.control.drivers.p4runtime import P4RuntimeDriver
from checkmate.control.drivers.tofino import TofinoDriver
from checkmate.control.p4rt_client import P4RuntimeClient, TargetUnreachable
from checkmate.errors import CheckmateError

REPO = Path(__file__).resolve().parents[1]
PB = p4proto.p4runtime()


def load_p4info(arch: str):
    text = (REPO / "p4" / f"checkmate_{arch}.p4info.txtpb").read_text()
    return text_format.Parse(text, p4proto.p4info().P4Info())


class FakeSwitch:
    """P4Runtime test double (see module docstring). Thread-safe; records Write updates."""

    def __init__(self, p4info=None) -> None:
        self.p4info = p4info
        self.device_config = b""
        self.entries: dict[tuple, object] = {}
        self.groups: dict[int, object] = {}
        self.updates: list = []  # every applied Update, in order
        self.primary_election: int | None = None
        self.direct_counts: dict[tuple, tuple[int, int]] = {}
        self.lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        u = grpc.unary_unary_rpc_method_handler
        handlers = {
            "Write": u(self.Write, PB.WriteRequest.FromString,
                       PB.WriteResponse.SerializeToString),
            "Read": grpc.unary_stream_rpc_method_handler(
                self.Read, PB.ReadRequest.FromString, PB.ReadResponse.SerializeToString),
            "GetForwardingPipelineConfig": u(
                self.GetPipe, PB.GetForwardingPipelineConfigRequest.FromString,
                PB.GetForwardingPipelineConfigResponse.SerializeToString),
            "SetForwardingPipelineConfig": u(
                self.SetPipe, PB.SetForwardingPipelineConfigRequest.FromString,
                PB.SetForwardingPipelineConfigResponse.SerializeToString),
            "StreamChannel": grpc.stream_stream_rpc_method_handler(
                self.Stream, PB.StreamMessageRequest.FromString,
                PB.StreamMessageResponse.SerializeToString),
        }
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(p4proto.SERVICE, handlers),))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.stop(0)

    # -- service -------------------------------------------------------------------------
    def Stream(self, requests, context):
        for req in requests:
            if req.HasField("arbitration"):
                eid = req.arbitration.election_id.low
                with self.lock:
                    if self.primary_election is None or eid >= self.primary_election:
                        self.primary_election = eid
                        code = 0
                    else:
                        code = grpc.StatusCode.ALREADY_EXISTS.value[0]
                resp = PB.StreamMessageResponse()
                resp.arbitration.CopyFrom(req.arbitration)
                resp.arbitration.status.code = code
                yield resp

    def GetPipe(self, req, context):
        resp = PB.GetForwardingPipelineConfigResponse()
        if self.p4info is not None:
            resp.config.p4info.CopyFrom(self.p4info)
        return resp

    def SetPipe(self, req, context):
        if req.election_id.low != self.primary_election:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "not primary")
        self.p4info = req.config.p4info
        self.device_config = req.config.p4_device_config
        return PB.SetForwardingPipelineConfigResponse()

    def _check_entry(self, te, context) -> tuple:
        tables = {t.preamble.id: t for t in self.p4info.tables}
        actions = {a.preamble.id: a for a in self.p4info.actions}
        t = tables.get(te.table_id)
        if t is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown table {te.table_id}")
        widths = {f.id: f.bitwidth for f in t.match_fields}
        if sorted(m.field_id for m in te.match) != sorted(widths):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "match fields incomplete")
        for m in te.match:
            v = m.exact.value
            if not v or (len(v) > 1 and v[0] == 0) or int.from_bytes(v, "big") >> widths[
                    m.field_id]:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "non-canonical/too wide")
        aid = te.action.action.action_id
        refs = {r.id for r in t.action_refs if r.scope != p4proto.p4info().ActionRef.DEFAULT_ONLY}
        if aid not in refs:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"action {aid} not in table")
        pw = {p.id: p.bitwidth for p in actions[aid].params}
        if sorted(p.param_id for p in te.action.action.params) != sorted(pw):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "action params incomplete")
        for p in te.action.action.params:
            if int.from_bytes(p.value, "big") >> pw[p.param_id]:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "param too wide")
        return (te.table_id, tuple(sorted((m.field_id, m.exact.value) for m in te.match)))

    def Write(self, req, context):
        if self.p4info is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no pipeline")
        if req.election_id.low != self.primary_election:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "not primary")
        with self.lock:
            for up in req.updates:
                ent = up.entity
                if ent.HasField("table_entry"):
                    key = self._check_entry(ent.table_entry, context)
                    store = self.entries
                    val = ent.table_entry
                else:
                    g = ent.packet_replication_engine_entry.multicast_group_entry
                    key, store, val = g.multicast_group_id, self.groups, g
                if up.type == PB.Update.INSERT and key in store:
                    context.abort(grpc.StatusCode.ALREADY_EXISTS, f"{key} exists")
                if up.type in (PB.Update.MODIFY, PB.Update.DELETE) and key not in store:
                    context.abort(grpc.StatusCode.NOT_FOUND, f"{key} missing")
                if up.type == PB.Update.DELETE:
                    del store[key]
                else:
                    store[key] = type(val)()
                    store[key].CopyFrom(val)
                self.updates.append(up)
        return PB.WriteResponse()

    def Read(self, req, context):
        resp = PB.ReadResponse()
        with self.lock:
            for ent in req.entities:
                if ent.HasField("table_entry"):
                    for (tid, _), te in sorted(self.entries.items()):
                        if ent.table_entry.table_id in (0, tid):
                            resp.entities.add().table_entry.CopyFrom(te)
                elif ent.HasField("packet_replication_engine_entry"):
                    for _gid, g in sorted(self.groups.items()):
                        out = resp.entities.add()
                        out.packet_replication_engine_entry.multicast_group_entry.CopyFrom(g)
                elif ent.HasField("direct_counter_entry"):
                    want = ent.direct_counter_entry.table_entry.table_id
                    for key, te in sorted(self.entries.items()):
                        if want in (0, key[0]):
                            out = resp.entities.add().direct_counter_entry
                            out.table_entry.CopyFrom(te)
                            pk, by = self.direct_counts.get(key, (0, 0))
                            out.data.packet_count, out.data.byte_count = pk, by
                elif ent.HasField("counter_entry"):
                    for i, n in enumerate((5, 3, 1, 1, 2, 4)):
                        out = resp.entities.add().counter_entry
                        out.counter_id = ent.counter_entry.counter_id
                        out.index.index = i
                        out.data.packet_count = n
        yield resp

    # -- decoding for assertions, from the P4Info by name (independent of the driver) ---
    def table(self, alias: str) -> set[tuple]:
        t = next(t for t in self.p4info.tables if t.preamble.alias == alias)
        actions = {a.preamble.id: a for a in self.p4info.actions}
        fnames = {f.id: f.name for f in t.match_fields}
        out = set()
        for (tid, _), te in self.entries.items():
            if tid != t.preamble.id:
                continue
            a = actions[te.action.action.action_id]
            pn = {p.id: p.name for p in a.params}
            m = tuple(sorted((fnames[x.field_id], int.from_bytes(x.exact.value, "big"))
                             for x in te.match))
            p = tuple(sorted((pn[x.param_id], int.from_bytes(x.value, "big"))
                             for x in te.action.action.params))
            out.add((m, a.preamble.alias, p))
        return out

    def group_map(self) -> dict[int, set[tuple[int, int]]]:
        return {gid: {(r.egress_port, r.instance) for r in g.replicas}
                for gid, g in self.groups.items()}


def ip(s: str) -> int:
    return int(ipaddress.IPv4Address(s))


def mac(s: str) -> int:
    return int(s.replace(":", ""), 16)


def p4_cfg(target: str, address: str, **changes) -> config.ClusterConfig:
    cfg = config.load(config.default_path())
    cfg = replace(cfg, switch=replace(cfg.switch, target=target, address=address))
    return replace(cfg, **changes) if changes else cfg


@pytest.fixture
def bmv2():
    sw = FakeSwitch(load_p4info("v1model"))
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
    assert res.writes == len(bmv2.updates) == 8 + 9 + 2 + 7 + 1
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
    assert len(bmv2.updates) == 27


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
        res = d.apply(plan_mod.build(cfg, {1: reg}))
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
        st = d.status()
    finally:
        d.close()
    hits = [e for e in st["entries"] if e["packets"] == 42]
    assert len(hits) == 1 and hits[0]["bytes"] == 378000
    assert hits[0]["entry"].startswith("ckm_replicate")
    assert len(st["entries"]) == 18
    assert st["ckm_stats"] == {"ckm": 5, "replicated": 3, "no_entry": 1, "malformed": 1,
                               "handshake": 2, "spoofed": 4}
    assert set(st["groups"]) == set(EXPECTED_GROUPS)


def test_pipeline_missing_without_build_is_clear_error():
    sw = FakeSwitch(None)
    try:
        cfg = p4_cfg("bmv2", sw.address)
        d = driver(cfg)
        with pytest.raises(CheckmateError, match="no P4 program loaded"):
            d.apply(plan_mod.build(cfg))
        d.close()
    finally:
        sw.stop()


def test_other_program_on_switch_is_refused():
    info = load_p4info("v1model")
    info.tables[0].preamble.alias = "ipv4_lpm"
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


def test_tofino_deploys_tables_and_writes_bfrt_port_script(tmp_path, monkeypatch):
    sw = FakeSwitch(load_p4info("tna"))
    import checkmate.control.drivers.tofino as tofino

    monkeypatch.setattr(tofino, "BUILD", tmp_path)
    try:
        cfg = p4_cfg("tofino", sw.address)
        d = TofinoDriver(cfg, P4RuntimeClient(sw.address, timeout=3))
        try:
            res = d.apply(plan_mod.build(cfg))
        finally:
            d.close()
    finally:
        sw.stop()
    assert sw.table("ckm_replicate") == EXPECTED_REPLICATE
    assert sw.group_map() == EXPECTED_GROUPS
    script = (tmp_path / "sw0-ports.bfrt.py").read_text()
    compile(script, "bfrt", "exec")  # valid python for bfrt_python
    # 100G, 3 m, MTU 9000 (docs/pfc.md): headroom 74480 B = 931 cells of 80 B.
    assert "port.add(DEV_PORT=5, SPEED='BF_SPEED_100G', FEC='BF_FEC_TYP_REED_SOLOMON'" in script
    assert "pfc_skid_max_cells=931" in script
    assert script.count("port.add(") == 6
    assert any("bfrt_python" in n for n in res.notes)


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
    assert "27 added, 0 changed, 0 removed" in r.stdout
    assert bmv2.table("ckm_replicate") == EXPECTED_REPLICATE
    r = _run_cli(["deploy", "--switch", "sw0"], path, **env)
    assert r.returncode == 0 and "0 added, 0 changed, 0 removed" in r.stdout
    r = _run_cli(["status", "--switch", "sw0"], path, **env)
    assert r.returncode == 0, r.stderr
    assert "ckm_replicate" in r.stdout and "multicast groups" in r.stdout
