"""The FEC group codec (checkmate.protocol.fec): exact recovery from any k of k + m
datagrams, nothing
wrong from fewer, clean errors on malformed parity, and a decoder that stays bounded."""

from __future__ import annotations

import random
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checkmate.protocol import fec, wire

Piece = tuple[int, int, int, bytes]  # (group, index, offset, payload)


def _stream(k: int, m: int, counts: list[int], seed: int = 0, itemsize: int = 4
            ) -> tuple[list[Piece], dict[int, list[tuple[int, bytes]]]]:
    """Encode pieces of the given element counts as one sender would: the data pieces with
    their (group, index) stamps, and the parity payloads of every group (flush included)."""
    rng = np.random.default_rng(seed)
    enc = fec.GroupEncoder(k, m, itemsize=itemsize)
    data: list[Piece] = []
    parity: dict[int, list[tuple[int, bytes]]] = {}
    offset = 1000
    for n in counts:
        g, i = enc.group_id, enc.next_index
        payload = rng.bytes(n * itemsize)
        data.append((g, i, offset, payload))
        offset += n
        out = enc.add(data[-1][2], payload)
        if out is not None:
            parity[g] = out
    g = enc.group_id
    out = enc.flush()
    if out is not None:
        parity[g] = out
    assert enc.flush() is None
    return data, parity


def _deliver(dec: fec.GroupDecoder, data: list[Piece], parity: dict[int, list], g: int,
             lost: set[int], k: int) -> list[tuple[int, bytes]]:
    """Send group g minus the datagrams at ``lost`` positions (data 0..k'-1, then parity)
    in a shuffled order; return what recover() gives back."""
    dgrams: list[tuple[int, int, bytes]] = [(i, o, p) for gg, i, o, p in data if gg == g]
    dgrams += [(j, -1, body) for j, body in parity[g]]  # offset -1: a parity datagram
    random.Random(g).shuffle(dgrams)
    for idx, offset, payload in dgrams:
        if idx in lost:
            continue
        if offset < 0:
            dec.parity(g, idx, payload)
        else:
            dec.data(g, idx, offset, payload, k=k)
    return dec.recover(g)


@pytest.mark.parametrize("k,m", [(16, 2), (8, 1)])
def test_every_loss_pattern_up_to_m_recovers_exactly(k, m):
    counts = [2229] * (k - 1) + [17]  # full pieces and the short last piece of a chunk
    data, parity = _stream(k, m, counts, seed=k)
    group = [d for d in data if d[0] == 0]
    rng = random.Random(1)
    for _ in range(40):
        lost = set(rng.sample(range(k + m), rng.randint(0, m)))
        dec = fec.GroupDecoder()
        got = _deliver(dec, data, parity, 0, lost, k)
        want = [(o, p) for _, i, o, p in group if i in lost]
        assert sorted(got) == sorted(want)
        assert dec.open_groups == 0 and dec.held_bytes == 0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(km=st.sampled_from([(16, 2), (8, 1), (3, 4), (1, 2)]),
       counts=st.lists(st.integers(1, 2229), min_size=1, max_size=40),
       seed=st.integers(0, 2**32 - 1), data=st.data())
def test_random_groups_round_trip(km, counts, seed, data):
    k, m = km
    stream, parity = _stream(k, m, counts, seed=seed)
    groups = sorted({g for g, _, _, _ in stream})
    assert sorted(parity) == groups  # every group got parity, the short last one too
    dec = fec.GroupDecoder()
    lost_data = 0
    waiting = 0
    for g in groups:
        size = sum(1 for d in stream if d[0] == g)  # k' (short last group: fewer)
        lost = set(data.draw(st.sets(st.integers(0, size + m - 1), max_size=m)))
        got = _deliver(dec, stream, parity, g, lost, k)
        want = [(o, p) for gg, i, o, p in stream if gg == g and i in lost]
        assert sorted(got) == sorted(want)
        lost_data += len(want)
        # A short group that lost all its parity cannot know it is complete: it waits
        # (bounded) until evicted or forgotten. Every other group is finished.
        waiting += size < k and lost == set(range(size, size + m))
    assert dec.open_groups == waiting
    assert dec.stats.recovered == lost_data


