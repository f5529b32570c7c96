"""The tc-eBPF switch, end to end: real namespaces, veths, bridge, BPF and UDP sockets.

One testbed (prefix "ta") serves the module; every test installs the entries and faults it
needs and clears them at the end.
"""

from __future__ import annotations

import os
import random
import socket
import struct

import pytest
from fakes import LENGTH_RULE_CASES

from checkmate.config import cluster as config
from checkmate.dataplane.switch import KernelSwitch, ReplicationEntry, SwitchUnreachable
from checkmate.errors import CheckmateError
from checkmate.protocol import wire

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for namespaces and BPF"),
]

RCVBUF = 8 << 20


@pytest.fixture(scope="module")
def tb(testbed_of):
    with testbed_of("ta") as bed:
        yield bed


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
            tb.switch.remove_replication(e.job_id, e.src_ip, e.dst_ip, e.partition, e.replica)
        for p in tb.switch.port_names:
            tb.switch.set_fault(p, 0.0, 0.0)


def entry(cfg, src: str, dst: str, partition: int, epoch: int = 11, token: int = 0xA5A5A5A5):
    sh = cfg.shadow_for(partition)
    return ReplicationEntry(cfg.job_id, cfg.host(src).ip, cfg.host(dst).ip, partition,
                            cfg.switch_ifname(sh.name), sh.mac, sh.ip, sh.port, epoch, token,
                            cfg.switch_ifname(src))


def datagram(cfg, seq: int, partition: int = 0, flags: int = wire.Flags.REPLICATE,
             n: int = 64, iteration: int = 3) -> bytes:
    payload = struct.pack(f"<{n}f", *(float(seq * 1000 + i) for i in range(n)))
    h = wire.Header(flags=flags, job_id=cfg.job_id, epoch=1, token=2, iteration=iteration,
                    offset=seq * n, count=n, seq=seq, partition=partition)
    return wire.encode(h, payload)


BIG = 64_000  # payload bytes of a ring-sized datagram: IP-fragmented on the 9000-byte MTU


def big_datagram(cfg, seq: int, iteration: int = 3) -> bytes:
    """A 64 KB ckm datagram, as the ring sends them (opaque bytes, distinct per seq)."""
    payload = random.Random(seq).randbytes(BIG)
    h = wire.Header(job_id=cfg.job_id, epoch=1, token=2, iteration=iteration, offset=seq * BIG,
                    count=BIG, seq=seq, dtype=wire.DType.BYTES)
    return wire.encode(h, payload)


def ack_datagram(cfg, seq: int) -> bytes:
    """A ring ACK: a ckm header with iteration 0 and no payload."""
    return wire.encode(wire.Header(flags=wire.Flags.ACK, job_id=cfg.job_id, seq=seq))


def udp_per_fragment(cfg) -> int:
    """Bytes of the UDP datagram (header included) one IPv4 fragment carries on the path."""
    return (cfg.network.mtu - 20) // 8 * 8


