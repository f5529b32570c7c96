"""Per-datagram MACs on the replica stream (docs/protocol.md, "Authenticated data").

Every gradient datagram a shadow may take (a REPLICATE piece, its repair answer) carries a
56-bit tag in the header fields it does not otherwise use (``fec_index``, ``fec_k``,
``fec_m``, ``fec_group``); a CONTROL fragment a 32-bit tag in ``seq`` (its ``fec_*``
fields say which message it belongs to, so the tag covers them). The tag is SipHash-2-4,
keyed from the job secret, over the fields that say what the payload is and where it goes
(job, flags, iteration, offset, count, partition, dtype) and the payload's CRC32C; the
fields the switch rewrites (epoch, token) and the ring's own (seq, bucket) are left out, so
a copy keeps its trainer's tag. A host without the secret cannot make a datagram the shadow
accepts, whether or not it can read the stream; on the path it can still change a payload
into another with the same CRC32C (docs/security.md).

SipHash rather than HMAC: the shadow checks a whole receive batch in one compiled call
(checkmate.shadow.ingest inlines ``good``), tens of nanoseconds a datagram, where hashlib
costs ~0.5 µs a datagram from Python (measured: docs/benchmarks.md, "ingest"). Control
messages are authenticated whole, once per iteration, with HMAC-SHA256 (``control_mac``),
on top of each fragment's tag.

Keys are per run: the trainers' rank 0 draws a run nonce R at every start (fresh, resumed,
or a restarted attempt) and tells each shadow in its ``peers`` request; every key here is
derived from ``run_secret(S, R)`` instead of the job secret S, so a datagram or control
message captured in one run verifies in no other (docs/security.md, "Replay").
"""

from __future__ import annotations

import hashlib
import hmac
import struct

import numpy as np
from numba import njit

_LABEL = b"checkmate data v1"
_CTL_LABEL = b"checkmate control v1"
_RUN_LABEL = b"checkmate run v1|"
_CTL = struct.Struct("!4sIQ")
#: Bytes of the HMAC that ends a control message.
CONTROL_MAC = 32
TAG_BITS = 56


def valid_run(run: object) -> bool:
    """Whether ``run`` is a run nonce: 32 lowercase hex digits (or "" for no run)."""
    return isinstance(run, str) and (run == "" or (
        len(run) == 32 and all(c in "0123456789abcdef" for c in run)))


def run_secret(secret: bytes, run: str) -> bytes:
    """The secret every per-datagram key of run ``run`` derives from: HMAC-SHA256(S, "checkmate
    run v1|" | R) for a run nonce R (32 hex digits), S itself for the empty run (tools such
    as ``shadow feed`` that speak for no trainer run). It has the job secret's form, so a
    component that derives keys from a secret file (the NCCL plugin) takes it as one."""
    if not valid_run(run):
        raise ValueError("a run nonce is 32 lowercase hex digits")
    if not run:
        return secret
    return hmac.new(secret, _RUN_LABEL + run.encode(), hashlib.sha256).digest()


def data_key(secret: bytes) -> tuple[int, int]:
    """The two 64-bit SipHash key words (little-endian halves of a derived 16-byte key)."""
    k = hmac.new(secret, _LABEL, hashlib.sha256).digest()[:16]
    return int.from_bytes(k[:8], "little"), int.from_bytes(k[8:], "little")


def control_key(secret: bytes) -> bytes:
    return hmac.new(secret, _CTL_LABEL, hashlib.sha256).digest()


def control_mac(key: bytes, job: int, iteration: int, body: bytes) -> bytes:
    """The 32 bytes that end control message ``body`` of ``iteration``."""
    return hmac.new(key, _CTL.pack(b"ctl1", job, iteration) + body, hashlib.sha256).digest()


# ----- SipHash-2-4 ---------------------------------------------------------------------
@njit(cache=True, inline="always")
def _rotl(x, b):  # noqa: ANN001, ANN202
    return (x << np.uint64(b)) | (x >> np.uint64(64 - b))


