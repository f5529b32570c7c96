"""The tc-eBPF switch, end to end: real namespaces, veths, bridge, BPF and UDP sockets.

One testbed (prefix "ta") serves the module; every test installs the entries and faults it
needs and clears them at the end.
"""

from __future__ import annotations

import os
import socket
import struct

import pytest

from checkmate import config, wire
from checkmate.dataplane.switch import KernelSwitch, ReplicationEntry, SwitchUnreachable
from checkmate.errors import CheckmateError

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for namespaces and BPF"),
]

RCVBUF = 8 << 20


@pytest.fixture(scope="module")
def tb():
    from checkmate.testbed.topology import Testbed

    cfg = config.with_prefix(config.load(config.default_path()), "ta")
    bed = Testbed(cfg)
    try:
        bed.up()
        yield bed
    finally:
        bed.down()


@pytest.fixture
def net(tb):
    """Bound UDP receivers on every host, a sender in t0, and a clean switch afterwards."""
    from checkmate.testbed.netsock import udp_socket_in

    cfg = tb.cfg
    rx = {h.name: udp_socket_in(cfg.netns(h.name), ("0.0.0.0", h.port), RCVBUF)
          for h in cfg.hosts}
    tx = udp_socket_in(cfg.netns("t0"))
    try:
        yield cfg, tb.switch, rx, tx
    finally:
        for s in [*rx.values(), tx]:
            s.close()
        for e in tb.switch.replication_entries():
            tb.switch.remove_replication(e.job_id, e.src_ip, e.dst_ip, e.partition)
        for p in tb.switch.port_names:
            tb.switch.set_fault(p, 0.0, 0.0)


def entry(cfg, src: str, dst: str, partition: int, epoch: int = 11, token: int = 0xA5A5A5A5):
    sh = cfg.shadow_for(partition)
    return ReplicationEntry(cfg.job_id, cfg.host(src).ip, cfg.host(dst).ip, partition,
                            cfg.switch_ifname(sh.name), sh.mac, sh.ip, sh.port, epoch, token)


def datagram(cfg, seq: int, partition: int = 0, flags: int = wire.Flags.REPLICATE,
             n: int = 64) -> bytes:
    payload = struct.pack(f"<{n}f", *(float(seq * 1000 + i) for i in range(n)))
    h = wire.Header(flags=flags, job_id=cfg.job_id, epoch=1, token=2, iteration=3,
                    offset=seq * n, count=n, seq=seq, partition=partition)
    return wire.encode(h, payload)


def received(sock: socket.socket, quiet: float = 0.3) -> list[bytes]:
    from checkmate.testbed.netsock import drain

    return [d for d, _ in drain(sock, quiet)]


def port_delta(after: dict, before: dict, port: str, key: str) -> int:
    return after["ports"][port][key] - before["ports"][port][key]


def test_plain_ckm_reaches_only_its_destination(net):
    cfg, sw, rx, tx = net
    sw.add_replication(entry(cfg, "t0", "t1", 0))  # present, but these lack REPLICATE
    before = sw.counters()
    sent = [datagram(cfg, i, flags=0) for i in range(20)]
    for d in sent:
        tx.sendto(d, (cfg.host("t1").ip, cfg.host("t1").port))
    assert received(rx["t1"]) == sent
    for name in ("t2", "t3", "s0", "s1"):
        assert received(rx[name], 0.05) == [], name
    after = sw.counters()
    assert port_delta(after, before, "tap-t0", "rx") >= 20
    assert port_delta(after, before, "tap-t0", "replicated") == 0
    assert after["entries"][0]["packets"] == 0


