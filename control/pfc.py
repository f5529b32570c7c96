"""PFC thresholds and headroom for the lossless ckm class (formula and sources: docs/pfc.md).

Headroom is the buffer a receiving port must still have free when it decides to send a
PAUSE for the ckm priority: everything the link partner can put on the wire before it
stops. It is the sum of the IEEE 802.1Qbb (Annex N) delay terms, converted from bit times
to bytes at the link speed.
"""

from __future__ import annotations

import math
import socket
from dataclasses import dataclass

from checkmate.errors import CheckmateError

#: 802.1p priority (and traffic class / ingress cos) of ckm traffic; PFC is enabled on it.
CKM_PRIORITY = 3
#: DSCP that hosts mark ckm datagrams with (CS3), trusted by NICs and the switch.
CKM_DSCP = 24
#: The IPv4 TOS byte of ckm datagrams: DSCP in the upper six bits, ECN bits left zero.
CKM_TOS = CKM_DSCP << 2
#: Tofino queue id for ckm traffic.
CKM_QID = 3
#: Propagation delay in fibre / twinax, ns per metre (signal at roughly 0.66 c).
NS_PER_METRE = 5.0
#: Ethernet overhead around an IP packet of MTU bytes: header 14, 802.1Q tag 4 (PFC needs
#: the priority tag), FCS 4, preamble+SFD 8, inter-frame gap 12.
FRAME_OVERHEAD = 14 + 4 + 4 + 8 + 12
#: A PFC frame: 64-byte minimum frame + preamble/SFD + IFG.
PFC_FRAME = 64 + 8 + 12
#: Tofino buffer cell size in bytes (thresholds are programmed in cells).
CELL_BYTES = 80

#: Per-speed upper bounds in bit times, speed in Gb/s -> (interface delay, response delay).
#: Interface delay: PHY/MAC delay of IEEE 802.3 for that speed; response delay: how long a
#: MAC may keep sending after it has received a PAUSE (802.3 Annex 31B pause reaction).
#: Values as tabulated for the 802.1Qbb Annex N headroom calculation (docs/pfc.md).
DELAY_BIT_TIMES = {
    10: (8192, 30720),
    25: (6144, 40960),
    40: (24576, 60416),
    100: (122880, 201728),
}


def mark_ckm(sock: socket.socket) -> socket.socket:
    """Put a ckm socket in the lossless class: every datagram it sends carries DSCP
    CKM_DSCP, which host NICs map to priority CKM_PRIORITY (the plan's host commands) and
    the switches classify (CkmLossless in the P4 programs, per-DSCP counts in the kernel
    switch). Marking is for the network only: nothing on a receiver depends on it."""
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, CKM_TOS)
    return sock


@dataclass(frozen=True)
class PfcSettings:
    """PFC for one port and the ckm priority; all sizes in bytes, cells rounded up."""

    priority: int
    headroom_bytes: int
    xoff_bytes: int
    xon_bytes: int
    cell_bytes: int = CELL_BYTES

    @property
    def headroom_cells(self) -> int:
        return math.ceil(self.headroom_bytes / self.cell_bytes)

    @property
    def xoff_cells(self) -> int:
        return math.ceil(self.xoff_bytes / self.cell_bytes)

    @property
    def xon_cells(self) -> int:
        return math.ceil(self.xon_bytes / self.cell_bytes)


def delays_for(speed_gbps: int) -> tuple[int, int]:
    """(interface, response) delay in bit times; unlisted speeds take the next faster row,
    which is the conservative choice (those delays only grow with speed)."""
    for speed in sorted(DELAY_BIT_TIMES):
        if speed >= speed_gbps:
            return DELAY_BIT_TIMES[speed]
    raise CheckmateError(f"no PFC delay figures for {speed_gbps} Gb/s links (max 100)")


def cable_bytes(speed_gbps: int, cable_m: float) -> int:
    """Bytes on the wire in one direction of a cable of ``cable_m`` metres."""
    return math.ceil(cable_m * NS_PER_METRE * speed_gbps / 8)


def headroom_bytes(speed_gbps: int, cable_m: float, mtu: int) -> int:
    """802.1Qbb Annex N headroom: max frame (delays the PAUSE) + PAUSE frame + interface delay
    at both ends + cable round trip + partner's response time + max frame in flight."""
    if cable_m < 0 or mtu <= 0 or speed_gbps <= 0:
        raise CheckmateError("PFC needs positive speed and MTU and a non-negative cable length")
    intf_bt, resp_bt = delays_for(speed_gbps)
    frame = mtu + FRAME_OVERHEAD
    bit_times = frame * 8 + PFC_FRAME * 8 + 2 * intf_bt + resp_bt + frame * 8
    return math.ceil(bit_times / 8) + 2 * cable_bytes(speed_gbps, cable_m)


def pfc_settings(speed_gbps: int, cable_m: float, mtu: int) -> PfcSettings:
    """Thresholds for the ckm priority group of one port.

    xon: resume once the queue has drained to one cable round trip of bytes, so the egress
    keeps sending while the RESUME travels and fresh data arrives; xoff = xon + two max
    frames of hysteresis, so PAUSE/RESUME do not chatter on every frame.
    """
    frame = mtu + FRAME_OVERHEAD
    xon = max(2 * cable_bytes(speed_gbps, cable_m), frame)
    return PfcSettings(
        priority=CKM_PRIORITY,
        headroom_bytes=headroom_bytes(speed_gbps, cable_m, mtu),
        xoff_bytes=xon + 2 * frame,
        xon_bytes=xon,
    )
