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
    KernelDriver(cfg).apply(plan_mod.build(cfg, {reg.host: reg}))
    rx = {n: udp_socket_in(cfg.netns(n), ("0.0.0.0", cfg.host(n).port), 8 << 20)
          for n in ("t1", "s0", "s1")}
    try:
        yield cfg, sw, rx
    finally:
        for s in rx.values():
            s.close()
        for e in sw.replication_entries():
            sw.remove_replication(e.job_id, e.src_ip, e.dst_ip, e.partition, e.replica)


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
def test_spoofed_source_is_dropped_not_copied_and_counted(net, attacker):
    """t0 -> t1 REPLICATE datagrams sent from another host's port (with its own MAC: a
    foreign source IP; with t0's MAC: a foreign source MAC) reach neither t1 nor a shadow:
    dropped where they entered and counted there; the same bytes sent from t0's port are
    delivered and copied with the shadow's session."""
    cfg, sw, rx = net
    sent = [datagram(cfg, 1, partition=0), datagram(cfg, 2, partition=1),
            datagram(cfg, 3, partition=0)]
    spoofed = [frame(cfg, attacker, "t0", "t1", sent[0]),
               frame(cfg, attacker, "t0", "t1", sent[1]),
               frame(cfg, attacker, "t0", "t1", sent[2], src_mac=cfg.host("t0").mac)]
    before = sw.counters()
    send_raw(cfg, attacker, spoofed)
    assert received(rx["t1"]) == []
    assert received(rx["s0"], 0.1) == [] and received(rx["s1"], 0.1) == []
    after = sw.counters()
    port = cfg.switch_ifname(attacker)
    assert delta(after, before, port, "bad_src_ip") == 2
    assert delta(after, before, port, "bad_src_mac") == 1
    assert delta(after, before, port, "replicated") == 0
    assert delta(after, before, port, "spoofed") == 0  # never got as far as the table
    for p in sw.port_names:
        if p != port:
            assert delta(after, before, p, "bad_src_ip") == 0
            assert delta(after, before, p, "bad_src_mac") == 0
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
    for key in ("spoofed", "bad_src_ip", "bad_src_mac"):
        assert delta(final, after, cfg.switch_ifname("t0"), key) == 0


def test_ports_are_bound_and_the_bridge_learns_nothing(net):
    """The bindings and forwarding entries are the config's: one per host, on its port."""
    cfg, sw, _ = net
    want = {cfg.switch_ifname(h.name): (h.mac.lower(), h.ip) for h in cfg.hosts}
    assert sw.bindings() == want
    assert sw.fdb() == {mac: port for port, (mac, _) in want.items()}
    assert sw.bind_ports() == []  # already so: nothing to write


