"""Deploy plan and PFC/FEC port plan, checked against values computed by hand."""

from __future__ import annotations

from dataclasses import replace

import pytest
import yaml

from checkmate.config import cluster as config
from checkmate.control import pfc
from checkmate.control import plan as plan_mod
from checkmate.errors import CheckmateError


@pytest.fixture
def cfg() -> config.ClusterConfig:
    return config.load(config.default_path())


def with_switch(cfg, **kw):
    return replace(cfg, switch=replace(cfg.switch, **kw))


def test_ring_hops_every_partition(cfg):
    p = plan_mod.build(cfg)
    hops = {(r.src, r.dst, r.partition, r.shadow) for r in p.replication}
    assert hops == {(s, d, part, f"s{part}") for s, d in
                    [("t0", "t1"), ("t1", "t2"), ("t2", "t3"), ("t3", "t0")]
                    for part in (0, 1)}
    assert all(r.job_id == 7 and r.epoch == 0 and r.shadow_port == 47001
               for r in p.replication)
    assert {r.key for r in p.replication} == {
        (7, "10.77.0.1" + a, "10.77.0.1" + b, part, 0)
        for a, b in [("0", "1"), ("1", "2"), ("2", "3"), ("3", "0")] for part in (0, 1)}


def test_every_entry_names_its_source_hosts_port(cfg):
    """Copies are made only from the port of the host that owns src_ip: by hand, t0..t3 are
    ports 1..4 (1 + index in the config) and veths ckmp-t0..ckmp-t3."""
    p = plan_mod.build(cfg)
    assert {(r.src, r.src_ip, r.ingress_port, r.ingress_ifname) for r in p.replication} == {
        (f"t{i}", f"10.77.0.1{i}", 1 + i, f"ckmp-t{i}") for i in range(4)}
    pinned = tuple(replace(h, switch_port=20 + i) for i, h in enumerate(cfg.hosts))
    p = plan_mod.build(replace(cfg, hosts=pinned))
    assert {(r.src, r.ingress_port) for r in p.replication} == {
        (f"t{i}", 20 + i) for i in range(4)}
    assert "(only from port 20 / ckmp-t0)" in plan_mod.describe(p)


def test_registration_overrides_config_address(cfg):
    reg = plan_mod.Registration(0, "s0", "10.77.0.100", "02:00:0a:4d:00:64", 47055, 4, 99)
    p = plan_mod.build(cfg, {reg.host: reg})
    part0 = [r for r in p.replication if r.partition == 0]
    part1 = [r for r in p.replication if r.partition == 1]
    assert {(r.shadow_port, r.epoch, r.token) for r in part0} == {(47055, 4, 99)}
    assert {(r.shadow_port, r.epoch, r.token) for r in part1} == {(47001, 0, 0)}
    rw = {w.rid: w for w in p.rewrites}
    assert (rw[1].udp_port, rw[1].epoch, rw[1].token) == (47055, 4, 99)


def test_registration_must_name_a_shadow_of_a_known_partition(cfg):
    bad = plan_mod.Registration(0, "t1", "10.77.0.11", "02:00:0a:4d:00:0b", 47001, 1, 1)
    with pytest.raises(CheckmateError, match="a trainer"):
        plan_mod.build(cfg, {"t1": bad})
    other = plan_mod.Registration(5, "s0", "10.77.0.100", "02:00:0a:4d:00:64", 47001, 1, 1)
    with pytest.raises(CheckmateError, match="partition 5"):
        plan_mod.build(cfg, {"s0": other})


def test_single_trainer_has_no_ring_hop(cfg):
    one = replace(cfg, hosts=tuple(h for h in cfg.hosts if h.name in ("t0", "s0", "s1")))
    p = plan_mod.build(one)
    assert p.replication == ()
    assert [g.group_id for g in p.groups] == [plan_mod.FLOOD_GROUP]


def test_port_collision_with_cpu_port_is_refused(cfg):
    hosts = tuple(replace(h, switch_port=64) if h.name == "t2" else h for h in cfg.hosts)
    with pytest.raises(CheckmateError, match="port 64 of t2 is also the CPU port"):
        plan_mod.build(replace(cfg, hosts=hosts))


