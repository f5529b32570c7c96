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


def entry_for(cfg: ClusterConfig, r: Replication) -> ReplicationEntry:
    return ReplicationEntry(
        job_id=r.job_id, src_ip=r.src_ip, dst_ip=r.dst_ip, partition=r.partition,
        shadow_ifname=cfg.switch_ifname(r.shadow), shadow_mac=r.shadow_mac,
        shadow_ip=r.shadow_ip, shadow_port=r.shadow_port, epoch=r.epoch, token=r.token,
        ingress_ifname=r.ingress_ifname, replica=r.replica,
    )


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
        want = {r.key: entry_for(self.cfg, r) for r in plan.replication}
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
