"""``checkmate plan --gpus``: what a job of G GPUs on nodes of K asks of shadows, switch and
controller, computed from the ring schedule, the P4 program and the controller's plan.

- Shadows: ``plan.size`` (the measured ingest and step rates of docs/benchmarks.md); the
  partition count is the shadow count.
- Network hops: the ring schedule's hops that leave a node (checkmate.train.ring_schedule):
  one per node with two nodes or more, none on one node (the trainers then send the copies).
- Switch state of one job, as control/plan.py lays it out with one destination per node:
  a ``ckm_replicate`` entry per (network hop, partition), a multicast group per (hop
  destination, partition) holding two replicas (the destination's port, rid 0; the shadow's
  port, rid partition + 1) plus the flood group, a ``shadow_rewrite`` entry per
  partition, and a ``port_bind`` and an ``l2_fwd`` entry per host port and the CPU port.
  Table sizes are read from p4/checkmate_tna.p4; the id spaces are Tofino's (TNA:
  ``MulticastGroupId_t`` and ``ReplicationId_t`` are 16 bits).
- Controller work per rendezvous: the previous attempt's entries and groups withdrawn, the
  new attempt's installed, each shadow's rewrite re-stamped with the new epoch (an upper
  bound: entries whose hop did not change could stay).
- Several jobs on one switch: the job id is an exact-match field of ``ckm_replicate``, so
  one job's datagrams never match another's entries; group ids and replication ids are
  switch-wide, so jobs need disjoint ranges of them (how many jobs of this shape fit).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from checkmate.control.pipeline import p4_source
from checkmate.control.plan import GROUP_BASE, group_id
from checkmate.errors import CheckmateError
from checkmate.launch.plan import Sizing
from checkmate.train.ring_schedule import RingSchedule

#: Tofino's id spaces (P4_16 Tofino Native Architecture, Intel doc. 631348-0001, and
#: tofino.p4 in Open-Tofino: MulticastGroupId_t and ReplicationId_t are bit<16>).
MGID_SPACE = 1 << 16
RID_SPACE = 1 << 16
#: Front-panel ports of one Tofino at 100 Gb/s (6.4 Tb/s class: 64 x 100G).
SWITCH_PORTS = 64
PORT_GBPS = 100


def p4_table_sizes(source: str | None = None) -> dict[str, int]:
    """``table name -> size`` as declared in the TNA program (what the compiler allocates)."""
    text = source if source is not None else p4_source("tna").read_text()
    out = {}
    for m in re.finditer(r"\btable\s+(\w+)\s*\{(.*?)\n    \}", text, re.S):
        size = re.search(r"\bsize\s*=\s*(\d+)\s*;", m.group(2))
        if size:
            out[m.group(1)] = int(size.group(1))
    for name in ("ckm_replicate", "shadow_rewrite", "port_bind", "l2_fwd"):
        if name not in out:
            raise CheckmateError(f"p4/checkmate_tna.p4 declares no size for table {name}")
    return out


@dataclass(frozen=True)
class Scale:
    gpus: int
    per_node: int
    nodes: int
    partitions: int
    network_hops: int
    entries: int  # ckm_replicate
    groups: int  # multicast groups, flood group included
    replicas: int  # (port, rid) pairs over all groups but the flood group
    highest_group: int | None  # None: no groups, or control/plan.py cannot number them
    encodable: bool  # control/plan.py's group_id numbers every (destination, partition)
    rewrites: int
    ports: int  # switch ports: one per node, one per shadow unless co-located
    writes_per_rendezvous: int
    shadow_bytes_per_s: float  # gradient into each shadow
    table_sizes: dict[str, int]
    #: shadows per partition (issue 38): each one more member of every multicast group of
    #: its partition and one more rewrite; the switch copies each byte once per replica
    per_partition: int = 1

    @property
    def jobs_per_switch(self) -> int:
        """Jobs of this shape one switch could hold with disjoint id ranges per job."""
        fits = [self.table_sizes["ckm_replicate"] // max(1, self.entries),
                self.table_sizes["shadow_rewrite"] // self.rewrites,
                (MGID_SPACE - GROUP_BASE) // max(1, self.groups - 1),
                (RID_SPACE - 1) // self.rewrites,
                SWITCH_PORTS // self.ports]
        return min(fits)


def scale(gpus: int, per_node: int, sizing: Sizing, step_s: float, grad_bytes: int,
          params: int, node_of: list[int] | None = None, replicas: int = 1,
          colocated: bool = False) -> Scale:
    """The figures of a job of ``gpus`` ranks, ``per_node`` per node (the last node may hold
    fewer), with ``sizing.shadows`` partitions of ``replicas`` shadows each; ``node_of``:
    each rank's node when it is not rank // per_node (one data-parallel group of a mesh
    job: :func:`group_nodes`). ``colocated``: the shadows run on the job's nodes and take
    no switch port of their own (their copies leave through their nodes' ports)."""
    if gpus < 1 or per_node < 1:
        raise CheckmateError(f"need --gpus >= 1 and --gpus-per-node >= 1, got {gpus} and "
                             f"{per_node}")
    nodes_of = node_of or [r // per_node for r in range(gpus)]
    nodes = len(set(nodes_of))
    sched = RingSchedule.build(gpus, nodes_of)
    hops = sched.network_hops()
    p = sizing.shadows
    entries = len(hops) * p
    dests = sorted({sched.node_of[dst] for _, dst in hops})
    try:
        highest, encodable = max((group_id(d, q) for d in dests for q in range(p)),
                                 default=None), True
    except CheckmateError:
        highest, encodable = None, False
    groups = len(dests) * p + 1
    sizes = p4_table_sizes()
    r = replicas
    writes = 2 * entries + 2 * (groups - 1) + p * r  # withdraw + install, re-stamp rewrites
    return Scale(gpus, per_node, nodes, p, len(hops), entries, groups,
                 (1 + r) * (groups - 1), highest, encodable, p * r,
                 nodes + (0 if colocated else p * r), writes,
                 sizing.partition_params * grad_bytes / step_s, sizes, r)


def describe(s: Scale) -> list[str]:
    """The lines ``checkmate plan`` prints."""
    t = s.table_sizes
    gbps = s.shadow_bytes_per_s * 8 / 1e9

    def of(n: int, limit: int) -> str:
        return f"{n} of {limit}" + ("" if n <= limit else " (EXCEEDS)")

    enc = ("EXCEEDS control/plan.py's id encoding (destination < 240, partition < 256)"
           if not s.encodable else "the flood group only" if s.highest_group is None
           else f"ids {GROUP_BASE}..{s.highest_group}")
    total = s.shadow_bytes_per_s * s.partitions * s.per_partition / 1e9
    who = (f"the switch copies {total:.3f} GB/s in all" if s.network_hops
           else f"the trainers send {total:.3f} GB/s in all")
    reps = (f" x {s.per_partition} replicas = {s.partitions * s.per_partition} shadow "
            "processes" if s.per_partition > 1 else "")
    lines = [
        f"job: {s.gpus} GPUs, {s.per_node} per node = {s.nodes} node(s), {s.partitions} "
        f"shadow(s){reps}; the ring crosses the switch on {s.network_hops} hop(s)"
        + ("" if s.network_hops else " (one node: the trainers send the copies)"),
        f"into each shadow: {s.shadow_bytes_per_s / 1e9:.3f} GB/s of gradient "
        f"({gbps:.1f} Gb/s, {gbps / PORT_GBPS:.0%} of a {PORT_GBPS} Gb/s port); {who}",
        f"switch state: ckm_replicate entries {of(s.entries, t['ckm_replicate'])}; "
        f"multicast groups {of(s.groups, MGID_SPACE - GROUP_BASE)} ({enc}), "
        f"{s.replicas} replicas; shadow_rewrite entries {of(s.rewrites, t['shadow_rewrite'])};"
        f" ports {of(s.ports, SWITCH_PORTS)} at {PORT_GBPS} Gb/s; port_bind and l2_fwd "
        f"entries {of(s.ports + 1, min(t['port_bind'], t['l2_fwd']))}",
        f"controller per rendezvous: {s.writes_per_rendezvous} writes ({s.entries} entries "
        f"and {s.groups - 1} groups withdrawn and installed, {s.rewrites} rewrites "
        "re-stamped with the new epoch)",
        f"jobs of this shape on one switch with disjoint group and rid ranges: "
        f"{s.jobs_per_switch} (ports, tables and id spaces shared; the job id is a "
        "ckm_replicate key, group and rid ids are switch-wide)",
    ]
    return lines


def group_nodes(gpus: int, per_node: int, tp: int, pp: int) -> list[int]:
    """The nodes of data-parallel group (pp 0, tp 0) of a mesh job laid out as torchtitan
    lays it (``init_device_mesh`` over ``(pp, dp, tp)``, tp innermost, so a TP group fills a
    node's GPUs first): its data-parallel rank d is global rank d * tp, on node
    (d * tp) // per_node, numbered from 0 in ring order. Every group has the same shape."""
    groups = tp * pp
    if gpus % groups:
        raise CheckmateError(f"--gpus {gpus} is not a multiple of --tp {tp} x --pp {pp}")
    seen: dict[int, int] = {}
    return [seen.setdefault((d * tp) // per_node, len(seen)) for d in range(gpus // groups)]


def describe_mesh(s: Scale, gpus: int, per_node: int, tp: int, pp: int) -> list[str]:
    """The lines ``checkmate plan --tp/--pp`` prints: one group's figures (``s``, every group
    alike), then the job's. One controller programs every group (control/plan.py, config
    ``job.groups``): the groups' shadows are one job's partitions (group g's the g-th
    set), so group and replication ids are numbered over all of them, while each group's
    datagrams carry its own wire job id (checkmate.protocol.wire.group_job_id)."""
    g = tp * pp
    nodes = math.ceil(gpus / per_node)
    t = s.table_sizes
    parts = g * s.partitions
    if not s.encodable or parts > 256:
        ids = "EXCEEDS control/plan.py's id encoding (destination < 240, partition < 256)"
    elif s.highest_group is None:
        ids = f"the flood group only, replication ids 1..{parts}"
    else:
        ids = (f"group ids {GROUP_BASE}..{s.highest_group + (g - 1) * s.partitions}, "
               f"replication ids 1..{parts}")
    return [
        f"mesh: TP {tp} x PP {pp} = {g} data-parallel groups of {s.gpus} ranks, each with "
        f"its own {s.partitions} shadow(s) ({parts} in all); one group:",
        f"  its ring: {s.gpus} ranks on {s.nodes} node(s), crossing the switch on "
        f"{s.network_hops} hop(s)",
        *("  " + line for line in describe(s)[1:4]),
        f"the whole job ({gpus} GPUs on {nodes} node(s)): ckm_replicate entries "
        f"{g * s.entries} of {t['ckm_replicate']}; multicast groups "
        f"{g * (s.groups - 1) + 1} of {MGID_SPACE - GROUP_BASE}; shadow_rewrite entries "
        f"{parts} of {t['shadow_rewrite']}; switch ports {nodes + parts}"
        f" of {SWITCH_PORTS}" + (" (EXCEEDS: several switches)"
                                 if nodes + parts > SWITCH_PORTS else "")
        + f"; {g * s.writes_per_rendezvous} controller writes per rendezvous",
        f"one controller programs every group (config job.groups: {g}; its {parts} shadows "
        f"are the job's partitions, {s.partitions} per group, each group's copies under "
        f"its own wire job id): {ids}",
    ]