def test_replicate_sends_one_rewritten_copy_to_the_shadow(net):
    from scapy.layers.inet import IP, UDP
    from scapy.layers.l2 import Ether

    from checkmate.testbed.netsock import PACKET_OUTGOING, drain, packet_socket_in

    cfg, sw, rx, tx = net
    t0, t1, s0 = cfg.host("t0"), cfg.host("t1"), cfg.host("s0")
    sw.add_replication(entry(cfg, "t0", "t1", 0, epoch=42, token=0xDEADBEEF))
    sw.add_replication(entry(cfg, "t0", "t1", 1, epoch=43, token=7))
    cap_t0 = packet_socket_in(cfg.netns("t0"), cfg.host_ifname("t0"))
    cap_t1 = packet_socket_in(cfg.netns("t1"), cfg.host_ifname("t1"))
    cap_s0 = packet_socket_in(cfg.netns("s0"), cfg.host_ifname("s0"))
    before = sw.counters()
    # small, jumbo (one 9000-byte frame) and odd-sized payloads
    sent = [datagram(cfg, i, n=n) for i, n in enumerate([1, 64, 2211, 7, 1000])]
    sent.append(datagram(cfg, 9, partition=1, n=16))
    try:
        for d in sent:
            tx.sendto(d, (t1.ip, t1.port))
        assert received(rx["t1"]) == sent  # the originals, byte for byte
        copies = received(rx["s0"])
        copies_s1 = received(rx["s1"])  # partition 1's shadow is s1
        frames_out = [f for f, a in drain(cap_t0, 0.05) if a[2] == PACKET_OUTGOING
                      and Ether(f).haslayer(UDP)]
        frames_t1 = [f for f, a in drain(cap_t1, 0.05) if a[2] != PACKET_OUTGOING
                     and Ether(f).haslayer(UDP)]
        frames_s0 = [f for f, a in drain(cap_s0, 0.05) if a[2] != PACKET_OUTGOING
                     and Ether(f).haslayer(UDP)]
    finally:
        for s in (cap_t0, cap_t1, cap_s0):
            s.close()
    assert len(copies) == 5
    assert len(copies_s1) == 1
    assert wire.decode(copies_s1[0])[0] == wire.decode(sent[5])[0].with_(epoch=43, token=7)
    for orig, copy in zip(sent[:5], copies, strict=True):
        h, payload = wire.decode(copy)  # CRC32C still valid: payload untouched
        ho, payload_o = wire.decode(orig)
        assert bytes(payload) == bytes(payload_o)
        assert h == ho.with_(epoch=42, token=0xDEADBEEF)
    # the frames on the wire: the original unchanged end to end, the copy re-addressed
    assert frames_t1 == frames_out
    assert len(frames_s0) == 5
    for f in frames_s0:
        p = Ether(f)
        assert p.dst == s0.mac and p.src == cfg.switch.mac
        assert p[IP].dst == s0.ip and p[IP].src == t0.ip and p[UDP].dport == s0.port
        fixed = p.copy()
        del fixed[IP].chksum
        del fixed[UDP].chksum
        fixed = Ether(bytes(fixed))
        assert p[UDP].chksum != 0
        assert (p[IP].chksum, p[UDP].chksum) == (fixed[IP].chksum, fixed[UDP].chksum)
    after = sw.counters()
    assert port_delta(after, before, "tap-t0", "replicated") == 6
    by_part = {e["partition"]: e for e in after["entries"]}
    assert by_part[0]["packets"] == 5 and by_part[1]["packets"] == 1
    assert by_part[0]["bytes"] == sum(len(d) + 42 for d in sent[:5])


def test_copy_for_second_partition_reaches_its_shadow(net):
    cfg, sw, rx, tx = net
    sw.add_replication(entry(cfg, "t2", "t3", 1, epoch=5, token=6))
    t3 = cfg.host("t3")
    from checkmate.testbed.netsock import udp_socket_in

    tx2 = udp_socket_in(cfg.netns("t2"))
    try:
        d = datagram(cfg, 1, partition=1)
        tx2.sendto(d, (t3.ip, t3.port))
    finally:
        tx2.close()
    assert received(rx["t3"]) == [d]
    copies = received(rx["s1"])
    assert len(copies) == 1
    assert wire.decode(copies[0])[0] == wire.decode(d)[0].with_(epoch=5, token=6)
    assert received(rx["s0"], 0.05) == []


