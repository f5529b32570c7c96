"""The cluster config document's schema (pydantic), from YAML to checkmate.config.cluster's types.

One place states what a valid document is: types and ranges per key, defaults derived
from other keys (the switch's address from the subnet, MACs from IPs), and the rules across
keys (addresses inside the subnet and unique, ranks and partitions numbered 0..n-1 once,
every shadow co-located -- no address of its own -- or none).
Every rule raises a ValueError whose text follows the key path, so checkmate.config.cluster can turn
the first error into one line such as ``hosts[1].ip 10.77.0.10 is used twice``.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from checkmate.schema import int_in as _int_in
from checkmate.schema import matching as _matching
from checkmate.schema import one_of as _one_of

NAME_RE = re.compile(r"^[a-z][a-z0-9]{0,7}$")
PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{0,4}$")
MAC_RE = re.compile(r"^([0-9a-f]{2}:){5}[0-9a-f]{2}$")
TARGETS = ("kernel", "bmv2", "tofino")
ROLES = ("trainer", "shadow")
#: Shadows one partition may have in a config (the kernel switch copies a datagram to at
#: most this many: dataplane/bpf/ckm_switch.c's CKM_MAX_REPLICAS).
MAX_REPLICAS = 3


def mac_for_ip(ip: str) -> str:
    """Deterministic locally administered MAC derived from an IPv4 address."""
    a, b, c, d = ipaddress.IPv4Address(ip).packed
    return f"02:00:{a:02x}:{b:02x}:{c:02x}:{d:02x}"


def _mapping(v: Any) -> Any:
    if not isinstance(v, dict):
        raise ValueError(f"must be a mapping, got {type(v).__name__}")
    return v


def _ipv4(v: Any) -> str:
    try:
        return str(ipaddress.IPv4Address(v))
    except ValueError:
        raise ValueError(f"is not an IPv4 address: {v!r}") from None


Name = Annotated[str, _matching(NAME_RE)]
U32 = Annotated[int, _int_in(0, 2**32 - 1)]
Port9 = Annotated[int, _int_in(0, 511)]
Mapping = BeforeValidator(_mapping)


class _Section(BaseModel):
    # Unknown keys inside a section are ignored (older files carry comments-as-keys);
    # unknown top-level keys are refused (ClusterDoc).
    model_config = ConfigDict(extra="ignore")


class JobDoc(_Section):
    id: Annotated[int, _int_in(1, 2**32 - 1)]
    name: str | None = None
    #: Data-parallel groups of a mesh job (pipeline x tensor parallel degrees): the shadows
    #: are that many equal sets in partition order, group g's the g-th (docs/architecture.md).
    groups: Annotated[int, _int_in(1, 255)] = 1


class NetworkDoc(_Section):
    subnet: str = "10.77.0.0/24"
    mtu: Annotated[int, _int_in(576, 9216)] = 9000
    prefix: Annotated[str, _matching(PREFIX_RE)] = "ckm"

    @model_validator(mode="after")
    def _subnet(self) -> NetworkDoc:
        try:
            ipaddress.IPv4Network(self.subnet)
        except ValueError as e:
            raise ValueError(f".subnet: {e}") from None
        return self


class TofinoDoc(_Section):
    """Tofino specifics: which P4Runtime server runs on the switch (it decides how the
    compiled program is packed, control/pipeline.py), the chip's pipe count (dev ports are
    pipe-encoded) and the port of the SDE's BF Runtime gRPC server."""

    server: Annotated[str, _one_of(("stratum", "sde"))] = "stratum"
    pipes: Annotated[int, _int_in(1, 4)] = 4
    bfrt_port: Annotated[int, _int_in(1, 65535)] = 50052


class SwitchDoc(_Section):
    name: Name
    target: Annotated[str, _one_of(TARGETS)] = "kernel"
    #: how the controller programs a bmv2 switch: P4Runtime (simple_switch_grpc) or bmv2's
    #: Thrift runtime (simple_switch, which the open-source toolchain builds)
    runtime: Annotated[str, _one_of(("p4runtime", "thrift"))] = "p4runtime"
    address: str | None = None
    device_id: U32 = 0
    ip: Annotated[str, BeforeValidator(_ipv4)] | None = None
    mac: str | None = None
    cpu_port: Port9 = 64
    cable_m: float = 3.0
    speed_gbps: Annotated[int, _int_in(1, 800)] = 100
    tofino: Annotated[TofinoDoc, Mapping] = Field(default_factory=TofinoDoc)


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"must be true or false, got {v!r}")
    return v


