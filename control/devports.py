"""Tofino (1) dev port numbers: which ones a host or the CPU may use at a given speed.

A dev port is pipe-encoded: bits 8..7 are the pipe, bits 6..0 the port inside it. Ports
0..63 of a pipe are front-panel MAC lanes (16 MACs of 4 lanes); a port of N lanes starts on
a lane that is a multiple of N. Ports 64..67 of pipe 0 are the Ethernet CPU port's lanes,
and the PCIe CPU port is port 64 of pipe 2 on a four-pipe chip (320) or of pipe 1 on a
two-pipe one (192). Ports 68..71 recirculate. The bmv2 habit of numbering ports 1, 2, 3 ...
is wrong here (port 1 would be the second lane of the first MAC), so on Tofino every host
needs an explicit ``switch_port``.
"""

from __future__ import annotations

from checkmate.errors import CheckmateError

FRONT_PANEL = 64
ETH_CPU = range(64, 68)
#: Lanes a port of each speed (Gb/s) occupies on Tofino 1.
LANES = {10: 1, 25: 1, 40: 4, 50: 2, 100: 4}


def pcie_cpu_port(pipes: int) -> int:
    return (2 if pipes == 4 else 1) << 7 | 64


def split(dev_port: int) -> tuple[int, int]:
    """(pipe, port inside the pipe)."""
    return dev_port >> 7, dev_port & 0x7F


def check_host_port(dev_port: int, speed_gbps: int, pipes: int, what: str) -> None:
    """Refuse a dev port a front-panel port of ``speed_gbps`` cannot have."""
    lanes = LANES.get(speed_gbps)
    if lanes is None:
        raise CheckmateError(f"{what}: Tofino 1 ports run at {sorted(LANES)} Gb/s, not "
                             f"{speed_gbps}")
    pipe, local = split(dev_port)
    if pipe >= pipes:
        raise CheckmateError(f"{what}: dev port {dev_port} is in pipe {pipe}; this switch has "
                             f"{pipes} pipes")
    if local >= FRONT_PANEL:
        raise CheckmateError(f"{what}: dev port {dev_port} is port {local} of pipe {pipe}, not "
                             f"a front-panel port (0..{FRONT_PANEL - 1} of each pipe)")
    if local % lanes:
        raise CheckmateError(f"{what}: a {speed_gbps}G port uses {lanes} lanes and must start "
                             f"on a multiple of {lanes}; dev port {dev_port} is lane {local}")


def check_cpu_port(dev_port: int, pipes: int) -> None:
    pcie = pcie_cpu_port(pipes)
    if dev_port != pcie and dev_port not in ETH_CPU:
        raise CheckmateError(f"switch.cpu_port {dev_port} is not a Tofino CPU port (PCIe "
                             f"{pcie}, or Ethernet CPU ports {ETH_CPU.start}.."
                             f"{ETH_CPU.stop - 1})")