def test_no_entry_forwards_without_copy_and_counts(net):
    cfg, sw, rx, tx = net
    sw.add_replication(entry(cfg, "t0", "t1", 0))
    before = sw.counters()
    t1, t2 = cfg.host("t1"), cfg.host("t2")
    cases = [
        (datagram(cfg, 1, partition=7), t1),  # unknown partition
        (datagram(cfg, 2, partition=1), t1),  # partition without an entry for this hop
        (datagram(cfg, 3, partition=0), t2),  # other destination
    ]
    for d, dst in cases:
        tx.sendto(d, (dst.ip, dst.port))
    assert received(rx["t1"]) == [cases[0][0], cases[1][0]]
    assert received(rx["t2"]) == [cases[2][0]]
    assert received(rx["s0"], 0.05) == [] and received(rx["s1"], 0.05) == []
    after = sw.counters()
    assert port_delta(after, before, "tap-t0", "no_entry") == 3
    assert port_delta(after, before, "tap-t0", "replicated") == 0


def test_malformed_never_replicated_never_crash(net):
    from scapy.layers.inet import IP, UDP
    from scapy.layers.l2 import Ether

    from checkmate.testbed.netsock import packet_socket_in

    cfg, sw, rx, tx = net
    t0, t1 = cfg.host("t0"), cfg.host("t1")
    sw.add_replication(entry(cfg, "t0", "t1", 0))
    good = datagram(cfg, 1)
    bad_magic = b"\x00\x00" + good[2:]
    bad_version = good[:2] + b"\x07" + good[3:]
    short = good[:30]
    l2 = Ether(src=t0.mac, dst=t1.mac)
    ip = IP(src=t0.ip, dst=t1.ip)
    udp = UDP(sport=40000, dport=t1.port)
    frames = [
        l2 / ip / udp / bad_magic,
        l2 / ip / udp / bad_version,
        l2 / ip / udp / short,
        l2 / ip / UDP(sport=40000, dport=t1.port, len=8 + 20) / good,  # UDP length too short
        l2 / ip / UDP(sport=40000, dport=t1.port, len=9000) / good,  # length past the frame
        l2 / ip / udp / b"",
    ]
    malformed = len(frames)
    frames.append(l2 / IP(src=t0.ip, dst=t1.ip, flags="MF") / udp / good)  # fragment: plain
    frames.append(l2 / IP(src=t0.ip, dst=t1.ip, proto=17) / b"\x01\x02")  # truncated UDP
    frames.append(Ether(src=t0.mac, dst=t1.mac, type=0x0800) / b"\x45")  # truncated IPv4
    frames.append(Ether(src=t0.mac, dst=t1.mac, type=0x88B5) / (b"\xc4\xec" * 40))
    before = sw.counters()
    raw = packet_socket_in(cfg.netns("t0"), cfg.host_ifname("t0"))
    try:
        for f in frames:
            raw.send(bytes(f))
    finally:
        raw.close()
    got = received(rx["t1"])
    # the well-formed-at-UDP-level ones are delivered (the kernel drops bad UDP lengths)
    assert bad_magic in got and bad_version in got and short in got
    assert received(rx["s0"], 0.05) == [] and received(rx["s1"], 0.05) == []
    after = sw.counters()
    assert port_delta(after, before, "tap-t0", "malformed") == malformed
    assert port_delta(after, before, "tap-t0", "replicated") == 0
    assert port_delta(after, before, "tap-t0", "rx") == len(frames)
    # and the switch still works
    tx.sendto(good, (t1.ip, t1.port))
    assert received(rx["t1"]) == [good]
    assert len(received(rx["s0"])) == 1


def _burst(cfg, tx, rx_sock, n: int, replicate: bool = False) -> list[bytes]:
    """Send n datagrams t0 -> t1 in rounds small enough for the receive buffer."""
    t1 = cfg.host("t1")
    out = []
    flags = wire.Flags.REPLICATE if replicate else 0
    for start in range(0, n, 100):
        for i in range(start, min(n, start + 100)):
            tx.sendto(datagram(cfg, i, flags=flags, n=8), (t1.ip, t1.port))
        out += received(rx_sock, 0.1)
    return out + received(rx_sock, 0.5)  # stragglers delayed by a busy machine


def _crc_ok(d: bytes) -> bool:
    try:
        wire.decode(d)
    except wire.WireError:
        return False
    return True


