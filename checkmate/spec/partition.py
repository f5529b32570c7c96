"""Partitioning of the flat parameter space, shared by trainers, controller and shadows.

The flat space is the concatenation of the model spec's parameters in spec order
(docs/protocol.md, "Model spec"). It is cut into ``n`` contiguous partitions balanced by
element count; a boundary may fall inside a parameter. Every component must agree on the
cut to the element, so this module is the only place that computes it.

Partition ``i`` of ``n`` covers ``[i * total // n, (i + 1) * total // n)``. When
``total < n`` some partitions are empty; :func:`partition_of` never returns one of those.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from math import prod

from checkmate.errors import CheckmateError

__all__ = [
    "ParamSlot",
    "Piece",
    "layout",
    "parse_partition_arg",
    "partition_bounds",
    "partition_of",
    "partition_pieces",
    "share_bounds",
    "split_range",
]


def _int(x: object) -> int | None:
    """``x`` as a Python int if it is an integer (numpy ones too), not a bool."""
    if isinstance(x, bool):
        return None
    try:
        return operator.index(x)  # type: ignore[arg-type]
    except TypeError:
        return None


def _check(total: int, n: int) -> tuple[int, int]:
    """``(total, n)`` as Python ints, validated."""
    t, k = _int(total), _int(n)
    if t is None or t < 0:
        raise CheckmateError(f"flat parameter count must be an integer >= 0, got {total!r}")
    if k is None or k < 1:
        raise CheckmateError(f"partition count must be an integer >= 1, got {n!r}")
    return t, k


def _start(i: int, total: int, n: int) -> int:
    return i * total // n


def partition_bounds(total: int, n: int) -> list[tuple[int, int]]:
    """Half-open ``(start, end)`` of each of the ``n`` partitions of ``total`` elements."""
    total, n = _check(total, n)
    return [(_start(i, total, n), _start(i + 1, total, n)) for i in range(n)]


def partition_of(offset: int, total: int, n: int) -> int:
    """Index of the partition that holds flat element ``offset``.

    Raises:
        CheckmateError: ``offset`` lies outside ``[0, total)``.
    """
    total, n = _check(total, n)
    offset = _int(offset)
    if offset is None or not 0 <= offset < total:
        raise CheckmateError(f"offset {offset} outside the flat space [0, {total})")
    # Largest i with i*total//n <= offset  <=>  i*total < (offset+1)*n.
    return ((offset + 1) * n - 1) // total


def share_bounds(start: int, end: int, rank: int, world: int) -> tuple[int, int]:
    """Rank ``rank``'s share of the partition ``[start, end)``: its ``world`` contiguous
    pieces, in rank order, cover it once. A trainer seeds its share of every partition
    (checkmate.train.shadow_client.seed_share) and hashes the same share for the shadow's
    state check (checkmate.protocol.state_digest)."""
    n = end - start
    return start + n * rank // world, start + n * (rank + 1) // world


def split_range(offset: int, count: int, total: int, n: int) -> list[tuple[int, int, int]]:
    """Cut the chunk ``[offset, offset+count)`` at partition boundaries.

    Returns:
        ``[(partition, offset, count), ...]`` in ascending offset order, empty for
        ``count == 0``; the pieces exactly cover the chunk.

    Raises:
        CheckmateError: the chunk does not lie inside ``[0, total)``.
    """
    total, n = _check(total, n)
    o, c = _int(offset), _int(count)
    if o is None or c is None or c < 0 or o < 0 or o + c > total:
        raise CheckmateError(
            f"chunk of {count!r} elements at offset {offset!r} outside the flat space [0, {total})")
    pieces: list[tuple[int, int, int]] = []
    pos, end = o, o + c
    while pos < end:
        part = partition_of(pos, total, n)
        stop = min(end, _start(part + 1, total, n))
        pieces.append((part, pos, stop - pos))
        pos = stop
    return pieces


_PARTITION_ARG = re.compile(r"(0|[1-9][0-9]*)/([1-9][0-9]*)")


def parse_partition_arg(s: str) -> tuple[int, int]:
    """Parse ``"i/n"`` (0-based index ``i`` of ``n`` partitions) as given on a command line.

    Raises:
        CheckmateError: anything but two plain decimal integers with ``0 <= i < n``.
    """
    m = _PARTITION_ARG.fullmatch(s) if isinstance(s, str) else None
    if m is None:
        raise CheckmateError(
            f"partition must look like INDEX/COUNT with 0 <= INDEX < COUNT (e.g. 0/4), got {s!r}")
    index, count = int(m.group(1)), int(m.group(2))
    if index >= count:
        raise CheckmateError(
            f"partition index {index} out of range for {count} partitions (use 0..{count - 1})")
    return index, count


@dataclass(frozen=True)
class ParamSlot:
    """One parameter's place in the flat space."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class Piece:
    """The part of one parameter that falls inside one partition.

    ``param_start`` indexes the parameter's flattened elements, ``local_start`` the
    partition's own array, ``flat_start`` the whole flat space; all three cover ``count``.
    """

    name: str
    param_index: int
    param_start: int
    local_start: int
    flat_start: int
    count: int


def layout(params: Iterable[tuple[str, Sequence[int]]]) -> list[ParamSlot]:
    """Offsets and sizes for ``[(name, shape), ...]`` taken in order.

    Raises:
        CheckmateError: a duplicate name or a negative dimension.
    """
    slots: list[ParamSlot] = []
    seen: set[str] = set()
    offset = 0
    for name, shape in params:
        shape_t = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape_t):
            raise CheckmateError(f"parameter {name!r} has a negative dimension: {shape_t}")
        if name in seen:
            raise CheckmateError(f"parameter {name!r} listed twice")
        seen.add(name)
        numel = prod(shape_t)
        slots.append(ParamSlot(name, shape_t, offset, numel))
        offset += numel
    return slots


def partition_pieces(slots: Sequence[ParamSlot], start: int, end: int) -> list[Piece]:
    """Intersect the flat range ``[start, end)`` (usually one partition) with each parameter.

    Parameters without elements in the range are left out; pieces come in flat order.
    """
    pieces: list[Piece] = []
    for i, s in enumerate(slots):
        lo, hi = max(start, s.offset), min(end, s.end)
        if lo < hi:
            pieces.append(Piece(s.name, i, lo - s.offset, lo - start, lo, hi - lo))
    return pieces