def test_pfc_default_100g_3m_jumbo(cfg):
    """100 Gb/s, 3 m, MTU 9000 (the default config), by hand:
    frame = 9000 + 42 = 9042 B; bit times: 2 frames 144672 + PFC frame 672 + 2 x interface
    122880 + response 201728 = 592832 BT = 74104 B; cable 3 m x 5 ns x 100 Gb/s = 1500 b =
    187.5 -> 188 B each way, 376 B both: headroom 74480 B = 931 cells of 80 B.
    xon = max(round trip 376, one frame 9042) = 9042; xoff = xon + 2 frames = 27126."""
    p = plan_mod.build(cfg)
    s = p.ports[0].pfc
    assert (s.priority, s.headroom_bytes, s.xoff_bytes, s.xon_bytes) == (3, 74480, 27126, 9042)
    assert (s.headroom_cells, s.xoff_cells, s.xon_cells) == (931, 340, 114)
    assert {pp.pfc for pp in p.ports} == {s}
    assert {pp.fec for pp in p.ports} == {"rs"}  # 100G: RS-FEC everywhere
    assert [pp.ifname for pp in p.ports] == ["ckmp-t0", "ckmp-t1", "ckmp-t2", "ckmp-t3",
                                             "ckmp-s0", "ckmp-s1"]


def test_pfc_25g_100m_standard_mtu(cfg):
    """25 Gb/s, 100 m, MTU 1500, by hand:
    frame = 1542 B; 2 frames 24672 + PFC 672 + 2 x 6144 + 40960 = 78592 BT = 9824 B; cable
    100 m x 5 ns x 25 Gb/s = 12500 b = 1562.5 -> 1563 B each way: headroom 9824 + 3126 =
    12950 B. xon = max(3126, 1542) = 3126; xoff = 3126 + 3084 = 6210."""
    c = with_switch(cfg, speed_gbps=25, cable_m=100.0)
    c = replace(c, network=replace(c.network, mtu=1500))
    p = plan_mod.build(c)
    s = p.ports[0].pfc
    assert (s.headroom_bytes, s.xon_bytes, s.xoff_bytes) == (12950, 3126, 6210)
    fec = {pp.host: pp.fec for pp in p.ports}
    assert fec == {"t0": "none", "t1": "none", "t2": "none", "t3": "none",
                   "s0": "rs", "s1": "rs"}
    # co-located shadows: every trainer port carries their copies, so RS-FEC on each
    c = with_switch(colocated(), speed_gbps=25, cable_m=100.0)
    assert {pp.host: pp.fec for pp in plan_mod.build(c).ports} == {
        "t0": "rs", "t1": "rs", "t2": "rs", "t3": "rs"}


def test_pfc_speed_rows():
    assert pfc.delays_for(100) == (122880, 201728)
    assert pfc.delays_for(50) == (122880, 201728)  # unlisted: next faster row
    assert pfc.delays_for(1) == (8192, 30720)
    with pytest.raises(CheckmateError, match="400 Gb/s"):
        pfc.delays_for(400)
    # Longer cable, more headroom, exactly 2 x the one-way bytes of the extra length.
    assert pfc.headroom_bytes(100, 103, 9000) - pfc.headroom_bytes(100, 3, 9000) == 2 * 6250


def test_host_commands_enable_pfc_on_ckm_priority(cfg):
    cmds = plan_mod.build(cfg).host_commands
    assert "t0: dcb pfc set dev ckm-t0 prio-pfc all:off 3:on" in cmds
    assert "s1: dcb app add dev ckm-s1 dscp-prio 24:3" in cmds
    assert "t2: mlnx_qos -i ckm-t2 --trust dscp --pfc 0,0,0,1,0,0,0,0" in cmds
    assert len(cmds) == 3 * len(cfg.hosts)


def test_describe_mentions_every_entry(cfg):
    text = plan_mod.describe(plan_mod.build(cfg))
    assert text.count(" => s") == 8
    assert "headroom 74480 B (931 cells)" in text
    assert "10.77.0.1:48023 -> CPU port 64" in text


# ------------------------------------------------------------ replicas (issue 38)

def with_replicas(cfg: config.ClusterConfig) -> config.ClusterConfig:
    """The default cluster with a second shadow per partition: s2 for 0, s3 for 1."""
    doc = yaml.safe_load(config.default_path().read_text())
    doc["hosts"] += [{"name": "s2", "role": "shadow", "partition": 0, "ip": "10.77.0.102"},
                     {"name": "s3", "role": "shadow", "partition": 1, "ip": "10.77.0.103"}]
    return config.parse(doc)