@njit(cache=True, inline="always")
def _round(v0, v1, v2, v3):  # noqa: ANN001, ANN202
    v0 += v1
    v1 = _rotl(v1, 13)
    v1 ^= v0
    v0 = _rotl(v0, 32)
    v2 += v3
    v3 = _rotl(v3, 16)
    v3 ^= v2
    v0 += v3
    v3 = _rotl(v3, 21)
    v3 ^= v0
    v2 += v1
    v1 = _rotl(v1, 17)
    v1 ^= v2
    v2 = _rotl(v2, 32)
    return v0, v1, v2, v3


@njit(cache=True)
def siphash24(k0, k1, data):  # noqa: ANN001, ANN201
    """SipHash-2-4 of the bytes ``data`` (uint8 array) under key (k0, k1)."""
    k0, k1 = np.uint64(k0), np.uint64(k1)
    v0 = k0 ^ np.uint64(0x736F6D6570736575)
    v1 = k1 ^ np.uint64(0x646F72616E646F6D)
    v2 = k0 ^ np.uint64(0x6C7967656E657261)
    v3 = k1 ^ np.uint64(0x7465646279746573)
    n = data.shape[0]
    full = n - n % 8
    for i in range(0, full, 8):
        m = np.uint64(0)
        for j in range(8):
            m |= np.uint64(data[i + j]) << np.uint64(8 * j)
        v3 ^= m
        v0, v1, v2, v3 = _round(v0, v1, v2, v3)
        v0, v1, v2, v3 = _round(v0, v1, v2, v3)
        v0 ^= m
    b = np.uint64(n & 0xFF) << np.uint64(56)
    for j in range(n - full):
        b |= np.uint64(data[full + j]) << np.uint64(8 * j)
    v3 ^= b
    v0, v1, v2, v3 = _round(v0, v1, v2, v3)
    v0, v1, v2, v3 = _round(v0, v1, v2, v3)
    v0 ^= b
    v2 ^= np.uint64(0xFF)
    for _ in range(4):
        v0, v1, v2, v3 = _round(v0, v1, v2, v3)
    return v0 ^ v1 ^ v2 ^ v3


@njit(cache=True, inline="always")
def _be(buf, at, size):  # noqa: ANN001, ANN202
    x = np.uint64(0)
    for i in range(size):
        x = (x << np.uint64(8)) | np.uint64(buf[at + i])
    return x


@njit(cache=True, inline="always")
def _put_le(msg, at, x, size):  # noqa: ANN001, ANN202
    for i in range(size):
        msg[at + i] = np.uint8((x >> np.uint64(8 * i)) & np.uint64(0xFF))


@njit(cache=True, inline="always")
def _put_fields(msg, job, flags, partition, dtype, iteration, offset, count, crc):  # noqa: ANN001, ANN202, E501
    """The MAC input's first 32 bytes: job u32, flags u8, partition u16, dtype u8,
    iteration u64, offset u64, count u32, crc32c u32, little-endian."""
    _put_le(msg, 0, job, 4)
    _put_le(msg, 4, flags, 1)
    _put_le(msg, 5, partition, 2)
    _put_le(msg, 7, dtype, 1)
    _put_le(msg, 8, iteration, 8)
    _put_le(msg, 16, offset, 8)
    _put_le(msg, 24, count, 4)
    _put_le(msg, 28, crc, 4)


@njit(cache=True)
def _message(hdr, base, msg):  # noqa: ANN001, ANN202
    """The MAC input of the packed header at ``hdr[base:]`` (_put_fields), then, for
    CONTROL only, fec_index, fec_k, fec_m u8, fec_group u32 and a zero byte:
    32 or 40."""
    _put_fields(msg, _be(hdr, base + 4, 4), _be(hdr, base + 3, 1), _be(hdr, base + 42, 2),
                _be(hdr, base + 44, 1), _be(hdr, base + 16, 8), _be(hdr, base + 24, 8),
                _be(hdr, base + 32, 4), _be(hdr, base + 52, 4))
    if hdr[base + 3] & 0x04:  # CONTROL: the message length is part of the claim
        for i in range(3):
            msg[32 + i] = hdr[base + 45 + i]
        _put_le(msg, 35, _be(hdr, base + 48, 4), 4)
        msg[39] = 0
        return 40
    return 32


