"""The co-located shadows' placement rule (issue 38): every node count 2-16, 1-3 replicas,
with and without failure domains, the refusals, and a membership change."""

from __future__ import annotations

import itertools
import random

import pytest

from checkmate.errors import CheckmateError
from checkmate.launch.shadow_placement import place, replace, reslot, slots


def _valid(pl, nodes, partitions, replicas, domains=None):
    dom = {n: (domains or {}).get(n, n) for n in nodes}
    assert len(pl.nodes) == partitions
    for ns in pl.nodes:
        assert len(ns) == replicas and set(ns) <= set(nodes)
        assert len({dom[n] for n in ns}) == replicas  # other nodes, other domains
    counted = {n: sum(ns.count(n) for ns in pl.nodes) for n in nodes}
    assert counted == pl.load
    return counted


@pytest.mark.parametrize("n,r", list(itertools.product(range(2, 17), (1, 2, 3))))
def test_every_node_count_and_replica_count(n, r):
    nodes = [f"node{i}" for i in range(n)]
    for partitions in (1, n - 1, n, 2 * n + 1):
        if r > n:
            with pytest.raises(CheckmateError, match=f"{r} replicas per partition need {r} "
                               f"nodes, the job has {n}"):
                place(nodes, partitions, r)
            continue
        load = _valid(place(nodes, partitions, r), nodes, partitions, r)
        assert max(load.values()) - min(load.values()) <= 1  # as even as it can be
        assert place(nodes, partitions, r).nodes == place(nodes, partitions, r).nodes
    assert "resumes from disk" in place(nodes, 3, 1).warning  # one replica: said
    assert place(nodes, 3, 2).warning == ""


@pytest.mark.parametrize("racks,per,r", [(2, 3, 2), (3, 2, 3), (4, 4, 2), (3, 5, 3), (2, 8, 2)])
def test_replicas_go_to_different_domains_and_equal_racks_share_the_load(racks, per, r):
    nodes = [f"n{i}" for i in range(racks * per)]
    domains = {n: f"rack{i // per}" for i, n in enumerate(nodes)}
    for partitions in (1, racks * per, 3 * racks * per + 1):
        load = _valid(place(nodes, partitions, r, domains), nodes, partitions, r, domains)
        assert max(load.values()) - min(load.values()) <= 1
    pl = place(nodes, 2, r, domains)
    assert "(rack0)" in pl.describe() and pl.describe().startswith("partition 0: ")


def test_the_refusals_are_one_line_each():
    nodes = ["a", "b", "c", "d"]
    with pytest.raises(CheckmateError, match=r"^3 replicas per partition need 3 failure "
                       r"domains, the job has 2 \(r1, r2\)$"):
        place(nodes, 4, 3, {"a": "r1", "b": "r1", "c": "r2", "d": "r2"})
    for bad in ((["a", "a"], 1, 1, None), ([], 1, 1, None), (nodes, 0, 1, None),
                (nodes, 2, 0, None), (nodes, 2, 1, {"z": "r1"})):
        with pytest.raises(CheckmateError):
            place(*bad)


@pytest.mark.parametrize("seed", range(6))
def test_a_lost_node_moves_only_its_replicas_and_a_spare_takes_some(seed):
    rng = random.Random(seed)
    n, r, partitions = rng.randrange(3, 12), rng.choice((2, 3)), rng.randrange(2, 20)
    if r > n - 1:
        r = 2
    nodes = [f"node{i}" for i in range(n)]
    before = place(nodes, partitions, r)
    lost = rng.choice(nodes)
    left = [x for x in nodes if x != lost]
    after = replace(before, left, r)
    _valid(after, left, partitions, r)
    for old, new in zip(before.nodes, after.nodes, strict=True):
        for k, x in enumerate(old):  # every survivor keeps its replica number
            assert new[k] == x if x != lost else new[k] not in old
        assert len(set(new) - set(old)) == (lost in old)  # only the lost replica is new
    spare = replace(after, [*left, "spare"], r)
    _valid(spare, [*left, "spare"], partitions, r)
    assert spare.nodes == after.nodes  # nothing moves to a spare by itself


def test_a_shadow_that_stays_keeps_its_ports_and_a_moved_one_takes_free_ones():
    """After a node's loss the surviving shadows keep running where they are: their
    addresses and ports must not change (the trainers' new list still names them), and a
    replica placed on a node that runs others takes ports none of them uses."""
    ips = {"a": "10.0.0.1", "b": "10.0.0.2", "c": "10.0.0.3", "d": "10.0.0.4"}
    before = place(["a", "b", "c"], 3, 2)
    old = slots(before, ips)
    after = replace(before, ["a", "c", "d"], 2)
    new = reslot(old, after, ips)
    n = len(after.nodes)
    for i, (node, ip, _udp, _tcp) in enumerate(new):
        assert node == after.nodes[i % n][i // n] and ip == ips[node]
        if old[i][0] != "b":
            assert new[i] == old[i]
    for node in ips:  # no two shadows of a node share a port
        mine = [s for s in new if s[0] == node]
        assert len({s[2] for s in mine}) == len({s[3] for s in mine}) == len(mine)
    moved = [s for s, o in zip(new, old, strict=True) if o[0] == "b"]
    assert moved and all(s[0] != "b" for s in moved)
    again = replace(after, ["a", "c"], 2)  # d lost too: its replicas go to a and c
    third = reslot(new, again, ips)
    for node in ("a", "c"):
        mine = [s for s in third if s[0] == node]
        assert len({s[3] for s in mine}) == len(mine)