def test_a_partition_with_two_shadows_is_copied_to_both():
    """Per hop and partition: the destination's member plus one member per replica, each
    with its own rid and rewrite; one P4 table entry per (hop, partition) (the group makes
    the copies), one kernel entry per replica. Counted by hand: 4 hops x 2 partitions."""
    cfg = with_replicas(config.load(config.default_path()))
    assert (cfg.num_partitions, cfg.replicas) == (2, 2)
    assert [h.name for h in cfg.shadows] == ["s0", "s1"]  # replica 0 of each
    assert [h.name for h in cfg.shadow_hosts] == ["s0", "s2", "s1", "s3"]
    p = plan_mod.build(cfg)
    assert len(p.replication) == 4 * 2 * 2
    assert {(r.partition, r.replica, r.shadow) for r in p.replication} == {
        (0, 0, "s0"), (0, 1, "s2"), (1, 0, "s1"), (1, 1, "s3")}
    assert {w.rid: w.shadow for w in p.rewrites} == {1: "s0", 2: "s1", 3: "s2", 4: "s3"}
    port = {h.name: plan_mod.switch_port(cfg, h) for h in cfg.hosts}
    g = {grp.group_id: grp.replicas for grp in p.groups}
    assert g[plan_mod.group_id(1, 0)] == ((port["t1"], 0), (port["s0"], 1), (port["s2"], 3))
    assert g[plan_mod.group_id(0, 1)] == ((port["t0"], 0), (port["s1"], 2), (port["s3"], 4))
    from checkmate.control.drivers import p4tables

    specs = p4tables.entries(p)
    assert sum(e.table == "ckm_replicate" for e in specs) == 4 * 2
    assert sum(e.table == "shadow_rewrite" for e in specs) == 4
    # what `checkmate plan` models for a switch (checkmate/launch/scale.py) is what the
    # controller's plan holds: entries, groups and (port, rid) members
    assert len({r.group_id for r in p.replication}) == 4 * 2
    assert sum(len(m) - 1 for gid, m in g.items() if gid != plan_mod.FLOOD_GROUP) == 4 * 2 * 2


def test_each_replica_takes_its_own_registration():
    cfg = with_replicas(config.load(config.default_path()))
    reg = plan_mod.Registration(0, "s2", "10.77.0.102", "02:00:0a:4d:00:66", 47009, 5, 77)
    p = plan_mod.build(cfg, {"s2": reg})
    got = {(r.shadow, r.epoch, r.token, r.shadow_port) for r in p.replication
           if r.partition == 0}
    assert got == {("s0", 0, 0, 47001), ("s2", 5, 77, 47009)}
    wrong = plan_mod.Registration(1, "s2", "10.77.0.102", "02:00:0a:4d:00:66", 47009, 5, 77)
    with pytest.raises(CheckmateError, match="s2 is a shadow of partition 0"):
        plan_mod.build(cfg, {"s2": wrong})


@pytest.mark.parametrize("parts, why", [
    ([0, 0, 1], "same number of shadows"),
    ([0, 0, 0, 0, 1, 1, 1, 1], "1 to 3"),
    ([0, 0, 2, 2], "partitions must be 0..1"),
])
def test_replica_counts_the_config_refuses(parts, why):
    doc = yaml.safe_load(config.default_path().read_text())
    doc["hosts"] = [h for h in doc["hosts"] if h["role"] == "trainer"] + [
        {"name": f"s{i}", "role": "shadow", "partition": p, "ip": f"10.77.0.{100 + i}"}
        for i, p in enumerate(parts)]
    with pytest.raises(config.ConfigError, match=why):
        config.parse(doc)


# ------------------------------------------------ co-located shadows (switch mode)

def colocated(first: bool = False) -> config.ClusterConfig:
    """The default's trainers t0..t3 and two co-located replicas of each of two partitions
    (c0, c2 of partition 0; c1, c3 of 1), listed after the trainers or (``first``) before."""
    doc = yaml.safe_load(config.default_path().read_text())
    trainers = [h for h in doc["hosts"] if h["role"] == "trainer"]
    shadows = [{"name": f"c{i}", "role": "shadow", "partition": i % 2, "colocated": True}
               for i in range(4)]
    doc["hosts"] = shadows + trainers if first else trainers + shadows
    return config.parse(doc)


def placed(cfg: config.ClusterConfig, shadow: str, node: str, port: int, epoch: int = 5,
           token: int = 77) -> plan_mod.Registration:
    n, h = cfg.host(node), cfg.host(shadow)
    return plan_mod.Registration(h.partition, shadow, n.ip, n.mac, port, epoch, token, "",
                                 node)


def test_colocated_shadows_get_nothing_before_an_attempt_places_them():
    """No registration yet: no entry, rewrite or multicast member (nowhere to copy to); the
    trainers' ports are 1..4 wherever the co-located shadows stand in the config, and only
    they get ports, bindings, L2 entries and NIC commands."""
    for cfg in (colocated(), colocated(first=True)):
        p = plan_mod.build(cfg)
        assert p.replication == () and p.rewrites == ()
        assert [(g.group_id, g.replicas) for g in p.groups] == [
            (plan_mod.FLOOD_GROUP, ((1, 0), (2, 0), (3, 0), (4, 0), (64, 0)))]
        assert [(pp.host, pp.port) for pp in p.ports] == [(f"t{i}", 1 + i) for i in range(4)]
        assert {b.host for b in p.bindings} == {"t0", "t1", "t2", "t3", "sw0"}
        assert {e.host for e in p.l2} == {"t0", "t1", "t2", "t3", "sw0"}
        assert len(p.host_commands) == 3 * 4
        with pytest.raises(CheckmateError, match="c0 is a co-located shadow: it has no "
                                                 "switch port"):
            plan_mod.switch_port(cfg, cfg.host("c0"))


