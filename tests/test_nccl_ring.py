"""The ckm NCCL plugin driven as each supported NCCL release drives a ring allreduce
(Simple protocol), by the harness (checkmate.testbed.nccl_harness) whose schedule is
checkmate.testbed.nccl_release -- NCCL's source, not the plugin's model: 4 rank processes, 4
channels, buckets that are not chunk multiples, several iterations in a row.

On loopback (no switch), an AF_PACKET tap on lo sees every REPLICATE datagram, i.e. what
a switch would copy; the namespace test in test_nccl_switch.py runs it through the kernel
switch to real shadows. The refused cases: a release or configuration whose schedule the
plugin cannot prove runs untagged with one line per rank, and a schedule that differs from
the plugin's is refused before any wrong label is sent."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
from fakes import BUCKETS, BUFFSIZE, ITERATIONS, python_ring_replicas

from checkmate.protocol import auth, datamac, wire
from checkmate.testbed import nccl_harness as H
from checkmate.testbed import nccl_replicas as R

REPO = Path(__file__).resolve().parent.parent
ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="the tap on lo is an AF_PACKET socket (root)")
pytestmark = pytest.mark.slow  # rank processes


def expected_flat(seed: int, it: int, world: int, buckets: list[int] = BUCKETS) -> np.ndarray:
    return np.concatenate([H.expected(seed, it, b, world, n) for b, n in enumerate(buckets)])


def _net() -> str:
    return f"127.{random.randrange(20, 99)}.{random.randrange(1, 250)}"


def _lines(workdir: Path, world: int) -> list[list[str]]:
    return [[x for x in (workdir / f"rank{r}.log").read_text().splitlines()
             if x.startswith("ckm-nccl:")] for r in range(world)]


@ROOT
@pytest.mark.parametrize("version,profiler", [
    ("2.28.9", "off"),       # profile 2.28, the newest release without profiler v6: model path
    ("2.30.7", "callback"),  # profile 2.29 (2.29.2-2.30.7), profiler v6: NCCL's phandle
])  # 2.29.7 on both paths: tests/test_nccl_switch.py
def test_nccl_ring_loopback_exact_and_each_reduced_element_tagged_once(nccl_plugin, tmp_path,
                                                                       ring_kit, version,
                                                                       profiler):
    world, partitions, seed = 4, 2, 11
    job = random.randrange(1 << 20, 1 << 31)
    net = _net()
    tap = R.ReplicaTap("lo", job)
    try:
        outs = H.launch(world, tmp_path / "run", str(nccl_plugin),
                        [f"{net}.{10 + r}" for r in range(world)], channels=4,
                        buffsize=BUFFSIZE, buckets=BUCKETS, iterations=ITERATIONS, seed=seed,
                        partitions=partitions, job=job, profiler=profiler, version=version)
    finally:
        datagrams = tap.close()
    expect = {it: expected_flat(seed, it, world) for it in range(1, ITERATIONS + 1)}
    for r in range(world):  # the allreduce result is exact on every rank
        for i, it in enumerate(expect):
            assert np.array_equal(outs[r][i], expect[it]), (r, it)
    assert _lines(tmp_path / "run", world) == [[]] * world
    key = datamac.data_key(auth.load_secret())
    summary = R.check_replicas(datagrams, key, job, BUCKETS, 1, ITERATIONS, partitions, expect)
    assert summary["pieces"] > 3 * len(BUCKETS)
    # the check fails on a lost piece, and on a second, different copy of a piece
    first = wire.decode(datagrams[0])[0]  # every copy of it: a resend is the same piece
    lost = [d for d in datagrams if (lambda h: (h.iteration, h.offset) != (
        first.iteration, first.offset))(wire.decode(d)[0])]
    with pytest.raises(AssertionError, match="missing"):
        R.check_replicas(lost, key, job, BUCKETS, 1, ITERATIONS, partitions, expect)
    forged = bytearray(datagrams[0])
    forged[-1] ^= 1
    with pytest.raises(Exception, match="CRC|MAC|payload"):
        R.check_replicas([*datagrams, bytes(forged)], key, job, BUCKETS, 1, ITERATIONS,
                         partitions, expect)
    # the plugin's own counters agree: every reduced element once per iteration
    stats = H.stats(tmp_path / "run", world)
    sends = [s for per in stats for s in per if s["kind"] == "send"]
    assert len(sends) == world * 4
    assert sum(s["repl_elems"] for s in sends) == ITERATIONS * sum(BUCKETS)
    assert all(s["malformed"] == s["corrupt"] == 0 for per in stats for s in per)
    if version != "2.28.9":
        return
    # and the shadows get exactly the bytes the Python ring gives them for these inputs
    py = python_ring_replicas(ring_kit, seed, world, partitions)
    for it in expect:
        assert np.array_equal(py[it], expect[it])


def test_nccl_ring_plain_mode_two_ranks_one_channel(nccl_plugin, tmp_path):
    """Without CKM_NCCL_BUCKETS the plugin is a plain reliable transport: nothing tagged."""
    outs = H.launch(2, tmp_path / "run", str(nccl_plugin), ["127.0.0.1"] * 2, channels=1,
                    buffsize=BUFFSIZE, buckets=[9_999, 1], iterations=2, seed=3, tag=False)
    for i, it in enumerate((1, 2)):
        exp = np.concatenate([H.expected(3, it, b, 2, n) for b, n in enumerate([9_999, 1])])
        assert np.array_equal(outs[0][i], exp) and np.array_equal(outs[1][i], exp)
    stats = H.stats(tmp_path / "run", 2)
    assert all(s["replicated"] == 0 for per in stats for s in per)


@pytest.mark.parametrize("case,why", [
    (dict(version="2.27.7"), "NCCL 2.27.7 is not a release whose ring schedule was checked"),
    (dict(version="2.31.0"), "NCCL 2.31.0 is not a release whose ring schedule was checked"),
    (dict(tuner=False), "the ckm tuner was not loaded"),
    (dict(profiler="callback", algo="Tree"), "ran as Tree/Simple"),
    (dict(profiler="callback", group=2), "grouped with other collectives into one kernel plan"),
    (dict(group=2), "not the next bucket of CKM_NCCL_BUCKETS"),
])
def test_nccl_ring_refuses_what_it_cannot_prove_and_nccl_runs_untagged(nccl_plugin, tmp_path,
                                                                       case, why):
    """An unchecked release, no tuner pinning the channels, a gradient bucket NCCL runs as
    Tree, collectives packed into one plan: one line per rank, exact results, nothing
    tagged (a missing label costs a re-seed, a wrong one the checkpoint)."""
    buckets = [20_000, 5_003]
    outs = H.launch(2, tmp_path / "run", str(nccl_plugin), ["127.0.0.1"] * 2, channels=2,
                    buffsize=BUFFSIZE, buckets=buckets, iterations=1, seed=5, **case)
    exp = expected_flat(5, 1, 2, buckets)
    assert all(np.array_equal(o[0], exp) for o in outs)
    for lines in _lines(tmp_path / "run", 2):
        assert len(lines) == 1 and why in lines[0] and "continues untagged" in lines[0], lines
    stats = H.stats(tmp_path / "run", 2)
    assert sum(s["repl_elems"] for per in stats for s in per if s["kind"] == "send") == 0


@ROOT
@pytest.mark.parametrize("profiler", ["off", "callback"])
def test_nccl_ring_schedule_mismatch_is_refused_never_mislabelled(nccl_plugin, tmp_path,
                                                                  profiler):
    """NCCL reports 2.29.7 but runs 2.28's schedule (cells of 16 KB instead of 32 KB: other
    channel splits): the plugin must stop tagging, and every label it sent before that must
    be right -- checked against the allreduce's values on the wire."""
    world, seed = 4, 13
    job = random.randrange(1 << 20, 1 << 31)
    net = _net()
    tap = R.ReplicaTap("lo", job)
    try:
        outs = H.launch(world, tmp_path / "run", str(nccl_plugin),
                        [f"{net}.{10 + r}" for r in range(world)], channels=4,
                        buffsize=BUFFSIZE, buckets=BUCKETS, iterations=1, seed=seed, job=job,
                        profiler=profiler, version="2.29.7", plays="2.28")
    finally:
        datagrams = tap.close()
    expect = {1: expected_flat(seed, 1, world)}
    assert all(np.array_equal(o[i], expect[it]) for o in outs for i, it in enumerate(expect))
    lines = _lines(tmp_path / "run", world)
    assert all(len(x) == 1 and "continues untagged" in x[0] for x in lines), lines
    tagged = 0
    for d in datagrams:
        h, payload = wire.decode(d)
        got = np.frombuffer(payload, "<f4")
        assert np.array_equal(got, expect[h.iteration][h.offset:h.offset + h.count]), h
        tagged += h.count
    assert tagged < sum(BUCKETS)  # refused: not everything was labelled


