"""Plan -> P4Runtime entities for the Checkmate P4 programs, and back (for diffing).

Tables, keys, actions and parameters are looked up by alias in the P4Info checked in next to
the P4 source (p4/checkmate_<arch>.p4info.txtpb), so the same code serves v1model and TNA,
whose P4Info names differ only by the "pipe." prefix.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import text_format

from checkmate.control import p4proto
from checkmate.control.plan import Plan
from checkmate.errors import CheckmateError

REPO = Path(__file__).resolve().parents[2]
P4_DIR = REPO / "p4"
ARCHS = {"bmv2": "v1model", "tofino": "tna"}


def p4info_path(arch: str) -> Path:
    return P4_DIR / f"checkmate_{arch}.p4info.txtpb"


def load_p4info(arch: str):
    path = p4info_path(arch)
    try:
        text = path.read_text()
    except OSError as e:
        raise CheckmateError(f"cannot read P4Info {path}: {e.strerror}") from None
    return text_format.Parse(text, p4proto.p4info().P4Info())


@dataclass(frozen=True, order=True)
class EntrySpec:
    """A table entry in plain values: table alias, (key, int) pairs, action, (param, int)."""

    table: str
    match: tuple[tuple[str, int], ...]
    action: str
    params: tuple[tuple[str, int], ...]

    @property
    def key(self) -> tuple[str, tuple[tuple[str, int], ...]]:
        return (self.table, self.match)

    def label(self) -> str:
        m = " ".join(f"{k}={v:#x}" for k, v in self.match)
        p = " ".join(f"{k}={v:#x}" for k, v in self.params)
        return f"{self.table} [{m}] -> {self.action}({p})"


def _mac(s: str) -> int:
    return int(s.replace(":", ""), 16)


def _ip(s: str) -> int:
    return int(ipaddress.IPv4Address(s))


def entries(plan: Plan) -> list[EntrySpec]:
    """Every table entry the plan needs, in table order."""
    out = [EntrySpec("l2_fwd", (("dst_mac", _mac(e.mac)),), "forward", (("port", e.port),))
           for e in plan.l2]
    out.append(EntrySpec(
        "ckm_punt", (("dst_ip", _ip(plan.punt.ip)), ("udp_dst_port", plan.punt.udp_port)),
        "to_cpu", (("port", plan.punt.cpu_port),)))
    # The source host's port rides along: the program copies only datagrams that entered
    # there and counts the rest as spoofed.
    out += [EntrySpec(
        "ckm_replicate",
        (("job_id", r.job_id), ("src_ip", _ip(r.src_ip)), ("dst_ip", _ip(r.dst_ip)),
         ("partition", r.partition)),
        "replicate", (("group", r.group_id), ("ingress_port", r.ingress_port)))
        for r in plan.replication]
    out += [EntrySpec(
        "shadow_rewrite", (("egress_rid", w.rid),), "rewrite_shadow",
        (("smac", _mac(w.smac)), ("dmac", _mac(w.dmac)), ("ip", _ip(w.ip)),
         ("udp_port", w.udp_port), ("epoch", w.epoch), ("token", w.token)))
        for w in plan.rewrites]
    return out


def groups(plan: Plan) -> dict[int, tuple[tuple[int, int], ...]]:
    return {g.group_id: tuple(sorted(g.replicas)) for g in plan.groups}


def encode(value: int, bitwidth: int, what: str) -> bytes:
    """P4Runtime canonical bytes: big-endian, no leading zero bytes, at least one byte."""
    if value < 0 or value >= 1 << bitwidth:
        raise CheckmateError(f"{what}: value {value} does not fit in {bitwidth} bits")
    return value.to_bytes(max(1, (value.bit_length() + 7) // 8), "big")


class Schema:
    """Names <-> ids of one P4Info."""

    TABLES = ("l2_fwd", "ckm_punt", "ckm_replicate", "shadow_rewrite")

    def __init__(self, p4info) -> None:
        self.p4info = p4info
        self.tables = {t.preamble.alias: t for t in p4info.tables}
        self.table_by_id = {t.preamble.id: t for t in p4info.tables}
        self.actions = {a.preamble.alias: a for a in p4info.actions}
        self.action_by_id = {a.preamble.id: a for a in p4info.actions}
        self.counters = {c.preamble.alias: c for c in p4info.counters}
        missing = [t for t in self.TABLES if t not in self.tables]
        if missing:
            raise CheckmateError(f"P4Info lacks table(s) {', '.join(missing)}: not the "
                                 "Checkmate program")

    def table_id(self, alias: str) -> int:
        return self.tables[alias].preamble.id

    def to_proto(self, spec: EntrySpec):
        pb = p4proto.p4runtime()
        t = self.tables[spec.table]
        fields = {f.name: f for f in t.match_fields}
        te = pb.TableEntry(table_id=t.preamble.id)
        for name, value in spec.match:
            f = fields[name]
            te.match.add(field_id=f.id, exact=pb.FieldMatch.Exact(
                value=encode(value, f.bitwidth, f"{spec.table}.{name}")))
        a = self.actions[spec.action]
        params = {p.name: p for p in a.params}
        act = te.action.action
        act.action_id = a.preamble.id
        for name, value in spec.params:
            p = params[name]
            act.params.add(param_id=p.id, value=encode(value, p.bitwidth,
                                                       f"{spec.action}.{name}"))
        return te

    def from_proto(self, te) -> EntrySpec:
        t = self.table_by_id[te.table_id]
        names = {f.id: f.name for f in t.match_fields}
        match = tuple(sorted(
            ((names[m.field_id], int.from_bytes(m.exact.value, "big")) for m in te.match),
            key=lambda kv: [f.name for f in t.match_fields].index(kv[0])))
        a = self.action_by_id[te.action.action.action_id]
        pnames = {p.id: p.name for p in a.params}
        params = tuple(sorted(
            ((pnames[p.param_id], int.from_bytes(p.value, "big"))
             for p in te.action.action.params),
            key=lambda kv: [p.name for p in a.params].index(kv[0])))
        return EntrySpec(t.preamble.alias, match, a.preamble.alias, params)