def test_placed_colocated_shadows_are_copied_out_of_their_nodes_ports():
    """Partition 0's replicas on t1 and t3, partition 1's on t0 and t2 (ports 1 + rank).
    Hop t0 -> t1 (destination rank 1), partition 0: t1's port forwards the datagram (rid 0)
    and carries replica 0's copy (rid 1) too, t3's replica 1's (rid 3); the copies are
    rewritten to the node's MAC and IP and the port the launcher gave."""
    from checkmate.control.drivers import p4tables
    from checkmate.control.drivers.kernel import entry_for

    cfg = colocated()
    regs = {r.host: r for r in (placed(cfg, "c0", "t1", 47001), placed(cfg, "c2", "t3", 47005),
                                placed(cfg, "c1", "t0", 47001), placed(cfg, "c3", "t2", 47005))}
    p = plan_mod.build(cfg, regs)
    g = {grp.group_id: grp.replicas for grp in p.groups}
    assert g[plan_mod.group_id(1, 0)] == ((2, 0), (2, 1), (4, 3))
    assert p4tables.groups(p)[plan_mod.group_id(1, 0)] == ((2, 0), (2, 1), (4, 3))
    assert g[plan_mod.group_id(1, 1)] == ((2, 0), (1, 2), (3, 4))
    assert g[plan_mod.group_id(3, 1)] == ((4, 0), (1, 2), (3, 4))  # t2 -> t3
    rw = {w.rid: (w.shadow, w.dmac, w.ip, w.udp_port, w.epoch) for w in p.rewrites}
    assert rw == {1: ("c0", "02:00:0a:4d:00:0b", "10.77.0.11", 47001, 5),
                  3: ("c2", "02:00:0a:4d:00:0d", "10.77.0.13", 47005, 5),
                  2: ("c1", "02:00:0a:4d:00:0a", "10.77.0.10", 47001, 5),
                  4: ("c3", "02:00:0a:4d:00:0c", "10.77.0.12", 47005, 5)}
    assert len(p.replication) == 4 * 2 * 2
    hop = {(r.partition, r.replica): r for r in p.replication if r.src == "t0"}
    assert (hop[0, 0].shadow, hop[0, 0].shadow_node, hop[0, 0].shadow_ip) == (
        "c0", "t1", "10.77.0.11")
    assert entry_for(cfg, hop[0, 0]).shadow_ifname == "ckmp-t1"  # the destination's port
    assert entry_for(cfg, hop[0, 1]).shadow_ifname == "ckmp-t3"
    assert "=> c0 on t1 10.77.0.11:47001 epoch 5" in plan_mod.describe(p)
    # only c2 (partition 0's replica 1) placed: partition 1 gets nothing; partition 0 its
    # one copy, with its own rid, a P4 entry per hop, and the kernel's replica slot 0 (its
    # program stops at the first missing slot)
    from checkmate.control.drivers.kernel import entries

    p = plan_mod.build(cfg, {"c2": regs["c2"]})
    assert {(r.partition, r.replica) for r in p.replication} == {(0, 1)}
    assert {w.rid for w in p.rewrites} == {3}
    g = {grp.group_id: grp.replicas for grp in p.groups}
    assert plan_mod.group_id(1, 1) not in g and g[plan_mod.group_id(1, 0)] == ((2, 0), (4, 3))
    assert sum(e.table == "ckm_replicate" for e in p4tables.entries(p)) == 4
    kern = entries(cfg, p)
    assert {k[3] for k in kern} == {0} and len(kern) == 4
    assert {e.shadow_ifname for e in kern.values()} == {"ckmp-t3"}


def test_a_colocated_registration_must_name_a_trainer_node():
    cfg = colocated()
    for node in ("", "c1"):
        bad = replace(placed(cfg, "c0", "t1", 47001), node=node)
        with pytest.raises(CheckmateError, match=f"must name the trainer node it runs on, "
                                                 f"not '{node}'"):
            plan_mod.build(cfg, {"c0": bad})
    hosted = config.load(config.default_path())
    own = plan_mod.Registration(0, "s0", "10.77.0.11", "02:00:0a:4d:00:0b", 47001, 1, 1, "",
                                "t1")
    with pytest.raises(CheckmateError, match="s0 is a shadow host of its own"):
        plan_mod.build(hosted, {"s0": own})