def fragments(cfg, d: bytes) -> int:
    return -(-(8 + len(d)) // udp_per_fragment(cfg))


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


def test_each_replica_of_a_partition_gets_its_own_copy(net):
    """Issue 38: two shadows of partition 0 (here s0, and s1's port and address as its
    second replica): one copy each, stamped with that replica's session; the original
    reaches its destination once. Replicas are numbered from 0 without gaps: with replica 0
    gone, replica 1's entry alone copies nothing (the datagram counts as having none)."""
    from dataclasses import replace

    cfg, sw, rx, tx = net
    t1 = cfg.host("t1")
    sw.add_replication(entry(cfg, "t0", "t1", 0, epoch=42, token=1))
    sw.add_replication(replace(entry(cfg, "t0", "t1", 1, epoch=43, token=2), partition=0,
                               replica=1))
    before = sw.counters()
    sent = [datagram(cfg, i, n=n) for i, n in enumerate([1, 64, 2211])]
    for d in sent:
        tx.sendto(d, (t1.ip, t1.port))
    assert received(rx["t1"]) == sent
    for name, epoch, token in (("s0", 42, 1), ("s1", 43, 2)):
        copies = received(rx[name])
        assert [wire.decode(c)[0] for c in copies] == [
            wire.decode(d)[0].with_(epoch=epoch, token=token) for d in sent], name
    after = sw.counters()
    assert port_delta(after, before, "tap-t0", "replicated") == 2 * len(sent)
    assert [(e["replica"], e["packets"]) for e in after["entries"]] == [(0, 3), (1, 3)]
    sw.remove_replication(cfg.job_id, cfg.host("t0").ip, t1.ip, 0, 0)
    tx.sendto(sent[0], (t1.ip, t1.port))
    assert received(rx["t1"]) == sent[:1]
    assert received(rx["s0"], 0.05) == [] and received(rx["s1"], 0.05) == []
    assert port_delta(sw.counters(), after, "tap-t0", "no_entry") == 1


def test_the_switch_and_the_config_agree_on_the_replica_bound():
    """The kernel switch copies to at most CKM_MAX_REPLICAS shadows: the config's bound."""
    import re

    from checkmate.config.schema import MAX_REPLICAS
    from checkmate.dataplane import build

    src = (build.SRC_DIR / "ckm_switch.c").read_text()
    assert re.search(r"#define CKM_MAX_REPLICAS (\d+)", src).group(1) == str(MAX_REPLICAS)


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


def test_length_rule_at_the_bounds_the_p4_form_checks(net):
    """fakes.LENGTH_RULE_CASES through the kernel switch: a REPLICATE datagram with an
    entry is copied exactly when its count agrees with its payload, with no wrap-around
    (the cases test_p4_sources runs through the P4 programs' length check)."""
    cfg, sw, rx, tx = net
    t1 = cfg.host("t1")
    sw.add_replication(entry(cfg, "t0", "t1", 0))
    before = sw.counters()
    sent = []
    for i, (count, dtype, n, _) in enumerate(LENGTH_RULE_CASES):
        h = wire.Header(flags=wire.Flags.REPLICATE, job_id=cfg.job_id, epoch=1, token=2,
                        iteration=3, count=count, seq=i, partition=0, dtype=dtype)
        d = wire.pack_header(h) + bytes([i]) * n
        tx.sendto(d, (t1.ip, t1.port))
        sent.append(d)
    assert sorted(received(rx["t1"])) == sorted(sent)  # all forwarded
    copies = received(rx["s0"])
    want = [i for i, (*_, ok) in enumerate(LENGTH_RULE_CASES) if ok]
    assert sorted(wire.decode_header(c).seq for c in copies) == want
    after = sw.counters()
    assert port_delta(after, before, "tap-t0", "replicated") == len(want)
    assert port_delta(after, before, "tap-t0", "malformed") == len(sent) - len(want)


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


def test_the_swap_pattern_keeps_any_crc32c_and_is_the_programs():
    """The swap knob's 6 bytes are a multiple of CRC32C's generator polynomial: XOR-ed into
    any payload at any offset, the CRC32C stays (and so the datagram's tag)."""
    from pathlib import Path

    import crc32c

    src = (Path(__file__).resolve().parents[1] / "dataplane" / "bpf" / "ckm_switch.c"
           ).read_text()
    pattern = bytes([0xf1, 0x76, 0xec, 0x05, 0x01, 0x00])
    assert "{0xf1, 0x76, 0xec, 0x05, 0x01, 0x00}" in src
    rng = random.Random(4)
    for _ in range(200):
        m = bytearray(rng.randbytes(rng.randrange(6, 9000)))
        at = rng.randrange(len(m) - 5)
        before = crc32c.crc32c(bytes(m))
        for i, b in enumerate(pattern):
            m[at + i] ^= b
        assert crc32c.crc32c(bytes(m)) == before


def test_swap_knob_rewrites_copies_under_their_crc_and_spares_control(net):
    """On the shadow's port: every gradient copy arrives changed yet passing its CRC32C (the
    on-path swap the state check must find); control datagrams and the originals pass
    untouched."""
    cfg, sw, rx, tx = net
    sw.add_replication(entry(cfg, "t0", "t1", 0))
    sw.set_fault("tap-s0", swap=1.0)
    sent = [datagram(cfg, i, flags=wire.Flags.REPLICATE, n=8) for i in range(20)]
    got = _burst(cfg, tx, rx["t1"], 20, replicate=True)
    assert sorted(got) == sorted(sent)  # the originals intact
    copies = received(rx["s0"])
    assert len(copies) == 20 and all(_crc_ok(d) for d in copies)
    payloads = {d[wire.HEADER_LEN:] for d in sent}
    assert not any(d[wire.HEADER_LEN:] in payloads for d in copies)  # every one rewritten
    assert sorted(wire.decode_header(d).offset for d in copies) == [8 * i for i in range(20)]
    assert sw.counters()["faults"]["tap-s0"]["swapped"] == 20
    ctl = wire.encode(wire.Header(flags=wire.Flags.REPLICATE | wire.Flags.CONTROL,
                                  job_id=cfg.job_id, epoch=1, token=2, iteration=3,
                                  count=32, dtype=wire.DType.BYTES), bytes(32))
    tx.sendto(ctl, (cfg.host("t1").ip, cfg.host("t1").port))
    (copy,) = received(rx["s0"])
    assert _crc_ok(copy) and copy[wire.HEADER_LEN:] == bytes(32)


def _send_big(cfg, tx, rx_sock, data: list[bytes], per_round: int = 16) -> list[bytes]:
    """Send to t1 in rounds whose reassembled datagrams fit the receive buffer."""
    t1 = cfg.host("t1")
    out = []
    for start in range(0, len(data), per_round):
        for d in data[start:start + per_round]:
            tx.sendto(d, (t1.ip, t1.port))
        out += received(rx_sock, 0.1)
    return out + received(rx_sock, 0.3)


def test_drop_hits_every_fragment_of_big_datagrams(net):
    cfg, sw, rx, tx = net
    sent = [big_datagram(cfg, i) for i in range(20)]
    frags = fragments(cfg, sent[0])
    assert frags == 8  # the 9000-byte MTU path really fragments them
    sw.set_fault("tap-t1", drop=1.0)
    before = sw.counters()
    assert _send_big(cfg, tx, rx["t1"], sent) == []
    after = sw.counters()
    assert port_delta(after, before, "tap-t1", "frag_dropped") == 20 * frags
    assert port_delta(after, before, "tap-t1", "dropped") == 20 * frags
    sw.set_fault("tap-t1", drop=0.0)
    assert sorted(_send_big(cfg, tx, rx["t1"], sent)) == sorted(sent)


def test_drop_rate_is_per_datagram_for_fragmented_datagrams(net):
    """All fragments of a datagram share one draw, so drop=0.3 loses ~30% of the 64 KB
    datagrams, not 1 - 0.7**8 (94%) as independent per-fragment drops would. The number lost
    is Binomial(n, p) when the draws are independent across datagrams: 5 standard deviations
    (sd = sqrt(n p (1-p)) = 7.9 for n = 300) fail a correct switch with probability < 1e-6,
    while per-fragment drops would lose ~283, 29 sd away."""
    cfg, sw, rx, tx = net
    n, p = 300, 0.3
    sent = [big_datagram(cfg, i) for i in range(n)]
    frags = fragments(cfg, sent[0])
    sw.set_fault("tap-t1", drop=p)
    before = sw.counters()
    got = _send_big(cfg, tx, rx["t1"], sent)
    after = sw.counters()
    assert set(got) <= set(sent) and len(set(got)) == len(got)
    lost = n - len(got)
    # a lost datagram lost all of its fragments, an arrived one none of them
    assert port_delta(after, before, "tap-t1", "frag_dropped") == lost * frags
    sd = (n * p * (1 - p)) ** 0.5
    assert abs(lost - n * p) < 5 * sd, lost


def _ones_sum(b: bytes) -> int:
    if len(b) % 2:
        b += b"\0"
    s = sum(struct.unpack(f"!{len(b) // 2}H", b))
    while s > 0xFFFF:
        s = (s & 0xFFFF) + (s >> 16)
    return s


def _reassembled_udp_ok(frames: list[bytes]) -> list[bool]:
    """Reassemble captured IPv4 fragments by IP id and verify each UDP checksum by hand
    (veth may mark frames checksum-unnecessary, so delivery alone proves nothing)."""
    parts: dict[int, list[tuple[int, bytes, bytes]]] = {}
    for f in frames:
        ip = f[14:]
        if f[12:14] != b"\x08\x00" or ip[9] != 17:
            continue
        ihl, tot = (ip[0] & 15) * 4, struct.unpack("!H", ip[2:4])[0]
        ident, frag = struct.unpack("!HH", ip[4:8])
        if frag & 0x3FFF:
            parts.setdefault(ident, []).append(((frag & 0x1FFF) * 8, ip[12:20], ip[ihl:tot]))
    out = []
    for pieces in parts.values():
        pieces.sort()
        udp = b"".join(p for _, _, p in pieces)
        addrs = pieces[0][1]
        pseudo = addrs + struct.pack("!BBH", 0, 17, len(udp))
        out.append(udp[6:8] != b"\0\0" and _ones_sum(pseudo + udp) == 0xFFFF)
    return out


def test_corrupt_fragmented_datagram_arrives_with_bad_crc(net):
    """The flip lands in the first fragment's payload and its UDP checksum is fixed up (it
    covers the whole datagram), so reassembly delivers a datagram whose CRC32C fails."""
    from checkmate.testbed.netsock import PACKET_OUTGOING, drain, packet_socket_in

    cfg, sw, rx, tx = net
    sent = {wire.decode(d)[0].seq: d for d in (big_datagram(cfg, i) for i in range(20))}
    first_end = udp_per_fragment(cfg) - 8  # ckm bytes the first fragment carries
    sw.set_fault("tap-t1", corrupt=1.0)
    cap = packet_socket_in(cfg.netns("t1"), cfg.host_ifname("t1"))
    try:
        cap.setsockopt(socket.SOL_SOCKET, 33, 32 << 20)  # SO_RCVBUFFORCE: hold every frame
        before = sw.counters()
        got = _send_big(cfg, tx, rx["t1"], list(sent.values()))
        after = sw.counters()
        frames = [f for f, a in drain(cap, 0.05) if a[2] != PACKET_OUTGOING]
    finally:
        cap.close()
    assert len(got) == len(sent) and not any(_crc_ok(d) for d in got)
    assert _reassembled_udp_ok(frames) == [True] * len(sent)  # valid UDP checksum on the wire
    for d in got:
        orig = sent[wire.decode_header(d).seq]
        diff = [i for i in range(len(d)) if d[i] != orig[i]]
        assert diff and diff[0] % 2 == 0 and diff[-1] <= diff[0] + 1, diff
        w = diff[0]
        assert wire.HEADER_LEN <= w < first_end  # payload of the first fragment
        assert d[w:w + 2] == bytes(b ^ 0xFF for b in orig[w:w + 2])
    assert port_delta(after, before, "tap-t1", "corrupted") == len(sent)
    assert port_delta(after, before, "tap-t1", "frag_corrupted") == len(sent)
    assert port_delta(after, before, "tap-t1", "dropped") == 0


def test_corrupt_rate_is_per_datagram_for_fragmented_datagrams(net):
    cfg, sw, rx, tx = net
    n, p = 200, 0.3
    sent = [big_datagram(cfg, i) for i in range(n)]
    sw.set_fault("tap-t1", corrupt=p)
    before = sw.counters()
    got = _send_big(cfg, tx, rx["t1"], sent)
    after = sw.counters()
    assert len(got) == n
    bad = sum(not _crc_ok(d) for d in got)
    assert bad == port_delta(after, before, "tap-t1", "frag_corrupted")
    sd = (n * p * (1 - p)) ** 0.5  # binomial, as for the drop rate
    assert abs(bad - n * p) < 5 * sd, bad


def test_fault_window_hits_only_its_iterations(net):
    """drop=1.0 from iteration 5 to 7: small and fragmented datagrams of iterations 4 and 8
    arrive, those of 5..7 never do. Frames without an iteration (later fragments, ACKs) go
    by the latest iteration that left the port; an ACK before any counts as iteration 0."""
    cfg, sw, rx, tx = net
    sw.set_fault("tap-t1", drop=1.0, from_iteration=5, until_iteration=7)
    faults = sw.counters()["faults"]["tap-t1"]
    assert faults == {"drop": 1.0, "corrupt": 0.0, "swap": 0.0, "swapped": 0,
                      "from_iteration": 5, "until_iteration": 7, "last_iteration": 0}
    ack = ack_datagram(cfg, 999)
    assert _send_big(cfg, tx, rx["t1"], [ack]) == [ack]
    before = sw.counters()
    big_frags = 0
    for it in (4, 5, 6, 7, 8):
        group = [datagram(cfg, 10 * it + k, flags=0, iteration=it) for k in range(3)]
        group += [big_datagram(cfg, 10 * it + k, iteration=it) for k in range(3)]
        group.append(ack_datagram(cfg, it))
        got = _send_big(cfg, tx, rx["t1"], group)  # drained before the next iteration
        if 5 <= it <= 7:
            assert got == [], it
            big_frags += sum(fragments(cfg, d) for d in group[3:6])
        else:
            assert sorted(got) == sorted(group), it
        assert sw.counters()["faults"]["tap-t1"]["last_iteration"] == it
    after = sw.counters()
    assert port_delta(after, before, "tap-t1", "frag_dropped") == big_frags
    assert port_delta(after, before, "tap-t1", "dropped") == big_frags + 3 * (3 + 1)


def test_fault_window_open_ends(net):
    cfg, sw, rx, tx = net
    sw.set_fault("tap-t1", drop=1.0, until_iteration=2)  # from the start up to 2
    got = _send_big(cfg, tx, rx["t1"], [datagram(cfg, it, flags=0, iteration=it)
                                        for it in (1, 2, 3)])
    assert [wire.decode(d)[0].iteration for d in got] == [3]
    sw.set_fault("tap-t1", drop=1.0, from_iteration=3)  # from 3 on
    got = _send_big(cfg, tx, rx["t1"], [datagram(cfg, it, flags=0, iteration=it)
                                        for it in (2, 3, 1000)])
    assert [wire.decode(d)[0].iteration for d in got] == [2]


def test_drop_knob_spares_non_ckm_udp(net):
    from checkmate.testbed.netsock import udp_socket_in

    cfg, sw, rx, tx = net
    t1 = cfg.host("t1")
    plain = udp_socket_in(cfg.netns("t1"), ("0.0.0.0", 40123), RCVBUF)
    try:
        sw.set_fault("tap-t1", drop=1.0)
        tx.sendto(b"not ckm", (t1.ip, 40123))
        assert received(plain) == [b"not ckm"]
    finally:
        plain.close()


def test_set_fault_keeps_its_positional_form(net):
    cfg, sw, rx, tx = net
    sw.set_fault("tap-t2", 0.5, 0.25)
    f = sw.counters()["faults"]["tap-t2"]
    assert (f["drop"], f["corrupt"], f["from_iteration"], f["until_iteration"]) == (
        0.5, 0.25, 0, 0)


def test_entries_insert_overwrite_remove(net):
    cfg, sw, rx, tx = net
    e = entry(cfg, "t0", "t1", 0, epoch=1)
    sw.add_replication(e)
    e2 = entry(cfg, "t0", "t1", 0, epoch=2, token=3)
    sw.add_replication(e2)
    assert sw.replication_entries() == [e2]
    sw.remove_replication(e.job_id, e.src_ip, e.dst_ip, e.partition, e.replica)
    assert sw.replication_entries() == []
    sw.remove_replication(e.job_id, e.src_ip, e.dst_ip, e.partition)  # absent: no error


@pytest.mark.parametrize("change", [
    {"shadow_ifname": "nope0"}, {"shadow_ip": "10.1.2"}, {"shadow_mac": "zz"},
    {"shadow_port": 70000}, {"epoch": -1}, {"partition": 1 << 16},
    {"ingress_ifname": "nope0"},
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


@pytest.mark.parametrize("window", [
    {"from_iteration": -1}, {"until_iteration": 1 << 64}, {"from_iteration": True},
    {"until_iteration": 2.0}, {"from_iteration": "5"}, {"from_iteration": 8, "until_iteration": 5},
])
def test_bad_fault_window_is_one_clear_error(net, window):
    cfg, sw, rx, tx = net
    with pytest.raises(CheckmateError) as exc:
        sw.set_fault("tap-t1", drop=0.1, **window)
    assert "\n" not in str(exc.value) and "iteration" in str(exc.value)
    assert sw.counters()["faults"]["tap-t1"]["drop"] == 0.0  # nothing was written


def test_absent_switch_is_unreachable():
    cfg = config.with_prefix(config.load(config.default_path()), "tazz")
    sw = KernelSwitch(cfg)
    assert not sw.is_up()
    with pytest.raises(SwitchUnreachable):
        sw.replication_entries()
    with pytest.raises(SwitchUnreachable):
        sw.counters()


def test_ckm_is_counted_per_dscp_and_trainer_sockets_mark_it(net):
    """The trainer's own ckm socket (checkmate.train.transport.open_socket, opened in t0's
    namespace) sends DSCP 24; an unmarked socket sends DSCP 0; the kernel switch counts
    well-formed ckm datagrams per ingress port and DSCP, malformed ones not at all."""
    from checkmate.control import pfc
    from checkmate.testbed.netsock import call_in_netns
    from checkmate.train.transport import open_socket

    cfg, sw, rx, tx = net
    t0, t1 = cfg.host("t0"), cfg.host("t1")
    trainer = call_in_netns(cfg.netns("t0"), lambda: open_socket(t0.ip, 0))
    try:
        before = sw.counters()["dscp"]["tap-t0"]
        marked = [datagram(cfg, i, flags=0) for i in range(7)]
        for d in marked:
            while True:
                try:
                    trainer.sendto(d, (t1.ip, t1.port))
                    break
                except BlockingIOError:
                    continue
        plain = [datagram(cfg, i, flags=0) for i in range(3)]
        for d in plain:
            tx.sendto(d, (t1.ip, t1.port))
        tx.sendto(b"\x00" * 40, (t1.ip, t1.port))  # ckm port, not ckm: not counted
        assert len(received(rx["t1"])) == len(marked) + len(plain) + 1
        after = sw.counters()["dscp"]["tap-t0"]
    finally:
        trainer.close()
    assert after.get(pfc.CKM_DSCP, 0) - before.get(pfc.CKM_DSCP, 0) == len(marked)
    assert after.get(0, 0) - before.get(0, 0) == len(plain)
    assert set(after) <= {0, pfc.CKM_DSCP}


def test_priority_tagged_ckm_is_classified_and_copied(net):
    """A ckm REPLICATE frame carrying an 802.1Q priority tag (VID 0, PCP 3, how a host
    without DSCP trust marks the lossless class) and DSCP 24 is still ckm to the kernel
    switch: counted under its DSCP, copied to the shadow, delivered to its destination.
    (Linux moves the tag into skb metadata before tc ingress; this checks that it does.)"""
    from scapy.layers.inet import IP, UDP
    from scapy.layers.l2 import Dot1Q, Ether

    from checkmate.control import pfc
    from checkmate.testbed.netsock import packet_socket_in

    cfg, sw, rx, tx = net
    t0, t1 = cfg.host("t0"), cfg.host("t1")
    sw.add_replication(entry(cfg, "t0", "t1", 0))
    before = sw.counters()
    d = datagram(cfg, 1)
    frame = bytes(Ether(src=t0.mac, dst=t1.mac) / Dot1Q(prio=pfc.CKM_PRIORITY, vlan=0)
                  / IP(src=t0.ip, dst=t1.ip, tos=pfc.CKM_TOS) / UDP(sport=40001, dport=t1.port)
                  / d)
    cap = packet_socket_in(cfg.netns("t0"), cfg.host_ifname("t0"))
    try:
        for _ in range(3):
            cap.send(frame)
    finally:
        cap.close()
    assert received(rx["t1"]) == [d] * 3
    assert len(received(rx["s0"])) == 3
    after = sw.counters()
    assert port_delta(after, before, "tap-t0", "replicated") == 3
    dscp = after["dscp"]["tap-t0"].get(pfc.CKM_DSCP, 0) - \
        before["dscp"]["tap-t0"].get(pfc.CKM_DSCP, 0)
    assert dscp == 3
