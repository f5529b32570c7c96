"""The ckm NCCL plugin driven as NCCL's ring allreduce (Simple protocol) drives it, by the
harness (checkmate.testbed.nccl_harness, the NCCL stand-in): 4 rank processes, 4 channels,
buckets that are not chunk multiples, several iterations in a row.

On loopback (no switch), an AF_PACKET tap on lo sees every REPLICATE datagram, i.e. what
a switch would copy; the namespace test in test_nccl_switch.py runs it through the kernel
switch to real shadows."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
from fakes import BUCKETS, BUFFSIZE, ITERATIONS, python_ring_replicas

from checkmate.protocol import auth, datamac
from checkmate.testbed import nccl_harness as H

REPO = Path(__file__).resolve().parent.parent
def expected_flat(seed: int, it: int, world: int) -> np.ndarray:
    return np.concatenate([H.expected(seed, it, b, world, n) for b, n in enumerate(BUCKETS)])


@pytest.mark.skipif(os.geteuid() != 0, reason="the tap on lo is an AF_PACKET socket (root)")
@pytest.mark.parametrize("profiler", ["off", "direct", "callback"])
def test_nccl_ring_loopback_exact_and_each_reduced_element_tagged_once(nccl_plugin, tmp_path,
                                                                       ring_kit, profiler):
    """profiler off: the plugin places isends by the schedule model alone; direct/callback:
    by the profiler events the harness issues as NCCL does (phandle = the step's event, or
    NCCL's own object and the plugin asks through the profiler callback)."""
    world, partitions, seed = 4, 2, 11
    job = random.randrange(1 << 20, 1 << 31)
    net = f"127.{random.randrange(20, 99)}.{random.randrange(1, 250)}"
    tap = H.ReplicaTap("lo", job)
    try:
        outs = H.launch(world, tmp_path / "run", str(nccl_plugin),
                        [f"{net}.{10 + r}" for r in range(world)], channels=4,
                        buffsize=BUFFSIZE, buckets=BUCKETS, iterations=ITERATIONS, seed=seed,
                        partitions=partitions, job=job, profiler=profiler)
    finally:
        datagrams = tap.close()
    expect = {it: expected_flat(seed, it, world) for it in range(1, ITERATIONS + 1)}
    for r in range(world):  # the allreduce result is exact on every rank
        for i, it in enumerate(expect):
            assert np.array_equal(outs[r][i], expect[it]), (r, it)
    key = datamac.data_key(auth.load_secret())
    summary = H.check_replicas(datagrams, key, job, BUCKETS, 1, ITERATIONS, partitions, expect)
    assert summary["pieces"] > 3 * len(BUCKETS)
    # the check fails on a lost piece, and on a second, different copy of a piece
    with pytest.raises(AssertionError, match="missing"):
        H.check_replicas(datagrams[1:], key, job, BUCKETS, 1, ITERATIONS, partitions, expect)
    forged = bytearray(datagrams[0])
    forged[-1] ^= 1
    with pytest.raises(Exception, match="CRC|MAC|payload"):
        H.check_replicas([*datagrams, bytes(forged)], key, job, BUCKETS, 1, ITERATIONS,
                         partitions, expect)
    # the plugin's own counters agree: every reduced element once per iteration
    stats = H.stats(tmp_path / "run", world)
    sends = [s for per in stats for s in per if s["kind"] == "send"]
    assert len(sends) == world * 4
    assert sum(s["repl_elems"] for s in sends) == ITERATIONS * sum(BUCKETS)
    assert all(s["malformed"] == s["corrupt"] == 0 for per in stats for s in per)
    if profiler != "off":
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


def test_nccl_profiler_refuses_a_gradient_allreduce_it_cannot_tag(nccl_plugin, tmp_path):
    """A gradient bucket NCCL runs as Tree: every rank's first tagged isend fails with one
    line, nothing is sent untagged in its place."""
    with pytest.raises(H.PluginError) as e:
        H.launch(2, tmp_path / "run", str(nccl_plugin), ["127.0.0.1"] * 2, channels=1,
                 buffsize=BUFFSIZE, buckets=[5000], iterations=1, profiler="callback",
                 algo="Tree", timeout=60)
    lines = [x for x in str(e.value).splitlines() if x.startswith("ckm-nccl:")]
    assert len(lines) == 2 and all("ran as Tree/Simple" in x for x in lines), lines
