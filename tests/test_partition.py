"""checkmate.spec.partition: the one cut of the flat space every component relies on."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from checkmate.errors import CheckmateError
from checkmate.spec.partition import (
    layout,
    parse_partition_arg,
    partition_bounds,
    partition_of,
    partition_pieces,
    split_range,
)


@given(st.integers(0, 10**7), st.integers(1, 300))
def test_bounds_cover_contiguously_and_balance(total: int, n: int) -> None:
    b = partition_bounds(total, n)
    assert len(b) == n
    assert b[0][0] == 0 and b[-1][1] == total
    assert all(b[i][1] == b[i + 1][0] for i in range(n - 1))
    sizes = [e - s for s, e in b]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("total,n", [(1, 1), (7, 3), (10, 4), (3, 5), (1000003, 7), (16, 16)])
def test_partition_of_agrees_with_bounds(total: int, n: int) -> None:
    b = partition_bounds(total, n)
    for offset in range(total) if total < 5000 else range(0, total, 997):
        i = partition_of(offset, total, n)
        assert b[i][0] <= offset < b[i][1]


def test_partition_of_boundaries_and_errors() -> None:
    total, n = 1000003, 4
    for i, (s, e) in enumerate(partition_bounds(total, n)):
        assert partition_of(s, total, n) == i
        assert partition_of(e - 1, total, n) == i
    for bad in (-1, total):
        with pytest.raises(CheckmateError, match="outside"):
            partition_of(bad, total, n)
    with pytest.raises(CheckmateError, match="partition count"):
        partition_bounds(10, 0)
    with pytest.raises(CheckmateError, match="partition count"):
        partition_bounds(10, 2.0)
    with pytest.raises(CheckmateError, match="flat parameter count"):
        partition_bounds(True, 2)
    # numpy integers (sizes computed with numpy) are fine and give plain ints back
    b = partition_bounds(np.int64(10), np.int32(3))
    assert b == [(0, 3), (3, 6), (6, 10)] and all(type(x) is int for r in b for x in r)
    assert partition_of(np.int64(5), 10, 3) == 1


@given(st.integers(1, 10**6), st.integers(1, 50), st.data())
def test_split_range_cuts_exactly_at_boundaries(total: int, n: int, data) -> None:
    offset = data.draw(st.integers(0, total - 1))
    count = data.draw(st.integers(0, total - offset))
    pieces = split_range(offset, count, total, n)
    assert sum(c for _, _, c in pieces) == count
    pos = offset
    bounds = partition_bounds(total, n)
    for part, off, c in pieces:
        assert off == pos and c > 0
        s, e = bounds[part]
        assert s <= off and off + c <= e
        pos += c
    # consecutive pieces belong to increasing partitions
    assert [p for p, _, _ in pieces] == sorted({p for p, _, _ in pieces})


def test_split_range_rejects_chunks_outside() -> None:
    with pytest.raises(CheckmateError):
        split_range(5, 6, 10, 2)
    with pytest.raises(CheckmateError):
        split_range(-1, 1, 10, 2)
    assert split_range(3, 0, 10, 2) == []
    assert split_range(3, 5, 10, 2) == [(0, 3, 2), (1, 5, 3)]


@pytest.mark.parametrize("s,expected", [("0/1", (0, 1)), ("3/4", (3, 4)), ("12/100", (12, 100))])
def test_parse_partition_arg_accepts(s: str, expected: tuple[int, int]) -> None:
    assert parse_partition_arg(s) == expected


@pytest.mark.parametrize("s", ["4/4", "0/0", "-1/3", "x", "1/", "/3", " 1/2", "1/2x", " 1/2x",
                               "1 /2", "01/2", "1/02", "1.0/2", "+1/2", "", "1/2/3", "٣/٤"])
def test_parse_partition_arg_rejects(s: str) -> None:
    with pytest.raises(CheckmateError) as e:
        parse_partition_arg(s)
    msg = str(e.value)
    assert "\n" not in msg and "partition" in msg


def test_layout_and_pieces_intersect_partitions_with_params() -> None:
    slots = layout([("a.w", (3, 4)), ("a.b", (4,)), ("c", ()), ("d", (0, 5)), ("e", (5,))])
    assert [(s.offset, s.numel) for s in slots] == [(0, 12), (12, 4), (16, 1), (17, 0), (17, 5)]
    total = slots[-1].end
    seen: dict[str, list[int]] = {s.name: [] for s in slots}
    for start, end in partition_bounds(total, 4):
        pieces = partition_pieces(slots, start, end)
        local = 0
        for p in pieces:
            assert p.local_start == local and p.flat_start == start + local
            assert p.flat_start == slots[p.param_index].offset + p.param_start
            seen[p.name].extend(range(p.param_start, p.param_start + p.count))
            local += p.count
        assert local == end - start
    for s in slots:
        assert seen[s.name] == list(range(s.numel))
    with pytest.raises(CheckmateError, match="twice"):
        layout([("a", (1,)), ("a", (2,))])
    with pytest.raises(CheckmateError, match="negative"):
        layout([("a", (-1,))])
