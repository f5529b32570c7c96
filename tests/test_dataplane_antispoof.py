"""Anti-spoofing and length checks of the tc-eBPF switch, observed at the shadow.

A copy carries the shadow's epoch/token, so the switch must copy a REPLICATE datagram only
when it entered through the port of the host that owns its source address, and only when its
``count`` agrees with its length. Real namespaces, veths, bridge and BPF (prefix "tsp": its
own namespaces and pins, removed on the way out even after a failure; ``Testbed.up()`` also
clears what a crashed earlier run left). The entries are installed the way the controller
installs them: plan from the config, kernel driver.
"""

from __future__ import annotations

import os
import struct

import pytest

from checkmate.config import cluster as config
from checkmate.control import plan as plan_mod
from checkmate.control.drivers.kernel import KernelDriver
from checkmate.protocol import wire

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for namespaces and BPF"),
]

PREFIX = "tsp"
EPOCH, TOKEN = 42, 0xC0FFEE01  # the session the plan gives partition 0's shadow


@pytest.fixture(scope="module")
def tb(testbed_of):
    with testbed_of(PREFIX) as bed:
        yield bed


@pytest.fixture
def net(tb):
    """The ring's entries deployed by the controller's path, UDP receivers on t1 and the
    shadows; the switch's table emptied afterwards."""
    from checkmate.testbed.netsock import udp_socket_in

    cfg, sw = tb.cfg, tb.switch
    s0 = cfg.host("s0")
    reg = plan_mod.Registration(0, "s0", s0.ip, s0.mac, s0.port, EPOCH, TOKEN)
    KernelDriver(cfg).apply(plan_mod.build(cfg, {0: reg}))
    rx = {n: udp_socket_in(cfg.netns(n), ("0.0.0.0", cfg.host(n).port), 8 << 20)
          for n in ("t1", "s0", "s1")}
    try:
        yield cfg, sw, rx
    finally:
        for s in rx.values():
            s.close()
        for e in sw.replication_entries():
            sw.remove_replication(e.job_id, e.src_ip, e.dst_ip, e.partition)


def datagram(cfg, seq: int, partition: int = 0, n: int = 32) -> bytes:
    payload = struct.pack(f"<{n}f", *(float(seq * 100 + i) for i in range(n)))
    return wire.encode(wire.Header(flags=wire.Flags.REPLICATE, job_id=cfg.job_id, epoch=1,
                                   token=2, iteration=5, offset=seq * n, count=n, seq=seq,
                                   partition=partition), payload)


def send_raw(cfg, via: str, frames: list[bytes]) -> None:
    """Send Ethernet frames out of host ``via``'s interface, as that host's NIC would."""
    from checkmate.testbed.netsock import packet_socket_in

    raw = packet_socket_in(cfg.netns(via), cfg.host_ifname(via))
    try:
        for f in frames:
            raw.send(f)
    finally:
        raw.close()


def frame(cfg, via: str, src: str, dst: str, payload: bytes, src_mac: str | None = None
          ) -> bytes:
    """An Ethernet/IPv4/UDP frame from ``via``'s port claiming to come from host ``src``."""
    from scapy.layers.inet import IP, UDP
    from scapy.layers.l2 import Ether

    s, d = cfg.host(src), cfg.host(dst)
    return bytes(Ether(src=src_mac or cfg.host(via).mac, dst=d.mac) / IP(src=s.ip, dst=d.ip)
                 / UDP(sport=config.TRAINER_PORT, dport=d.port) / payload)


def received(sock, quiet: float = 0.3) -> list[bytes]:
    from checkmate.testbed.netsock import drain

    return [d for d, _ in drain(sock, quiet)]


def delta(after: dict, before: dict, port: str, key: str) -> int:
    return after["ports"][port][key] - before["ports"][port][key]


def test_plan_programs_every_entrys_ingress_port(net):
    cfg, sw, _ = net
    entries = sw.replication_entries()
    assert len(entries) == 8
    owner = {h.ip: h.name for h in cfg.hosts}
    assert all(e.ingress_ifname == cfg.switch_ifname(owner[e.src_ip]) for e in entries)


