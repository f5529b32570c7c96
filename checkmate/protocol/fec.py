"""Packet FEC for the replica stream
=================================

A switch copies REPLICATE datagrams best effort; a lost copy costs the shadow a repair round
trip to the trainer (docs/protocol.md, "Repair"). With FEC the trainer adds ``m`` parity
datagrams to every ``k`` consecutive data pieces it sends for one (iteration, partition), and
a shadow that got any ``k`` of the ``k + m`` datagrams of a group rebuilds the missing pieces
at once, bit for bit. This module is the group codec only: no sockets, no headers.

The code
--------

Reed-Solomon over GF(2^8), Cauchy matrix, as computed by liberasurecode's
``isa_l_rs_cauchy`` (Intel ISA-L) through :mod:`pyeclib`: maximum distance separable for any
``k + m <= 256``, i.e. any ``k`` of the ``k + m`` blocks decode. Both ends must use it: the
parity bytes are the protocol. Chosen by measurement against zfec, the only other candidate
fast enough (reedsolo and galois run below 2 MB/s), with ``testbed bench fec`` (pyeclib
1.8.0, zfec 1.6.0.0; median of 7 alternated rounds, one thread, decode = the first ``m``
data pieces lost; a shared 2-core AMD EPYC with AVX-512 and GFNI at load average 4.5 from
other jobs, so +-30% noise)::

           encode MB/s      decode MB/s      µs per group of 4-byte pieces (enc / dec)
    k  m  pyeclib   zfec   pyeclib   zfec    pyeclib        zfec
    8  1     7854   1648      3726   1685     2.5 / 5.1     0.2 / 0.6
    8  2     9852   1348      7302   1374     2.9 / 8.7     0.3 / 0.8
    8  4     6971    674      5103    671     3.5 / 7.3     0.5 / 1.0
    16 1    11866   2666      3710   1728     4.0 / 21.9    0.6 / 0.9
    16 2    11675   1020      4894   1406     4.4 / 30.0    0.4 / 1.0
    16 4     9355    571      2429    343     9.7 / 22.9    0.8 / 1.9
    32 1     8728   1641       522   2102    14.4 / 188.2   0.8 / 2.6
    32 2     5821   1386       816    645     8.3 / 211.9   0.7 / 2.4
    32 4     6101    699       381    703     9.0 / 152.2   1.0 / 2.1

(``fec ratio: 7.297``: pyeclib's encode MB/s over zfec's, geometric mean over the nine.)
Encoding runs on every group a trainer sends, decoding only where a copy was lost. pyeclib
encodes 4-16x faster and decodes 2-8x faster up to k=16; at k=32 its decode is mostly
slower (0.25-1.3x zfec's), because ISA-L inverts the whole k x k decode matrix on every call (about
0.2 ms at k=32, O(k^3)) where zfec's fixed cost per group is 1-3 µs: k <= 16 is the sweet
spot. zfec also limits k + m to 256 (the same as the one-byte ``fec_index``), and its
decode reorders the caller's list in place unless every data block sits at its own index.

Robustness: pyeclib hands out fragments with an 80-byte liberasurecode header in front of
each block and decodes only such fragments, while data pieces arrive without one. With no
checksum configured the headers do not depend on the data, so :func:`_headers` takes them
from an encode of zeros of the same shape; :func:`_driver` checks that layout (header +
block, content-independent header) once per (k, m) and refuses to work (:class:`FecError`)
with a pyeclib that lays fragments out otherwise. ``isa_l_rs_cauchy`` needs the ISA-L
backend that pyeclib's x86-64 wheels bundle; without it :class:`GroupEncoder` raises
:class:`FecError`. zfec (the ``bench`` extra in pyproject.toml) is not imported here; the bench
imports it, when installed, to compare.

Wire format of a parity datagram's payload (``PIECE_TABLE``)
------------------------------------------------------------

Big-endian: a 4-byte preamble ``(version = 1, k, m, itemsize)`` as u8 each, then ``k``
entries ``(offset u64, count u32)``, the data pieces of the group in order (flat element
offset and element count; ``count * itemsize`` payload bytes), then the parity block.
Pieces may differ in length (the last piece of a chunk is shorter): every piece is padded
with zeros to the group's longest payload ``L`` before encoding, so the parity block is
``L`` bytes and the receiver trims recovered pieces to the counts of the table. A short
last group (``flush``) is a group of ``k' < k`` pieces, and its table says ``k'``.

Parity ``j`` of a group of ``k`` pieces has ``fec_index = k + j``; data pieces have
``fec_index`` 0 .. k-1. A parity payload is ``4 + 12 k + L`` bytes (:func:`parity_len`):
with full 8916-byte pieces it exceeds one jumbo frame
(:data:`checkmate.protocol.wire.MAX_PAYLOAD_JUMBO`), so a sender with FEC on cuts its data pieces at
:func:`max_piece_bytes` (2180 float32 for k=16 instead of 2229).

Which data pieces belong to group g
-----------------------------------

The sender stamps them: a REPLICATE data datagram carries ``fec_group`` = the id of the
group it belongs to, ``fec_index`` = its position, ``fec_k``/``fec_m`` = the encoder's k and
m (read :attr:`GroupEncoder.group_id` and :attr:`GroupEncoder.next_index` before
:meth:`GroupEncoder.add`). ``fec_k = 0`` keeps meaning "no FEC". Parity datagrams: flag
``PARITY`` alone (sent straight to the shadow, never copied by a switch), dtype BYTES,
``count`` = payload length, ``fec_group``/``fec_index`` as above, ``fec_k`` = the group's k
(k' for a short group), ``fec_m`` = m, ``offset`` = the first piece's offset,
``partition``/``iteration``/``bucket`` as the data. Group ids count from 0 per encoder, and
a sender uses one encoder per (iteration, partition), so the receiver's group key is (sender
address, iteration, partition, fec_group); the :class:`GroupDecoder` takes any hashable key.
The table in every parity datagram names all the group's pieces, so pieces whose datagram
never arrived are recovered with their offset and count, and a data piece that disagrees
with the table is not used.
"""

