"""The kernel (tc-eBPF) Checkmate switch: load, attach, and program it from Python.

This is the contract the controller's kernel driver codes against (names and signatures are
fixed). The switch lives in the network namespace ``cfg.netns(cfg.switch.name)``; one veth
port per host (``cfg.switch_ifname(host)``) is enslaved to a Linux bridge that does plain
L2 forwarding, and ``bpf/ckm_switch.c`` on every port replicates ckm datagrams to shadows,
counts, and injects faults. Maps are pinned under ``/sys/fs/bpf/<prefix>-<switch>/maps``,
so any process (the controller service, tests, ``testbed demo``) reads and writes the same
tables through the bpf(2) syscall.

Fault knobs act on frames *leaving* the switch through a port (towards its host), shadow
copies included, and only on ckm traffic: UDP datagrams to ckm ports and IPv4/UDP fragments
(later fragments carry no port; the testbed carries no other fragmented UDP). ARP, TCP and
other traffic is never dropped or corrupted. A knob can be limited to an iteration window.

Anti-spoofing, two layers. Every port is bound to its host's MAC and IPv4 address from the
config (``bind_ports``, done by ``attach`` and again by the controller's kernel driver): a
frame entering a port from any other source MAC or source IP (ARP: sender addresses; any
ethertype but IPv4 and ARP) is dropped and counted (``bad_src_mac`` / ``bad_src_ip``). The
bridge does not learn: its forwarding entries are static and sticky, written from the config,
with learning and unknown-unicast flooding off on every port, so no frame can move a host's
entry to another port (one frame with a shadow's source MAC used to redirect the shadow's
traffic, control messages with its epoch and token included, to the sender). Then, a
replication entry names the port its source host is attached to (``ingress_ifname``); a
matching REPLICATE datagram that enters through any other port is forwarded plainly and
counted ``spoofed`` (with the bindings in place this only happens when they disagree with
the entries): a copy carries the shadow's valid epoch/token, so a forged source must never
get one. A ckm datagram whose ``count`` disagrees with its length is ``malformed``:
forwarded plainly, never copied.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

from checkmate.config.cluster import ClusterConfig
from checkmate.config.schema import MAX_REPLICAS
from checkmate.dataplane import maps
from checkmate.dataplane.bpfsys import BpfError, PinnedMap
from checkmate.errors import CheckmateError
from checkmate.extras import needs

BPFFS = Path("/sys/fs/bpf")
NETNS_DIR = Path("/run/netns")

# Maps of the fault window, mirroring bpf/ckm_switch.c (kept here, next to their only user).
#: struct fault_win: from/until iteration (inclusive, 0 = unbounded), per-setting seed
FAULT_WIN = struct.Struct("<QQQ")
#: struct fault_state, in this order; written by the BPF program only
FAULT_STATE_FIELDS = ("last_iteration", "seed", "frag_dropped", "frag_corrupted", "swapped")
FAULT_STATE = struct.Struct("<" + "Q" * len(FAULT_STATE_FIELDS))
#: every pinned map of the switch: name -> (key size, value size)
MAP_LAYOUT = {
    **maps.MAP_LAYOUT,
    "ckm_fault_win": (maps.U32.size, FAULT_WIN.size),
    "ckm_fault_st": (maps.U32.size, FAULT_STATE.size),
}
#: maps a switch loaded by an older build lacks; it still runs, without those counts
OPTIONAL_MAPS = ("ckm_dscp",)
#: fault_state counters that counters() reports with the port's own
FRAG_COUNTERS = ("frag_dropped", "frag_corrupted")


class SwitchUnreachable(CheckmateError):
    """The switch namespace, its BPF programs or its pinned maps are absent."""


@dataclass(frozen=True)
class ReplicationEntry:
    """Copy REPLICATE datagrams of (job, src, dst, partition) to one shadow, but only those
    that entered the switch through ``ingress_ifname``, the port of the host owning src_ip.

    ``ingress_ifname`` is required (last, so an old positional call fails loudly rather than
    installing an entry that any port could trigger)."""

    job_id: int
    src_ip: str
    dst_ip: str
    partition: int
    shadow_ifname: str  # switch-namespace interface leading to the shadow
    shadow_mac: str
    shadow_ip: str
    shadow_port: int
    epoch: int
    token: int
    ingress_ifname: str  # switch-namespace interface leading to the host that owns src_ip
    #: Which of the partition's shadows (0 ..): each gets its own entry and its own copy.
    replica: int = 0


def netns_exists(name: str) -> bool:
    return (NETNS_DIR / name).exists()


def nsenter_argv(netns: str, argv: list[str]) -> list[str]:
    """argv run inside a network namespace without remounting /sys (bpffs stays visible)."""
    return ["nsenter", f"--net={NETNS_DIR / netns}", "--", *argv]


def ensure_bpffs() -> None:
    """Mount bpffs at /sys/fs/bpf when the machine booted without it."""
    if os.path.ismount(BPFFS):
        return
    res = subprocess.run(["mount", "-t", "bpf", "bpf", str(BPFFS)], capture_output=True,
                         text=True)
    if res.returncode != 0:
        raise CheckmateError(f"cannot mount bpffs on {BPFFS}: {res.stderr.strip()}")


def _check_u(name: str, v: int, bits: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < (1 << bits):
        raise CheckmateError(f"replication entry: {name} must be an integer in "
                             f"0..{(1 << bits) - 1}, got {v!r}")


def _check_prob(name: str, p: float) -> None:
    if isinstance(p, bool) or not isinstance(p, int | float) or not 0.0 <= p <= 1.0:
        raise CheckmateError(f"fault {name} must be a probability in 0..1, got {p!r}")


def _check_window(from_iteration: int, until_iteration: int) -> None:
    """One line per mistake: the window is compared with a u64 on the wire, 0 = unbounded."""
    for name, v in (("from_iteration", from_iteration), ("until_iteration", until_iteration)):
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 1 << 64:
            raise CheckmateError(f"fault {name} must be an iteration in 0..2**64-1 "
                                 f"(0: unbounded), got {v!r}")
    if from_iteration and until_iteration and from_iteration > until_iteration:
        raise CheckmateError(f"fault window is empty: from_iteration {from_iteration} > "
                             f"until_iteration {until_iteration}")


def _check_ip(name: str, v: str) -> None:
    try:
        ipaddress.IPv4Address(v)
    except ValueError:
        raise CheckmateError(f"replication entry: {name} is not an IPv4 address: {v!r}") from None


class KernelSwitch:
    """Handle on one kernel switch; constructing it touches nothing."""

    def __init__(self, cfg: ClusterConfig) -> None:
        self.cfg = cfg
        self.netns = cfg.netns(cfg.switch.name)
        self.pin_dir = BPFFS / f"{cfg.network.prefix}-{cfg.switch.name}"
        self.prog_dir = self.pin_dir / "progs"
        self.map_dir = self.pin_dir / "maps"

    # -- inventory -----------------------------------------------------------------------
    @property
    def port_names(self) -> list[str]:
        """The switch's ports: one per host that owns one (a co-located shadow has none)."""
        return [self.cfg.switch_ifname(h.name) for h in self.cfg.port_hosts]

    def _ifindexes(self) -> dict[str, int]:
        """Switch-namespace interface name -> ifindex, for every existing link."""
        if not netns_exists(self.netns):
            raise SwitchUnreachable(f"switch namespace {self.netns} does not exist "
                                    "(run `testbed up`)")
        with needs("switch"):
            from pyroute2 import NetNS

        try:
            with NetNS(self.netns, flags=0) as ns:
                return {link.get("ifname"): link["index"] for link in ns.get_links()}
        except OSError as e:
            raise SwitchUnreachable(f"cannot enter namespace {self.netns}: {e}") from None

    def _port_ifindexes(self) -> dict[str, int]:
        links = self._ifindexes()
        missing = [p for p in self.port_names if p not in links]
        if missing:
            raise SwitchUnreachable(f"switch {self.netns} lacks port(s) {', '.join(missing)}")
        return {p: links[p] for p in self.port_names}

    def _map(self, name: str) -> PinnedMap:
        path = self.map_dir / name
        if not path.exists():
            raise SwitchUnreachable(f"switch tables are not loaded ({path} missing; "
                                    "run `testbed up`)")
        try:
            return PinnedMap(str(path), *MAP_LAYOUT[name])
        except BpfError as e:
            raise SwitchUnreachable(str(e)) from None

    def is_up(self) -> bool:
        """Namespace, programs and maps all present."""
        if not netns_exists(self.netns):
            return False
        need = [self.prog_dir / "ckm_ingress", self.prog_dir / "ckm_egress"]
        need += [self.map_dir / m for m in MAP_LAYOUT if m not in OPTIONAL_MAPS]
        return all(p.exists() for p in need)

    # -- life cycle ----------------------------------------------------------------------
    def _tc(self, lines: list[str], check: bool = True) -> None:
        res = subprocess.run(nsenter_argv(self.netns, ["tc", "-force", "-batch", "-"]),
                             input="\n".join(lines) + "\n", capture_output=True, text=True)
        if check and res.returncode != 0:
            first = (res.stderr.strip().splitlines() or ["no output"])[0]
            raise CheckmateError(f"tc in {self.netns} failed: {first}")

    def attach(self) -> None:
        """Load the programs, pin maps, fill port tables and attach to every switch port."""
        from checkmate.dataplane.build import ensure_built

        obj = ensure_built()
        ensure_bpffs()
        ports = self._port_ifindexes()
        self.detach()
        if shutil.which("bpftool") is None:
            raise CheckmateError("bpftool not found; install bpftool (make setup)")
        self.pin_dir.mkdir(parents=True)
        res = subprocess.run(
            ["bpftool", "prog", "loadall", str(obj), str(self.prog_dir), "type", "classifier",
             "pinmaps", str(self.map_dir)], capture_output=True, text=True)
        if res.returncode != 0:
            self._remove_pins()
            tail = (res.stderr.strip().splitlines() or ["no output"])[-1]
            raise CheckmateError(f"loading {obj.name} failed: {tail}")
        with self._map("ckm_cfg") as m:
            m.update(maps.U32.pack(0), maps.SW_CFG.pack(maps.mac_bytes(self.cfg.switch.mac), 0))
        with (self._map("ckm_ports") as pm, self._map("ckm_fault") as fm,
              self._map("ckm_fault_win") as wm, self._map("ckm_fault_st") as sm):
            for idx in ports.values():
                pm.update(maps.U32.pack(idx), bytes(maps.PORT_STATS.size))
                fm.update(maps.U32.pack(idx), bytes(maps.FAULT.size))
                wm.update(maps.U32.pack(idx), bytes(FAULT_WIN.size))
                sm.update(maps.U32.pack(idx), bytes(FAULT_STATE.size))
        lines = []
        for p in ports:
            lines.append(f"qdisc add dev {p} clsact")
            lines.append(f"filter add dev {p} ingress bpf da pinned {self.prog_dir}/ckm_ingress")
            lines.append(f"filter add dev {p} egress bpf da pinned {self.prog_dir}/ckm_egress")
        self.bind_ports()  # before the filters: a port is never open to any source
        self._tc(lines)

    # -- source bindings and static L2 -----------------------------------------------------
    def _want_bindings(self) -> dict[str, tuple[str, str]]:
        return {self.cfg.switch_ifname(h.name): (h.mac.lower(), h.ip)
                for h in self.cfg.port_hosts}

    def bindings(self) -> dict[str, tuple[str, str]]:
        """{port: (MAC, IPv4)} as the switch holds them: the only source of frames entering
        that port."""
        names = {v: k for k, v in self._ifindexes().items()}
        with self._map("ckm_bind") as m:
            items = m.items()
        out = {}
        for k, v in items:
            mac, _, ip = maps.PORT_BIND.unpack(v)
            (idx,) = maps.U32.unpack(k)
            out[names.get(idx, f"if{idx}")] = (maps.mac_str(mac), maps.ip_str(ip))
        return out

    def bind_ports(self) -> list[str]:
        """Bind every port to its host's MAC and IPv4 address (the config's) and program the
        bridge's forwarding table from the config alone: a static, sticky entry per host,
        learning and unknown-unicast flooding off on every port. Idempotent; returns one
        label per binding it had to write (none when the switch already agreed)."""
        ports = self._port_ifindexes()
        want = {maps.U32.pack(ports[name]): (name, mac, ip)
                for name, (mac, ip) in self._want_bindings().items()}
        changed = []
        with self._map("ckm_bind") as m:
            have = dict(m.items())
            for key, (name, mac, ip) in want.items():
                val = maps.PORT_BIND.pack(maps.mac_bytes(mac), 0, maps.ip_bytes(ip))
                if have.get(key) != val:
                    m.update(key, val)
                    changed.append(f"port {name} bound to {mac} {ip}")
            for key in set(have) - set(want):  # an interface the config no longer has
                m.delete(key)
                changed.append(f"ifindex {maps.U32.unpack(key)[0]} unbound")
        lines = [f"link set dev {p} learning off flood off" for p, _, _ in want.values()]
        lines += [f"fdb replace {mac} dev {p} master static sticky"
                  for p, mac, _ in want.values()]
        lines.append(f"fdb flush dev {self.cfg.bridge_name} dynamic")
        self._bridge(lines)
        return changed

    def _bridge(self, lines: list[str]) -> None:
        res = subprocess.run(nsenter_argv(self.netns, ["bridge", "-force", "-batch", "-"]),
                             input="\n".join(lines) + "\n", capture_output=True, text=True)
        if res.returncode != 0:
            first = (res.stderr.strip().splitlines() or ["no output"])[0]
            raise CheckmateError(f"bridge in {self.netns} failed: {first}")

    def fdb(self) -> dict[str, str]:
        """{MAC: port} of every forwarding entry the bridge holds towards a host (learned ones
        included, were there any; the ports' own addresses, ``permanent``, left out)."""
        res = subprocess.run(nsenter_argv(self.netns, ["bridge", "-j", "fdb", "show", "br",
                                                       self.cfg.bridge_name]),
                             capture_output=True, text=True)
        if res.returncode != 0:
            raise SwitchUnreachable(f"cannot read the bridge table in {self.netns}: "
                                    f"{res.stderr.strip()}")
        ports = set(self.port_names)
        return {e["mac"]: e["ifname"] for e in json.loads(res.stdout or "[]")
                if e.get("ifname") in ports and "self" not in e.get("flags", [])
                and e.get("state") != "permanent"}

    def _remove_pins(self) -> None:
        if self.pin_dir.exists():
            shutil.rmtree(self.pin_dir, ignore_errors=True)

    def detach(self) -> None:
        """Remove the clsact qdiscs (and so the filters) and the pinned objects; idempotent."""
        if netns_exists(self.netns):
            links = self._ifindexes()
            lines = [f"qdisc del dev {p} clsact" for p in self.port_names if p in links]
            if lines:
                self._tc(lines, check=False)
        self._remove_pins()

    # -- tables --------------------------------------------------------------------------
    def replication_entries(self) -> list[ReplicationEntry]:
        names = {v: k for k, v in self._ifindexes().items()}
        with self._map("ckm_repl") as m:
            items = m.items()
        out = []
        for k, v in items:
            job, src, dst, part, replica = maps.REPL_KEY.unpack(k)
            idx, in_idx, mac, port, ip, epoch, token, *_ = maps.REPL_VAL.unpack(v)
            out.append(ReplicationEntry(
                job, maps.ip_str(src), maps.ip_str(dst), part, names.get(idx, f"if{idx}"),
                maps.mac_str(mac), maps.ip_str(ip), int.from_bytes(port, "big"), epoch, token,
                names.get(in_idx, f"if{in_idx}"), replica))
        return sorted(out, key=lambda e: (e.job_id, e.src_ip, e.dst_ip, e.partition,
                                          e.replica))

    def add_replication(self, e: ReplicationEntry) -> None:
        """Insert or overwrite (an overwrite restarts the entry's packet/byte counters)."""
        _check_u("job_id", e.job_id, 32)
        _check_u("partition", e.partition, 16)
        _check_u("shadow_port", e.shadow_port, 16)
        if not isinstance(e.replica, int) or isinstance(e.replica, bool) \
                or not 0 <= e.replica < MAX_REPLICAS:
            raise CheckmateError(f"replication entry: replica must be an integer in "
                                 f"0..{MAX_REPLICAS - 1}, got {e.replica!r}")
        _check_u("epoch", e.epoch, 32)
        _check_u("token", e.token, 32)
        for name in ("src_ip", "dst_ip", "shadow_ip"):
            _check_ip(name, getattr(e, name))
        try:
            mac = maps.mac_bytes(e.shadow_mac)
        except ValueError:
            raise CheckmateError(f"replication entry: bad shadow_mac {e.shadow_mac!r}") from None
        ports = self._port_ifindexes()
        for name in ("shadow_ifname", "ingress_ifname"):
            if getattr(e, name) not in ports:
                raise CheckmateError(f"replication entry: {name} {getattr(e, name)!r} is not "
                                     f"a port of switch {self.cfg.switch.name}")
        key = maps.repl_key(e.job_id, e.src_ip, e.dst_ip, e.partition, e.replica)
        val = maps.REPL_VAL.pack(ports[e.shadow_ifname], ports[e.ingress_ifname], mac,
                                 e.shadow_port.to_bytes(2, "big"), maps.ip_bytes(e.shadow_ip),
                                 e.epoch, e.token, 0, 0, 0)
        with self._map("ckm_repl") as m:
            m.update(key, val)

    def remove_replication(self, job_id: int, src_ip: str, dst_ip: str, partition: int,
                           replica: int = 0) -> None:
        _check_u("job_id", job_id, 32)
        _check_u("partition", partition, 16)
        _check_u("replica", replica, 16)
        _check_ip("src_ip", src_ip)
        _check_ip("dst_ip", dst_ip)
        with self._map("ckm_repl") as m:
            m.delete(maps.repl_key(job_id, src_ip, dst_ip, partition, replica))

    # -- counters and faults -------------------------------------------------------------
    def counters(self) -> dict:
        """{"ports": {ifname: {rx, tx, replicated, ..., spoofed, bad_src_mac, bad_src_ip,
        frag_dropped, frag_corrupted}},
        "faults": {ifname: {drop, corrupt, swap, swapped, from_iteration, until_iteration,
        last_iteration}},
        "entries": [{job_id, src_ip, dst_ip, partition, shadow_ifname, ingress_ifname,
        packets, bytes}], "dscp": {ifname: {dscp: well-formed ckm datagrams that entered}}}

        A port's ``spoofed`` counts REPLICATE datagrams that entered it carrying the source
        address of another port's host (forwarded, not copied); ``malformed`` includes
        datagrams whose ``count`` disagrees with their length; ``bad_src_mac`` /
        ``bad_src_ip`` count the frames dropped on entering because their source is not the
        port's bound host (any frame, not only ckm).

        ``last_iteration`` is the iteration the port's knobs give frames without one (later
        IP fragments, ACKs); it is tracked only while a knob is set and restarts at 0 with
        every set_fault()."""
        ports = self._port_ifindexes()
        out: dict = {"ports": {}, "faults": {}, "entries": []}
        with (self._map("ckm_ports") as pm, self._map("ckm_fault") as fm,
              self._map("ckm_fault_win") as wm, self._map("ckm_fault_st") as sm):
            for name, idx in ports.items():
                key = maps.U32.pack(idx)
                raw = pm.lookup(key)
                vals = maps.PORT_STATS.unpack(raw) if raw else (0,) * len(maps.PORT_FIELDS)
                out["ports"][name] = dict(zip(maps.PORT_FIELDS, vals, strict=True))
                raw = sm.lookup(key)
                st = dict(zip(FAULT_STATE_FIELDS, FAULT_STATE.unpack(raw) if raw
                              else (0,) * len(FAULT_STATE_FIELDS), strict=True))
                out["ports"][name].update({k: st[k] for k in FRAG_COUNTERS})
                f = fm.lookup(key)
                d, c, sw = maps.FAULT.unpack(f) if f else (0, 0, 0)
                raw = wm.lookup(key)
                lo, hi, seed = FAULT_WIN.unpack(raw) if raw else (0, 0, 0)
                last = st["last_iteration"] if st["seed"] == seed else 0  # stale: not seen yet
                out["faults"][name] = {"drop": d / 2**32, "corrupt": c / 2**32,
                                       "swap": sw / 2**32, "swapped": st["swapped"],
                                       "from_iteration": lo, "until_iteration": hi,
                                       "last_iteration": last}
        names = {v: k for k, v in ports.items()}
        out["dscp"] = None  # a switch loaded before per-DSCP counting existed has no map
        if (self.map_dir / "ckm_dscp").exists():
            out["dscp"] = {name: {} for name in ports}
            with self._map("ckm_dscp") as m:
                for k, v in m.items():
                    idx, dscp = maps.DSCP_KEY.unpack(k)
                    if idx in names:
                        out["dscp"][names[idx]][dscp] = maps.U64.unpack(v)[0]
        with self._map("ckm_repl") as m:
            for k, v in m.items():
                job, src, dst, part, replica = maps.REPL_KEY.unpack(k)
                idx, in_idx, *_ = maps.REPL_VAL.unpack(v)
                packets, nbytes = maps.repl_counts(v)
                out["entries"].append({
                    "job_id": job, "src_ip": maps.ip_str(src), "dst_ip": maps.ip_str(dst),
                    "partition": part, "replica": replica,
                    "shadow_ifname": names.get(idx, f"if{idx}"),
                    "ingress_ifname": names.get(in_idx, f"if{in_idx}"),
                    "packets": packets, "bytes": nbytes})
        out["entries"].sort(key=lambda d: (d["job_id"], d["src_ip"], d["dst_ip"],
                                           d["partition"], d["replica"]))
        return out

    def set_fault(self, ifname: str, drop: float = 0.0, corrupt: float = 0.0,
                  from_iteration: int = 0, until_iteration: int = 0, swap: float = 0.0
                  ) -> None:
        """Drop / corrupt / swap probabilities for ckm traffic leaving the switch through
        ``ifname`` (swap: a gradient's payload rewritten keeping its CRC32C, the on-path
        attack the state check must find),
        limited to ckm iterations ``from_iteration .. until_iteration`` (inclusive; 0 leaves
        that end open), so a scenario can say "drop 5% on port X from iteration 10 to 20".

        Probabilities are per datagram: the fragments of one IP-fragmented datagram share
        one draw, so the knob loses ``drop`` of the datagrams whatever their size. Frames
        without an iteration (later fragments, ring ACKs, iteration 0) are judged by the
        latest iteration that left the port since this call (0 before any)."""
        _check_prob("drop", drop)
        _check_prob("corrupt", corrupt)
        _check_prob("swap", swap)
        _check_window(from_iteration, until_iteration)
        ports = self._port_ifindexes()
        if ifname not in ports:
            raise CheckmateError(f"{ifname!r} is not a port of switch {self.cfg.switch.name} "
                                 f"(ports: {', '.join(ports)})")
        key = maps.U32.pack(ports[ifname])
        # A fresh seed re-draws the fragments' fates and tells the program to forget the
        # port's last iteration. The window goes in first: while both maps change, the old
        # probabilities meet the new window rather than new probabilities the old window.
        seed = int.from_bytes(os.urandom(8), "little") or 1
        with self._map("ckm_fault_win") as wm, self._map("ckm_fault") as fm:
            wm.update(key, FAULT_WIN.pack(from_iteration, until_iteration, seed))
            fm.update(key, maps.FAULT.pack(maps.prob_scaled(drop), maps.prob_scaled(corrupt),
                                           maps.prob_scaled(swap)))
