"""The deploy plan: what every target must hold for one cluster config, independent of target.

One plan is built from the config (plus current shadow registrations from the handshake) and
handed to a driver, which turns it into BPF map entries, P4Runtime table entries and
multicast groups, or a bfrt script. Keeping it target-independent means every target gets
the same ring hops, the same groups and the same PFC numbers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from checkmate.config.cluster import CONTROLLER_PORT, ClusterConfig, Host
from checkmate.control import devports, pfc
from checkmate.errors import CheckmateError

#: Multicast group flooding broadcast/unknown destinations (FLOOD_GROUP in the P4 sources).
FLOOD_GROUP = 1
#: Replication groups: GROUP_BASE + destination rank * 256 + partition.
GROUP_BASE = 0x1000


@dataclass(frozen=True)
class Registration:
    """A shadow's current session, from the handshake (overrides the config's address)."""

    partition: int
    host: str
    ip: str
    mac: str
    port: int
    epoch: int
    token: int
    #: The registering shadow process's id (register's ``instance``): a repeated request
    #: of the same instance gets this registration again, not a new epoch ("" before).
    instance: str = ""
    #: The config host (a trainer node) whose switch port leads to the shadow: where the
    #: launcher's attempt placed a co-located shadow ("" = the shadow's own host).
    node: str = ""


@dataclass(frozen=True)
class Replication:
    """One replication entry: copies of (job, src -> dst, partition) go to ``shadow``.

    Only datagrams that entered the switch on ``src``'s own port are copied (a copy is
    stamped with the shadow's valid epoch/token, so the shadow would accept a datagram from
    another host forging ``src_ip``): the port is ``ingress_port`` on P4 targets and
    ``ingress_ifname`` on the kernel switch."""

    job_id: int
    src: str
    src_ip: str
    ingress_port: int
    ingress_ifname: str
    dst: str
    dst_ip: str
    partition: int
    shadow: str
    #: The host whose switch port leads to the shadow: the node a co-located shadow was
    #: placed on, else the shadow's own host (the kernel switch copies out of its port).
    shadow_node: str
    shadow_ip: str
    shadow_mac: str
    shadow_port: int
    epoch: int
    token: int
    group_id: int
    #: Which of the partition's shadows (config order) this copy goes to; a P4 target has
    #: one table entry per key and a multicast member per replica, the kernel switch one
    #: map entry per replica.
    replica: int = 0

    @property
    def key(self) -> tuple[int, str, str, int, int]:
        return (self.job_id, self.src_ip, self.dst_ip, self.partition, self.replica)


@dataclass(frozen=True)
class L2Entry:
    mac: str
    host: str
    port: int


@dataclass(frozen=True)
class McastGroup:
    """A P4 multicast group; replicas are (egress port, replication id) pairs."""

    group_id: int
    replicas: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class ShadowRewrite:
    """Egress rewrite of the copy carrying replication id ``rid`` (rid_for: partition + 1
    for a partition's first shadow)."""

    rid: int
    partition: int
    shadow: str
    smac: str
    dmac: str
    ip: str
    udp_port: int
    epoch: int
    token: int


@dataclass(frozen=True)
class PortPlan:
    host: str
    role: str
    ifname: str
    port: int
    speed_gbps: int
    fec: str  # "rs" (Reed-Solomon, 802.3 clause 91) or "none"
    mtu: int
    pfc: pfc.PfcSettings


@dataclass(frozen=True)
class SourceBinding:
    """Frames entering switch port ``port`` must come from ``mac`` / ``ip`` (the host's, for
    the CPU port the switch's own): the P4 programs' port_bind table."""

    port: int
    host: str
    mac: str
    ip: str


@dataclass(frozen=True)
class Punt:
    """HANDSHAKE datagrams to (ip, udp_port) go to the CPU port, where the controller is."""

    ip: str
    udp_port: int
    cpu_port: int


@dataclass(frozen=True)
class Plan:
    job_id: int
    switch: str
    target: str
    replication: tuple[Replication, ...]
    l2: tuple[L2Entry, ...]
    groups: tuple[McastGroup, ...]
    rewrites: tuple[ShadowRewrite, ...]
    ports: tuple[PortPlan, ...]
    punt: Punt
    host_commands: tuple[str, ...] = field(default=())
    bindings: tuple[SourceBinding, ...] = field(default=())


def switch_port(cfg: ClusterConfig, host: Host) -> int:
    """Physical switch port of a host on P4 targets: ``switch_port`` from the config, else
    (bmv2 and kernel only) 1 + the host's index among the hosts that own a port
    (``port_hosts``: co-located shadows have none), the order mininet_bmv2 attaches the
    links. A Tofino has pipe-encoded dev ports: no default (devports)."""
    if host.colocated:
        raise CheckmateError(f"{host.name} is a co-located shadow: it has no switch port of "
                             "its own (its node's leads to it)")
    if host.switch_port is not None:
        return host.switch_port
    if cfg.switch.target == "tofino":
        raise CheckmateError(f"host {host.name} has no switch_port: a Tofino switch needs "
                             "each host's dev port (control/devports.py)")
    return 1 + cfg.port_hosts.index(host)


def group_id(dst_rank: int, partition: int) -> int:
    if dst_rank >= 240 or partition >= 256:
        raise CheckmateError(
            f"multicast group id space holds ranks < 240 and partitions < 256 "
            f"(got rank {dst_rank}, partition {partition})"
        )
    return GROUP_BASE + dst_rank * 256 + partition


def rid_for(cfg: ClusterConfig, partition: int, replica: int) -> int:
    """The replication id of the copies for ``partition``'s ``replica``-th shadow: 0 is the
    destination's own copy, so partition + 1 for the first shadows, then one block of
    num_partitions ids per further replica (egress_rid is 16 bits on both P4 targets)."""
    rid = 1 + partition + replica * cfg.num_partitions
    if rid > 0xFFFF:
        raise CheckmateError(f"replication id {rid} of partition {partition} replica "
                             f"{replica} exceeds 16 bits")
    return rid


def _shadow_session(cfg: ClusterConfig, h: Host,
                    regs: Mapping[str, Registration]) -> Registration | None:
    """The session copies for shadow ``h`` are stamped with: its registration if any, else
    its configured address with epoch 0 (which no shadow accepts); None for a co-located
    shadow no attempt has placed yet (there is nowhere to copy to)."""
    reg = regs.get(h.name)
    if reg is not None or h.colocated:
        return reg
    assert h.partition is not None
    return Registration(h.partition, h.name, h.ip, h.mac, h.port, 0, 0)


def _check_registration(cfg: ClusterConfig, name: str, reg: Registration) -> None:
    """A registration must be of a shadow of its partition, and a co-located shadow's must
    name the trainer node it was placed on (a shadow host's own names none)."""
    h = cfg.host(name)
    if h.role != "shadow" or reg.host != name or h.partition != reg.partition:
        raise CheckmateError(f"registration of {name} for partition {reg.partition}: "
                             f"{name} is a {h.role}" + (
                                 f" of partition {h.partition}" if h.role == "shadow"
                                 else ""))
    if not h.colocated:
        if reg.node:
            raise CheckmateError(f"registration of {name} names node {reg.node}: {name} is "
                                 "a shadow host of its own, not a co-located one")
        return
    node = cfg.host(reg.node) if reg.node else None
    if node is None or node.role != "trainer":
        raise CheckmateError(f"registration of co-located shadow {name} must name the "
                             f"trainer node it runs on, not {reg.node!r}")


def host_commands(cfg: ClusterConfig) -> tuple[str, ...]:
    """NIC commands that make hosts trust DSCP and run PFC on the ckm priority (printed, not
    run: the hosts are not ours to configure from the switch)."""
    prio, dscp = pfc.CKM_PRIORITY, pfc.CKM_DSCP
    pfc_vec = ",".join("1" if i == prio else "0" for i in range(8))
    out = []
    for h in cfg.port_hosts:
        ifn = cfg.host_ifname(h.name)
        out.append(f"{h.name}: dcb pfc set dev {ifn} prio-pfc all:off {prio}:on")
        out.append(f"{h.name}: dcb app add dev {ifn} dscp-prio {dscp}:{prio}")
        out.append(f"{h.name}: mlnx_qos -i {ifn} --trust dscp --pfc {pfc_vec}")
    return tuple(out)


def ring_hops(cfg: ClusterConfig, ring: Sequence[str] | None) -> list[tuple[int, Host, Host]]:
    """The ring hops that cross the switch: ``(destination rank, source host, destination
    host)``. Without ``ring``: the config's trainers in rank order, one rank per host. With
    it (a launcher's rendezvous: the ring IP of every rank, in ring order): consecutive
    ranks on one host talk without the switch, so only hops between two hosts are kept; a
    host's ranks must be consecutive (torch's elastic agent numbers them so), or two hops
    would share one (source, destination) entry."""
    if ring is None:
        trainers = cfg.trainers
        n = len(trainers)
        if n < 2:
            return []
        out = []
        for src in trainers:
            assert src.rank is not None
            dst = trainers[(src.rank + 1) % n]
            assert dst.rank is not None
            out.append((dst.rank, src, dst))
        return out
    by_ip = {h.ip: h for h in cfg.trainers}
    hosts = []
    for r, ip in enumerate(ring):
        if ip not in by_ip:
            raise CheckmateError(f"rank {r} is at {ip}, which is no trainer host of the "
                                 "config")
        hosts.append(by_ip[ip])
    n = len(hosts)
    hops = [((r + 1) % n, hosts[r], hosts[(r + 1) % n]) for r in range(n)
            if hosts[r].ip != hosts[(r + 1) % n].ip]
    pairs = [(a.ip, b.ip) for _, a, b in hops]
    if len(set(pairs)) != len(pairs):
        raise CheckmateError("the ranks of a host are not consecutive in the ring: two hops "
                             f"would share the entry of {pairs[0][0]} -> {pairs[0][1]}")
    return hops


def build(cfg: ClusterConfig, registrations: Mapping[str, Registration] | None = None,
          rings: Sequence[Sequence[str]] | None = None) -> Plan:
    """The plan for ``cfg``; ``registrations`` (shadow host -> session) override shadows;
    ``rings`` (a launcher's rendezvous: per data-parallel group, every rank's IP in ring
    order) override the config's static ranks (see ring_hops). A mesh job (``job.groups``
    > 1) gets replication only from its attempt's rings: which ranks form a group is the
    job's mesh, not the config's. Group g replicates to config partitions g*n..g*n+n-1 under
    its own wire job id (checkmate.protocol.wire.group_job_id), its datagrams' partition
    field the partition within the group. A partition with several shadows (replicas)
    gets one copy per shadow: a multicast member and a rewrite each. A co-located shadow's
    copy leaves through the port of the node its registration names (the destination's own
    port may so be a group's member twice, with different rids); one that no attempt has
    placed yet gets nothing."""
    from checkmate.protocol.wire import group_job_id

    regs = dict(registrations or {})
    for name, reg in regs.items():
        _check_registration(cfg, name, reg)
    if rings is not None and len(rings) != cfg.groups:
        raise CheckmateError(f"the config's job has {cfg.groups} data-parallel group(s) "
                             f"(job.groups), the attempt names {len(rings)} ring(s)")
    hosts = cfg.port_hosts
    port = {h.name: switch_port(cfg, h) for h in hosts}
    repl: list[Replication] = []
    groups: list[McastGroup] = []
    rewrites: list[ShadowRewrite] = []
    # Each partition's shadows in replica order with their replica number, session and
    # rid, once: the hop loop below reads them for every hop. An unplaced co-located shadow
    # is left out, its replica number and rid kept by the others.
    replicas: list[list[tuple[int, Host, Registration, int]]] = [
        [(k, h, reg, rid_for(cfg, p, k)) for k, h in enumerate(cfg.shadows_for(p))
         if (reg := _shadow_session(cfg, h, regs)) is not None]
        for p in range(cfg.num_partitions)]
    for p, shadows in enumerate(replicas):
        for _, host, reg, rid in shadows:
            rewrites.append(ShadowRewrite(
                rid=rid, partition=p, shadow=host.name, smac=cfg.switch.mac, dmac=reg.mac,
                ip=reg.ip, udp_port=reg.port, epoch=reg.epoch, token=reg.token,
            ))
    n = cfg.group_partitions
    for g in range(cfg.groups if n else 0):
        if rings is None and cfg.groups > 1:
            break  # a mesh job's groups are known from its attempt only
        job = group_job_id(cfg.job_id, g, cfg.groups)
        for dst_rank, src, dst in ring_hops(cfg, None if rings is None else rings[g]):
            src_port = port[src.name]  # the source's port is named first
            for p in range(g * n, (g + 1) * n):
                if not replicas[p]:
                    continue  # no shadow placed: nothing to copy to
                gid = group_id(dst_rank, p)
                members = [(port[dst.name], 0)]
                for k, host, reg, rid in replicas[p]:
                    node = reg.node or host.name
                    repl.append(Replication(
                        job_id=job, src=src.name, src_ip=src.ip,
                        ingress_port=src_port, ingress_ifname=cfg.switch_ifname(src.name),
                        dst=dst.name, dst_ip=dst.ip, partition=p % n, shadow=host.name,
                        shadow_node=node, shadow_ip=reg.ip, shadow_mac=reg.mac,
                        shadow_port=reg.port, epoch=reg.epoch, token=reg.token,
                        group_id=gid, replica=k,
                    ))
                    members.append((port[node], rid))
                groups.append(McastGroup(gid, tuple(members)))
    groups.append(McastGroup(
        FLOOD_GROUP, tuple((p, 0) for p in [*sorted(port.values()), cfg.switch.cpu_port])
    ))
    l2 = [L2Entry(h.mac, h.name, port[h.name]) for h in hosts]
    l2.append(L2Entry(cfg.switch.mac, cfg.switch.name, cfg.switch.cpu_port))
    settings = pfc.pfc_settings(cfg.switch.speed_gbps, cfg.switch.cable_m, cfg.network.mtu)
    ports = tuple(
        PortPlan(
            host=h.name, role=h.role, ifname=cfg.switch_ifname(h.name),
            port=port[h.name], speed_gbps=cfg.switch.speed_gbps,
            # a co-located config's trainer ports carry its shadows' copies too
            fec=fec_for("shadow" if cfg.colocated else h.role, cfg.switch.speed_gbps),
            mtu=cfg.network.mtu, pfc=settings,
        )
        for h in hosts
    )
    _check_ports(cfg, ports)
    return Plan(
        job_id=cfg.job_id, switch=cfg.switch.name, target=cfg.switch.target,
        replication=tuple(repl), l2=tuple(l2), groups=tuple(sorted(groups, key=_gid)),
        rewrites=tuple(rewrites), ports=ports,
        punt=Punt(cfg.switch.ip, CONTROLLER_PORT, cfg.switch.cpu_port),
        host_commands=host_commands(cfg),
        bindings=tuple(
            [SourceBinding(port[h.name], h.name, h.mac.lower(), h.ip) for h in hosts]
            + [SourceBinding(cfg.switch.cpu_port, cfg.switch.name, cfg.switch.mac.lower(),
                             cfg.switch.ip)]),
    )


def fec_for(role: str, speed_gbps: int) -> str:
    """RS-FEC on every shadow-facing port (copies have no retransmission on the switch path)
    and on every port of 100G and faster (the paper runs its 100G links with RS-FEC)."""
    return "rs" if role == "shadow" or speed_gbps >= 100 else "none"


def _gid(g: McastGroup) -> int:
    return g.group_id


def _check_ports(cfg: ClusterConfig, ports: tuple[PortPlan, ...]) -> None:
    if cfg.switch.target == "tofino":
        pipes = cfg.switch.tofino_pipes
        devports.check_cpu_port(cfg.switch.cpu_port, pipes)
        for p in ports:
            devports.check_host_port(p.port, p.speed_gbps, pipes, f"host {p.host}")
    seen: dict[int, str] = {cfg.switch.cpu_port: "the CPU port"}
    for p in ports:
        if p.port in seen:
            raise CheckmateError(f"switch port {p.port} of {p.host} is also {seen[p.port]}")
        seen[p.port] = p.host


def describe(plan: Plan) -> str:
    """Human-readable plan, printed by ``control deploy --dry-run``."""
    lines = [f"plan for switch {plan.switch} ({plan.target}), job {plan.job_id}"]
    lines.append(f"replication entries ({len(plan.replication)}):")
    for r in plan.replication:
        lines.append(
            f"  job {r.job_id} {r.src}({r.src_ip}) -> {r.dst}({r.dst_ip}) part {r.partition}"
            + (f" replica {r.replica}" if r.replica else "")
            + f" => {r.shadow}"
            + (f" on {r.shadow_node}" if r.shadow_node != r.shadow else "")
            + f" {r.shadow_ip}:{r.shadow_port} epoch {r.epoch} group "
            f"{r.group_id} (only from port {r.ingress_port} / {r.ingress_ifname})"
        )
    lines.append(f"multicast groups ({len(plan.groups)}):")
    for g in plan.groups:
        reps = ", ".join(f"port {p} rid {rid}" for p, rid in g.replicas)
        lines.append(f"  group {g.group_id}: {reps}")
    lines.append("shadow rewrites:")
    for w in plan.rewrites:
        lines.append(
            f"  rid {w.rid} (partition {w.partition}) -> {w.shadow} {w.dmac} {w.ip}:{w.udp_port}"
            f" epoch {w.epoch}"
        )
    lines.append("l2 forwarding:")
    lines += [f"  {e.mac} -> port {e.port} ({e.host})" for e in plan.l2]
    lines.append(
        f"handshake punt: {plan.punt.ip}:{plan.punt.udp_port} -> CPU port {plan.punt.cpu_port}"
    )
    lines.append("ports:")
    for p in plan.ports:
        s = p.pfc
        lines.append(
            f"  {p.ifname} port {p.port} ({p.role}) {p.speed_gbps}G fec={p.fec} mtu={p.mtu} "
            f"pfc prio {s.priority}: headroom {s.headroom_bytes} B ({s.headroom_cells} cells) "
            f"xoff {s.xoff_bytes} B xon {s.xon_bytes} B"
        )
    lines.append("host NIC commands (run on each host):")
    lines += [f"  {c}" for c in plan.host_commands]
    return "\n".join(lines)