@pytest.mark.parametrize("k,m", [(16, 2), (8, 1)])
def test_more_than_m_losses_recover_nothing_until_enough_arrive(k, m):
    data, parity = _stream(k, m, [100 + i for i in range(k)], seed=3)
    dec = fec.GroupDecoder()
    lost = set(range(m + 1))  # m + 1 data pieces
    assert _deliver(dec, data, parity, 0, lost, k) == []
    assert dec.open_groups == 1 and dec.stats.recovered == 0
    _, i, o, p = data[0]  # one late copy makes it k of k + m
    assert dec.data(0, i, o, p, k=k)
    got = dec.recover(0)
    assert sorted(got) == sorted((o, p) for _, i, o, p in data if i in lost and i != 0)
    assert dec.recover(0) == []  # finished: nothing twice


def test_short_last_group_table_says_k_prime():
    data, parity = _stream(16, 2, [50] * 19, seed=4)  # groups of 16 and of 3
    assert sorted(parity) == [0, 1]
    t = fec.parse_parity(parity[1][0][1])
    assert (t.k, t.m, t.block_len) == (3, 2, 200)
    assert [j for j, _ in parity[1]] == [3, 4]  # parity indices follow the k' data indices
    assert t.pieces == tuple((o, 50) for g, _, o, _ in data if g == 1)
    dec = fec.GroupDecoder()
    # Data headers carry the nominal k=16: the short group waits for its table.
    got = _deliver(dec, data, parity, 1, {0, 2}, 16)
    assert sorted(got) == sorted((o, p) for g, i, o, p in data if g == 1 and i in (0, 2))


def test_recovers_pieces_whose_headers_never_arrived():
    data, parity = _stream(8, 1, [7, 300, 2229, 1, 64, 64, 64, 9], seed=5)
    dec = fec.GroupDecoder()
    for _, i, o, p in data[1:]:
        dec.data(0, i, o, p)  # no k: completion is learnt from the table
    assert dec.recover(0) == []
    dec.parity(0, *parity[0][0])
    assert dec.recover(0) == [(data[0][2], data[0][3])]


def test_complete_group_finishes_without_parity_and_ignores_it_late():
    data, parity = _stream(8, 1, [10] * 8)
    dec = fec.GroupDecoder()
    for _, i, o, p in data:
        assert dec.data(0, i, o, p, k=8)
    assert dec.open_groups == 0 and dec.stats.complete_groups == 1
    assert not dec.parity(0, *parity[0][0])
    assert dec.stats.late == 1 and dec.open_groups == 0


def test_data_that_contradicts_the_table_is_not_used():
    data, parity = _stream(8, 2, [10] * 8, seed=6)
    dec = fec.GroupDecoder()
    for j, body in parity[0]:
        dec.parity(0, j, body)
    _, i, o, p = data[0]
    assert not dec.data(0, i, o + 1, p)  # wrong offset for index 0
    assert not dec.data(0, i, o, p[:-4])  # wrong count
    assert dec.stats.mismatch == 2
    for _, i, o, p in data[2:]:
        dec.data(0, i, o, p)
    assert sorted(dec.recover(0)) == sorted((o, p) for _, i, o, p in data[:2])


def test_conflicting_tables_and_duplicates_are_counted():
    _, parity = _stream(8, 2, [10] * 8, seed=7)
    _, other = _stream(8, 2, [11] * 8, seed=7)
    dec = fec.GroupDecoder()
    assert dec.parity(0, *parity[0][0])
    assert not dec.parity(0, *parity[0][0])
    assert not dec.parity(0, *other[0][1])
    assert dec.stats.duplicate == 1 and dec.stats.mismatch == 1


