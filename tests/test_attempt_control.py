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
             rings: list[list[str]] | None = None) -> tuple[wire.Header, dict]:
    body = {"op": "attempt", "job": 7, "attempt": attempt}
    body.update({"ranks": ranks} if rings is None else {"rings": rings})
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
