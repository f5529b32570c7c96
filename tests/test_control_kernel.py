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