@pytest.mark.parametrize("attacker", ["t2", "s1"])
def test_a_frame_with_a_shadows_mac_moves_nothing_and_the_shadow_keeps_its_copies(
        net, attacker):
    """The issue's hijack: frames with s0's source MAC (with the attacker's IP, with s0's
    IP, as an ARP reply claiming s0's address, as plain UDP to a non-ckm port) sent from
    another port. Each is dropped and counted there; s0's forwarding entry stays on s0's
    port; s0 keeps receiving its copies and plain traffic, and the attacker none of it."""
    from scapy.layers.inet import IP, UDP
    from scapy.layers.l2 import ARP, Ether

    from checkmate.testbed.netsock import udp_socket_in

    cfg, sw, rx = net
    s0, me, t1 = cfg.host("s0"), cfg.host(attacker), cfg.host("t1")
    spy = rx.get(attacker) or udp_socket_in(cfg.netns(attacker), ("0.0.0.0", me.port),
                                            1 << 20)
    hijack = [
        bytes(Ether(src=s0.mac, dst=t1.mac) / IP(src=me.ip, dst=t1.ip)
              / UDP(sport=1, dport=t1.port) / b"x"),
        bytes(Ether(src=s0.mac, dst=t1.mac) / IP(src=s0.ip, dst=t1.ip)
              / UDP(sport=1, dport=9) / b"x"),
        bytes(Ether(src=s0.mac, dst="ff:ff:ff:ff:ff:ff")
              / ARP(op=2, hwsrc=s0.mac, psrc=s0.ip, hwdst=t1.mac, pdst=t1.ip)),
        bytes(Ether(src=me.mac, dst="ff:ff:ff:ff:ff:ff")
              / ARP(op=2, hwsrc=me.mac, psrc=s0.ip, hwdst=t1.mac, pdst=t1.ip)),
    ]
    fdb_before = sw.fdb()
    before = sw.counters()
    try:
        send_raw(cfg, attacker, hijack * 5)
        port = cfg.switch_ifname(attacker)
        after = sw.counters()
        assert delta(after, before, port, "bad_src_mac") == 3 * 5
        assert delta(after, before, port, "bad_src_ip") == 1 * 5
        assert received(rx["t1"], 0.1) == []
        assert sw.fdb() == fdb_before and sw.fdb()[s0.mac.lower()] == cfg.switch_ifname("s0")

        sent = [datagram(cfg, i, partition=0) for i in range(4)]
        send_raw(cfg, "t0", [frame(cfg, "t0", "t0", "t1", d) for d in sent])
        assert received(rx["t1"]) == sent
        assert [wire.decode(c)[0] for c in received(rx["s0"])] == [
            wire.decode(d)[0].with_(epoch=EPOCH, token=TOKEN) for d in sent]
        plain = wire.encode(wire.Header(job_id=cfg.job_id, seq=99))  # t0 -> s0 directly
        send_raw(cfg, "t0", [frame(cfg, "t0", "t0", "s0", plain)])
        assert received(rx["s0"]) == [plain]
        assert received(spy, 0.1) == []
    finally:
        if attacker not in rx:
            spy.close()


def test_a_register_with_a_forged_source_never_reaches_the_controller(net):
    """The controller's `register` check (sent from the shadow's own address) rests on
    this: a datagram to the controller's address claiming s0's source from another port is
    dropped at the switch, while s0's own arrives."""
    from checkmate.config.cluster import CONTROLLER_PORT
    from checkmate.testbed.netsock import udp_socket_in

    cfg, sw, _ = net
    ctl = udp_socket_in(cfg.netns(cfg.switch.name), (cfg.switch.ip, CONTROLLER_PORT), 1 << 20)
    s0, t2 = cfg.host("s0"), cfg.host("t2")
    try:
        def to_ctl(via: str, src_ip: str, body: bytes) -> bytes:
            from scapy.layers.inet import IP, UDP
            from scapy.layers.l2 import Ether

            return bytes(Ether(src=cfg.host(via).mac, dst=cfg.switch.mac)
                         / IP(src=src_ip, dst=cfg.switch.ip)
                         / UDP(sport=40000, dport=CONTROLLER_PORT) / body)

        before = sw.counters()
        send_raw(cfg, "t2", [to_ctl("t2", s0.ip, b"forged register")])
        assert received(ctl, 0.2) == []
        after = sw.counters()
        assert delta(after, before, cfg.switch_ifname("t2"), "bad_src_ip") == 1
        send_raw(cfg, "s0", [to_ctl("s0", s0.ip, b"register")])
        send_raw(cfg, "t2", [to_ctl("t2", t2.ip, b"t2's own")])
        assert sorted(received(ctl)) == [b"register", b"t2's own"]
    finally:
        ctl.close()


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


def test_the_chaos_hijack_round_is_dropped_as_its_check_expects(net):
    """testbed.attacks.hijack_frames (the attack-mac-hijack chaos case) through the real
    switch: each round is 3 frames dropped for their MAC and 1 for its IP, nothing else."""
    from checkmate.testbed.attacks import hijack_frames

    cfg, sw, rx = net
    t3, s0 = cfg.host("t3"), cfg.host("s0")
    before = sw.counters()
    send_raw(cfg, "t3", hijack_frames(t3.mac, t3.ip, s0.mac, s0.ip) * 7)
    after = sw.counters()
    port = cfg.switch_ifname("t3")
    assert delta(after, before, port, "bad_src_mac") == 3 * 7
    assert delta(after, before, port, "bad_src_ip") == 7
    assert delta(after, before, port, "rx") == 4 * 7
    assert sw.fdb()[s0.mac.lower()] == cfg.switch_ifname("s0")
    assert all(received(s, 0.05) == [] for s in rx.values())
