"""Byte layouts of the switch's BPF maps, mirroring the structs in bpf/ckm_switch.c."""

from __future__ import annotations

import ipaddress
import struct

#: struct repl_key: job_id (host order), src/dst IPv4 (network order), partition, replica
REPL_KEY = struct.Struct("<I4s4sHH")
#: struct repl_val: shadow ifindex, ingress ifindex (the source host's port), shadow MAC,
#: UDP port (big-endian), IPv4, epoch, token, pad, packets, bytes
REPL_VAL = struct.Struct("<II6s2s4sIIIQQ")
#: struct port_stats, in this order
PORT_FIELDS = ("rx", "tx", "replicated", "dropped", "corrupted", "malformed", "no_entry",
               "spoofed", "bad_src_mac", "bad_src_ip")
PORT_STATS = struct.Struct("<" + "Q" * len(PORT_FIELDS))
#: struct fault: drop, corrupt and swap probabilities scaled to 2**32
FAULT = struct.Struct("<QQQ")
#: struct port_bind: the MAC and IPv4 address (network order) every frame entering a port
#: must come from
PORT_BIND = struct.Struct("<6sH4s")
#: struct sw_cfg: the switch MAC
SW_CFG = struct.Struct("<6sH")
U32 = struct.Struct("<I")
#: struct dscp_key: ifindex, DSCP; the value is a u64 datagram count
DSCP_KEY = struct.Struct("<II")
U64 = struct.Struct("<Q")

MAP_LAYOUT = {
    "ckm_repl": (REPL_KEY.size, REPL_VAL.size),
    "ckm_ports": (U32.size, PORT_STATS.size),
    "ckm_fault": (U32.size, FAULT.size),
    "ckm_bind": (U32.size, PORT_BIND.size),
    "ckm_cfg": (U32.size, SW_CFG.size),
    "ckm_dscp": (DSCP_KEY.size, U64.size),
}


def ip_bytes(ip: str) -> bytes:
    return ipaddress.IPv4Address(ip).packed


def ip_str(b: bytes) -> str:
    return str(ipaddress.IPv4Address(b))


def mac_bytes(mac: str) -> bytes:
    parts = mac.split(":")
    if len(parts) != 6:
        raise ValueError(f"not a MAC address: {mac!r}")
    return bytes(int(p, 16) for p in parts)


def mac_str(b: bytes) -> str:
    return ":".join(f"{x:02x}" for x in b)


def repl_key(job_id: int, src_ip: str, dst_ip: str, partition: int, replica: int = 0) -> bytes:
    return REPL_KEY.pack(job_id, ip_bytes(src_ip), ip_bytes(dst_ip), partition, replica)


def repl_counts(val: bytes) -> tuple[int, int]:
    """(packets, bytes) copied by one replication entry, from its raw map value."""
    *_, packets, nbytes = REPL_VAL.unpack(val)
    return packets, nbytes


def prob_scaled(p: float) -> int:
    """A probability as the threshold the BPF side compares bpf_get_prandom_u32() with."""
    return round(p * (1 << 32))
