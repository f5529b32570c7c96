"""Controller against the real kernel (tc-eBPF) switch in a namespace testbed (prefix "tb")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from fakes import DATAGRAM_RECEIVER

from checkmate.config import cluster as config
from checkmate.control import plan as plan_mod
from checkmate.control.drivers.kernel import KernelDriver
from checkmate.dataplane.switch import KernelSwitch, ReplicationEntry

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces and BPF"),
]

S0 = ("tbp-s0", "02:00:0a:4d:00:64", "10.77.0.100")
S1 = ("tbp-s1", "02:00:0a:4d:00:65", "10.77.0.101")


def expected(hops, shadows) -> set[ReplicationEntry]:
    """Hand-written entries: job 7, each hop for each (partition, shadow), epoch/token 0,
    copied only from the source trainer's port (10.77.0.1x is tx, port tbp-tx)."""
    return {ReplicationEntry(7, f"10.77.0.{a}", f"10.77.0.{b}", p, ifn, mac, ip, 47001, 0, 0,
                             f"tbp-t{a - 10}")
            for a, b in hops for p, (ifn, mac, ip) in enumerate(shadows)}


RING4 = [(10, 11), (11, 12), (12, 13), (13, 10)]


@pytest.fixture(scope="module")
def testbed():
    from checkmate.testbed.topology import Testbed

    cfg = config.with_prefix(config.load(config.default_path()), "tb")
    with Testbed(cfg) as tb:
        yield tb


def cfg_file(tmp_path: Path, **changes) -> Path:
    data = yaml.safe_load(Path(config.default_path()).read_text())
    data["network"]["prefix"] = "tb"
    data.update(changes)
    p = tmp_path / "tb.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def test_deploy_is_idempotent_and_removes_stale(testbed):
    cfg = testbed.cfg
    drv = KernelDriver(cfg)
    sw = KernelSwitch(cfg)
    for e in sw.replication_entries():  # start from an empty table
        sw.remove_replication(e.job_id, e.src_ip, e.dst_ip, e.partition, e.replica)
    res = drv.apply(plan_mod.build(cfg))
    assert set(sw.replication_entries()) == expected(RING4, [S0, S1])
    assert len(res.added) == 8 and res.writes == 8
    assert drv.apply(plan_mod.build(cfg)).writes == 0
    # A foreign entry on the switch is stale: the next deploy removes it.
    sw.add_replication(ReplicationEntry(9, "10.77.0.10", "10.77.0.12", 0, *S0[:3], 47001,
                                        0, 0, "tbp-t0"))
    small = replace(cfg, hosts=tuple(h for h in cfg.hosts if h.name not in ("t3", "s1")))
    res = drv.apply(plan_mod.build(small))
    assert set(sw.replication_entries()) == expected([(10, 11), (11, 12), (12, 10)], [S0])
    # 6 of the old ring + the foreign one removed; t2 -> t0 added; 2 unchanged.
    assert (len(res.removed), len(res.added), len(res.changed)) == (7, 1, 0)


