"""Repair messages between a shadow and the trainers (docs/protocol.md, "Repair").

A shadow that sees a hole in an iteration asks the trainer that sent the missing piece for
exactly what is missing; the trainer answers from the pieces it retained. Three kinds of
datagram, all ordinary ckm datagrams (56-byte header, CRC32C over the payload):

- request, shadow -> trainer (REPAIR_PORT): flags ``NACK`` (gradient elements) or
  ``NACK | CONTROL`` (the control message), dtype BYTES, ``iteration`` and ``partition`` of
  the hole, ``epoch``/``token`` of the shadow's session, payload = up to
  :data:`MAX_RANGES` big-endian ``(start u64, end u64)`` pairs: flat element ranges, or
  byte ranges of the control message (an empty payload asks for all of it); tagged like
  every data datagram (checkmate.protocol.datamac), so trainers answer only shadows of the job;
- answer, trainer -> shadow (SHADOW_PORT): the retained datagram again with flag ``ACK``
  added in place of ``REPLICATE`` (so no switch copies it and the shadow counts it as a
  repair), stamped with the shadow's current epoch/token;
- gone, trainer -> shadow: flags ``ACK | NACK``, count 0, ``iteration`` = the one asked
  for: the trainer no longer retains it. The shadow cannot be repaired and asks to be
  re-seeded.
"""

from __future__ import annotations

import struct

from checkmate.protocol import wire

_RANGE = struct.Struct("!QQ")
#: Ranges in one request: 16 bytes each, so a request stays far below one frame.
MAX_RANGES = 256

REQUEST = int(wire.Flags.NACK)
REQUEST_CONTROL = int(wire.Flags.NACK | wire.Flags.CONTROL)
ANSWER = int(wire.Flags.ACK)
ANSWER_CONTROL = int(wire.Flags.ACK | wire.Flags.CONTROL)
GONE = int(wire.Flags.ACK | wire.Flags.NACK)


def encode_ranges(ranges: list[tuple[int, int]]) -> bytes:
    """Payload of a request: at most MAX_RANGES (start, end) pairs, in order given."""
    if len(ranges) > MAX_RANGES:
        raise wire.WireError(f"{len(ranges)} ranges in one repair request (max {MAX_RANGES})")
    return b"".join(_RANGE.pack(a, b) for a, b in ranges)


def decode_ranges(payload: bytes | memoryview) -> list[tuple[int, int]]:
    """Ranges of a request payload; WireError if it is not whole pairs or a range is empty."""
    if len(payload) % _RANGE.size or len(payload) > MAX_RANGES * _RANGE.size:
        raise wire.WireError(f"repair payload of {len(payload)} bytes is not 1..{MAX_RANGES} "
                             "(start, end) pairs")
    out = [(a, b) for a, b in _RANGE.iter_unpack(payload)]
    if any(a >= b for a, b in out):
        raise wire.WireError("repair range with start >= end")
    return out


def request(job_id: int, epoch: int, token: int, iteration: int, partition: int,
            ranges: list[tuple[int, int]], control: bool = False, seq: int = 0,
            key: tuple[int, int] | None = None) -> bytes:
    """One request datagram (see the module docstring); with ``key`` (checkmate.protocol.datamac)
    it carries the tag a trainer checks, as every datagram a shadow takes does."""
    from checkmate.protocol import datamac

    payload = encode_ranges(ranges)
    flags = REQUEST_CONTROL if control else REQUEST
    tag = (0, 0, 0, 0) if key is None else datamac.data_tag(
        key, job_id, flags, iteration, 0, len(payload), partition, int(wire.DType.BYTES),
        wire.crc(payload))
    h = wire.Header(flags=flags, job_id=job_id, epoch=epoch, token=token, iteration=iteration,
                    partition=partition, count=len(payload), dtype=wire.DType.BYTES, seq=seq,
                    fec_index=tag[0], fec_k=tag[1], fec_m=tag[2], fec_group=tag[3])
    return wire.encode(h, payload)