from __future__ import annotations

import functools
import struct
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from pyeclib.ec_iface import ECDriver, ECDriverError

from checkmate.errors import CheckmateError
from checkmate.protocol import wire

#: liberasurecode backend: ISA-L Reed-Solomon with a Cauchy matrix (MDS for k + m <= 256;
#: ``isa_l_rs_vand`` is not MDS for every k, m and loss pattern).
EC_TYPE = "isa_l_rs_cauchy"
TABLE_VERSION = 1
#: ``fec_index`` is one byte: indices 0 .. k + m - 1 must fit.
MAX_BLOCKS = 256
#: Largest piece (and parity block) accepted: one UDP datagram can carry no more.
MAX_BLOCK = 65536
ITEMSIZES = (1, 2, 4, 8)
PREAMBLE = struct.Struct("!BBBB")
ENTRY = struct.Struct("!QI")
_U64 = 1 << 64
_ZEROS = memoryview(bytes(MAX_BLOCK))


class FecError(CheckmateError, ValueError):
    """Bad FEC parameters or a malformed parity payload; the message says why."""


def parity_len(k: int, block: int) -> int:
    """Bytes of a parity payload for a group of ``k`` pieces whose longest has ``block``."""
    return PREAMBLE.size + ENTRY.size * k + block


def max_piece_bytes(k: int, limit: int = wire.MAX_PAYLOAD_JUMBO, itemsize: int = 4) -> int:
    """Longest data piece (bytes, a multiple of ``itemsize``) whose parity datagram still
    carries at most ``limit`` payload bytes: where a sender with FEC on cuts its pieces."""
    room = limit - PREAMBLE.size - ENTRY.size * k
    if room < itemsize:
        raise FecError(f"a parity payload for k={k} does not fit in {limit} bytes")
    return room // itemsize * itemsize


def _check_km(k: int, m: int) -> None:
    if not (1 <= k and 1 <= m and k + m <= MAX_BLOCKS):
        raise FecError(f"need k >= 1, m >= 1 and k + m <= {MAX_BLOCKS}; got k={k}, m={m}")


