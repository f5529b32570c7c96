"""Kernel (tc-eBPF) switch driver: the plan's replication entries as BPF map entries.

L2 forwarding is the Linux bridge under the BPF program, and veth has no FEC or PFC, so only
replication entries are programmed; port settings are reported as not applicable. Each entry
carries the source host's switch port (the plan's ``ingress_ifname``): the switch copies only
datagrams that entered there. Every apply also re-asserts the ports' source bindings and the
bridge's static, non-learning forwarding table from the config
(KernelSwitch.bind_ports): a frame from another source than its port's host is dropped.
"""

from __future__ import annotations

from checkmate.config.cluster import ClusterConfig
from checkmate.control.drivers.base import ApplyResult
from checkmate.control.plan import Plan, Replication
from checkmate.dataplane.switch import KernelSwitch, ReplicationEntry, SwitchUnreachable


def entry_for(cfg: ClusterConfig, r: Replication, replica: int | None = None
              ) -> ReplicationEntry:
    """The map entry of ``r`` (as ``replica``, default its own number): its copy leaves
    through the port that leads to the shadow (a co-located shadow's node's port, which may
    be the hop's destination's too)."""
    return ReplicationEntry(
        job_id=r.job_id, src_ip=r.src_ip, dst_ip=r.dst_ip, partition=r.partition,
        shadow_ifname=cfg.switch_ifname(r.shadow_node), shadow_mac=r.shadow_mac,
        shadow_ip=r.shadow_ip, shadow_port=r.shadow_port, epoch=r.epoch, token=r.token,
        ingress_ifname=r.ingress_ifname, replica=r.replica if replica is None else replica,
    )


def entries(cfg: ClusterConfig, plan: Plan) -> dict[tuple, ReplicationEntry]:
    """The plan's map entries by key, each (hop, partition)'s numbered from 0 without gaps:
    the program copies to replicas 0, 1, ... up to the first missing one, and a co-located
    replica no attempt has placed has no entry."""
    slots: dict[tuple, int] = {}
    out = {}
    for r in plan.replication:  # in replica order within each (hop, partition)
        k = r.key[:4]
        slots[k] = slots.get(k, -1) + 1
        out[(*k, slots[k])] = entry_for(cfg, r, slots[k])
    return out


def _label(e: ReplicationEntry) -> str:
    replica = f"replica {e.replica} " if e.replica else ""
    return (f"replication job {e.job_id} {e.src_ip}->{e.dst_ip} part {e.partition} "
            f"{replica}from {e.ingress_ifname} => {e.shadow_ifname} {e.shadow_ip}:"
            f"{e.shadow_port} epoch {e.epoch}")


class KernelDriver:
    def __init__(self, cfg: ClusterConfig) -> None:
        self.cfg = cfg
        self.switch = KernelSwitch(cfg)

    def _require_up(self) -> None:
        if not self.switch.is_up():
            raise SwitchUnreachable(
                f"kernel switch {self.cfg.switch.name} is not up (namespace "
                f"{self.cfg.netns(self.cfg.switch.name)}); run `testbed up` first")

    def apply(self, plan: Plan) -> ApplyResult:
        """Diff the BPF table against the plan; write only the difference."""
        self._require_up()
        want = entries(self.cfg, plan)
        have = {(e.job_id, e.src_ip, e.dst_ip, e.partition, e.replica): e
                for e in self.switch.replication_entries()}
        res = ApplyResult(notes=["kernel target: L2 by the bridge; FEC/PFC not applicable "
                                 "to veth"])
        res.changed.extend(self.switch.bind_ports())
        for key, e in have.items():
            if key not in want:
                self.switch.remove_replication(*key)
                res.removed.append(_label(e))
        for key, e in want.items():
            old = have.get(key)
            if old == e:
                continue
            self.switch.add_replication(e)
            (res.changed if old else res.added).append(_label(e))
        return res

    def status(self) -> dict:
        self._require_up()
        return {"target": "kernel", "switch": self.cfg.switch.name,
                "replication": [vars(e) for e in self.switch.replication_entries()],
                "counters": self.switch.counters()}

    def close(self) -> None:
        pass
