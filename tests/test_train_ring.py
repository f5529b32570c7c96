"""Ring allreduce over real UDP sockets on loopback (127.R.x.y, R random per run).

Loss and corruption come from ``LossyLink``, a test double of a lossy network applied to
outgoing datagrams (loopback has no switch); the namespace test in test_e2e_switch.py uses
the real switch's fault knobs instead.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from checkmate.protocol import wire
from checkmate.spec.partition import partition_bounds
from checkmate.train.ring import MAX_CHUNK


def run_allreduce(rings, tensors, base=0, iteration=1, bucket=0):
    futs = [r.submit(t, base, iteration, bucket) for r, t in zip(rings, tensors, strict=True)]
    return [f.wait() for f in futs]


def ring_order_sum(xs: list[torch.Tensor], world: int) -> torch.Tensor:
    """The sum in the ring's order: segment g accumulates ranks g, g+1, ... in turn."""
    n = xs[0].numel()
    out = torch.empty(n)
    for g in range(world):
        s, e = g * n // world, (g + 1) * n // world
        acc = xs[g][s:e].clone()
        for k in range(1, world):
            acc += xs[(g + k) % world][s:e]
        out[s:e] = acc
    return out


@pytest.mark.parametrize("world,chunk", [(2, 512), (3, 512), (4, 512), (3, 16_000)])
def test_exact_sum_identical_on_every_rank(world, chunk, ring_kit):
    n = 100_007
    rings = ring_kit.make(world, n, chunk=chunk)
    try:
        g = torch.Generator().manual_seed(world)
        xs = [torch.randn(n, generator=g) for _ in range(world)]
        res = run_allreduce(rings, [x.clone() for x in xs])
        expect = ring_order_sum(xs, world)
        for t in res:
            assert torch.equal(t, expect)
        assert all(r.stats["resent"] == 0 for r in rings)
    finally:
        ring_kit.close_all(rings)


@pytest.mark.parametrize("chunk", [512, 6_000])
def test_exact_sum_under_loss_and_corruption(chunk, ring_kit):
    world, n = 4, 40_011
    rings = ring_kit.make(world, n, link=0.05, corrupt=0.05, chunk=chunk)
    try:
        g = torch.Generator().manual_seed(5)
        for it in range(1, 4):
            xs = [torch.randn(n, generator=g) for _ in range(world)]
            res = run_allreduce(rings, [x.clone() for x in xs], iteration=it)
            expect = ring_order_sum(xs, world)
            for t in res:
                assert torch.equal(t, expect)
        assert sum(r.stats["resent"] for r in rings) > 0
        assert sum(r.stats["corrupt"] for r in rings) > 0
        assert sum(r.link.dropped for r in rings) > 0
    finally:
        ring_kit.close_all(rings)


