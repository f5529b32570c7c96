"""bmv2 simple_switch driver over its Thrift runtime (``switch: {target: bmv2, runtime:
thrift}``): the switch the open-source toolchain builds, which has no P4Runtime server.

Thrift addresses everything by the names in the switch's loaded JSON, so the JSON is the
schema: every table, key, action and parameter the plan writes is looked up there, with its
width, before anything is written (:class:`JsonSchema`), as the P4Runtime driver does with
the P4Info. A switch started without a program (``--no-p4 -- --enable-swap``) gets the
compiled JSON from the build folder (checkmate.control.pipeline) on the first deploy.

The client classes are bmv2's own, generated from its Thrift IDL and installed beside
``simple_switch`` (``share/bmv2/gen-py``; bmv2's tools/bmpy_utils.py connects the same way:
one buffered socket, one multiplexed protocol per service). They are looked for in
``$CHECKMATE_BMV2_PY`` and else beside the ``simple_switch`` on PATH.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from checkmate.config.cluster import ClusterConfig
from checkmate.control import pipeline
from checkmate.control.drivers import p4tables
from checkmate.control.drivers.base import ApplyResult
from checkmate.control.plan import Plan
from checkmate.errors import CheckmateError
from checkmate.extras import needs

#: Where bmv2's generated Python clients are (a folder holding bm_runtime/).
GENPY_ENV = "CHECKMATE_BMV2_PY"
CXT = 0  # simple_switch has one context


def genpy_dir() -> Path | None:
    """bmv2's gen-py folder: $CHECKMATE_BMV2_PY, else share/bmv2/gen-py beside the
    simple_switch on PATH; None when neither holds bm_runtime."""
    env = os.environ.get(GENPY_ENV)
    cands = [Path(env)] if env else []
    exe = shutil.which("simple_switch")
    if exe:
        cands.append(Path(exe).resolve().parent.parent / "share" / "bmv2" / "gen-py")
    return next((c for c in cands if (c / "bm_runtime" / "standard").is_dir()), None)


def _runtime() -> tuple[Any, Any, Any]:
    """(Standard, SimplePreLAG, ttypes) modules of bmv2's Thrift clients."""
    where = genpy_dir()
    if where is None:
        raise CheckmateError(f"bmv2's Thrift clients (bm_runtime) not found: set {GENPY_ENV} "
                             "to bmv2's share/bmv2/gen-py or put simple_switch on PATH")
    if str(where) not in sys.path:
        sys.path.append(str(where))
    with needs("switch"):
        import thrift  # noqa: F401  (named in the switch extra; the clients need it)
    # thrift logs a refused connection itself, before raising what _errors turns into the
    # one line: without a handler of the application's, Python's last-resort handler would
    # print it as a second line
    logging.getLogger("thrift").addHandler(logging.NullHandler())
    from bm_runtime.simple_pre_lag import SimplePreLAG
    from bm_runtime.standard import Standard, ttypes

    return Standard, SimplePreLAG, ttypes


def port_map(ports: list[int]) -> str:
    """simple_pre_lag's port bitmap: a string of 0/1 with port 0 as the last character."""
    top = max(ports)
    return "".join("1" if p in ports else "0" for p in range(top, -1, -1))


