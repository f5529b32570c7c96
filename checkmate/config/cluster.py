"""The cluster config: one YAML file read by the testbed, the controller, shadows and trainers.

It names the job, the switch, and every host with its role, address and (for shadows) the
partition it owns. Everything that must agree across machines (addresses, MACs, interface
names, ports) is derived here so that no two components derive it differently. What a valid
document is -- types, ranges, defaults, rules across keys -- is stated once, as a pydantic
schema in checkmate.config.schema; ``parse`` turns its first error into one ConfigError
line that names the key.

Example (testbed/default.yaml is the shipped default)::

    job: {id: 7, name: demo}
    switch: {name: sw0, target: kernel}
    network: {subnet: 10.77.0.0/24, mtu: 9000, prefix: ckm}
    hosts:
      - {name: t0, role: trainer, rank: 0, ip: 10.77.0.10}
      - {name: s0, role: shadow, partition: 0, ip: 10.77.0.100}

A shadow may instead say ``colocated: true`` and have no ip, mac or switch_port: it runs on
the trainer nodes, where the job's launcher places it anew at every rendezvous and tells
the controller (its ``attempt``). Every shadow of a config is co-located or none is.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from checkmate.config.schema import PREFIX_RE as _PREFIX_RE
from checkmate.config.schema import ROLES, TARGETS, mac_for_ip  # noqa: F401 - re-exported
from checkmate.errors import CheckmateError
from checkmate.protocol import wire

#: UDP port a trainer's ckm transport listens on (the ring allreduce receives here).
TRAINER_PORT = wire.CKM_PORT_BASE
#: UDP port a shadow receives replicated gradients on.
SHADOW_PORT = wire.CKM_PORT_BASE + 1
#: UDP port a trainer answers shadows' repair requests on (checkmate.train.repair).
REPAIR_PORT = wire.CKM_PORT_BASE + 2
#: UDP port the controller's handshake service listens on.
CONTROLLER_PORT = wire.CKM_PORT_BASE + wire.CKM_PORT_COUNT - 1
#: TCP port a shadow's restore service listens on (not a ckm port: restore is bulk TCP).
RESTORE_PORT = 47100


class ConfigError(CheckmateError, ValueError):
    """A config that cannot be used; the message names the offending key."""


@dataclass(frozen=True)
class Host:
    name: str
    role: str
    ip: str
    mac: str
    rank: int | None = None
    partition: int | None = None
    switch_port: int | None = None  # physical port number on P4 targets
    #: A shadow on the trainer nodes, placed by the launcher's attempt: ip and mac are ""
    #: (it has no address, port or namespace of its own).
    colocated: bool = False

    @property
    def port(self) -> int:
        """UDP port this host receives ckm traffic on."""
        return TRAINER_PORT if self.role == "trainer" else SHADOW_PORT


@dataclass(frozen=True)
class Switch:
    name: str
    target: str
    address: str | None = None  # P4Runtime gRPC (bmv2/tofino) or bmv2 Thrift host:port
    device_id: int = 0
    ip: str = ""  # the switch's own address (controller service, source of shadow copies)
    mac: str = ""
    cpu_port: int = 64
    cable_m: float = 3.0
    speed_gbps: int = 100
    tofino_server: str = "stratum"  # P4Runtime server on a Tofino: stratum or sde
    tofino_pipes: int = 4
    bfrt_port: int = 50052  # the SDE's BF Runtime gRPC server
    runtime: str = "p4runtime"  # bmv2 only: p4runtime or thrift (simple_switch)


@dataclass(frozen=True)
class Network:
    subnet: str = "10.77.0.0/24"
    mtu: int = 9000
    prefix: str = "ckm"


@dataclass(frozen=True)
class ClusterConfig:
    job_id: int
    job_name: str
    switch: Switch
    network: Network
    hosts: tuple[Host, ...]
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    #: Data-parallel groups (``job.groups``): a mesh job's shadows are ``groups`` equal
    #: sets in partition order; config partition q is partition q % n of group q // n.
    groups: int = 1

    @property
    def trainers(self) -> list[Host]:
        return sorted((h for h in self.hosts if h.role == "trainer"), key=lambda h: h.rank)

    @property
    def port_hosts(self) -> list[Host]:
        """The hosts that own a switch port (and, on the testbed, a namespace): every host
        but a co-located shadow, in config order."""
        return [h for h in self.hosts if not h.colocated]

    @property
    def colocated(self) -> bool:
        """The config's shadows run on the trainer nodes (the schema makes it all or none):
        each attempt of the job's launcher places them, none registers."""
        return any(h.colocated for h in self.hosts)

    @property
    def shadows(self) -> list[Host]:
        """One shadow per partition, in partition order: each partition's first in the
        config (its replica 0). ``shadow_hosts`` has every replica."""
        return [hs[0] for hs in self._by_partition()]

    @property
    def shadow_hosts(self) -> list[Host]:
        """Every shadow, replicas included: by partition, then replica index."""
        return [h for hs in self._by_partition() for h in hs]

    @property
    def replicas(self) -> int:
        """Shadows per partition (the schema makes it the same for every partition)."""
        return len(self._by_partition()[0]) if self.num_partitions else 0

    def shadows_for(self, partition: int) -> list[Host]:
        """The partition's shadows in replica order (the config's order)."""
        return [h for h in self.hosts if h.role == "shadow" and h.partition == partition]

    def replica_index(self, host: Host) -> int:
        """``host``'s replica number within its partition (0: the first in the config)."""
        assert host.partition is not None
        return [h.name for h in self.shadows_for(host.partition)].index(host.name)

    def _by_partition(self) -> list[list[Host]]:
        """Every partition's shadows in replica order, in one pass over the hosts (the
        schema numbers the partitions 0..n-1)."""
        out: dict[int, list[Host]] = {}
        for h in self.hosts:
            if h.role == "shadow":
                assert h.partition is not None
                out.setdefault(h.partition, []).append(h)
        return [out[p] for p in sorted(out)]

    @property
    def num_partitions(self) -> int:
        return len({h.partition for h in self.hosts if h.role == "shadow"})

    @property
    def group_partitions(self) -> int:
        """Partitions per data-parallel group (every group has as many)."""
        return self.num_partitions // self.groups

    def wire_place(self, partition: int) -> tuple[int, int, int]:
        """Config partition ``partition`` as the data path sees it: (the group's wire job
        id, its partition within the group, the group's partition count)."""
        from checkmate.protocol.wire import group_job_id

        n = self.group_partitions
        return group_job_id(self.job_id, partition // n, self.groups), partition % n, n

    def host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise ConfigError(f"no host named {name!r} in the config")

    def shadow_for(self, partition: int) -> Host | None:
        for h in self.shadows:
            if h.partition == partition:
                return h
        return None

    # Names of kernel objects, derived in one place so that up, down and deploy agree.
    def netns(self, host_or_switch: str) -> str:
        return f"{self.network.prefix}-{host_or_switch}"

    def host_ifname(self, host: str) -> str:
        """Interface inside the host's namespace."""
        return f"{self.network.prefix}-{host}"

    def switch_ifname(self, host: str) -> str:
        """The switch namespace's end of the veth pair that leads to ``host``."""
        return f"{self.network.prefix}p-{host}"

    @property
    def bridge_name(self) -> str:
        return f"{self.network.prefix}-br"


def parse(data: Any) -> ClusterConfig:
    """Validate a decoded YAML document (checkmate.config.schema); every problem is a
    ConfigError with its key path, one line."""
    from pydantic import ValidationError

    from checkmate.config.schema import ClusterDoc
    from checkmate.schema import first_error

    try:
        doc = ClusterDoc.model_validate(data)
    except ValidationError as e:
        raise ConfigError(first_error(e)) from None
    net, sw = doc.network, doc.switch
    sw_ip = sw.ip or str(ipaddress.IPv4Network(net.subnet).network_address + 1)
    switch = Switch(name=sw.name, target=sw.target, address=sw.address,
                    device_id=sw.device_id, ip=sw_ip, mac=sw.mac or mac_for_ip(sw_ip),
                    cpu_port=sw.cpu_port, cable_m=sw.cable_m, speed_gbps=sw.speed_gbps,
                    tofino_server=sw.tofino.server, tofino_pipes=sw.tofino.pipes,
                    bfrt_port=sw.tofino.bfrt_port, runtime=sw.runtime)
    hosts = tuple(Host(h.name, h.role, h.ip or "", h.mac or "", h.rank, h.partition,
                       h.switch_port, h.colocated) for h in doc.hosts)
    extra = {k: v for k in ("training", "shadow", "testbed")
             if (v := getattr(doc, k)) is not None}
    return ClusterConfig(doc.job.id, doc.job.name or f"job{doc.job.id}", switch,
                         Network(net.subnet, net.mtu, net.prefix), hosts, extra,
                         doc.job.groups)


def load(path: str | Path) -> ClusterConfig:
    """Read and validate a config file; I/O and YAML errors become ConfigError too."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config {p}: {e.strerror or e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"config {p} is not valid YAML{at}") from None
    return parse(data)


def default_path() -> Path:
    """The shipped default: 4 trainers, 2 shadows, kernel switch."""
    from importlib.resources import files

    return Path(str(files("checkmate.testbed") / "default.yaml"))


def with_prefix(cfg: ClusterConfig, prefix: str) -> ClusterConfig:
    """The same cluster under another name prefix (tests run beside a live testbed)."""
    if not _PREFIX_RE.match(prefix):
        raise ConfigError(f"prefix must match {_PREFIX_RE.pattern}: {prefix!r}")
    from dataclasses import replace

    return replace(cfg, network=replace(cfg.network, prefix=prefix))
