"""P4Runtime driver (bmv2 and Tofino tables and multicast groups).

Deploy reads what the device holds (entries of the four Checkmate tables, multicast groups),
diffs it against the plan and writes only the difference, ordered so that nothing ever
points at a missing group: stale entries are deleted first, then groups are written, then
entries, and stale groups last.
"""

from __future__ import annotations

from pathlib import Path

from checkmate.config import ClusterConfig
from checkmate.control import p4proto
from checkmate.control.drivers import p4tables
from checkmate.control.drivers.base import ApplyResult
from checkmate.control.p4rt_client import P4RuntimeClient
from checkmate.control.plan import Plan
from checkmate.errors import CheckmateError

BUILD = p4tables.REPO / "build" / "p4"
#: Indexes of the P4 ckm_stats counter (STAT_* in p4/include/checkmate_common.p4).
STAT_NAMES = ("ckm", "replicated", "no_entry", "malformed", "handshake", "spoofed")


def device_config_path(arch: str) -> Path:
    """Where the compiled program is expected (p4c-bm2-ss JSON / bf-p4c output)."""
    return BUILD / ("checkmate_v1model.json" if arch == "v1model" else "checkmate_tna.bin")


class P4RuntimeDriver:
    def __init__(self, cfg: ClusterConfig, arch: str,
                 client: P4RuntimeClient | None = None) -> None:
        self.cfg = cfg
        self.arch = arch
        self.schema = p4tables.Schema(p4tables.load_p4info(arch))
        if client is None:
            if not cfg.switch.address:
                raise CheckmateError(f"switch.address (P4Runtime host:port) is not set for "
                                     f"{cfg.switch.target} switch {cfg.switch.name}")
            client = P4RuntimeClient(cfg.switch.address, cfg.switch.device_id)
        self.client = client
        self._connected = False

    # -- connection and pipeline -----------------------------------------------------------
    def _ensure(self) -> None:
        if self._connected:
            return
        self.client.connect()
        self._connected = True
        have = self.client.get_p4info()
        if have is None:
            path = device_config_path(self.arch)
            if not path.exists():
                raise CheckmateError(
                    f"switch {self.cfg.switch.name} has no P4 program loaded and {path} is "
                    f"missing; compile p4/checkmate_{self.arch}.p4 first")
            self.client.set_pipeline(self.schema.p4info, path.read_bytes())
            return
        names = {t.preamble.alias for t in have.tables}
        missing = [t for t in p4tables.Schema.TABLES if t not in names]
        if missing:
            raise CheckmateError(f"switch {self.cfg.switch.name} runs another P4 program "
                                 f"(no table {', '.join(missing)})")
        ours = {t.preamble.name: t.preamble.id for t in self.schema.p4info.tables}
        theirs = {t.preamble.name: t.preamble.id for t in have.tables}
        if any(theirs.get(n) != i for n, i in ours.items()):
            raise CheckmateError(f"switch {self.cfg.switch.name} runs a different build of "
                                 f"the Checkmate program (P4Info ids differ)")

    def close(self) -> None:
        if self._connected:
            self.client.close()
            self._connected = False

    # -- reading -------------------------------------------------------------------------
    def read_entries(self) -> dict:
        pb = p4proto.p4runtime()
        ents = [pb.Entity(table_entry=pb.TableEntry(table_id=self.schema.table_id(t)))
                for t in p4tables.Schema.TABLES]
        out = {}
        for ent in self.client.read(ents):
            spec = self.schema.from_proto(ent.table_entry)
            out[spec.key] = spec
        return out

    def read_groups(self) -> dict[int, tuple[tuple[int, int], ...]]:
        pb = p4proto.p4runtime()
        ent = pb.Entity(packet_replication_engine_entry=pb.PacketReplicationEngineEntry(
            multicast_group_entry=pb.MulticastGroupEntry(multicast_group_id=0)))
        out = {}
        for e in self.client.read([ent]):
            g = e.packet_replication_engine_entry.multicast_group_entry
            out[g.multicast_group_id] = tuple(sorted((r.egress_port, r.instance)
                                                     for r in g.replicas))
        return out

    # -- deploy --------------------------------------------------------------------------
    def _entry_update(self, kind: int, spec: p4tables.EntrySpec):
        pb = p4proto.p4runtime()
        return pb.Update(type=kind, entity=pb.Entity(table_entry=self.schema.to_proto(spec)))

    @staticmethod
    def _group_update(kind: int, gid: int, replicas: tuple[tuple[int, int], ...]):
        pb = p4proto.p4runtime()
        g = pb.MulticastGroupEntry(multicast_group_id=gid, replicas=[
            pb.Replica(egress_port=port, instance=rid) for port, rid in replicas])
        return pb.Update(type=kind, entity=pb.Entity(
            packet_replication_engine_entry=pb.PacketReplicationEngineEntry(
                multicast_group_entry=g)))

    def apply(self, plan: Plan) -> ApplyResult:
        self._ensure()
        pb = p4proto.p4runtime()
        want = {e.key: e for e in p4tables.entries(plan)}
        have = self.read_entries()
        want_g = p4tables.groups(plan)
        have_g = self.read_groups()
        res = ApplyResult()
        stale = [self._entry_update(pb.Update.DELETE, s) for k, s in sorted(have.items())
                 if k not in want]
        res.removed += [s.label() for k, s in sorted(have.items()) if k not in want]
        group_ups = []
        for gid, reps in sorted(want_g.items()):
            if gid not in have_g:
                group_ups.append(self._group_update(pb.Update.INSERT, gid, reps))
                res.added.append(f"multicast group {gid} {list(reps)}")
            elif have_g[gid] != reps:
                group_ups.append(self._group_update(pb.Update.MODIFY, gid, reps))
                res.changed.append(f"multicast group {gid} {list(reps)}")
        entry_ups = []
        for k, spec in want.items():
            if k not in have:
                entry_ups.append(self._entry_update(pb.Update.INSERT, spec))
                res.added.append(spec.label())
            elif have[k] != spec:
                entry_ups.append(self._entry_update(pb.Update.MODIFY, spec))
                res.changed.append(spec.label())
        stale_g = [self._group_update(pb.Update.DELETE, gid, reps)
                   for gid, reps in sorted(have_g.items()) if gid not in want_g]
        res.removed += [f"multicast group {gid}" for gid in sorted(have_g) if gid not in want_g]
        for batch in (stale, group_ups, entry_ups, stale_g):
            self.client.write(batch)
        return res

    # -- status --------------------------------------------------------------------------
    def status(self) -> dict:
        self._ensure()
        pb = p4proto.p4runtime()
        entries = []
        for t in p4tables.Schema.TABLES:
            tid = self.schema.table_id(t)
            ent = pb.Entity(direct_counter_entry=pb.DirectCounterEntry(
                table_entry=pb.TableEntry(table_id=tid)))
            counts = {}
            for e in self.client.read([ent]):
                spec = self.schema.from_proto(e.direct_counter_entry.table_entry)
                counts[spec.key] = e.direct_counter_entry.data
            for k, spec in sorted(self.read_entries().items()):
                if spec.table != t:
                    continue
                d = counts.get(k)
                entries.append({"entry": spec.label(),
                                "packets": d.packet_count if d else 0,
                                "bytes": d.byte_count if d else 0})
        stats = {}
        c = self.schema.counters.get("ckm_stats")
        if c is not None:
            ent = pb.Entity(counter_entry=pb.CounterEntry(counter_id=c.preamble.id))
            for e in self.client.read([ent]):
                i = e.counter_entry.index.index
                if i < len(STAT_NAMES):
                    stats[STAT_NAMES[i]] = e.counter_entry.data.packet_count
        return {"target": self.cfg.switch.target, "switch": self.cfg.switch.name,
                "entries": entries, "groups": {g: list(r) for g, r in self.read_groups().items()},
                "ckm_stats": stats}