@pytest.mark.parametrize("attacker", ["t2", "s1"])
def test_spoofed_source_is_forwarded_not_copied_and_counted(net, attacker):
    """t0 -> t1 REPLICATE datagrams sent from another host's port (with its own MAC, and
    with t0's MAC too) reach t1 untouched but no shadow, and count as spoofed on the port
    they entered; the same bytes sent from t0's port are copied with the shadow's session."""
    cfg, sw, rx = net
    sent = [datagram(cfg, 1, partition=0), datagram(cfg, 2, partition=1),
            datagram(cfg, 3, partition=0)]
    spoofed = [frame(cfg, attacker, "t0", "t1", sent[0]),
               frame(cfg, attacker, "t0", "t1", sent[1]),
               frame(cfg, attacker, "t0", "t1", sent[2], src_mac=cfg.host("t0").mac)]
    before = sw.counters()
    send_raw(cfg, attacker, spoofed)
    assert received(rx["t1"]) == sent  # forwarded, byte for byte
    assert received(rx["s0"], 0.1) == [] and received(rx["s1"], 0.1) == []
    after = sw.counters()
    port = cfg.switch_ifname(attacker)
    assert delta(after, before, port, "spoofed") == 3
    assert delta(after, before, port, "replicated") == 0
    assert all(delta(after, before, p, "spoofed") == 0 for p in sw.port_names if p != port)
    assert sum(e["packets"] for e in after["entries"]) == 0

    send_raw(cfg, "t0", [frame(cfg, "t0", "t0", "t1", d) for d in sent])
    assert received(rx["t1"]) == sent
    copies = received(rx["s0"])
    assert [wire.decode(c)[0] for c in copies] == [
        wire.decode(sent[i])[0].with_(epoch=EPOCH, token=TOKEN) for i in (0, 2)]
    (copy1,) = received(rx["s1"])
    assert wire.decode(copy1)[0] == wire.decode(sent[1])[0].with_(epoch=0, token=0)
    final = sw.counters()
    assert delta(final, after, cfg.switch_ifname("t0"), "replicated") == 3
    assert delta(final, after, cfg.switch_ifname("t0"), "spoofed") == 0


def _with(d: bytes, **fields: int) -> bytes:
    """``d`` with header fields overwritten and its CRC32C left valid (payload unchanged)."""
    h = wire.decode_header(d).with_(**fields)
    return wire.pack_header(h) + d[wire.HEADER_LEN:]


def test_count_length_mismatch_is_malformed_never_copied(net):
    """Sent from t0's own port through its UDP stack, so only the header lies. Every
    mismatch reaches t1 as plain traffic and is counted malformed; only the consistent
    datagrams (float32, bfloat16, bytes, an empty one) reach the shadow."""
    from checkmate.testbed.netsock import udp_socket_in

    cfg, sw, rx = net
    t1 = cfg.host("t1")
    base = datagram(cfg, 7, n=32)  # 128 payload bytes
    bad = [
        _with(base, count=33),  # longer than the payload
        _with(base, count=31),  # shorter
        _with(base, count=0),
        _with(base, dtype=wire.DType.BYTES),  # 32 bytes claimed, 128 there
        _with(base, dtype=9),  # no such dtype
        _with(base, count=(1 << 30) + 32),  # count * 4 wraps to 128 in 32 bits
    ]
    good = [base,
            wire.encode(wire.Header(flags=wire.Flags.REPLICATE, job_id=cfg.job_id, count=3,
                                    dtype=wire.DType.BFLOAT16, seq=8), b"\x01\x02" * 3),
            wire.encode(wire.Header(flags=wire.Flags.REPLICATE, job_id=cfg.job_id, count=5,
                                    dtype=wire.DType.BYTES, seq=9), b"abcde"),
            wire.encode(wire.Header(flags=wire.Flags.REPLICATE, job_id=cfg.job_id, seq=10))]
    tx = udp_socket_in(cfg.netns("t0"))
    before = sw.counters()
    try:
        for d in bad + good:
            tx.sendto(d, (t1.ip, t1.port))
    finally:
        tx.close()
    assert received(rx["t1"]) == bad + good
    copies = received(rx["s0"])
    assert [c[wire.HEADER_LEN:] for c in copies] == [g[wire.HEADER_LEN:] for g in good]
    assert [wire.decode(c)[0] for c in copies] == [
        wire.decode(g)[0].with_(epoch=EPOCH, token=TOKEN) for g in good]
    assert received(rx["s1"], 0.1) == []
    after = sw.counters()
    port = cfg.switch_ifname("t0")
    assert delta(after, before, port, "malformed") == len(bad)
    assert delta(after, before, port, "replicated") == len(good)
    assert delta(after, before, port, "no_entry") == 0
    assert delta(after, before, port, "spoofed") == 0
