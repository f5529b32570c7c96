"""Switch mode under the launcher: each rendezvous's rank-to-host mapping programs the switch.

The controller's ``attempt`` request (control/service.py) carries every rank's ring IP in
rank order. The service programs the replication for exactly the hops that cross the
switch, under a new epoch for every partition, and withdraws what hosts that left had.
Here the service programs a bmv2-target switch that is the P4Runtime TEST DOUBLE of
tests/fakes.py (no bmv2 build on this machine), over a real gRPC channel, and
requests are real authenticated handshake datagrams. The shadow side of the new epoch
(a shadow adopting it from the controller and dropping the previous attempt's copies) is
tested with a real shadow process at the end.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from fakes import ip
from handshake_service import answer, make_service, reg_body, req, rewrite_of

from checkmate.config import cluster as config
from checkmate.control import plan as plan_mod
from checkmate.errors import CheckmateError
from checkmate.protocol import wire

T = {f"t{i}": f"10.77.0.{10 + i}" for i in range(4)}  # the default config's trainer hosts


def _hops(ring: list[str]) -> set[tuple[str, str]]:
    cfg = config.load(config.default_path())
    return {(a.name, b.name) for _, a, b in plan_mod.ring_hops(cfg, ring)}


def test_ring_hops_cross_hosts_only_and_need_consecutive_ranks():
    cfg = config.load(config.default_path())
    # no ring: the config's ranks, one per host, as before
    assert [(r, a.name, b.name) for r, a, b in plan_mod.ring_hops(cfg, None)] == [
        (1, "t0", "t1"), (2, "t1", "t2"), (3, "t2", "t3"), (0, "t3", "t0")]
    two_each = [T["t0"], T["t0"], T["t1"], T["t1"], T["t2"], T["t2"]]
    assert _hops(two_each) == {("t0", "t1"), ("t1", "t2"), ("t2", "t0")}
    assert [r for r, _, _ in plan_mod.ring_hops(cfg, two_each)] == [2, 4, 0]
    assert _hops([T["t1"], T["t3"]]) == {("t1", "t3"), ("t3", "t1")}
    assert _hops([T["t2"]] * 3) == set()  # one host: no hop crosses the switch
    with pytest.raises(CheckmateError, match="not consecutive"):
        plan_mod.ring_hops(cfg, [T["t0"], T["t1"], T["t0"], T["t1"]])
    with pytest.raises(CheckmateError, match="no trainer host"):
        plan_mod.ring_hops(cfg, [T["t0"], "10.77.0.100"])
    plan = plan_mod.build(cfg, None, [two_each])
    assert {(r.src, r.dst, r.partition) for r in plan.replication} == {
        (a, b, p) for a, b in _hops(two_each) for p in (0, 1)}


def _registered(svc) -> int:
    epoch = 0
    for p in (0, 1):
        _, body = answer(svc.handle(req(7, 10 + p, reg_body(p, f"s{p}"), p)))
        epoch = max(epoch, body["epoch"])
    return epoch


def _replicate(sw) -> set[tuple[int, int, int]]:
    return {(dict(m)["src_ip"], dict(m)["dst_ip"], dict(m)["partition"])
            for m, _, _ in sw.table("ckm_replicate")}


def _attempt(svc, seq: int, attempt: str, ranks: list[str],
             rings: list[list[str]] | None = None, shadows: object = None
             ) -> tuple[wire.Header, dict]:
    body = {"op": "attempt", "job": 7, "attempt": attempt}
    body.update({"ranks": ranks} if rings is None else {"rings": rings})
    if shadows is not None:
        body["shadows"] = shadows
    return answer(svc.handle(req(7, seq, body)))


def test_each_attempt_programs_its_hops_under_a_new_epoch(switch, tmp_path):
    state = tmp_path / "state.json"
    svc = make_service(switch, state)
    svc.deploy()
    before = _registered(svc)
    ring = [T["t0"], T["t0"], T["t1"], T["t1"], T["t2"], T["t2"]]
    h, body = _attempt(svc, 20, "job:a1", ring)
    assert h.flags & wire.Flags.ACK, body
    epochs = {v["epoch"] for v in body["partitions"].values()}
    assert len(epochs) == 1 and epochs.pop() > before
    e1 = body["partitions"]["0"]["epoch"]
    assert _replicate(switch) == {(ip(T[a]), ip(T[b]), p) for a, b in
                                  [("t0", "t1"), ("t1", "t2"), ("t2", "t0")] for p in (0, 1)}
    for p in (0, 1):  # the copies are stamped with the attempt's session
        rw = rewrite_of(switch, p + 1)
        assert (rw["epoch"], rw["token"]) == (e1, body["partitions"][str(p)]["token"])
    # a retry of the same attempt (its reply was lost): the same sessions, nothing written
    n = len(switch.updates)
    _, again = _attempt(svc, 21, "job:a1", ring)
    assert again["partitions"] == body["partitions"] and len(switch.updates) == n
    # node t1 is lost, a spare on t3 takes its ranks: t1's entries withdrawn, t3's added
    ring2 = [T["t0"], T["t0"], T["t3"], T["t3"], T["t2"], T["t2"]]
    _, b2 = _attempt(svc, 22, "job:a2", ring2)
    e2 = b2["partitions"]["0"]["epoch"]
    assert e2 > e1 and rewrite_of(switch, 1)["epoch"] == e2
    assert _replicate(switch) == {(ip(T[a]), ip(T[b]), p) for a, b in
                                  [("t0", "t3"), ("t3", "t2"), ("t2", "t0")] for p in (0, 1)}
    # shrink to two nodes: one hop each way
    _, b3 = _attempt(svc, 23, "job:a3", [T["t0"], T["t2"]])
    assert b3["partitions"]["1"]["epoch"] > e2
    assert _replicate(switch) == {(ip(T["t0"]), ip(T["t2"]), p) for p in (0, 1)} | {
        (ip(T["t2"]), ip(T["t0"]), p) for p in (0, 1)}
    # a restarted controller keeps the attempt's ring (and epochs only grow)
    svc2 = make_service(switch, state)
    assert svc2.store.rings == [[T["t0"], T["t2"]]]
    svc2.deploy()
    assert _replicate(switch) == {(ip(T["t0"]), ip(T["t2"]), p) for p in (0, 1)} | {
        (ip(T["t2"]), ip(T["t0"]), p) for p in (0, 1)}
    _, b4 = _attempt(svc2, 24, "job:a4", [T["t1"], T["t2"]])
    assert b4["partitions"]["0"]["epoch"] > b3["partitions"]["0"]["epoch"]


def test_a_mesh_attempt_programs_one_ring_per_group_under_its_own_job_id(switch, tmp_path):
    """Two data-parallel groups (job.groups 2, one shadow each): group g's ring is tagged
    under its wire job id and copied to its own shadow (config partition g, partition 0 of
    its group on the wire); both rings cross t0 <-> t1, told apart only by the job id."""
    svc = make_service(switch, tmp_path / "state.json", groups=2)
    svc.deploy()
    assert not _replicate(switch)  # which ranks form a group is the mesh's: none yet
    _registered(svc)
    ring = [T["t0"], T["t1"]]
    h, body = _attempt(svc, 50, "job:m1", [], rings=[ring, ring])
    assert h.flags & wire.Flags.ACK, body
    got = {(dict(m)["job_id"], dict(m)["src_ip"], dict(m)["dst_ip"], dict(m)["partition"],
            dict(a)["group"]) for m, _, a in switch.table("ckm_replicate")}
    jobs = [wire.group_job_id(7, g, 2) for g in (0, 1)]
    assert jobs == [7 | 1 << 24, 7 | 2 << 24]
    assert {(j, s, d, p) for j, s, d, p, _ in got} == {
        (jobs[g], ip(T[a]), ip(T[b]), 0) for g in (0, 1) for a, b in (("t0", "t1"),
                                                                        ("t1", "t0"))}
    # each entry's multicast group ends at its own group's shadow (rid = config partition+1)
    groups = switch.group_map()
    for g, j in enumerate(jobs):
        for gid in {gid for jj, _, _, _, gid in got if jj == j}:
            assert {rid for _, rid in groups[gid]} == {0, g + 1}, (g, groups[gid])
    assert rewrite_of(switch, 1)["ip"] == ip("10.77.0.100")
    assert rewrite_of(switch, 2)["ip"] == ip("10.77.0.101")
    for rings, why in (([ring], "names 1 data-parallel group(s), the controller's config 2"),
                       ([ring, [T["t0"], "10.77.0.100"]], "no trainer host")):
        h, body = _attempt(svc, 51, "job:m2", [], rings=rings)
        assert h.flags & wire.Flags.NACK and why in body["reason"], body
    assert svc.store.attempt == "job:m1"


def test_bad_attempts_are_refused_and_change_nothing(switch, tmp_path):
    svc = make_service(switch, tmp_path / "state.json")
    svc.deploy()
    h, body = _attempt(svc, 30, "job:a0", [T["t0"], T["t1"]])
    assert h.flags & wire.Flags.NACK and "no registered shadow" in body["reason"]
    _registered(svc)
    _, ok = _attempt(svc, 31, "job:a1", [T["t0"], T["t1"]])
    table = _replicate(switch)
    for seq, attempt, ranks, why in (
            (32, "job:b", [T["t0"], "10.77.0.100"], "no trainer host"),
            (33, "job:b", [T["t0"], T["t1"], T["t0"], T["t1"]], "not consecutive"),
            (34, "job:b", [], "bad rings"),
            (35, "", [T["t0"]], "bad attempt"),
            (36, "job:b", "10.77.0.10", "bad rings")):
        h, body = _attempt(svc, seq, attempt, ranks)
        assert h.flags & wire.Flags.NACK and why in body["reason"], body
    assert _replicate(switch) == table and svc.store.attempt == "job:a1"
    assert rewrite_of(switch, 1)["epoch"] == ok["partitions"]["0"]["epoch"]
    # unauthenticated: refused without a reason, nothing changes
    from checkmate.protocol import auth
    forged = req(7, 37, {"op": "attempt", "job": 7, "attempt": "x", "ranks": [T["t3"]]},
                 key=auth.handshake_key(b"another secret" * 3))
    h, _ = answer(svc.handle(forged))
    assert h.flags & wire.Flags.NACK and _replicate(switch) == table


def test_shadow_adopts_the_attempts_epoch_from_the_controller(switch, tmp_path):
    """A real shadow node (in this process, on loopback) registered with the service: the
    TCP ``session`` op makes it ask the controller, and it takes the attempt's session;
    the copies the switch stamped for the previous attempt no longer match it."""
    import random
    import threading

    from checkmate.shadow.node import NodeOptions, ShadowNode
    from checkmate.train.shadow_client import ShadowClient

    svc = make_service(switch, tmp_path / "state.json")
    svc.deploy()
    svc.bind()
    addr = svc.sock.getsockname()
    t = threading.Thread(target=svc.serve_forever, daemon=True)
    t.start()
    cfg = svc.cfg
    ip_ = f"127.86.{random.randrange(1, 255)}.100"
    nodes = []
    try:
        for p in (0, 1):
            h = cfg.shadow_for(p)
            nodes.append(ShadowNode(NodeOptions(
                partition=p, partitions=2, job=7, bind=ip_[:-3] + str(100 + p),
                restore_bind=ip_[:-3] + str(100 + p), controller=addr, host=h.name,
                ip=h.ip, mac=h.mac, register_deadline=10.0)).start())
        first = nodes[0].receiver.epoch
        assert first > 0
        _, body = _attempt(svc, 40, "job:a1", [T["t0"], T["t1"]])
        new = body["partitions"]["0"]
        assert new["epoch"] > first and nodes[0].receiver.epoch == first  # not yet told
        with ShadowClient((ip_, config.RESTORE_PORT), 5) as c:
            reply, _ = c.request({"op": "session"})
        assert reply["epoch"] == new["epoch"]
        assert (nodes[0].receiver.epoch, nodes[0].receiver.token) == (new["epoch"],
                                                                      new["token"])
        # asked again (a retry): nothing changes; an older epoch is never taken back
        with ShadowClient((ip_, config.RESTORE_PORT), 5) as c:
            assert c.request({"op": "session"})[0]["epoch"] == new["epoch"]
        assert nodes[1].receiver.epoch < new["epoch"]  # partition 1 was not asked yet
    finally:
        for n in nodes:
            n.stop()
        svc.close()
        t.join(5)


def test_shadow_without_a_controller_refuses_the_session_op(serve_shadows):
    import random

    from checkmate.train.shadow_client import ShadowClient

    net = f"127.87.{random.randrange(1, 255)}"
    with serve_shadows([f"{net}.100"], config=False):
        with ShadowClient((f"{net}.100", config.RESTORE_PORT), 5) as c, \
                pytest.raises(CheckmateError, match="no controller session"):
            c.request({"op": "session"})


def test_two_shadows_of_a_partition_register_apart_and_share_each_attempt(switch, tmp_path):
    """Replicas (issue 38) in switch mode: each shadow of a partition registers for itself
    (its own epoch and token, its own rewrite), the session answer lists every replica, a
    shadow cannot register for its sibling's partition, and an attempt moves every replica
    to its one new epoch. The double is fed by the real P4Runtime driver."""
    import yaml

    doc = yaml.safe_load(config.default_path().read_text())
    doc["hosts"] += [{"name": "s2", "role": "shadow", "partition": 0, "ip": "10.77.0.102"},
                     {"name": "s3", "role": "shadow", "partition": 1, "ip": "10.77.0.103"}]
    svc = make_service(switch, tmp_path / "state.json", cfg=config.parse(doc))
    svc.deploy()
    got = {}
    for seq, (p, host, last) in enumerate([(0, "s0", 100), (1, "s1", 101), (0, "s2", 102),
                                           (1, "s3", 103)]):
        body = {**reg_body(p, host), "ip": f"10.77.0.{last}",
                "mac": f"02:00:0a:4d:00:{last:02x}"}
        h, got[host] = answer(svc.handle(req(7, 20 + seq, body, p)))
        assert h.flags & wire.Flags.ACK and got[host]["partition"] == p, got[host]
    # rids: partition + 1 for the first shadows, then num_partitions more per replica
    for rid, host in [(1, "s0"), (2, "s1"), (3, "s2"), (4, "s3")]:
        assert (rewrite_of(switch, rid)["epoch"], rewrite_of(switch, rid)["token"]) == (
            got[host]["epoch"], got[host]["token"])
    groups = switch.group_map()
    assert all(len(members) == 3 for gid, members in groups.items()
               if gid != plan_mod.FLOOD_GROUP)
    _, sess = answer(svc.handle(req(7, 30, {"op": "session", "job": 7})))
    assert sess["partitions"]["0"]["host"] == "s0"  # replica 0 first
    assert [(r["host"], r["replica"]) for r in sess["replicas"]["1"]] == [("s1", 0), ("s3", 1)]
    # s2 is partition 0's: its register for partition 1 is refused, nothing changes
    bad = {**reg_body(1, "s2"), "ip": "10.77.0.102", "mac": "02:00:0a:4d:00:66"}
    h, why = answer(svc.handle(req(7, 31, bad, 1)))
    assert h.flags & wire.Flags.NACK and "belongs to s1, s3" in why["reason"]
    _, body = _attempt(svc, 32, "a1", list(T.values()))
    epochs = {r["epoch"] for reps in body["replicas"].values() for r in reps}
    assert len(epochs) == 1 and epochs.pop() > max(g["epoch"] for g in got.values())
    assert len(body["replicas"]["0"]) == 2
    for rid in (1, 2, 3, 4):
        assert rewrite_of(switch, rid)["epoch"] == body["partitions"]["0"]["epoch"]


# ------------------------------------------------ co-located shadows (switch mode)

def _colocated() -> config.ClusterConfig:
    """The default's trainers t0..t3 (switch ports 1..4) and two co-located replicas of
    each of two partitions: c0, c2 of partition 0, c1, c3 of partition 1."""
    import yaml

    doc = yaml.safe_load(config.default_path().read_text())
    doc["hosts"] = [h for h in doc["hosts"] if h["role"] == "trainer"] + [
        {"name": f"c{i}", "role": "shadow", "partition": i % 2, "colocated": True}
        for i in range(4)]
    return config.parse(doc)


#: Where a launcher placed them: partition 0 on t1 and t3, partition 1 on t0 and t2.
PLACED = [[f"{T['t1']}:47001", f"{T['t3']}:47005"], [f"{T['t0']}:47001", f"{T['t2']}:47005"]]


def _counting(svc) -> list:
    """Every plan the service hands its driver, recorded (the driver still applies it)."""
    applied: list = []
    real = svc.driver.apply
    svc.driver.apply = lambda plan: (applied.append(plan), real(plan))[1]
    return applied


def test_an_attempt_places_colocated_shadows_under_one_new_epoch(switch, tmp_path):
    """The attempt's ``shadows`` give every replica's node address and UDP port: each gets
    a session there under the attempt's one epoch, the switch copies to it out of its
    node's port (t1's port carries the hop t0 -> t1's datagram and partition 0's first
    replica's copy), a repeat is answered the same without a write, ``session`` lists the
    placed ones, and the next attempt moves them under a newer epoch."""
    state = tmp_path / "state.json"
    svc = make_service(switch, state, cfg=_colocated())
    svc.deploy()
    assert not _replicate(switch)  # nothing placed yet: nothing to copy to
    _, sess = answer(svc.handle(req(7, 59, {"op": "session", "job": 7})))
    assert (sess["expected"], sess["partitions"], sess["replicas"]) == (2, {}, {})
    ring = list(T.values())
    h, body = _attempt(svc, 60, "job:c1", ring, shadows=PLACED)
    assert h.flags & wire.Flags.ACK, body
    got = {p: [(r["replica"], r["host"], r["node"], r["ip"], r["port"]) for r in reps]
           for p, reps in body["replicas"].items()}
    assert got == {"0": [(0, "c0", "t1", T["t1"], 47001), (1, "c2", "t3", T["t3"], 47005)],
                   "1": [(0, "c1", "t0", T["t0"], 47001), (1, "c3", "t2", T["t2"], 47005)]}
    epochs = {r["epoch"] for reps in body["replicas"].values() for r in reps}
    assert len(epochs) == 1 and epochs.pop() > 0
    e1 = body["partitions"]["0"]["epoch"]
    first = body["replicas"]["0"][0]
    assert body["partitions"]["0"] == {k: first[k] for k in ("epoch", "token", "ip", "port")}
    assert all(0 < r["token"] < 2**32 for reps in body["replicas"].values() for r in reps)
    assert _replicate(switch) == {(ip(T[a]), ip(T[b]), p) for a, b in
                                  [("t0", "t1"), ("t1", "t2"), ("t2", "t3"), ("t3", "t0")]
                                  for p in (0, 1)}
    groups = switch.group_map()
    assert groups[plan_mod.group_id(1, 0)] == {(2, 0), (2, 1), (4, 3)}
    for rid, (node, port, r) in {1: ("t1", 47001, first),
                                 3: ("t3", 47005, body["replicas"]["0"][1])}.items():
        rw = rewrite_of(switch, rid)
        assert (rw["ip"], rw["udp_port"], rw["dmac"]) == (
            ip(T[node]), port, int(svc.cfg.host(node).mac.replace(":", ""), 16))
        assert (rw["epoch"], rw["token"]) == (e1, r["token"])
    # a retry of the same attempt (its reply was lost): the same sessions, nothing written
    n = len(switch.updates)
    _, again = _attempt(svc, 61, "job:c1", ring, shadows=PLACED)
    assert again == body and len(switch.updates) == n
    _, sess = answer(svc.handle(req(7, 62, {"op": "session", "job": 7})))
    assert sess["replicas"] == body["replicas"] and sess["expected"] == 2
    assert sess["partitions"]["1"] == {**body["partitions"]["1"], "host": "c1"}
    # node t3 is lost: the launcher places partition 0's replica 1 on t2 anew
    moved = [[PLACED[0][0], f"{T['t2']}:47009"], PLACED[1]]
    _, b2 = _attempt(svc, 63, "job:c2", ring[:3], shadows=moved)
    assert b2["partitions"]["0"]["epoch"] > e1
    assert (b2["replicas"]["0"][1]["node"], rewrite_of(switch, 3)["ip"],
            rewrite_of(switch, 3)["udp_port"]) == ("t2", ip(T["t2"]), 47009)
    # a restarted controller programs the same, node included
    svc2 = make_service(switch, state, cfg=_colocated())
    assert svc2.store.for_config(svc2.cfg)["c2"].node == "t2"
    assert svc2.store.placement == moved
    n = len(switch.updates)
    svc2.deploy()
    assert len(switch.updates) == n


@pytest.mark.parametrize("shadows, why", [
    (None, 'this config\'s shadows are co-located: the attempt must say where the launcher '
           'placed each ("shadows")'),
    ([[f"{T['t1']}:47001", f"{T['t3']}:47005"]],
     "the attempt places the shadows of 1 partition(s), the controller's config has 2"),
    ([[f"{T['t1']}:47001"], PLACED[1]],
     "the attempt places 1 replica(s) of partition 0, the controller's config has 2"),
    ([[f"{T['t1']}:47001", "10.77.0.100:47005"], PLACED[1]],
     "partition 0 replica 1 is placed at 10.77.0.100, which is no trainer host of the "
     "config"),
    ([[f"{T['t1']}:47001", f"{T['t3']}:0"], PLACED[1]],
     "partition 0 replica 1: bad port '0' (1..65535)"),
    ([[f"{T['t1']}:47001", f"{T['t3']}:65536"], PLACED[1]],
     "partition 0 replica 1: bad port '65536' (1..65535)"),
    ([[f"{T['t1']}:47001", "t3:47005"], PLACED[1]],
     "partition 0 replica 1: bad address 't3:47005' (\"IP:PORT\")"),
    ([[f"{T['t1']}:47001", f"{T['t1']}:47005"], PLACED[1]],
     "partition 0's replicas 0 and 1 are both on t1 (a node's loss would take both)"),
    ([PLACED[0], [f"{T['t1']}:47001", f"{T['t2']}:47005"]],
     "partition 0 replica 0 and partition 1 replica 0 are both placed at 10.77.0.11:47001"),
    ([[f"{T['t1']}:47001", 47005], PLACED[1]],
     'bad shadows: per partition a list of "IP:PORT" strings, one per replica in replica '
     'order'),
])
def test_bad_placements_are_one_line_and_write_nothing(switch, tmp_path, shadows, why):
    state = tmp_path / "state.json"
    svc = make_service(switch, state, cfg=_colocated())
    svc.deploy()
    _, ok = _attempt(svc, 70, "job:c1", list(T.values()), shadows=PLACED)
    before, n = state.read_bytes(), len(switch.updates)
    applied = _counting(svc)
    h, body = _attempt(svc, 71, "job:c2", list(T.values()), shadows=shadows)
    assert h.flags & wire.Flags.NACK and body["reason"] == why, body
    assert applied == [] and len(switch.updates) == n and state.read_bytes() == before
    assert svc.store.attempt == "job:c1"
    assert rewrite_of(switch, 1)["epoch"] == ok["partitions"]["0"]["epoch"]


def test_colocated_shadows_do_not_register_and_hosted_ones_take_no_placement(switch,
                                                                               tmp_path):
    state = tmp_path / "state.json"
    svc = make_service(switch, state, cfg=_colocated())
    svc.deploy()
    applied = _counting(svc)
    h, body = answer(svc.handle(req(7, 80, {**reg_body(0, "c0"), "ip": T["t1"]}, 0)))
    assert h.flags & wire.Flags.NACK and body["reason"] == (
        "partition 0's shadows are co-located: the launcher's attempt places them; they do "
        "not register")
    assert applied == [] and not state.exists()
    # a config of shadow hosts: an attempt that places shadows is refused, nothing written
    hosted = make_service(switch, tmp_path / "hosted.json")
    hosted.deploy()
    _registered(hosted)
    before, n = (tmp_path / "hosted.json").read_bytes(), len(switch.updates)
    applied = _counting(hosted)
    h, body = _attempt(hosted, 81, "job:h1", [T["t0"], T["t1"]], shadows=[[], []])
    assert h.flags & wire.Flags.NACK and body["reason"] == (
        "bad shadows: this config's shadows are hosts of their own (they register); an "
        "attempt places only co-located ones")
    assert applied == [] and len(switch.updates) == n
    assert (tmp_path / "hosted.json").read_bytes() == before


def test_a_state_file_of_an_older_controller_still_loads(tmp_path):
    """Written before registrations had a ``node`` and the store a ``placement``: it loads,
    as shadow hosts' sessions, and the next save carries both keys."""
    import json

    from checkmate.control.sessions import SessionStore

    path = tmp_path / "state.json"
    regs = [{"partition": 0, "host": h, "ip": a, "mac": "02:00:0a:4d:00:64", "port": 47001,
             "epoch": 9, "token": 5, "instance": "x"}
            for h, a in (("s0", "10.77.0.100"), ("c0", T["t1"]))]
    path.write_text(json.dumps({"max_epoch": 9, "attempt": "a1", "rings": [[T["t0"]]],
                                "registrations": regs}))
    store = SessionStore(path)
    cfg = config.load(config.default_path())
    assert store.for_config(cfg)["s0"].node == "" and store.placement is None
    assert store.max_epoch == 9 and store.rings == [[T["t0"]]]
    store.save()
    saved = json.loads(path.read_text())
    assert saved["placement"] is None and saved["registrations"][0]["node"] == ""
    # a co-located shadow's session fits its config only with the node it was placed on
    colo = _colocated()
    assert store.for_config(colo) == {}
    store.registrations["c0"] = replace(store.registrations["c0"], node="t1")
    assert list(store.for_config(colo)) == ["c0"] and "c0" not in store.for_config(cfg)