def test_wire_round_trip_of_the_documented_scheme():
    """Data and parity as ckm datagrams stamped as the module docstring says."""
    k, m = 16, 2
    n = fec.max_piece_bytes(k) // 4
    assert fec.parity_len(k, 4 * n) <= wire.MAX_PAYLOAD_JUMBO < fec.parity_len(k, 8916)
    data, parity = _stream(k, m, [n] * k + [n // 2], seed=8)
    base = wire.Header(flags=wire.Flags.REPLICATE, job_id=1, iteration=5, partition=1)
    dgrams = [wire.encode(base.with_(offset=o, count=len(p) // 4, fec_group=g, fec_index=i,
                                     fec_k=k, fec_m=m), p) for g, i, o, p in data]
    for g, out in parity.items():
        t = fec.parse_parity(out[0][1])
        for j, body in out:
            h = base.with_(flags=wire.Flags.REPLICATE | wire.Flags.PARITY,
                           dtype=wire.DType.BYTES, count=len(body), offset=t.pieces[0][0],
                           fec_group=g, fec_index=j, fec_k=t.k, fec_m=m)
            dgrams.append(wire.encode(h, body))
    assert max(len(d) for d in dgrams) <= 9000 - 28
    lost = {1, 7, 16}  # two of group 0, the one piece of group 1
    dec = fec.GroupDecoder()
    got = []
    for d in [d for x, d in enumerate(dgrams) if x not in lost]:
        h, payload = wire.decode(d)
        key = ("10.0.0.1", h.iteration, h.partition, h.fec_group)
        if h.flags & wire.Flags.PARITY:
            dec.parity(key, h.fec_index, payload)
        else:
            dec.data(key, h.fec_index, h.offset, payload, k=h.fec_k)
        got += dec.recover(key)
    assert sorted(got) == sorted((data[x][2], data[x][3]) for x in lost)


# ----- malformed input --------------------------------------------------------------------


def _table(k: int, m: int, counts: list[int], block: int, version: int = 1,
           itemsize: int = 4) -> bytes:
    return (struct.pack("!BBBB", version, k, m, itemsize)
            + b"".join(struct.pack("!QI", 8 * i, c) for i, c in enumerate(counts))
            + bytes(block))


@pytest.mark.parametrize("payload,why", [
    (b"", "no table"),
    (b"\x01\x02", "no table"),
    (_table(2, 1, [1, 1], 4, version=2), "version"),
    (_table(2, 1, [1, 1], 4, itemsize=3), "itemsize"),
    (_table(0, 1, [], 4), "k >= 1"),
    (_table(2, 0, [1, 1], 4), "m >= 1"),
    (_table(200, 57, [1] * 200, 4), "k=200, m=57"),
    (_table(4, 1, [1, 1], 4), "parity block"),  # table shorter than k says
    (_table(2, 1, [1, 1], 0), "parity block"),
    (_table(2, 1, [1, 2], 4), "do not match"),
    (_table(2, 1, [0, 1], 4), "do not match"),
    (_table(1, 1, [20000], 80000), "parity block"),
])
def test_malformed_parity_is_a_clean_error(payload, why):
    with pytest.raises(fec.FecError, match=why):
        fec.parse_parity(payload)
    dec = fec.GroupDecoder()
    with pytest.raises(ValueError):  # FecError is a ValueError
        dec.parity(0, 2, payload)
    assert dec.stats.rejected == 1 and dec.open_groups == 0


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400), st.integers(0, 300))
def test_arbitrary_bytes_never_crash(payload, index):
    dec = fec.GroupDecoder()
    try:
        dec.parity(("x", 1), index, payload)
    except fec.FecError:
        assert dec.stats.rejected == 1
    assert dec.recover(("x", 1)) == []


def test_bad_index_itemsize_and_data_are_clean_errors():
    _, parity = _stream(8, 1, [4] * 8)
    dec = fec.GroupDecoder()
    for idx in (0, 7, 9, 255):
        with pytest.raises(fec.FecError, match="parity index"):
            dec.parity(0, idx, parity[0][0][1])
    with pytest.raises(fec.FecError, match="itemsize"):
        fec.GroupDecoder(itemsize=2).parity(0, 8, parity[0][0][1])
    for args in ((255, 0, b"\0" * 4), (-1, 0, b"\0" * 4), (0, 0, b"\0" * 3), (0, 0, b""),
                 (0, -5, b"\0" * 4), (0, 1 << 64, b"\0" * 4)):
        with pytest.raises(fec.FecError):
            dec.data(0, *args)
    with pytest.raises(fec.FecError, match="k=4"):
        dec.data(0, 5, 0, b"\0" * 4, k=4)
    assert dec.stats.rejected == 11  # 4 parity, 6 + 1 data (the itemsize one: another)


def test_encoder_parameters_are_checked():
    for k, m in ((0, 1), (1, 0), (255, 2), (300, 1)):
        with pytest.raises(fec.FecError):
            fec.GroupEncoder(k, m)
    with pytest.raises(fec.FecError):
        fec.GroupEncoder(8, 1, itemsize=3)
    enc = fec.GroupEncoder(8, 1)
    for bad in (b"", b"\0\0\0", bytes(fec.MAX_BLOCK + 4)):
        with pytest.raises(fec.FecError):
            enc.add(0, bad)
    assert enc.next_index == 0 and enc.flush() is None
    with pytest.raises(fec.FecError):
        fec.max_piece_bytes(255, limit=1000)