@functools.lru_cache(maxsize=64)
def _driver(k: int, m: int) -> tuple[ECDriver, int]:
    """The pyeclib driver for (k, m) and its fragment header length, after checking that
    fragments are ``header + block`` with a header that does not depend on the data (what
    lets the decoder put headers on data pieces that arrived without one)."""
    _check_km(k, m)
    try:
        drv = ECDriver(k=k, m=m, ec_type=EC_TYPE)
        probe = bytes(range(1, 17)) * k
        frags, zero = drv.encode(probe), drv.encode(bytes(len(probe)))
    except ECDriverError as e:
        raise FecError(f"pyeclib {EC_TYPE} unavailable for k={k}, m={m}: {e}") from None
    head = len(frags[0]) - 16
    ok = (len(frags) == k + m and head > 0
          and all(len(f) == head + 16 and f[:head] == z[:head] for f, z in zip(frags, zero,
                                                                                strict=True))
          and all(frags[i][head:] == probe[16 * i:16 * (i + 1)] for i in range(k)))
    if not ok:
        raise FecError("this pyeclib does not lay fragments out as header + block; "
                       "checkmate.protocol.fec cannot use it")
    return drv, head


@functools.lru_cache(maxsize=256)
def _headers(k: int, m: int, block: int) -> tuple[bytes, ...]:
    """The k + m fragment headers of a group of ``k`` blocks of ``block`` bytes."""
    drv, head = _driver(k, m)
    frags = drv.encode(bytes(k * block))
    if any(len(f) != head + block for f in frags):
        raise FecError(f"pyeclib pads {block}-byte blocks; checkmate.protocol.fec cannot use it")
    return tuple(f[:head] for f in frags)


def _padded(payload: bytes | memoryview, block: int) -> list[bytes | memoryview]:
    n = len(payload)
    return [payload] if n == block else [payload, _ZEROS[:block - n]]


def _check_piece(offset: int, payload: bytes | memoryview, itemsize: int) -> None:
    n = len(payload)
    if not 0 < n <= MAX_BLOCK or n % itemsize:
        raise FecError(f"piece of {n} bytes: need 1 .. {MAX_BLOCK} bytes, a multiple of "
                       f"itemsize {itemsize}")
    if not 0 <= offset < _U64:
        raise FecError(f"offset {offset} is not a u64")


