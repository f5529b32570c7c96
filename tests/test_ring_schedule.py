"""The ring schedule with several ranks per node (issue 20, item 3).

The grid tests ask the schedule the ring itself asks (``tagged_hop``, ``replicator``,
``replica_owners``) and check the answers against what is worked out here from the node
of each rank alone: which hops leave a node, each segment's all-gather path. The loopback
tests run the real ring over real UDP sockets with two nodes of two ranks (a node's ranks
share its address) and read what it sends.
"""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import torch

from checkmate.errors import CheckmateError
from checkmate.protocol import wire
from checkmate.spec.partition import partition_bounds
from checkmate.train.ring import MAX_CHUNK, replica_owners
from checkmate.train.ring_schedule import (
    RingSchedule,
    check_hosts,
    node_from_env,
    node_of_from_keys,
    segment_bounds,
)


def _layouts() -> list[list[int]]:
    """1-8 ranks per node on 1-16 nodes, contiguous as torch elastic numbers them; the same
    nodes with ranks dealt round-robin (not contiguous); uneven nodes."""
    out = []
    for per in range(1, 9):
        for nodes in range(1, 17):
            out.append([r // per for r in range(per * nodes)])
            out.append([r % nodes for r in range(per * nodes)])
    rng = random.Random(20)
    for nodes in range(2, 17):
        for _ in range(3):
            sizes = [rng.randint(1, 8) for _ in range(nodes)]
            out.append([nd for nd, k in enumerate(sizes) for _ in range(k)])
    return out


def _check(node_of: list[int]) -> None:
    w, n_nodes = len(node_of), len(set(node_of))
    s = RingSchedule.build(w, node_of)
    order = s.order
    assert sorted(order) == list(range(w))
    along = [node_of[r] for r in order]
    changes = sum(along[p] != along[p + 1] for p in range(w - 1))
    assert changes == n_nodes - 1, "a node's ranks are not contiguous in the ring"
    if node_of == sorted(node_of):
        assert order == tuple(range(w)), "contiguous nodes must keep position = rank"
    for r in range(w):
        assert s.left(s.right(r)) == r and order[s.position(r)] == r
    net = [along[p] != along[(p + 1) % w] for p in range(w)]  # the hop out of position p
    assert sum(net) == (n_nodes if n_nodes > 1 else 0)
    assert s.network_hops() == [(order[p], order[(p + 1) % w]) for p in range(w) if net[p]]
    n = 3 * w + 1
    tagged_net = np.zeros(n, np.int32)  # times an element goes out tagged on a network hop
    tagged_any = np.zeros(n, np.int32)  # ... tagged on any hop
    copied = np.zeros(n, np.int32)  # times an element reaches a copy (tag or host fallback)
    owner_of = np.full(n, -1)
    for g in range(w):
        lo, hi = segment_bounds(n, w, g)
        completer = (g - 1) % w
        path = [(completer + k) % w for k in range(w - 1)]  # senders of the all-gather
        reached = {(p + 1) % w for p in path} | {completer}
        assert reached == set(range(w)), f"segment {g} does not reach every rank"
        tags = [p for p in range(w) if s.tagged_hop(p, g)]
        for p in tags:
            tagged_any[lo:hi] += 1
            tagged_net[lo:hi] += net[p]
        if n_nodes > 1:
            assert len(tags) == 1 and tags[0] in path, (node_of, g, tags)
            first = next(p for p in path if net[p])
            assert tags[0] == first, "not the first hop of the path that leaves a node"
            assert s.switched(g) and s.replicator(g) == tags[0]
        else:
            assert tags == [] and not s.switched(g) and s.replicator(g) == completer
        copied[lo:hi] += 1
        owner_of[lo:hi] = order[tags[0] if tags else completer]
    if n_nodes > 1:
        assert tagged_net.min() == 1 and tagged_net.max() == 1 and tagged_any.max() == 1
    else:
        assert tagged_any.max() == 0
    assert copied.min() == 1 and copied.max() == 1
    owned = np.full(n, -1)
    cover = np.zeros(n, np.int32)
    for a, b, rank in replica_owners([(0, n)], w, 0, n, node_of):
        owned[a:b] = rank
        cover[a:b] += 1
    assert cover.min() == 1 and cover.max() == 1
    assert np.array_equal(owned, owner_of), "replica owners differ from the senders"
    for lo, hi in partition_bounds(n, 3):  # what each partition's shadow is told
        part = replica_owners([(0, n)], w, lo, hi, node_of)
        assert sum(b - a for a, b, _ in part) == hi - lo
        assert all(lo <= a < b <= hi and (owner_of[a:b] == rank).all() for a, b, rank in part)


def test_every_element_tagged_once_on_a_network_hop_over_the_grid():
    layouts = _layouts()
    assert {(len(x), len(set(x))) for x in layouts} >= {(p * k, k) for p in range(1, 9)
                                                        for k in range(1, 17)}
    for node_of in layouts:
        _check(node_of)


def test_every_rank_its_own_node_is_the_old_ring():
    """node_of None: every segment tagged on its first all-gather hop by its completer."""
    for w in range(1, 10):
        s = RingSchedule.build(w)
        assert s.order == tuple(range(w))
        for g in range(w):
            assert s.tagger(g) == ((g - 1) % w if w > 1 else None)
    assert replica_owners([(0, 12)], 3, 0, 12) == [(0, 4, 2), (4, 8, 0), (8, 12, 1)]


def test_node_from_torch_elastic_env_and_bad_input():
    assert node_from_env({"GROUP_RANK": "3", "LOCAL_RANK": "1", "RANK": "25"}) == 3
    assert node_from_env({"LOCAL_RANK": "1", "RANK": "25"}) == 24
    assert node_from_env({"RANK": "2"}) is None
    with pytest.raises(CheckmateError, match="GROUP_RANK must be an integer"):
        node_from_env({"GROUP_RANK": "x"})
    assert node_of_from_keys([None, None]) is None
    assert node_of_from_keys([0, 0, 1]) == [0, 0, 1]
    with pytest.raises(CheckmateError, match=r"ranks \[1\] do not know their node"):
        node_of_from_keys([0, None])
    with pytest.raises(CheckmateError, match="node_of names 3 ranks for a world of 2"):
        RingSchedule.build(2, [0, 0, 1])
    check_hosts(RingSchedule.build(3, [0, 0, 1]), ["10.0.0.1", "10.0.0.1", "10.0.0.2"])
    with pytest.raises(CheckmateError, match="ranks 0 and 1 share the address 10.0.0.1"):
        check_hosts(RingSchedule.build(2, [0, 1]), ["10.0.0.1", "10.0.0.1"])


def _spy_tagged(rings, tagged: list) -> None:
    """Record every REPLICATE datagram a ring sends: (sender rank, destination, header)."""
    for r, ring in enumerate(rings):
        send = ring._transmit

        def transmit(parts, addr, r=r, send=send):
            h = wire.decode_header(b"".join(parts))
            if h.flags & wire.Flags.REPLICATE and not h.flags & wire.Flags.ACK:
                tagged.append((r, addr, h))
            return send(parts, addr)
        ring._transmit = transmit


def _ring_sum(xs: list[torch.Tensor], order: tuple[int, ...]) -> torch.Tensor:
    """The sum in the ring's order: segment g accumulates positions g, g+1, ... in turn."""
    w, n = len(order), xs[0].numel()
    out = torch.empty(n)
    for g in range(w):
        a, b = segment_bounds(n, w, g)
        acc = xs[order[g]][a:b].clone()
        for k in range(1, w):
            acc += xs[order[(g + k) % w]][a:b]
        out[a:b] = acc
    return out


@pytest.mark.parametrize("node_of", [[0, 0, 1, 1], [0, 1, 0, 1]])
def test_two_nodes_of_two_ranks_tag_each_element_once_on_a_node_crossing_hop(node_of,
                                                                             ring_kit):
    world, total, parts = 4, 40_003, 3
    base, n = 1_001, 37_000
    seen: list = []
    lock = threading.Lock()

    def on_reduced(rank, it, bucket, off, part, payload, switched):
        with lock:
            seen.append((rank, off, len(payload) // 4, switched))

    rings = ring_kit.make(world, total, partitions=parts, chunk=4000, on_reduced=on_reduced,
                          node_of=node_of)
    tagged: list = []
    _spy_tagged(rings, tagged)
    try:
        g = torch.Generator().manual_seed(3)
        xs = [torch.randn(n, generator=g) for _ in range(world)]
        futs = [r.submit(x.clone(), base, 1, 0) for r, x in zip(rings, xs, strict=True)]
        res = [f.wait() for f in futs]
        expect = _ring_sum(xs, rings[0].schedule.order)
        assert all(torch.equal(t, expect) for t in res)
        own_ip = {r: rings[r].sock.getsockname()[0] for r in range(world)}
        cover = np.zeros(total, np.int32)
        for r, addr, h in tagged:
            assert addr[0] != own_ip[r], f"rank {r} tagged a hop inside its node"
            assert h.count <= MAX_CHUNK
            cover[h.offset:h.offset + h.count] += 1
        assert cover[base:base + n].min() == 1 and cover.max() == 1 and cover[:base].sum() == 0
        copies = np.zeros(total, np.int32)
        owners = {}
        for r, off, cnt, switched in seen:
            assert switched
            copies[off:off + cnt] += 1
            owners[off] = r
        assert np.array_equal(copies, cover)
        # The ranks that sent the copies are the replica owners a shadow is told about.
        for lo, hi, rank in replica_owners([(base, base + n)], world, 0, total, node_of):
            assert all(owners[o] == rank for o in owners if lo <= o < hi)
    finally:
        ring_kit.close_all(rings)


def test_one_node_tags_nothing_and_the_completer_copies(ring_kit):
    """No hop crosses the switch: no REPLICATE datagram, and every element reaches
    ``on_reduced`` once with switched False, at the rank replica_owners names."""
    world, total, n = 3, 9_001, 9_001
    node_of = [5, 5, 5]
    seen: list = []
    lock = threading.Lock()

    def on_reduced(rank, it, bucket, off, part, payload, switched):
        with lock:
            seen.append((rank, off, len(payload) // 4, switched))

    rings = ring_kit.make(world, total, partitions=2, on_reduced=on_reduced, node_of=node_of)
    tagged: list = []
    _spy_tagged(rings, tagged)
    try:
        xs = [torch.full((n,), float(r + 1)) for r in range(world)]
        res = [f.wait() for f in [r.submit(x, 0, 1, 0) for r, x in zip(rings, xs, strict=True)]]
        assert all(torch.equal(t, torch.full((n,), 6.0)) for t in res)
        assert tagged == []
        copies = np.zeros(total, np.int32)
        owner = np.full(total, -1)
        for r, off, cnt, switched in seen:
            assert not switched and cnt <= MAX_CHUNK
            copies[off:off + cnt] += 1
            owner[off:off + cnt] = r
        assert copies.min() == 1 and copies.max() == 1
        for lo, hi, rank in replica_owners([(0, n)], world, 0, total, node_of):
            assert (owner[lo:hi] == rank).all()
    finally:
        ring_kit.close_all(rings)


# ------------------------------------------------------------------- job level (slow)
STEPS = 3


def _trainer(rank: int, groups: list[str], net: str, ips: list[str], port: int,
             out: str) -> None:
    """One rank of a switch-mode job with no switch (loopback): torch elastic's GROUP_RANK
    says which node the rank is on, and the session derives the schedule from it."""
    import json
    import os
    from pathlib import Path

    import torch.distributed as dist

    from checkmate.config import cluster as cfgmod
    from checkmate.train import CheckmateSession, JobLayout, ShadowTarget
    from checkmate.train.shadow_client import restore_state_dicts
    from testbed.models import build_cnn

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GROUP_RANK=groups[rank])
    world = len(groups)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    report: dict = {}
    try:
        w = build_cnn(5, STEPS, width=4)
        layout = JobLayout(
            job_id=7, rank=rank, world=world,
            trainers=[(f"{net}.{10 + r}", cfgmod.TRAINER_PORT) for r in range(world)],
            shadows=[ShadowTarget(p, ip, cfgmod.SHADOW_PORT) for p, ip in enumerate(ips)],
            shadow_tcp=[(ip, cfgmod.RESTORE_PORT) for ip in ips], mode="switch", seed=5,
            bucket_elems=2048)
        sess = CheckmateSession(w.model, w.optimizer, w.scheduler, layout, w.max_grad_norm)
        sess.start()
        report["node_of"] = sess.node_of
        for it in range(1, STEPS + 1):
            sess.begin(it)
            x, y = w.batch(rank, it)
            w.optimizer.zero_grad()
            w.loss(sess.model(x), y).backward()
            sess.step()
        report["copy_bytes"] = sess.sender.copy_bytes
        report["protected"] = sess.finish(timeout=60)["protected"]
        model_sd, _, it, _, _ = restore_state_dicts(layout.shadow_tcp, sess.spec)
        report["restored"] = it
        report["equal"] = all(torch.equal(t, model_sd[k])
                              for k, t in w.model.state_dict().items())
        sess.close()
    finally:
        Path(out, f"rank{rank}.json").write_text(json.dumps(report))
        dist.destroy_process_group()


@pytest.mark.slow
def test_switch_mode_on_one_node_the_trainers_send_every_copy(loopback_shadows, tmp_path):
    """One node (GROUP_RANK 0 on both ranks): no hop crosses the switch, so the trainers
    send every copy themselves, and the shadows end equal to the trainers with no switch."""
    import json

    import torch.multiprocessing as mp
    from fakes import free_port

    groups = ["0", "0"]
    net, ips = loopback_shadows
    mp.spawn(_trainer, args=(groups, net, ips, free_port(), str(tmp_path)),
             nprocs=len(groups), join=True)
    reps = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(len(groups))]
    for rep in reps:
        assert rep["node_of"] == [0, 0], rep
        assert rep["copy_bytes"] > 0, rep
        assert rep["protected"] and rep["restored"] == STEPS and rep["equal"], rep


@pytest.mark.parametrize("mode", ["switch", "host"])
def test_the_trainer_sends_a_copy_unless_the_switch_makes_it(mode):
    """The session's ``on_reduced``: in switch mode a piece the ring tagged through the
    switch is not sent again; one without a switch hop is; host mode sends every piece."""
    import socket

    from checkmate.train.layout import JobLayout
    from checkmate.train.replicate import ShadowSender, ShadowTarget
    from checkmate.train.session import CheckmateSession

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as shadow:
        shadow.bind(("127.0.0.1", 0))
        shadow.settimeout(2.0)
        target = ShadowTarget(0, "127.0.0.1", shadow.getsockname()[1])
        sess = object.__new__(CheckmateSession)  # only what on_reduced reads
        sess.layout = JobLayout(7, 0, 1, [("127.0.0.1", 1)], [target], [("127.0.0.1", 1)],
                                mode=mode)
        sess.sender, sess.replica_log, sess.parity = ShadowSender(7, [target]), None, None
        try:
            sess._on_reduced(1, 0, 0, 0, b"\0" * 8, True)
            sess._on_reduced(1, 0, 2, 0, b"\1" * 8, False)
            got = [wire.decode_header(shadow.recv(65536)).offset]
            if mode == "host":
                got.append(wire.decode_header(shadow.recv(65536)).offset)
            shadow.settimeout(0.2)
            with pytest.raises(TimeoutError):
                shadow.recv(65536)
        finally:
            sess.sender.close()
    assert sorted(got) == ([0, 2] if mode == "host" else [2])


# ------------------------------------------------- through the kernel switch (netns, slow)
NODES_CONFIG = """\
job: {id: 7, name: tn}
switch: {name: sw0, target: kernel}
network: {subnet: 10.77.0.0/24, mtu: 9000, prefix: PREFIX}
hosts:
  - {name: t0, role: trainer, rank: 0, ip: 10.77.0.10}
  - {name: t1, role: trainer, rank: 1, ip: 10.77.0.11}
  - {name: s0, role: shadow, partition: 0, ip: 10.77.0.100}
  - {name: s1, role: shadow, partition: 1, ip: 10.77.0.101}
"""

# One rank of a ring of two nodes of two ranks: a node's ranks share its address.
NODE_RANK_PROGRAM = """
import sys, torch
from checkmate.train.ring import RingAllreduce
from checkmate.train.ring_schedule import RingSchedule
from checkmate.train.transport import open_socket
rank, n, out, ips = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4:]
node_of = [0, 0, 1, 1]
addrs = [(ips[node_of[r]], 47000 + r % 2) for r in range(4)]
sched = RingSchedule.build(4, node_of)
ring = RingAllreduce(rank, 4, open_socket(*addrs[rank]), addrs[sched.right(rank)],
                     addrs[sched.left(rank)], 7, 4242, n, 2, rto=0.05, stall_timeout=60,
                     node_of=node_of)
res = [ring.allreduce(torch.full((n,), float(rank + it)), 0, it, 0).clone()
       for it in (1, 2)]
torch.save({"res": res}, out)
ring.close(timeout=3)
"""


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.skipif(__import__("os").geteuid() != 0, reason="needs root for namespaces and BPF")
def test_two_nodes_of_two_ranks_through_the_kernel_switch_copy_each_element_once(tmp_path):
    """The switch has replication entries for the two node-crossing hops only (t0 -> t1 and
    t1 -> t0, per partition), as the schedule needs: every element of every iteration
    reaches its partition's shadow exactly once (an element tagged on a hop inside a node
    would never be copied)."""
    import subprocess
    import sys
    import time

    from checkmate.config import cluster as cfgmod
    from checkmate.dataplane.switch import ReplicationEntry
    from checkmate.spec.partition import partition_bounds
    from checkmate.testbed.netsock import udp_socket_in
    from checkmate.testbed.topology import Testbed

    p = tmp_path / "tn.yaml"
    p.write_text(NODES_CONFIG.replace("PREFIX", f"tn{random.randrange(1000):03d}"))
    cfg = cfgmod.load(p)
    n, ips = 30_011, [cfg.host("t0").ip, cfg.host("t1").ip]
    with Testbed(cfg) as tb:
        for src, dst in (("t0", "t1"), ("t1", "t0")):
            for part in (0, 1):
                sh = cfg.shadow_for(part)
                tb.switch.add_replication(ReplicationEntry(
                    cfg.job_id, cfg.host(src).ip, cfg.host(dst).ip, part,
                    cfg.switch_ifname(sh.name), sh.mac, sh.ip, sh.port, 1, 2,
                    cfg.switch_ifname(src)))
        rx = {part: udp_socket_in(cfg.netns(cfg.shadow_for(part).name),
                                  ("0.0.0.0", cfg.shadow_for(part).port), 64 << 20)
              for part in (0, 1)}
        procs = [tb.popen_in("t0" if r < 2 else "t1",
                             [sys.executable, "-c", NODE_RANK_PROGRAM, str(r), str(n),
                              str(tmp_path / f"r{r}.pt"), *ips], stderr=subprocess.PIPE)
                 for r in range(4)]
        errs = []
        for pr in procs:
            try:
                errs.append(pr.communicate(timeout=120)[1].decode()[-2000:])
            finally:
                if pr.poll() is None:
                    pr.kill()
                    pr.wait()
        assert all(pr.returncode == 0 for pr in procs), errs
        bounds = partition_bounds(n, 2)
        copies = {it: np.zeros(n, np.int32) for it in (1, 2)}
        values = {it: np.zeros(n, np.float32) for it in (1, 2)}
        deadline = time.monotonic() + 3
        for part, s in rx.items():
            s.settimeout(0.5)
            while time.monotonic() < deadline:
                try:
                    d = s.recv(65536)
                except TimeoutError:
                    break
                h = wire.decode_header(d)
                assert h.partition == part and (h.epoch, h.token) == (1, 2)
                assert bounds[part][0] <= h.offset < h.offset + h.count <= bounds[part][1]
                copies[h.iteration][h.offset:h.offset + h.count] += 1
                values[h.iteration][h.offset:h.offset + h.count] = np.frombuffer(
                    d[wire.HEADER_LEN:], "<f4")
            s.close()
        counters = tb.switch.counters()
    for it in (1, 2):
        assert copies[it].min() == 1 and copies[it].max() == 1, it
        assert (values[it] == sum(float(r + it) for r in range(4))).all()
    for e in counters["entries"]:  # every entry a node-crossing hop, each one used
        assert e["packets"] > 0, e