@ROOT
def test_nccl_ring_order_other_than_rank_order_is_refused_never_mislabelled(nccl_plugin,
                                                                             tmp_path):
    """NCCL's ring 0 -> 4 -> 1 -> 2 -> 3: rank 2's own neighbours (1 and 3) are the rank
    order's, but its ring index (distance from rank 0) is 3, so labelling by rank would be
    wrong. Every rank stops tagging (the neighbour checks, and for rank 2 the index the ring
    itself carries; the sizes cannot tell), and nothing wrong is labelled."""
    world, seed, buckets = 5, 17, [20_480]  # 5 full chunks: every isend size is the same
    job = random.randrange(1 << 20, 1 << 31)
    net = _net()
    tap = R.ReplicaTap("lo", job)
    try:
        outs = H.launch(world, tmp_path / "run", str(nccl_plugin),
                        [f"{net}.{10 + r}" for r in range(world)], channels=1,
                        buffsize=BUFFSIZE, buckets=buckets, iterations=1, seed=seed, job=job,
                        ring=[0, 4, 1, 2, 3])
    finally:
        datagrams = tap.close()
    exp = expected_flat(seed, 1, world, buckets)
    assert all(np.array_equal(o[0], exp) for o in outs)
    lines = _lines(tmp_path / "run", world)
    assert all(len(x) == 1 and "continues untagged" in x[0] for x in lines[1:]), lines
    assert "at index 3 (the distance from rank 0)" in lines[2][0], lines[2]
    for d in datagrams:  # rank 0 (index 0 whatever the order) may label; never wrongly
        h, payload = wire.decode(d)
        assert np.array_equal(np.frombuffer(payload, "<f4"), exp[h.offset:h.offset + h.count])