class GroupEncoder:
    """Sender side: buffers data pieces and returns each full group's parity payloads.

    Holds references to the pieces (no copy) until their group is encoded; encoding joins
    them once into the buffer the library encodes, padding short ones with zeros.
    """

    def __init__(self, k: int, m: int, *, itemsize: int = 4) -> None:
        _check_km(k, m)
        if itemsize not in ITEMSIZES:
            raise FecError(f"itemsize must be one of {ITEMSIZES}, got {itemsize}")
        _driver(k, m)  # fail here, not on the first full group
        self.k, self.m, self.itemsize = k, m, itemsize
        self._group = 0
        self._pieces: list[tuple[int, bytes | memoryview]] = []

    @property
    def group_id(self) -> int:
        """Id of the group being filled: the ``fec_group`` of the next data piece."""
        return self._group

    @property
    def next_index(self) -> int:
        """Position the next data piece takes in its group: its ``fec_index``."""
        return len(self._pieces)

    def add(self, offset: int, payload: bytes) -> list[tuple[int, bytes]] | None:
        """Buffer one data piece; when it completes a group of k, return that group's m
        parity payloads as (fec_index, payload) and move on to the next group id. The
        piece is held by reference: it must not change until its group is encoded."""
        if self._group >= 1 << 32:
            raise FecError("fec_group is a u32: this encoder has used every group id")
        piece = payload if isinstance(payload, bytes) else memoryview(payload).cast("B")
        _check_piece(offset, piece, self.itemsize)
        self._pieces.append((offset, piece))
        return self._emit() if len(self._pieces) == self.k else None

    def flush(self) -> list[tuple[int, bytes]] | None:
        """Parity for a short last group (k' < k pieces, same m); None if nothing is
        buffered. Call it after the last piece of the (iteration, partition)."""
        return self._emit() if self._pieces else None

    def _emit(self) -> list[tuple[int, bytes]]:
        pieces, self._pieces = self._pieces, []
        self._group += 1
        k, m = len(pieces), self.m
        block = max(len(p) for _, p in pieces)
        table = [PREAMBLE.pack(TABLE_VERSION, k, m, self.itemsize)]
        parts: list[bytes | memoryview] = []
        for off, p in pieces:
            table.append(ENTRY.pack(off, len(p) // self.itemsize))
            parts += _padded(p, block)
        drv, head = _driver(k, m)
        frags = drv.encode(b"".join(parts))
        if any(len(f) != head + block for f in frags):
            raise FecError(f"pyeclib pads {block}-byte blocks; checkmate.protocol.fec "
                           "cannot use it")
        prefix = b"".join(table)
        return [(k + j, b"".join((prefix, memoryview(frags[k + j])[head:])))
                for j in range(m)]


@dataclass(frozen=True)
class PieceTable:
    """A parsed parity payload: the group's shape, its pieces and the parity block."""

    k: int
    m: int
    itemsize: int
    pieces: tuple[tuple[int, int], ...]  # (offset, count) per data index
    prefix: bytes  # preamble + table as sent: equal in every parity of one group
    block: memoryview

    @property
    def block_len(self) -> int:
        return len(self.block)


def parse_parity(payload: bytes | bytearray | memoryview) -> PieceTable:
    """Validate and split a parity payload; raises :class:`FecError` on anything malformed
    (never another exception, whatever the bytes)."""
    try:
        buf = memoryview(payload).cast("B")
    except (TypeError, ValueError) as e:
        raise FecError(f"parity payload is not a contiguous buffer: {e}") from None
    if len(buf) < PREAMBLE.size:
        raise FecError(f"parity payload of {len(buf)} bytes has no table")
    version, k, m, itemsize = PREAMBLE.unpack_from(buf, 0)
    if version != TABLE_VERSION:
        raise FecError(f"unknown piece table version {version}")
    if itemsize not in ITEMSIZES:
        raise FecError(f"bad itemsize {itemsize} in piece table")
    _check_km(k, m)
    end = PREAMBLE.size + ENTRY.size * k
    block = len(buf) - end
    if not 0 < block <= MAX_BLOCK:
        raise FecError(f"parity payload of {len(buf)} bytes: a table of {k} pieces leaves "
                       f"a parity block of {block} bytes (need 1 .. {MAX_BLOCK})")
    pieces = tuple(ENTRY.iter_unpack(buf[PREAMBLE.size:end]))
    longest = max(n for _, n in pieces) * itemsize
    if min(n for _, n in pieces) < 1 or longest != block:
        raise FecError(f"piece table counts {[n for _, n in pieces]} (x{itemsize} bytes) do "
                       f"not match a parity block of {block} bytes")
    return PieceTable(k, m, itemsize, pieces, bytes(buf[:end]), buf[end:])


@dataclass
class DecoderStats:
    """What the decoder did with its input; every field only grows."""

    data: int = 0  # data pieces accepted
    parity: int = 0  # parity payloads accepted
    recovered: int = 0  # data pieces rebuilt
    decoded_groups: int = 0  # groups that needed (and got) a decode
    complete_groups: int = 0  # groups whose data all arrived
    evicted_groups: int = 0  # dropped unfinished: max_groups / max_bytes, or forget()
    rejected: int = 0  # malformed input (FecError raised)
    mismatch: int = 0  # well formed, but contradicts the group's table or k
    duplicate: int = 0  # index already held
    late: int = 0  # for a group already finished or evicted
    over_budget: int = 0  # one group alone would exceed max_bytes


class _Group:
    __slots__ = ("data", "parity", "table", "k_hint", "nbytes")

    def __init__(self) -> None:
        self.data: dict[int, tuple[int, bytes]] = {}
        self.parity: dict[int, memoryview] = {}
        self.table: PieceTable | None = None
        self.k_hint = 0
        self.nbytes = 0


class GroupDecoder:
    """Receiver side: collects the datagrams of open groups and rebuilds lost data pieces.

    Bounded: at most ``max_groups`` open groups and ``max_bytes`` of held payload; past
    either, the oldest open groups are dropped (counted in ``stats.evicted_groups``; the
    repair path then fills their holes). A finished or dropped group is remembered (the
    last ``4 * max_groups`` keys) so that its late datagrams are ignored, not reopened.
    A short last group whose parity was all lost cannot know it is complete and waits for
    eviction: the receiver calls :meth:`forget` for an iteration it committed. One thread
    per decoder.
    """

    def __init__(self, *, max_groups: int = 256, max_bytes: int = 64 << 20,
                 itemsize: int = 4) -> None:
        if max_groups < 1 or max_bytes < 1:
            raise FecError("max_groups and max_bytes must be >= 1")
        if itemsize not in ITEMSIZES:
            raise FecError(f"itemsize must be one of {ITEMSIZES}, got {itemsize}")
        self.max_groups, self.max_bytes, self.itemsize = max_groups, max_bytes, itemsize
        self.stats = DecoderStats()
        self._open: OrderedDict[Hashable, _Group] = OrderedDict()
        self._closed: OrderedDict[Hashable, None] = OrderedDict()
        self._held = 0

    @property
    def open_groups(self) -> int:
        return len(self._open)

    @property
    def held_bytes(self) -> int:
        return self._held

    def data(self, group: Hashable, index: int, offset: int,
             payload: bytes | bytearray | memoryview, k: int | None = None) -> bool:
        """Hold a data piece (``fec_index`` = ``index``; ``k`` = its header's ``fec_k``, which
        lets a group whose data all arrived finish without waiting for parity). Returns
        whether it was kept; raises :class:`FecError` on malformed input."""
        try:
            raw = payload if isinstance(payload, bytes) else bytes(payload)
            if not 0 <= index < MAX_BLOCKS - 1:
                raise FecError(f"data index {index} out of range")
            if k is not None and not (1 <= k < MAX_BLOCKS and index < k):
                raise FecError(f"data index {index} with k={k}")
            _check_piece(offset, raw, self.itemsize)
        except FecError:
            self.stats.rejected += 1
            raise
        g = self._group(group)
        if g is None:
            return False
        if index in g.data:
            self.stats.duplicate += 1
            return False
        if k is not None:
            if g.k_hint and g.k_hint != k:
                self.stats.mismatch += 1
                return False
            g.k_hint = k
        if g.table is not None and not self._fits(g.table, index, offset, len(raw)):
            self.stats.mismatch += 1
            return False
        if not self._charge(group, g, len(raw)):
            return False
        g.data[index] = (offset, raw)
        self.stats.data += 1
        want = g.table.k if g.table is not None else g.k_hint
        if want and len(g.data) == want:
            self.stats.complete_groups += 1
            self._close(group)
        return True

    def parity(self, group: Hashable, index: int,
               payload: bytes | bytearray | memoryview) -> bool:
        """Hold a parity payload (``fec_index`` = ``index``). Returns whether it was kept;
        raises :class:`FecError` on a malformed payload or index."""
        try:
            table = parse_parity(payload)
            if not table.k <= index < table.k + table.m:
                raise FecError(f"parity index {index} outside {table.k} .. "
                               f"{table.k + table.m - 1} (k={table.k}, m={table.m})")
            if table.itemsize != self.itemsize:
                raise FecError(f"piece table itemsize {table.itemsize}, decoder expects "
                               f"{self.itemsize}")
        except FecError:
            self.stats.rejected += 1
            raise
        g = self._group(group)
        if g is None:
            return False
        if g.table is None:
            if g.k_hint and table.k > g.k_hint:
                self.stats.mismatch += 1
                return False
            g.table = table
            for i, (off, raw) in list(g.data.items()):
                if not self._fits(table, i, off, len(raw)):
                    del g.data[i]
                    g.nbytes -= len(raw)
                    self._held -= len(raw)
                    self.stats.mismatch += 1
        elif g.table.prefix != table.prefix or g.table.block_len != table.block_len:
            self.stats.mismatch += 1
            return False
        j = index - table.k
        if j in g.parity:
            self.stats.duplicate += 1
            return False
        # A bytes payload is kept as is (a view of its block); anything else may be a
        # receive buffer the caller reuses, so its block is copied.
        keep = isinstance(payload, bytes)
        if not self._charge(group, g, len(payload) if keep else table.block_len):
            return False
        g.parity[j] = table.block if keep else memoryview(bytes(table.block))
        self.stats.parity += 1
        if len(g.data) == table.k:
            self.stats.complete_groups += 1
            self._close(group)
        return True

    def recover(self, group: Hashable) -> list[tuple[int, bytes]]:
        """The group's missing data pieces as (offset, payload), exact, once any k of its
        k + m datagrams arrived (the group is then finished); [] before that, and for a
        group that is unknown, finished, or had nothing missing."""
        g = self._open.get(group)
        if g is None or g.table is None:
            return []
        t = g.table
        if len(g.data) + len(g.parity) < t.k:
            return []
        missing = [i for i in range(t.k) if i not in g.data]
        if not missing:
            self.stats.complete_groups += 1
            self._close(group)
            return []
        block = t.block_len
        heads = _headers(t.k, t.m, block)
        frags: list[bytes] = []
        for i, (_, raw) in sorted(g.data.items()):
            frags.append(b"".join([heads[i], *_padded(raw, block)]))
        for j, par in sorted(g.parity.items())[:t.k - len(frags)]:
            frags.append(b"".join((heads[t.k + j], par)))
        try:  # cannot fail for well-formed input; if it does, say so and drop the group
            out = _driver(t.k, t.m)[0].decode(frags)
            if len(out) != t.k * block:
                raise FecError(f"{len(out)} bytes decoded, expected {t.k * block}")
        except (ECDriverError, FecError) as e:
            self.stats.rejected += 1
            self.stats.evicted_groups += 1
            self._close(group)
            raise FecError(f"group {group!r} did not decode: {e}") from None
        got = []
        for i in missing:
            off, count = t.pieces[i]
            got.append((off, out[i * block:i * block + count * t.itemsize]))
        self.stats.recovered += len(got)
        self.stats.decoded_groups += 1
        self._close(group)
        return got

    def forget(self, match: Callable[[Hashable], bool]) -> int:
        """Drop every open group whose key matches (e.g. of a committed iteration); returns
        how many. They count as evicted, and their late datagrams are ignored."""
        keys = [key for key in self._open if match(key)]
        for key in keys:
            self.stats.evicted_groups += 1
            self._close(key)
        return len(keys)

    # -- internals -------------------------------------------------------------------------

    def _fits(self, t: PieceTable, index: int, offset: int, nbytes: int) -> bool:
        return index < t.k and t.pieces[index] == (offset, nbytes // t.itemsize)

    def _group(self, key: Hashable) -> _Group | None:
        g = self._open.get(key)
        if g is not None:
            return g
        if key in self._closed:
            self.stats.late += 1
            return None
        while len(self._open) >= self.max_groups:
            self._evict_oldest()
        g = self._open[key] = _Group()
        return g

    def _charge(self, key: Hashable, g: _Group, nbytes: int) -> bool:
        if g.nbytes + nbytes > self.max_bytes:
            self.stats.over_budget += 1
            return False
        while self._held + nbytes > self.max_bytes:
            if next(iter(self._open)) == key:  # the oldest is this one: make it the newest
                self._open.move_to_end(key)
            self._evict_oldest()
        g.nbytes += nbytes
        self._held += nbytes
        return True

    def _evict_oldest(self) -> None:
        key = next(iter(self._open))
        self.stats.evicted_groups += 1
        self._close(key)

    def _close(self, key: Hashable) -> None:
        g = self._open.pop(key)
        self._held -= g.nbytes
        self._closed[key] = None
        while len(self._closed) > 4 * self.max_groups:
            self._closed.popitem(last=False)