@pytest.mark.parametrize("chunk", [512, 16_000])
def test_each_element_reduced_exactly_once_split_at_partitions(chunk, ring_kit):
    world, total, parts = 4, 60_001, 3
    base, n = 1_234, 55_000  # a bucket in the middle of the flat space
    seen = []
    lock = threading.Lock()

    def on_reduced(rank, iteration, bucket, offset, partition, payload, switched):
        assert switched, "every rank is its own node: every copy crosses the switch"
        with lock:
            seen.append((rank, iteration, bucket, offset, partition, payload))

    rings = ring_kit.make(world, total, partitions=parts, on_reduced=on_reduced, chunk=chunk)
    try:
        xs = [torch.full((n,), float(r + 1)) for r in range(world)]
        res = run_allreduce(rings, [x.clone() for x in xs], base=base, iteration=3, bucket=2)
        cover = np.zeros(total, np.int32)
        bounds = partition_bounds(total, parts)
        for _, it, b, off, p, payload in seen:
            assert (it, b) == (3, 2)
            cnt = len(payload) // 4
            assert cnt <= MAX_CHUNK, "a copy larger than one jumbo frame"
            lo, hi = bounds[p]
            assert lo <= off and off + cnt <= hi, "a copy crosses its partition boundary"
            cover[off:off + cnt] += 1
            vals = np.frombuffer(payload, "<f4")
            assert np.array_equal(vals, res[0].numpy()[off - base:off - base + cnt])
        assert cover[base:base + n].min() == 1 and cover.max() == 1
        assert cover[:base].sum() == 0
        # Each rank completes the segment after its own: 1/world of the bucket.
        per_rank = {r: sum(len(s[5]) // 4 for s in seen if s[0] == r) for r in range(world)}
        for r in range(world):
            g = (r + 1) % world
            assert per_rank[r] == (g + 1) * n // world - g * n // world
    finally:
        ring_kit.close_all(rings)


@pytest.mark.parametrize("chunk", [700, 16_000])
def test_replicate_flag_on_first_all_gather_hop_only(chunk, ring_kit):
    """Sniff every datagram of a 3-rank ring: each element is sent with REPLICATE once,
    in datagrams that fit one jumbo frame."""
    world, n = 3, 30_001
    rings = ring_kit.make(world, n, partitions=2, chunk=chunk)
    tagged = np.zeros(n, np.int32)
    orig = [r._transmit for r in rings]

    def spy(i):
        def transmit(parts, addr):
            dgram = b"".join(parts)
            h = wire.decode_header(dgram)
            if h.flags & wire.Flags.REPLICATE:
                assert len(dgram) <= wire.HEADER_LEN + wire.MAX_PAYLOAD_JUMBO
                tagged[h.offset:h.offset + h.count] += 1
            return orig[i](parts, addr)
        return transmit

    for i, r in enumerate(rings):
        r._transmit = spy(i)
    try:
        run_allreduce(rings, [torch.ones(n) for _ in range(world)])
        assert tagged.min() == 1 and tagged.max() == 1
    finally:
        ring_kit.close_all(rings)


def test_buckets_out_of_order_and_foreign_datagrams_dropped(ring_kit):
    world, n = 2, 4_000
    rings = ring_kit.make(world, n, partitions=1, nonce=5)
    try:
        # rank 1 submits bucket 1 first, rank 0 bucket 0 first: held until each side has both
        a0, a1 = torch.ones(2000), torch.ones(2000) * 2
        b0, b1 = torch.ones(2000) * 3, torch.ones(2000) * 4
        f = [rings[0].submit(a0, 0, 1, 0), rings[1].submit(b1, 2000, 1, 1),
             rings[0].submit(a1, 2000, 1, 1), rings[1].submit(b0, 0, 1, 0)]
        for x in f:
            x.wait()
        assert torch.equal(a0, torch.full((2000,), 4.0)) and torch.equal(b0, a0)
        assert torch.equal(a1, torch.full((2000,), 6.0)) and torch.equal(b1, a1)
        # A datagram of another incarnation (other nonce) is dropped and counted.
        import socket

        h = wire.Header(job_id=7, token=6, count=1, iteration=2)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.sendto(wire.encode(h, b"\0\0\0\0"), rings[0].sock.getsockname())
            s.sendto(b"garbage", rings[0].sock.getsockname())
        import time

        deadline = time.monotonic() + 2
        while time.monotonic() < deadline and not (rings[0].stats["foreign"]
                                                   and rings[0].stats["malformed"]):
            time.sleep(0.01)
        assert rings[0].stats["foreign"] == 1 and rings[0].stats["malformed"] == 1
    finally:
        ring_kit.close_all(rings)


def test_bad_arguments_are_one_line_errors(ring_kit):
    from checkmate.errors import CheckmateError

    rings = ring_kit.make(2, 100, partitions=1)
    try:
        with pytest.raises(CheckmateError):
            rings[0].submit(torch.ones(10, dtype=torch.float64), 0, 1, 0)
        with pytest.raises(CheckmateError):
            rings[0].submit(torch.ones(10), 95, 1, 0)
    finally:
        ring_kit.close_all(rings)