@njit(cache=True)
def _tag_of(k0, k1, hdr, base):  # noqa: ANN001, ANN202
    msg = np.zeros(40, np.uint8)
    n = _message(hdr, base, msg)
    return siphash24(k0, k1, msg[:n])


@njit(cache=True, inline="always")
def good(k0, k1, ring, base, length, msg):  # noqa: ANN001, ANN202
    """Whether the datagram at ``ring[base:]`` carries the tag its header and CRC call
    for: 32 bits in ``seq`` for CONTROL, else 56 in the fec fields; too short
    ones fail (they are dropped as short anyway)."""
    if length < 56:
        return False
    flags = ring[base + 3]
    t = siphash24(k0, k1, msg[:_message(ring, base, msg)])
    if flags & 0x04:
        return (t & np.uint64(0xFFFFFFFF)) == _be(ring, base + 36, 4)
    return (t >> np.uint64(8)) == _be(ring, base + 45, 7)


@njit(cache=True)
def check_batch(k0, k1, ring, lens, slot, ok):  # noqa: ANN001, ANN201
    """``ok[i]`` = 1 when datagram i of a batch (``ring[i*slot:]``, ``lens[i]`` bytes)
    is good (``good``)."""
    msg = np.zeros(40, np.uint8)
    for i in range(lens.shape[0]):
        ok[i] = 1 if good(k0, k1, ring, i * slot, lens[i], msg) else 0
    return ok


@njit(cache=True)
def check_at(k0, k1, buf, bases, lens, ok):  # noqa: ANN001, ANN201
    """``ok[i]`` = 1 when the datagram at ``buf[bases[i]:]`` (``lens[i]`` bytes) is good
    (``good``): for receive rings whose completions name any slot (the verbs ring)."""
    msg = np.zeros(40, np.uint8)
    for i in range(lens.shape[0]):
        ok[i] = 1 if good(k0, k1, buf, bases[i], lens[i], msg) else 0
    return ok


# ----- the sender's side ---------------------------------------------------------------
_U64 = "uint64"


@njit(f"{_U64}({', '.join([_U64] * 10)})", cache=True)
def tag56(k0, k1, job, flags, iteration, offset, count, partition, dtype, crc):  # noqa: ANN001, ANN202
    """The 56-bit tag from the fields themselves (typed: one call costs ~0.35 µs)."""
    msg = np.zeros(32, np.uint8)
    _put_fields(msg, job, flags, partition, dtype, iteration, offset, count, crc)
    return siphash24(k0, k1, msg) >> np.uint64(8)


def split(tag: int) -> tuple[int, int, int, int]:
    """(fec_index, fec_k, fec_m, fec_group): the header fields a 56-bit tag goes in."""
    return (tag >> 48) & 0xFF, (tag >> 40) & 0xFF, (tag >> 32) & 0xFF, tag & 0xFFFFFFFF


def data_tag(key: tuple[int, int], job: int, flags: int, iteration: int, offset: int,
             count: int, partition: int, dtype: int, crc: int) -> tuple[int, int, int, int]:
    """(fec_index, fec_k, fec_m, fec_group) carrying the 56-bit tag of a data datagram."""
    return split(int(tag56(key[0], key[1], job, flags, iteration, offset, count, partition,
                           dtype, crc)))


def control_tag(key: tuple[int, int], header: bytes) -> int:
    """The ``seq`` of a CONTROL fragment whose other header fields are
    ``header`` (packed; its ``seq`` is not read)."""
    # uint64 key words: a Python int of 2^63 or more does not convert to Numba's int64.
    return int(_tag_of(np.uint64(key[0]), np.uint64(key[1]),
                       np.frombuffer(header, np.uint8), 0)) & 0xFFFFFFFF