def test_encoder_group_ids_and_indices():
    enc = fec.GroupEncoder(4, 2)
    seen = []
    for x in range(10):
        seen.append((enc.group_id, enc.next_index))
        out = enc.add(x * 10, bytes(40))
        assert (out is not None) == (x % 4 == 3)
        if out:
            assert [j for j, _ in out] == [4, 5]
            assert all(len(b) == fec.parity_len(4, 40) for _, b in out)
    assert seen == [(g, i) for g in range(3) for i in range(4)][:10]
    assert [j for j, _ in enc.flush()] == [2, 3] and enc.group_id == 3


def test_encoder_accepts_memoryviews_of_any_format():
    arr = np.arange(12, dtype=np.float32)  # a float32 view: len() counts elements
    enc1, enc2 = fec.GroupEncoder(2, 1), fec.GroupEncoder(2, 1)
    assert enc1.add(0, memoryview(arr)) is None and enc2.add(0, arr.tobytes()) is None
    assert enc1.add(12, memoryview(arr)) == enc2.add(12, arr.tobytes())


# ----- bounds -----------------------------------------------------------------------------


def test_max_groups_drops_the_oldest_and_ignores_its_late_datagrams():
    data, parity = _stream(8, 1, [10] * 8 * 4, seed=9)
    dec = fec.GroupDecoder(max_groups=2)
    for g in range(4):
        _, i, o, p = next(d for d in data if d[0] == g)
        dec.data(g, i, o, p, k=8)
    assert dec.open_groups == 2 and dec.stats.evicted_groups == 2
    _, i, o, p = data[1]
    assert not dec.data(0, i, o, p) and dec.stats.late == 1  # group 0 was dropped
    assert dec.recover(0) == []


def test_max_bytes_bounds_what_is_held():
    data, parity = _stream(8, 1, [250] * 8 * 3, seed=10)  # 1000-byte pieces
    dec = fec.GroupDecoder(max_bytes=5000)
    for g, i, o, p in data:
        if i < 4:
            dec.data(g, i, o, p, k=8)
        assert dec.held_bytes <= 5000
    assert dec.stats.evicted_groups >= 1
    # One group that alone needs more than max_bytes cannot be held.
    small = fec.GroupDecoder(max_bytes=1500)
    assert small.data("a", 0, data[0][2], data[0][3])
    assert not small.data("a", 1, data[1][2], data[1][3])
    assert small.stats.over_budget == 1 and small.held_bytes == 1000


def test_forget_drops_matching_groups():
    data, _ = _stream(8, 1, [10] * 16)
    dec = fec.GroupDecoder()
    for g, i, o, p in data[::4]:
        dec.data((5, g), i, o, p)
        dec.data((6, g), i, o, p)
    assert dec.forget(lambda key: key[0] <= 5) == 2
    assert dec.open_groups == 2 and dec.held_bytes == 4 * 40
    assert not dec.data((5, 0), 1, *data[1][2:])


def test_reused_receive_buffers_do_not_corrupt_held_pieces():
    data, parity = _stream(8, 2, [100] * 8, seed=11)
    dec = fec.GroupDecoder()
    buf = bytearray(2000)
    for _, i, o, p in data[2:]:
        buf[:len(p)] = p
        dec.data(0, i, o, memoryview(buf)[:len(p)])
    for j, body in parity[0]:
        buf[:len(body)] = body
        dec.parity(0, j, memoryview(buf)[:len(body)])
    buf[:] = bytes(len(buf))
    assert sorted(dec.recover(0)) == sorted((o, p) for _, i, o, p in data[:2])


@pytest.mark.parametrize("k,m", [(16, 2), (8, 1)])
def test_random_losses_beyond_m_never_give_data(k, m):
    data, parity = _stream(k, m, [30] * k, seed=12)
    rng = random.Random(2)
    for _ in range(30):
        lost = set(rng.sample(range(k + m), rng.randint(m + 1, k + m)))
        dec = fec.GroupDecoder()
        assert _deliver(dec, data, parity, 0, lost, k) == []
        assert dec.stats.recovered == 0


def test_bench_runs_and_prints_one_ratio_line(capsys):
    from checkmate.testbed.bench import fec as bench

    assert bench.main(["--ks", "2", "--ms", "1", "--piece", "64", "--rounds", "1"]) == 0
    lines = capsys.readouterr().out.rstrip().splitlines()
    assert [line for line in lines if "ratio:" in line] == lines[-1:]
    assert float(lines[-1].removeprefix("fec ratio: ")) > 0