class HostDoc(_Section):
    name: Name
    role: Annotated[str, _one_of(ROLES)]
    ip: Annotated[str, BeforeValidator(_ipv4)] | None = None
    mac: str | None = None
    rank: Any = None
    partition: Any = None
    switch_port: Port9 | None = None
    #: A shadow that runs on the trainer nodes, placed anew by the job's launcher at every
    #: rendezvous (its ``attempt`` tells the controller where): no address or port of its own.
    colocated: Annotated[bool, BeforeValidator(_bool)] = False

    @model_validator(mode="after")
    def _per_role(self) -> HostDoc:
        if self.colocated:
            if self.role != "shadow":
                raise ValueError(f".colocated: only a shadow may be co-located, not a "
                                 f"{self.role}")
            for k, what in (("ip", "address"), ("mac", "address"), ("switch_port", "port")):
                if getattr(self, k) is not None:
                    raise ValueError(f".{k}: a co-located shadow has no {what} of its own "
                                     "(the launcher's attempt places it)")
        elif self.ip is None:
            raise ValueError(".ip is required")
        else:
            mac = (self.mac or mac_for_ip(self.ip)).lower()
            if not MAC_RE.match(mac):
                raise ValueError(f".mac is not a MAC address: {mac!r}")
            self.mac = mac
        key = "rank" if self.role == "trainer" else "partition"
        v = getattr(self, key)
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= 65535:
            raise ValueError(f".{key} must be an integer in 0..65535, got {v!r}")
        setattr(self, "partition" if key == "rank" else "rank", None)
        return self


class ClusterDoc(BaseModel):
    """The whole document."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    job: Annotated[JobDoc, Mapping]
    switch: Annotated[SwitchDoc, Mapping]
    network: Annotated[NetworkDoc, Mapping] = Field(default_factory=NetworkDoc)
    hosts: list[Annotated[HostDoc, Mapping]]
    training: dict[str, Any] | None = None
    shadow: dict[str, Any] | None = None
    testbed: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _required_sections(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            raise ValueError(f"config must be a mapping, got {type(data).__name__}")
        data = dict(data)
        for key in ("job", "switch"):  # absent: the same one line as a wrong type
            data.setdefault(key, None)
        hosts = data.get("hosts")
        if not isinstance(hosts, list) or not hosts:
            raise ValueError("hosts must be a non-empty list")
        return data

    @model_validator(mode="after")
    def _across_keys(self) -> ClusterDoc:
        subnet = ipaddress.IPv4Network(self.network.subnet)
        sw_ip = self.switch.ip or str(subnet.network_address + 1)
        names, ips = {self.switch.name}, {sw_ip}
        first: HostDoc | None = None  # the first shadow: every other is co-located as it is
        for i, h in enumerate(self.hosts):
            where = f"hosts[{i}]"
            if h.name in names:
                raise ValueError(f"{where}.name {h.name!r} is used twice")
            names.add(h.name)
            if h.role == "shadow":
                first = first or h
                if h.colocated != first.colocated:
                    yes, no = (h, first) if h.colocated else (first, h)
                    raise ValueError(f"{where}.colocated: every shadow of a config is "
                                     f"co-located or none is ({yes.name} is, {no.name} is not)")
            if h.ip is None:  # a co-located shadow: no address of its own
                continue
            if ipaddress.IPv4Address(h.ip) not in subnet:
                raise ValueError(f"{where}.ip {h.ip} is outside network.subnet {subnet}")
            if h.ip in ips:
                raise ValueError(f"{where}.ip {h.ip} is used twice")
            ips.add(h.ip)
        ranks = sorted(h.rank for h in self.hosts if h.role == "trainer")
        if ranks != list(range(len(ranks))):
            raise ValueError(f"trainer ranks must be 0..{len(ranks) - 1} once each, got {ranks}")
        every = sorted(h.partition for h in self.hosts if h.role == "shadow")
        parts = sorted(set(every))
        if parts != list(range(len(parts))):
            raise ValueError(f"shadow partitions must be 0..{len(parts) - 1}, got {every}")
        # Replicas: a partition may have up to MAX_REPLICAS shadows, every partition as many
        # (a partition with fewer would be the one a node loss takes out).
        per = {every.count(p) for p in parts}
        if len(per) > 1 or max(per, default=1) > MAX_REPLICAS:
            raise ValueError(f"every partition needs the same number of shadows (replicas, "
                             f"1 to {MAX_REPLICAS}), got {every}")
        if len(parts) % self.job.groups:
            raise ValueError(f"job.groups {self.job.groups} must divide the {len(parts)} "
                             "shadows into equal sets (one per data-parallel group)")
        if self.job.groups > 1 and self.job.id >= 1 << 24:
            raise ValueError(f"job.id {self.job.id}: a job of {self.job.groups} groups needs "
                             f"an id below {1 << 24} (its groups take the top byte)")
        return self
