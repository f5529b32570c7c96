"""P4Runtime driver (bmv2 and Tofino tables and multicast groups).

Deploy reads what the device holds (entries of the four Checkmate tables, multicast groups),
diffs it against the plan and writes only the difference, ordered so that nothing ever
points at a missing group: stale entries are deleted first, then groups are written, then
entries, and stale groups last.
"""

from __future__ import annotations

from checkmate.config.cluster import ClusterConfig
from checkmate.control import p4proto, pipeline
from checkmate.control.drivers import p4tables
from checkmate.control.drivers.base import ApplyResult
from checkmate.control.p4rt_client import P4RuntimeClient
from checkmate.control.plan import Plan
from checkmate.errors import CheckmateError

#: Kept here for readers of the P4Runtime driver; defined with the tables (p4tables).
STAT_NAMES = p4tables.STAT_NAMES
WELL_FORMED = p4tables.WELL_FORMED


class P4RuntimeDriver:
    def __init__(self, cfg: ClusterConfig, arch: str,
                 client: P4RuntimeClient | None = None) -> None:
        self.cfg = cfg
        self.arch = arch
        self.schema: p4tables.Schema | None = None
        if client is None:
            if not cfg.switch.address:
                raise CheckmateError(f"switch.address (P4Runtime host:port) is not set for "
                                     f"{cfg.switch.target} switch {cfg.switch.name}")
            client = P4RuntimeClient(cfg.switch.address, cfg.switch.device_id)
        self.client = client
        self._connected = False

    # -- connection and pipeline -----------------------------------------------------------
    def device_config(self) -> bytes:
        """The compiled program as this target's p4_device_config."""
        return pipeline.device_config(self.arch)

    def _ensure(self, load: bool = True) -> p4tables.Schema:
        """Connect, load the compiled pipeline if the switch has none (``load``; deploys
        only), and resolve the switch's own P4Info by name (whatever ids its compiler
        gave)."""
        if self._connected and self.schema is not None:
            return self.schema
        if not self._connected:
            self.client.connect()
            self._connected = True
        sw = self.cfg.switch.name
        have = self.client.get_p4info()
        if have is None and not load:
            raise CheckmateError(f"switch {sw} has no P4 program loaded; `control deploy "
                                 f"--switch {sw}` loads and programs it")
        if have is None:
            loaded = pipeline.compiled_p4info(self.arch)
            if loaded.opaque:
                raise CheckmateError(
                    f"switch {sw} has no P4 program loaded and {loaded.source} is text with "
                    "Tofino extern payloads this controller cannot re-encode; have the "
                    "compiler write the binary P4Info too (--p4runtime-files "
                    "...p4info.txtpb,...p4info.bin; p4c refuses .binpb)")
            schema = p4tables.Schema(loaded.p4info, f"compiler output {loaded.source}")
            self.client.set_pipeline(loaded.p4info, self.device_config())
            self.schema = schema
        else:
            self.schema = p4tables.Schema(have, f"switch {sw}'s P4Info")
        return self.schema

    def close(self) -> None:
        if self._connected:
            self.client.close()
            self._connected = False

    # -- reading -------------------------------------------------------------------------
    def read_entries(self) -> dict:
        schema = self._ensure()
        pb = p4proto.p4runtime()
        ents = [pb.Entity(table_entry=pb.TableEntry(table_id=schema.table_id(t)))
                for t in schema.tables]
        out = {}
        for ent in self.client.read(ents):
            spec = schema.from_proto(ent.table_entry)
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
        assert self.schema is not None
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
        schema = self._ensure()
        pb = p4proto.p4runtime()
        want = {e.key: e for e in p4tables.entries(plan) if e.table in schema.tables}
        have = self.read_entries()
        want_g = p4tables.groups(plan)
        have_g = self.read_groups()
        res = ApplyResult()
        if not schema.source_checked:
            res.notes.append(p4tables.SOURCE_UNCHECKED)
        d = p4tables.diff(want, have, want_g, have_g)
        res.added, res.changed, res.removed = d.labels()
        batches = (
            [self._entry_update(pb.Update.DELETE, s) for s in d.stale],
            [self._group_update(pb.Update.INSERT, g, r) for g, r in d.groups_new.items()]
            + [self._group_update(pb.Update.MODIFY, g, r) for g, r in d.groups_changed.items()],
            [self._entry_update(pb.Update.INSERT, s) for s in d.entries_new]
            + [self._entry_update(pb.Update.MODIFY, s) for s in d.entries_changed],
            [self._group_update(pb.Update.DELETE, g, have_g[g]) for g in d.groups_stale])
        for batch in batches:
            self.client.write(batch)
        return res

    # -- status --------------------------------------------------------------------------
    def _direct_counts(self, short: str) -> dict | None:
        """Per-entry (packets, bytes) of a table's direct counter, None when unreadable over
        P4Runtime (a Tofino extern: compile with --p4runtime-force-std-externs)."""
        schema = self._ensure()
        c = schema.counter(f"{({**p4tables.TABLES, **p4tables.OPTIONAL_TABLES})[short]}"
                           "_counter")
        if c.extern:
            return None
        pb = p4proto.p4runtime()
        ent = pb.Entity(direct_counter_entry=pb.DirectCounterEntry(
            table_entry=pb.TableEntry(table_id=schema.table_id(short))))
        out = {}
        for e in self.client.read([ent]):
            spec = schema.from_proto(e.direct_counter_entry.table_entry)
            d = e.direct_counter_entry.data
            out[spec.key] = (d.packet_count, d.byte_count)
        return out

    def _indexed(self, name: str) -> dict[int, int] | None:
        """Packets per index of an indexed counter, None when it is a Tofino extern."""
        c = self._ensure().counter(name)
        if c.extern:
            return None
        pb = p4proto.p4runtime()
        ent = pb.Entity(counter_entry=pb.CounterEntry(counter_id=c.id))
        return {e.counter_entry.index.index: e.counter_entry.data.packet_count
                for e in self.client.read([ent])}

    def status(self) -> dict:
        schema = self._ensure(load=False)
        entries, notes = [], []
        if not schema.source_checked:
            notes.append(p4tables.SOURCE_UNCHECKED)
        specs = self.read_entries()
        for t in schema.tables:
            counts = self._direct_counts(t)
            for k, spec in sorted(specs.items()):
                if spec.table != t:
                    continue
                pk, by = (None, None) if counts is None else counts.get(k, (0, 0))
                entries.append({"entry": spec.label(), "packets": pk, "bytes": by})
        raw = self._indexed(p4tables.STATS_COUNTER)
        misses = {k: self._indexed(n) for k, n in p4tables.MISS_COUNTERS.items()}
        if raw is None or None in misses.values():
            notes.append("counters are Tofino externs in this build: read them in bfrt, or "
                         "compile with --p4runtime-force-std-externs")
        # frames dropped by the source check, per reason
        src = self._indexed(p4tables.SOURCE_COUNTER) if schema.source_checked else None
        stats = p4tables.counter_stats(raw, misses, src)
        return {"target": self.cfg.switch.target, "switch": self.cfg.switch.name,
                "entries": entries, "groups": {g: list(r) for g, r in self.read_groups().items()},
                "ckm_stats": stats, "notes": notes}