class JsonSchema:
    """The Checkmate tables as the switch's loaded bmv2 JSON names them, with the width of
    every key and parameter, checked against what the plan writes (p4tables.WRITES)."""

    def __init__(self, program: dict, where: str) -> None:
        widths = {h["name"]: {f[0]: f[1] for f in h["fields"]}
                  for h in program.get("header_types", [])}
        header_type = {h["name"]: h["header_type"] for h in program.get("headers", [])}
        tables = {t["name"]: t for p in program.get("pipelines", []) for t in p["tables"]}
        actions = {a["name"]: a for a in program.get("actions", [])}
        self.counters = {c["name"]: c for c in program.get("counter_arrays", [])}
        missing = [n for n in p4tables.TABLES.values() if n not in tables]
        if missing:
            raise CheckmateError(f"{where} lacks table(s) {', '.join(missing)}: another P4 "
                                 "program, not Checkmate's")
        names = {**p4tables.TABLES, **p4tables.OPTIONAL_TABLES}
        self.tables = {s: n for s, n in names.items() if n in tables}
        self.source_checked = "port_bind" in self.tables
        self.keys: dict[str, list[tuple[str, int]]] = {}
        self.params: dict[str, list[tuple[str, int]]] = {}
        problems = []
        for short, full in self.tables.items():
            keys, action, params = p4tables.WRITES[short]
            t = tables[full]
            have = []
            for k in t["key"]:
                hdr, field = k["target"]
                have.append((k["name"], widths.get(header_type.get(hdr), {}).get(field, -1)))
            if dict(have) != keys or any(k["match_type"] != "exact" for k in t["key"]):
                problems.append(f"table {full} keys {sorted(have)}, expected "
                                f"{sorted(keys.items())}")
            self.keys[short] = have
            if action not in t["actions"]:
                problems.append(f"table {full} does not offer action {action}")
                continue
            pw = [(r["name"], r["bitwidth"]) for r in actions[action]["runtime_data"]]
            if dict(pw) != params:
                problems.append(f"action {action} parameters {sorted(pw)}, expected "
                                f"{sorted(params.items())}")
            self.params[short] = pw
        if problems:
            raise CheckmateError(f"{where} is from another build of the Checkmate program: "
                                 f"{'; '.join(problems)} (recompile p4/ and reload it)")

    def action(self, short: str) -> str:
        return p4tables.WRITES[short][1]

    def encode(self, spec: p4tables.EntrySpec) -> tuple[list[bytes], list[bytes]]:
        """Key and action data as Thrift wants them: big-endian, each its field's full
        width in bytes."""
        def full(value: int, width: int, what: str) -> bytes:
            p4tables.encode(value, width, what)  # range check, one line on overflow
            return value.to_bytes((width + 7) // 8, "big")

        m, p = dict(spec.match), dict(spec.params)
        key = [full(m[n], w, f"{spec.table}.{n}") for n, w in self.keys[spec.table]]
        data = [full(p[n], w, f"{spec.action}.{n}") for n, w in self.params[spec.table]]
        return key, data

    def decode(self, short: str, entry: Any) -> p4tables.EntrySpec:
        match = tuple((n, int.from_bytes(k.exact.key, "big"))
                      for (n, _), k in zip(self.keys[short], entry.match_key, strict=True))
        a = entry.action_entry
        names = [n for n, _ in self.params.get(short, [])]
        params = tuple((n, int.from_bytes(v, "big"))
                       for n, v in zip(names, a.action_data, strict=False))
        return p4tables.EntrySpec(short, match, a.action_name.rsplit(".", 1)[-1], params)


class Bmv2ThriftDriver:
    def __init__(self, cfg: ClusterConfig, timeout: float = 10.0) -> None:
        if not cfg.switch.address:
            raise CheckmateError(f"switch.address (bmv2 Thrift host:port) is not set for "
                                 f"switch {cfg.switch.name}")
        host, _, port = cfg.switch.address.rpartition(":")
        if not host or not port.isdigit():
            raise CheckmateError(f"switch.address {cfg.switch.address!r} is not host:port")
        self.cfg, self.addr, self.timeout = cfg, (host, int(port)), timeout
        self.schema: JsonSchema | None = None
        self._transport = None
        self.std: Any = None
        self.pre: Any = None
        self.tt: Any = None

    # -- connection and pipeline -----------------------------------------------------------
    @contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        """One line for anything bmv2 or the connection refuses."""
        from thrift.Thrift import TException

        try:
            yield
        except TException as e:
            name = type(e).__name__
            code = getattr(e, "code", None)
            raise CheckmateError(f"bmv2 switch {self.cfg.switch.name} at {self.addr[0]}:"
                                 f"{self.addr[1]}: {what} failed: {name}"
                                 f"{f' (code {code})' if code is not None else ''}"
                                 f"{f': {e.message}' if getattr(e, 'message', None) else ''}"
                                 ) from None

    def _connect(self) -> None:
        if self._transport is not None:
            return
        standard, pre_lag, self.tt = _runtime()
        from thrift.protocol import TBinaryProtocol, TMultiplexedProtocol
        from thrift.transport import TSocket, TTransport

        sock = TSocket.TSocket(*self.addr)
        sock.setTimeout(int(self.timeout * 1000))
        transport = TTransport.TBufferedTransport(sock)
        proto = TBinaryProtocol.TBinaryProtocol(transport)
        self.std = standard.Client(TMultiplexedProtocol.TMultiplexedProtocol(proto, "standard"))
        self.pre = pre_lag.Client(TMultiplexedProtocol.TMultiplexedProtocol(proto,
                                                                           "simple_pre_lag"))
        with self._errors("connecting"):
            transport.open()
        self._transport = transport

    def _ensure(self, load: bool = True) -> JsonSchema:
        """Connect, load the compiled program when the switch runs none (``load``: deploys
        only), and read the names from the switch's own JSON."""
        if self.schema is not None:
            return self.schema
        self._connect()
        sw = self.cfg.switch.name
        with self._errors("reading its program"):
            program = json.loads(self.std.bm_get_config() or "{}")
        if not program.get("pipelines"):
            if not load:
                raise CheckmateError(f"switch {sw} has no P4 program loaded; `control deploy "
                                     f"--switch {sw}` loads and programs it")
            text = pipeline.device_config("v1model").decode()
            with self._errors("loading the compiled program (start simple_switch with "
                              "-- --enable-swap)"):
                self.std.bm_load_new_config(text)
                self.std.bm_swap_configs()
            program = json.loads(text)
            where = "the compiled program"
        else:
            where = f"switch {sw}'s program"
        self.schema = JsonSchema(program, where)
        return self.schema

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None
            self.schema = None

    # -- reading -------------------------------------------------------------------------
    def _read(self) -> dict[tuple, tuple[p4tables.EntrySpec, int]]:
        """Every Checkmate entry the switch holds, by key, with its handle."""
        schema = self._ensure()
        out = {}
        for short, full in schema.tables.items():
            with self._errors(f"reading {full}"):
                rows = self.std.bm_mt_get_entries(CXT, full)
            for e in rows:
                spec = schema.decode(short, e)
                out[spec.key] = (spec, e.entry_handle)
        return out

    def read_entries(self) -> dict:
        return {k: spec for k, (spec, _) in self._read().items()}

    def _mc(self) -> dict:
        self._ensure()
        with self._errors("reading multicast groups"):
            return json.loads(self.pre.bm_mc_get_entries(CXT))

    def _group_nodes(self) -> dict[int, dict[tuple[int, int], int]]:
        """Multicast group id -> {(port, rid): node handle}; one port per node as written."""
        mc = self._mc()
        l1 = {n["handle"]: n for n in mc.get("l1_handles", [])}
        l2 = {n["handle"]: n for n in mc.get("l2_handles", [])}
        out: dict[int, dict[tuple[int, int], int]] = {}
        for g in mc.get("mgrps", []):
            nodes = out.setdefault(g["id"], {})
            for h in g.get("l1_handles", []):
                node = l1[h]
                for port in l2.get(node.get("l2_handle"), {}).get("ports", []):
                    nodes[(port, node["rid"])] = h
        return out

    def read_groups(self) -> dict[int, tuple[tuple[int, int], ...]]:
        return {g: tuple(sorted(n)) for g, n in self._group_nodes().items()}

    # -- deploy --------------------------------------------------------------------------
    def _add(self, spec: p4tables.EntrySpec) -> None:
        assert self.schema is not None
        key, data = self.schema.encode(spec)
        tt = self.tt
        match = [tt.BmMatchParam(type=tt.BmMatchParamType.EXACT,
                                 exact=tt.BmMatchParamExact(k)) for k in key]
        with self._errors(f"adding {spec.label()}"):
            self.std.bm_mt_add_entry(CXT, self.schema.tables[spec.table], match,
                                     self.schema.action(spec.table), data,
                                     tt.BmAddEntryOptions())

    def _write_group(self, gid: int, reps: tuple[tuple[int, int], ...],
                     nodes: dict[tuple[int, int], int] | None) -> None:
        """Create the group (``nodes`` None) or bring its members to ``reps``: new members
        are associated before old ones leave, so a copy is never sent to nobody."""
        with self._errors(f"writing multicast group {gid}"):
            if nodes is None:
                self.pre.bm_mc_mgrp_create(CXT, gid)
                nodes = {}
            for port, rid in reps:
                if (port, rid) not in nodes:
                    h = self.pre.bm_mc_node_create(CXT, rid, port_map([port]), "")
                    self.pre.bm_mc_node_associate(CXT, gid, h)
            for member, h in nodes.items():
                if member not in reps:
                    self.pre.bm_mc_node_dissociate(CXT, gid, h)
                    self.pre.bm_mc_node_destroy(CXT, h)

    def apply(self, plan: Plan) -> ApplyResult:
        schema = self._ensure()
        want = {e.key: e for e in p4tables.entries(plan) if e.table in schema.tables}
        held = self._read()
        have = {k: spec for k, (spec, _) in held.items()}
        nodes = self._group_nodes()
        have_g = {g: tuple(sorted(n)) for g, n in nodes.items()}
        d = p4tables.diff(want, have, p4tables.groups(plan), have_g)
        res = ApplyResult()
        if not schema.source_checked:
            res.notes.append(p4tables.SOURCE_UNCHECKED)
        res.added, res.changed, res.removed = d.labels()
        for spec in d.stale:
            with self._errors(f"deleting {spec.label()}"):
                self.std.bm_mt_delete_entry(CXT, schema.tables[spec.table], held[spec.key][1])
        for gid, reps in d.groups_new.items():
            self._write_group(gid, reps, None)
        for gid, reps in d.groups_changed.items():
            self._write_group(gid, reps, nodes[gid])
        for spec in d.entries_new:
            self._add(spec)
        for spec in d.entries_changed:
            key, data = schema.encode(spec)
            with self._errors(f"modifying {spec.label()}"):
                self.std.bm_mt_modify_entry(CXT, schema.tables[spec.table],
                                            held[spec.key][1], schema.action(spec.table), data)
        for gid in d.groups_stale:
            self._write_group(gid, (), nodes[gid])
            with self._errors(f"deleting multicast group {gid}"):
                self.pre.bm_mc_mgrp_destroy(CXT, gid)
        return res

    # -- status --------------------------------------------------------------------------
    def _indexed(self, name: str) -> dict[int, int] | None:
        """Packets per index of an indexed counter (None: this build has no such counter)."""
        c = self._ensure().counters.get(name)
        if c is None or c.get("is_direct"):
            return None
        with self._errors(f"reading counter {name}"):
            return {i: self.std.bm_counter_read(CXT, name, i).packets
                    for i in range(int(c.get("size", 0)))}

    def status(self) -> dict:
        schema = self._ensure(load=False)
        notes = [] if schema.source_checked else [p4tables.SOURCE_UNCHECKED]
        entries = []
        held = self._read()
        for short, full in schema.tables.items():
            for _, (spec, handle) in sorted(held.items()):
                if spec.table != short:
                    continue
                with self._errors(f"reading the counter of {spec.label()}"):
                    c = self.std.bm_mt_read_counter(CXT, full, handle)
                entries.append({"entry": spec.label(), "packets": c.packets,
                                "bytes": c.bytes})
        misses = {k: self._indexed(n) for k, n in p4tables.MISS_COUNTERS.items()}
        src = self._indexed(p4tables.SOURCE_COUNTER) if schema.source_checked else None
        stats = p4tables.counter_stats(self._indexed(p4tables.STATS_COUNTER), misses, src)
        return {"target": "bmv2", "runtime": "thrift", "switch": self.cfg.switch.name,
                "entries": entries, "groups": {g: list(r) for g, r in self.read_groups().items()},
                "ckm_stats": stats, "notes": notes}
