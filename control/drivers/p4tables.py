"""Plan -> P4Runtime entities for the Checkmate P4 programs, and back (for diffing).

Every table, key, action and parameter is resolved by its P4 name in the P4Info the switch
reports (or the compiler wrote, when the controller loads the pipeline itself), never by a
remembered id: p4c's ids are hashes, and v1model and TNA spell some names differently
(checkmate.control.p4info folds that). A P4Info that lacks a name the plan writes, or has
it with another width, is refused before anything is written.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from checkmate.control import p4info as p4info_mod
from checkmate.control import p4proto
from checkmate.control.plan import Plan
from checkmate.errors import CheckmateError

ARCHS = {"bmv2": "v1model", "tofino": "tna"}
#: Short name -> P4 name (without the TNA pipeline prefix) of the tables the plan fills.
TABLES = {
    "l2_fwd": "CkmIngress.l2_fwd",
    "ckm_punt": "CkmIngress.ckm_punt",
    "ckm_replicate": "CkmIngress.ckm_replicate",
    "shadow_rewrite": "CkmEgress.shadow_rewrite",
}
#: Tables a build of the program may lack: port_bind (the per-port source check, issue 23)
#: is newer than the compiler outputs at hand. Without it the switch checks no source
#: address; the drivers say so on every deploy and in status (SOURCE_UNCHECKED).
OPTIONAL_TABLES = {"port_bind": "CkmIngress.port_bind"}
SOURCE_UNCHECKED = ("UNPROTECTED: the switch's P4 program has no port_bind table (a build "
                    "older than the per-port source check): frames with another host's "
                    "source MAC or IP are forwarded; recompile p4/ and reload it")
#: Every key field, action and parameter the plan writes, with its width: what a P4Info
#: must offer for the controller to program the switch.
WRITES = {
    "port_bind": ({"ingress_port": 9}, "CkmIngress.bind_source", {"mac": 48, "ip": 32}),
    "l2_fwd": ({"dst_mac": 48}, "CkmIngress.forward", {"port": 9}),
    "ckm_punt": ({"dst_ip": 32, "udp_dst_port": 16}, "CkmIngress.to_cpu", {"port": 9}),
    "ckm_replicate": ({"job_id": 32, "src_ip": 32, "dst_ip": 32, "partition": 16},
                      "CkmIngress.replicate", {"group": 16, "ingress_port": 9}),
    "shadow_rewrite": ({"egress_rid": 16}, "CkmEgress.rewrite_shadow",
                       {"smac": 48, "dmac": 48, "ip": 32, "udp_port": 16, "epoch": 32,
                        "token": 32}),
}
#: Indexed counters the program keeps (checkmate_common.p4), by P4 name.
STATS_COUNTER = "CkmIngress.ckm_stats"
#: Indexes of the ckm_stats counter (STAT_* in p4/include/checkmate_common.p4). Every
#: datagram on a ckm port is counted at exactly one index; "ckm" (well-formed datagrams)
#: is the sum of the outcomes of well-formed ones.
STAT_NAMES = ("plain", "replicated", "no_entry", "malformed", "handshake", "spoofed",
              "parser_error")
WELL_FORMED = ("plain", "replicated", "no_entry", "handshake", "spoofed")
#: Frames dropped by the source check, by SRC_* index (checkmate_common.p4).
SOURCE_COUNTER = "CkmIngress.src_check"
SOURCE_NAMES = ("bad_src_mac", "bad_src_ip")
#: Misses with no entry for a direct counter to count: l2_fwd floods, shadow_rewrite misses.
MISS_COUNTERS = {"l2_miss": "CkmIngress.l2_miss", "rewrite_miss": "CkmEgress.rewrite_miss"}


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
    out = [EntrySpec("port_bind", (("ingress_port", b.port),), "bind_source",
                     (("mac", _mac(b.mac)), ("ip", _ip(b.ip)))) for b in plan.bindings]
    out += [EntrySpec("l2_fwd", (("dst_mac", _mac(e.mac)),), "forward", (("port", e.port),))
           for e in plan.l2]
    out.append(EntrySpec(
        "ckm_punt", (("dst_ip", _ip(plan.punt.ip)), ("udp_dst_port", plan.punt.udp_port)),
        "to_cpu", (("port", plan.punt.cpu_port),)))
    # The source host's port rides along: the program copies only datagrams that entered
    # there and counts the rest as spoofed. One entry per (hop, partition), from its first
    # replica's: the group holds every replica (replica 0 may be a co-located shadow no
    # attempt has placed, which has no entry).
    firsts = {r.key[:4]: r for r in reversed(plan.replication)}
    out += [EntrySpec(
        "ckm_replicate",
        (("job_id", r.job_id), ("src_ip", _ip(r.src_ip)), ("dst_ip", _ip(r.dst_ip)),
         ("partition", r.partition)),
        "replicate", (("group", r.group_id), ("ingress_port", r.ingress_port)))
        for r in plan.replication if firsts[r.key[:4]] is r]
    out += [EntrySpec(
        "shadow_rewrite", (("egress_rid", w.rid),), "rewrite_shadow",
        (("smac", _mac(w.smac)), ("dmac", _mac(w.dmac)), ("ip", _ip(w.ip)),
         ("udp_port", w.udp_port), ("epoch", w.epoch), ("token", w.token)))
        for w in plan.rewrites]
    return out


def groups(plan: Plan) -> dict[int, tuple[tuple[int, int], ...]]:
    return {g.group_id: tuple(sorted(g.replicas)) for g in plan.groups}


@dataclass
class Diff:
    """What a deploy writes, in the order that never points an entry at a missing group:
    stale entries deleted, groups written, entries written, stale groups deleted."""

    stale: list[EntrySpec]
    groups_new: dict[int, tuple[tuple[int, int], ...]]
    groups_changed: dict[int, tuple[tuple[int, int], ...]]
    entries_new: list[EntrySpec]
    entries_changed: list[EntrySpec]
    groups_stale: list[int]

    def labels(self) -> tuple[list[str], list[str], list[str]]:
        """(added, changed, removed) lines of an ApplyResult."""
        added = [f"multicast group {g} {list(r)}" for g, r in self.groups_new.items()]
        added += [s.label() for s in self.entries_new]
        changed = [f"multicast group {g} {list(r)}" for g, r in self.groups_changed.items()]
        changed += [s.label() for s in self.entries_changed]
        removed = [s.label() for s in self.stale]
        removed += [f"multicast group {g}" for g in self.groups_stale]
        return added, changed, removed


def diff(want: dict, have: dict, want_g: dict, have_g: dict) -> Diff:
    """The writes that turn ``have`` (entries by key, groups by id) into ``want``."""
    return Diff(
        stale=[s for k, s in sorted(have.items()) if k not in want],
        groups_new={g: r for g, r in sorted(want_g.items()) if g not in have_g},
        groups_changed={g: r for g, r in sorted(want_g.items())
                        if g in have_g and have_g[g] != r},
        entries_new=[s for k, s in want.items() if k not in have],
        entries_changed=[s for k, s in want.items() if k in have and have[k] != s],
        groups_stale=[g for g in sorted(have_g) if g not in want_g])


def counter_stats(raw: dict[int, int] | None, misses: dict[str, dict[int, int] | None],
                  source: dict[int, int] | None) -> dict[str, int]:
    """The program's counters by name: ckm_stats per outcome (and "ckm", their well-formed
    sum), the two miss counters, the source check's drops per reason; a counter the target
    cannot read (None) is left out."""
    stats: dict[str, int] = {}
    if raw is not None:
        stats = {n: raw.get(i, 0) for i, n in enumerate(STAT_NAMES)}
        stats["ckm"] = sum(stats[n] for n in WELL_FORMED)
    for k, m in misses.items():
        if m is not None:
            stats[k] = m.get(0, 0)
    if source is not None:
        stats.update({n: source.get(i, 0) for i, n in enumerate(SOURCE_NAMES)})
    return stats


def encode(value: int, bitwidth: int, what: str) -> bytes:
    """P4Runtime canonical bytes: big-endian, no leading zero bytes, at least one byte."""
    if value < 0 or value >= 1 << bitwidth:
        raise CheckmateError(f"{what}: value {value} does not fit in {bitwidth} bits")
    return value.to_bytes(max(1, (value.bit_length() + 7) // 8), "big")


class Schema:
    """Names <-> ids of one P4Info (the switch's), checked to hold what the plan writes."""

    TABLES = tuple(TABLES)

    def __init__(self, p4info, where: str = "the P4Info") -> None:
        self.p4info = p4info
        by_name = {p4info_mod.canonical(t.preamble.name): t for t in p4info.tables}
        self.actions = {p4info_mod.canonical(a.preamble.name): a for a in p4info.actions}
        self.action_by_id = {a.preamble.id: a for a in p4info.actions}
        missing = [n for n in TABLES.values() if n not in by_name]
        if missing:
            raise CheckmateError(f"{where} lacks table(s) {', '.join(missing)}: another P4 "
                                 "program, not Checkmate's")
        self.tables = {short: by_name[full] for short, full in TABLES.items()}
        self.tables.update({short: by_name[full] for short, full in OPTIONAL_TABLES.items()
                            if full in by_name})
        #: the per-port source check is in this build (see OPTIONAL_TABLES)
        self.source_checked = "port_bind" in self.tables
        self.short = {t.preamble.id: short for short, t in self.tables.items()}
        self.counters = p4info_mod.counters(p4info)
        problems = [p for short in self.tables for p in self._check(short)]
        if problems:
            raise CheckmateError(f"{where} is from another build of the Checkmate program: "
                                 f"{'; '.join(problems)} (recompile p4/ and reload it)")

    def _check(self, short: str) -> list[str]:
        keys, action, params = WRITES[short]
        t = self.tables[short]
        tn = {**TABLES, **OPTIONAL_TABLES}[short]
        have = {f.name: f.bitwidth for f in t.match_fields}
        out = [] if have == keys else [f"table {tn} keys {sorted(have.items())}, expected "
                                       f"{sorted(keys.items())}"]
        a = self.actions.get(action)
        if a is None:
            return [*out, f"no action {action}"]
        if a.preamble.id not in {r.id for r in t.action_refs}:
            out.append(f"table {tn} does not offer action {action}")
        pw = {p.name: p.bitwidth for p in a.params}
        if pw != params:
            out.append(f"action {action} parameters {sorted(pw.items())}, expected "
                       f"{sorted(params.items())}")
        return out

    def table_id(self, short: str) -> int:
        return self.tables[short].preamble.id

    def counter(self, name: str) -> p4info_mod.Counter:
        c = self.counters.get(name)
        if c is None:
            raise CheckmateError(f"the switch's P4Info has no counter {name}: another build "
                                 "of the Checkmate program (recompile p4/ and reload it)")
        return c

    def to_proto(self, spec: EntrySpec):
        pb = p4proto.p4runtime()
        t = self.tables[spec.table]
        fields = {f.name: f for f in t.match_fields}
        te = pb.TableEntry(table_id=t.preamble.id)
        for name, value in spec.match:
            f = fields[name]
            te.match.add(field_id=f.id, exact=pb.FieldMatch.Exact(
                value=encode(value, f.bitwidth, f"{spec.table}.{name}")))
        a = self.actions[WRITES[spec.table][1]]
        params = {p.name: p for p in a.params}
        act = te.action.action
        act.action_id = a.preamble.id
        for name, value in spec.params:
            p = params[name]
            act.params.add(param_id=p.id, value=encode(value, p.bitwidth,
                                                       f"{spec.action}.{name}"))
        return te

    def from_proto(self, te) -> EntrySpec:
        t = self.p4info_table(te.table_id)
        order = [f.name for f in t.match_fields]
        names = {f.id: f.name for f in t.match_fields}
        match = tuple(sorted(
            ((names[m.field_id], int.from_bytes(m.exact.value, "big")) for m in te.match),
            key=lambda kv: order.index(kv[0])))
        a = self.action_by_id.get(te.action.action.action_id)
        if a is None:
            raise CheckmateError(f"switch reports an entry of {t.preamble.name} with action id "
                                 f"{te.action.action.action_id}, which its P4Info lacks")
        porder = [p.name for p in a.params]
        pnames = {p.id: p.name for p in a.params}
        params = tuple(sorted(
            ((pnames[p.param_id], int.from_bytes(p.value, "big"))
             for p in te.action.action.params),
            key=lambda kv: porder.index(kv[0])))
        short_action = p4info_mod.canonical(a.preamble.name).rsplit(".", 1)[-1]
        return EntrySpec(self.short[t.preamble.id], match, short_action, params)

    def p4info_table(self, table_id: int):
        short = self.short.get(table_id)
        if short is None:
            raise CheckmateError(f"switch reports an entry of table id {table_id}, which is "
                                 "not one of the Checkmate tables")
        return self.tables[short]