def test_cli_deploy_and_status(testbed, tmp_path):
    path = cfg_file(tmp_path)
    env = {**os.environ, "CHECKMATE_CONTROL_STATE": str(tmp_path / "state.json")}
    sw = KernelSwitch(testbed.cfg)
    for e in sw.replication_entries():
        sw.remove_replication(e.job_id, e.src_ip, e.dst_ip, e.partition, e.replica)

    def control(*args):
        return subprocess.run([sys.executable, "-m", "checkmate.control.cli", *args,
                               "--config", str(path)], capture_output=True, text=True,
                              env=env, timeout=60)

    r = control("deploy", "--switch", "sw0")
    assert r.returncode == 0, r.stderr
    assert "8 added, 0 changed, 0 removed" in r.stdout
    assert set(sw.replication_entries()) == expected(RING4, [S0, S1])
    r = control("deploy", "--switch", "sw0")
    assert "0 added, 0 changed, 0 removed" in r.stdout
    r = control("status", "--switch", "sw0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("=> tbp-s") == 8 and "tbp-t0:" in r.stdout
    assert r.stdout.count(" spoofed=0") == 6  # every port's anti-spoofing counter
    assert "handshake service: not asked (" in r.stdout  # none runs in this test
    r = control("status", "--switch", "sw0", "--json")
    st = json.loads(r.stdout)
    assert len(st["replication"]) == 8 and set(st["counters"]["ports"]) == {
        f"tbp-{h}" for h in ("t0", "t1", "t2", "t3", "s0", "s1")}
    assert {(e["src_ip"], e["ingress_ifname"]) for e in st["counters"]["entries"]} == {
        (f"10.77.0.1{i}", f"tbp-t{i}") for i in range(4)}
    r = control("status", "--switch", "sw1")
    assert r.returncode == 2 and r.stderr.strip() == \
        "control: error: unknown switch 'sw1' (the config has 'sw0')"


def test_a_partition_with_two_shadows_gets_an_entry_per_replica(testbed):
    """Replicas (issue 38) on the kernel switch: with s1 as partition 0's second shadow, each
    hop gets replica 0's entry (to s0) and replica 1's (to s1); back to one shadow, the
    replica entries go and replica 0's stay untouched."""
    cfg = testbed.cfg
    drv = KernelDriver(cfg)
    sw = KernelSwitch(cfg)
    for e in sw.replication_entries():
        sw.remove_replication(e.job_id, e.src_ip, e.dst_ip, e.partition, e.replica)
    two = replace(cfg, hosts=tuple(replace(h, partition=0) if h.name == "s1" else h
                                   for h in cfg.hosts))
    assert (two.num_partitions, two.replicas) == (1, 2)
    res = drv.apply(plan_mod.build(two))
    assert len(res.added) == 8 and any("replica 1 from" in a for a in res.added)
    want = {replace(e, replica=k)
            for k, s in enumerate([S0, S1]) for e in expected(RING4, [s])}
    assert set(sw.replication_entries()) == want
    one = replace(cfg, hosts=tuple(h for h in cfg.hosts if h.name != "s1"))
    res = drv.apply(plan_mod.build(one))
    assert (len(res.removed), len(res.added), len(res.changed)) == (4, 0, 0)
    assert set(sw.replication_entries()) == expected(RING4, [S0])




def _receive(tb, host: str, port: int) -> subprocess.Popen:
    rx = tb.popen_in(host, [sys.executable, "-c", DATAGRAM_RECEIVER, str(port)],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert rx.stdout.readline().strip() == "READY"
    return rx


def test_colocated_shadows_copies_leave_through_their_nodes_ports():
    """A testbed of co-located shadows (prefix "tkc"): namespaces for the trainer nodes
    only. Placed by an attempt, partition 0's shadow on t1, the destination of the hop
    t0 -> t1, partition 1's on t0, its source: their entries copy out of those nodes'
    ports, and REPLICATE datagrams t0 -> t1 reach each shadow at its placed UDP port,
    stamped with its session -- the source node's too (the testbed lets a node take a copy
    from its own address, as a co-located node must)."""
    from checkmate.protocol import wire
    from checkmate.testbed.topology import Testbed

    data = yaml.safe_load(Path(config.default_path()).read_text())
    data["network"]["prefix"] = "tkc"
    data["hosts"] = [h for h in data["hosts"] if h["role"] == "trainer"] + [
        {"name": f"s{p}", "role": "shadow", "partition": p, "colocated": True} for p in (0, 1)]
    colo = config.parse(data)
    t0, t1 = colo.host("t0"), colo.host("t1")
    regs = {"s0": plan_mod.Registration(0, "s0", t1.ip, t1.mac, 47021, 11, 1234, "", "t1"),
            "s1": plan_mod.Registration(1, "s1", t0.ip, t0.mac, 47022, 12, 5678, "", "t0")}
    with Testbed(colo) as tb:
        assert tb.namespaces == ["tkc-sw0"] + [f"tkc-t{i}" for i in range(4)]
        sw = KernelSwitch(colo)
        assert len(KernelDriver(colo).apply(plan_mod.build(colo, regs)).added) == 8
        assert {(e.partition, e.shadow_ifname, e.shadow_ip, e.shadow_port, e.epoch)
                for e in sw.replication_entries()} == {
            (0, "tkcp-t1", t1.ip, 47021, 11), (1, "tkcp-t0", t0.ip, 47022, 12)}
        before = sw.counters()["ports"]["tkcp-t0"]["replicated"]
        rxs = {0: _receive(tb, "t1", 47021), 1: _receive(tb, "t0", 47022)}
        try:
            send = ("import socket,sys; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                    "for d in sys.argv[1:]: s.sendto(bytes.fromhex(d), ('10.77.0.11', 47000))")
            dgrams = [wire.encode(wire.Header(flags=wire.Flags.REPLICATE, job_id=7,
                                              partition=p, count=4, iteration=3),
                                  b"\x00" * 16).hex() for p in (0, 1)]
            assert tb.run_in("t0", [sys.executable, "-c", send, *dgrams],
                             timeout=30).returncode == 0
            got = {p: rx.communicate(timeout=10)[0].strip() for p, rx in rxs.items()}
        finally:
            for rx in rxs.values():
                if rx.poll() is None:
                    rx.kill()
                    rx.wait()
        assert {p: json.loads(out) for p, out in got.items()} == {
            0: {"epoch": 11, "token": 1234, "partition": 0},
            1: {"epoch": 12, "token": 5678, "partition": 1}}
        assert sw.counters()["ports"]["tkcp-t0"]["replicated"] == before + 2
