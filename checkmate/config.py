"""The cluster config: one YAML file read by the testbed, the controller, shadows and trainers.

It names the job, the switch, and every host with its role, address and (for shadows) the
partition it owns. Everything that must agree across machines (addresses, MACs, interface
names, ports) is derived here so that no two components derive it differently.

Example (testbed/default.yaml is the shipped default)::

    job: {id: 7, name: demo}
    switch: {name: sw0, target: kernel}
    network: {subnet: 10.77.0.0/24, mtu: 9000, prefix: ckm}
    hosts:
      - {name: t0, role: trainer, rank: 0, ip: 10.77.0.10}
      - {name: s0, role: shadow, partition: 0, ip: 10.77.0.100}
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from checkmate import wire
from checkmate.errors import CheckmateError

TARGETS = ("kernel", "bmv2", "tofino")
ROLES = ("trainer", "shadow")
_NAME_RE = re.compile(r"^[a-z][a-z0-9]{0,7}$")
_PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{0,4}$")
_MAC_RE = re.compile(r"^([0-9a-f]{2}:){5}[0-9a-f]{2}$")

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

    @property
    def port(self) -> int:
        """UDP port this host receives ckm traffic on."""
        return TRAINER_PORT if self.role == "trainer" else SHADOW_PORT


@dataclass(frozen=True)
class Switch:
    name: str
    target: str
    address: str | None = None  # P4Runtime gRPC address for bmv2/tofino
    device_id: int = 0
    ip: str = ""  # the switch's own address (controller service, source of shadow copies)
    mac: str = ""
    cpu_port: int = 64
    cable_m: float = 3.0
    speed_gbps: int = 100


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

    @property
    def trainers(self) -> list[Host]:
        return sorted((h for h in self.hosts if h.role == "trainer"), key=lambda h: h.rank)

    @property
    def shadows(self) -> list[Host]:
        return sorted((h for h in self.hosts if h.role == "shadow"), key=lambda h: h.partition)

    @property
    def num_partitions(self) -> int:
        return len(self.shadows)

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


def mac_for_ip(ip: str) -> str:
    """A locally administered MAC that encodes the IPv4 address (02:00:a:b:c:d)."""
    a, b, c, d = ipaddress.IPv4Address(ip).packed
    return f"02:00:{a:02x}:{b:02x}:{c:02x}:{d:02x}"


def _int(d: dict, key: str, where: str, lo: int = 0, hi: int = 2**32 - 1) -> int:
    v = d.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise ConfigError(f"{where}.{key} must be an integer in {lo}..{hi}, got {v!r}")
    return v


def _mapping(v: Any, where: str) -> dict:
    if not isinstance(v, dict):
        raise ConfigError(f"{where} must be a mapping, got {type(v).__name__}")
    return v


def parse(data: Any) -> ClusterConfig:
    """Validate a decoded YAML document; every problem is a ConfigError with its key path."""
    top = _mapping(data, "config")
    unknown = set(top) - {"job", "switch", "network", "hosts", "training", "shadow", "testbed"}
    if unknown:
        raise ConfigError(f"unknown top-level key(s): {', '.join(sorted(unknown))}")
    job = _mapping(top.get("job"), "job")
    job_id = _int(job, "id", "job", 1)
    job_name = str(job.get("name", f"job{job_id}"))

    net_d = _mapping(top.get("network", {}), "network")
    network = Network(
        subnet=str(net_d.get("subnet", Network.subnet)),
        mtu=_int({"mtu": net_d.get("mtu", 9000)}, "mtu", "network", 576, 9216),
        prefix=str(net_d.get("prefix", Network.prefix)),
    )
    if not _PREFIX_RE.match(network.prefix):
        raise ConfigError(f"network.prefix must match {_PREFIX_RE.pattern}: {network.prefix!r}")
    try:
        subnet = ipaddress.IPv4Network(network.subnet)
    except ValueError as e:
        raise ConfigError(f"network.subnet: {e}") from None

    sw_d = _mapping(top.get("switch"), "switch")
    target = sw_d.get("target", "kernel")
    if target not in TARGETS:
        raise ConfigError(f"switch.target must be one of {', '.join(TARGETS)}, got {target!r}")
    sw_name = sw_d.get("name")
    if not isinstance(sw_name, str) or not _NAME_RE.match(sw_name):
        raise ConfigError(f"switch.name must match {_NAME_RE.pattern}, got {sw_name!r}")
    sw_ip = str(sw_d.get("ip", subnet.network_address + 1))
    switch = Switch(
        name=sw_name,
        target=target,
        address=sw_d.get("address"),
        device_id=_int({"d": sw_d.get("device_id", 0)}, "d", "switch.device_id"),
        ip=sw_ip,
        mac=str(sw_d.get("mac", mac_for_ip(sw_ip))),
        cpu_port=_int({"c": sw_d.get("cpu_port", 64)}, "c", "switch.cpu_port", 0, 511),
        cable_m=float(sw_d.get("cable_m", 3.0)),
        speed_gbps=_int({"s": sw_d.get("speed_gbps", 100)}, "s", "switch.speed_gbps", 1, 800),
    )

    hosts_l = top.get("hosts")
    if not isinstance(hosts_l, list) or not hosts_l:
        raise ConfigError("hosts must be a non-empty list")
    hosts: list[Host] = []
    seen_names: set[str] = set()
    seen_ips: set[str] = {sw_ip}
    for i, hd in enumerate(hosts_l):
        where = f"hosts[{i}]"
        hd = _mapping(hd, where)
        name = hd.get("name")
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ConfigError(f"{where}.name must match {_NAME_RE.pattern}, got {name!r}")
        if name in seen_names or name == sw_name:
            raise ConfigError(f"{where}.name {name!r} is used twice")
        role = hd.get("role")
        if role not in ROLES:
            raise ConfigError(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}")
        try:
            ip = ipaddress.IPv4Address(hd.get("ip"))
        except ValueError:
            raise ConfigError(f"{where}.ip is not an IPv4 address: {hd.get('ip')!r}") from None
        if ip not in subnet:
            raise ConfigError(f"{where}.ip {ip} is outside network.subnet {subnet}")
        if str(ip) in seen_ips:
            raise ConfigError(f"{where}.ip {ip} is used twice")
        mac = str(hd.get("mac", mac_for_ip(str(ip)))).lower()
        if not _MAC_RE.match(mac):
            raise ConfigError(f"{where}.mac is not a MAC address: {mac!r}")
        rank = _int(hd, "rank", where, 0, 65535) if role == "trainer" else None
        part = _int(hd, "partition", where, 0, 65535) if role == "shadow" else None
        sp = hd.get("switch_port")
        if sp is not None:
            sp = _int(hd, "switch_port", where, 0, 511)
        hosts.append(Host(name, role, str(ip), mac, rank, part, sp))
        seen_names.add(name)
        seen_ips.add(str(ip))

    ranks = sorted(h.rank for h in hosts if h.role == "trainer")
    if ranks != list(range(len(ranks))):
        raise ConfigError(f"trainer ranks must be 0..{len(ranks) - 1} once each, got {ranks}")
    parts = sorted(h.partition for h in hosts if h.role == "shadow")
    if parts != list(range(len(parts))):
        raise ConfigError(f"shadow partitions must be 0..{len(parts) - 1} once each, got {parts}")
    extra = {k: top[k] for k in ("training", "shadow", "testbed") if k in top}
    return ClusterConfig(job_id, job_name, switch, network, tuple(hosts), extra)


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