def test_drop_knob_drops_at_the_configured_rate(net):
    cfg, sw, rx, tx = net
    n, p = 600, 0.3
    sw.set_fault("tap-t1", drop=p)
    before = sw.counters()
    got = _burst(cfg, tx, rx["t1"], n)
    after = sw.counters()
    dropped = port_delta(after, before, "tap-t1", "dropped")
    assert dropped == n - len(got)  # every loss is a counted fault drop
    sd = (n * p * (1 - p)) ** 0.5
    assert abs(dropped - n * p) < 5 * sd, dropped
    assert after["faults"]["tap-t1"]["drop"] == pytest.approx(p)
    assert all(_crc_ok(d) for d in got)


def test_corrupt_knob_breaks_crc_at_the_configured_rate(net):
    cfg, sw, rx, tx = net
    n, p = 600, 0.25
    sw.set_fault("tap-t1", corrupt=p)
    before = sw.counters()
    got = _burst(cfg, tx, rx["t1"], n)
    after = sw.counters()
    assert len(got) == n  # UDP checksum fixed up: corrupted datagrams are still delivered
    bad = sum(not _crc_ok(d) for d in got)
    assert bad == port_delta(after, before, "tap-t1", "corrupted")
    sd = (n * p * (1 - p)) ** 0.5
    assert abs(bad - n * p) < 5 * sd, bad


def test_faults_on_the_shadow_port_hit_only_copies(net):
    cfg, sw, rx, tx = net
    sw.add_replication(entry(cfg, "t0", "t1", 0))
    sw.set_fault("tap-s0", drop=1.0)
    got = _burst(cfg, tx, rx["t1"], 50, replicate=True)
    assert len(got) == 50
    assert received(rx["s0"], 0.05) == []
    assert sw.counters()["ports"]["tap-s0"]["dropped"] >= 50
    sw.set_fault("tap-s0", drop=0.0)
    _burst(cfg, tx, rx["t1"], 10, replicate=True)
    assert len(received(rx["s0"])) == 10
    sw.set_fault("tap-s0", corrupt=1.0)
    got = _burst(cfg, tx, rx["t1"], 20, replicate=True)
    assert len(got) == 20 and all(_crc_ok(d) for d in got)  # originals intact
    copies = received(rx["s0"])
    assert len(copies) == 20 and not any(_crc_ok(d) for d in copies)


def test_entries_insert_overwrite_remove(net):
    cfg, sw, rx, tx = net
    e = entry(cfg, "t0", "t1", 0, epoch=1)
    sw.add_replication(e)
    e2 = entry(cfg, "t0", "t1", 0, epoch=2, token=3)
    sw.add_replication(e2)
    assert sw.replication_entries() == [e2]
    sw.remove_replication(e.job_id, e.src_ip, e.dst_ip, e.partition)
    assert sw.replication_entries() == []
    sw.remove_replication(e.job_id, e.src_ip, e.dst_ip, e.partition)  # absent: no error


@pytest.mark.parametrize("change", [
    {"shadow_ifname": "nope0"}, {"shadow_ip": "10.1.2"}, {"shadow_mac": "zz"},
    {"shadow_port": 70000}, {"epoch": -1}, {"partition": 1 << 16},
])
def test_bad_entry_is_one_clear_error(net, change):
    from dataclasses import replace

    cfg, sw, rx, tx = net
    with pytest.raises(CheckmateError):
        sw.add_replication(replace(entry(cfg, "t0", "t1", 0), **change))
    assert sw.replication_entries() == []


def test_bad_fault_arguments(net):
    cfg, sw, rx, tx = net
    with pytest.raises(CheckmateError):
        sw.set_fault("tap-t1", drop=1.5)
    with pytest.raises(CheckmateError):
        sw.set_fault("eth9", drop=0.1)


def test_absent_switch_is_unreachable():
    cfg = config.with_prefix(config.load(config.default_path()), "tazz")
    sw = KernelSwitch(cfg)
    assert not sw.is_up()
    with pytest.raises(SwitchUnreachable):
        sw.replication_entries()
    with pytest.raises(SwitchUnreachable):
        sw.counters()