def test_rank0_places_the_colocated_replicas_and_each_takes_its_session(switch, tmp_path,
                                                                        monkeypatch):
    """The trainers' side (checkmate.train.attempt.program) with real placed shadow nodes
    (``shadow serve --placed``: no registration; in this process, on loopback, each known
    to the controller by the node address and UDP port its launcher placed it at): the
    attempt carries the placement, every replica adopts the attempt's one epoch; a
    replica started again where it was placed takes the held session by itself; a replica
    down during an attempt is one warning while its sibling took the session, and a
    partition with no replica answering fails the attempt in one line."""
    import random
    import threading
    from types import SimpleNamespace

    from checkmate.shadow.node import NodeOptions, ShadowNode
    from checkmate.train import attempt
    from checkmate.train.replicate import ShadowTarget

    monkeypatch.setattr(attempt, "ATTEMPT_TIMEOUT", 2.0)  # a shadow that is down: 2 s
    svc = make_service(switch, tmp_path / "state.json", cfg=_colocated())
    svc.deploy()
    svc.bind()
    addr = svc.sock.getsockname()
    t = threading.Thread(target=svc.serve_forever, daemon=True)
    t.start()
    net = f"127.88.{random.randrange(1, 255)}"
    # replica k of partition p: PLACED[p][k] (node address, UDP port); TCP on loopback
    where = {(p, k): (f"{net}.{100 + 2 * k + p}", *PLACED[p][k].split(":"))
             for p in (0, 1) for k in (0, 1)}

    def start(p: int, k: int) -> ShadowNode:
        lo, node_ip, port = where[p, k]
        return ShadowNode(NodeOptions(partition=p, partitions=2, job=7, bind=lo,
                                      port=int(port), restore_bind=lo, controller=addr,
                                      ip=node_ip, placed=True)).start()

    nodes = {}
    try:
        nodes = {pk: start(*pk) for pk in where}
        assert all(n.receiver.epoch == 0 for n in nodes.values())  # nothing placed yet
        lay = SimpleNamespace(
            controller=addr, job_id=7, placed=True,
            shadows=[ShadowTarget(p, where[p, 0][1], int(where[p, 0][2])) for p in (0, 1)],
            replica_shadows=[[ShadowTarget(p, where[p, 1][1], int(where[p, 1][2]))
                              for p in (0, 1)]],
            shadow_tcp=[(where[p, 0][0], config.RESTORE_PORT) for p in (0, 1)],
            replica_tcp=[[(where[p, 1][0], config.RESTORE_PORT) for p in (0, 1)]])
        place = attempt.ControlPlace.of_layout(lay)
        assert place.placed == tuple(tuple((a.split(":")[0], int(a.split(":")[1]))
                                           for a in reps) for reps in PLACED)
        got = attempt.program(lay, place, [list(T.values())])
        sessions = svc.store.for_config(svc.cfg)
        for (p, k), n in nodes.items():
            reg = sessions[svc.cfg.shadows_for(p)[k].name]
            assert (reg.ip, reg.port) == (where[p, k][1], int(where[p, k][2]))
            assert (n.receiver.epoch, n.receiver.token) == (got["epoch"], reg.token)
        # replica 1 of partition 1 exits; its launcher starts it again at its place: it
        # takes the session the controller holds for that address, unasked
        nodes[1, 1].stop()
        nodes[1, 1] = start(1, 1)
        assert nodes[1, 1].receiver.epoch == got["epoch"]
        # down during the next attempt: its sibling took the session, the attempt goes on
        nodes.pop((1, 1)).stop()
        again = attempt.program(lay, place, [list(T.values())])
        assert again["epoch"] > got["epoch"]
        assert all(n.receiver.epoch == again["epoch"] for n in nodes.values())
        nodes.pop((1, 0)).stop()  # no replica of partition 1 answers: one line
        with pytest.raises(CheckmateError, match=r"no shadow of partition\(s\) \[1\] "
                           r"answered after the attempt: "):
            attempt.program(lay, place, [list(T.values())])
    finally:
        for n in nodes.values():
            n.stop()
        svc.close()
        t.join(5)
