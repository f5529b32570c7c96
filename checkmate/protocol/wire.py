"""The ckm wire protocol: the one definition of the header every component speaks.

A ckm datagram is a UDP datagram whose destination port lies in CKM_PORT_BASE ..
CKM_PORT_BASE + CKM_PORT_COUNT - 1, whose payload starts with the fixed 56-byte header
below (network byte order) followed by ``count`` elements of ``dtype``.

This module is the source of truth. The BPF C view (dataplane/bpf/ckm_wire.h), the P4
view (p4/include/ckm_headers.p4) and the NCCL C view (nccl_plugin/ckm_wire.h) are produced
by :mod:`checkmate.protocol.wire_gen` from :data:`FIELDS`, and a test fails when a checked-in view
drifts from what the generator writes.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass, field, replace

import crc32c as _crc32c

from checkmate.errors import CheckmateError

MAGIC = 0xC4EC
VERSION = 1
HEADER_LEN = 56
CKM_PORT_BASE = 47000
CKM_PORT_COUNT = 1024
#: Largest payload that fits one jumbo frame (MTU 9000 - IPv4 20 - UDP 8 - header 56).
MAX_PAYLOAD_JUMBO = 9000 - 20 - 8 - HEADER_LEN


class Flags(enum.IntFlag):
    """Bits of the ``flags`` byte."""

    REPLICATE = 0x01  # the switch copies this datagram to the shadow owning ``partition``
    PARITY = 0x02  # reserved (FEC parity, removed): shadows drop it
    CONTROL = 0x04  # payload is a per-iteration control message (JSON), not elements
    LAST = 0x08  # last datagram of its bucket for this iteration from this sender
    ACK = 0x10  # reliability: receiver acknowledges ``seq``
    NACK = 0x20  # reliability: receiver asks for ``seq`` again
    HANDSHAKE = 0x40  # shadow <-> controller registration (payload JSON)
    SEED = 0x80  # payload is initial model/optimizer state, not a gradient


class DType(enum.IntEnum):
    """Element types on the wire (``dtype`` byte)."""

    FLOAT32 = 0
    BFLOAT16 = 1
    FLOAT16 = 2
    BYTES = 3  # opaque bytes (control, handshake, seed blobs)


DTYPE_SIZE = {DType.FLOAT32: 4, DType.BFLOAT16: 2, DType.FLOAT16: 2, DType.BYTES: 1}


@dataclass(frozen=True)
class Field:
    """One header field: name, byte offset, width in bytes, and why it exists."""

    name: str
    offset: int
    size: int
    doc: str


#: The header layout. Every other view of the protocol is generated from this table.
FIELDS: tuple[Field, ...] = (
    Field("magic", 0, 2, "0xC4EC; anything else is not ckm"),
    Field("version", 2, 1, "protocol version, currently 1"),
    Field("flags", 3, 1, "Flags bits: REPLICATE, PARITY, CONTROL, LAST, ACK, NACK, ..."),
    Field("job_id", 4, 4, "training job the datagram belongs to"),
    Field("epoch", 8, 4, "session epoch handed out by the controller at registration"),
    Field("token", 12, 4, "session token handed out with the epoch"),
    Field("iteration", 16, 8, "training iteration the payload belongs to"),
    Field("offset", 24, 8, "element offset in the flat parameter space"),
    Field("count", 32, 4, "number of elements (or bytes for DType.BYTES) in the payload"),
    Field("seq", 36, 4, "per-sender sequence number, for loss detection and acks"),
    Field("bucket", 40, 2, "gradient bucket id"),
    Field("partition", 42, 2, "partition (shadow) that owns offset .. offset+count"),
    Field("dtype", 44, 1, "DType of the payload elements"),
    Field("fec_index", 45, 1, "index of this datagram inside its FEC group"),
    Field("fec_k", 46, 1, "data datagrams per FEC group (0: no FEC)"),
    Field("fec_m", 47, 1, "parity datagrams per FEC group"),
    Field("fec_group", 48, 4, "FEC group id; ack/nack reference for control datagrams"),
    Field("crc32c", 52, 4, "CRC32C (Castagnoli) of the payload only"),
)

#: A mesh job (pipeline or tensor parallel beside data parallel) is several data-parallel
#: groups, each with its own shadows: on the wire a group is a job of its own, its
#: ``job_id`` the job's with the group number + 1 in the top byte (GROUP_SHIFT). So every
#: component keys a group as it keys a job (the switch's tables, the shadows' ingest, the
#: datagram and control keys), and a datagram of one group is refused by another group's
#: shadows as another job's would be. A plain data-parallel job is group-less: its own id.
GROUP_SHIFT = 24
MAX_GROUPS = (1 << (32 - GROUP_SHIFT)) - 1


def group_job_id(job_id: int, group: int, groups: int) -> int:
    """The wire job id of data-parallel ``group`` (of ``groups``) of job ``job_id``."""
    if groups == 1:
        return job_id
    if not 0 < job_id < 1 << GROUP_SHIFT:
        raise CheckmateError(f"a job with {groups} data-parallel groups needs a job id below "
                             f"{1 << GROUP_SHIFT} (its groups take the top byte), got {job_id}")
    if not 0 <= group < groups <= MAX_GROUPS:
        raise CheckmateError(f"data-parallel group {group} of {groups}: at most {MAX_GROUPS} "
                             "groups per job")
    return job_id | (group + 1) << GROUP_SHIFT


_FMT = {1: "B", 2: "H", 4: "I", 8: "Q"}
STRUCT = struct.Struct("!" + "".join(_FMT[f.size] for f in FIELDS))
assert STRUCT.size == HEADER_LEN
assert all(a.offset + a.size == b.offset for a, b in zip(FIELDS, FIELDS[1:], strict=False))


class WireError(CheckmateError, ValueError):
    """A datagram that is not a well-formed ckm datagram; the message says why."""


@dataclass(frozen=True)
class Header:
    """A decoded ckm header. ``crc32c`` is filled in by :func:`encode`."""

    flags: int = 0
    job_id: int = 0
    epoch: int = 0
    token: int = 0
    iteration: int = 0
    offset: int = 0
    count: int = 0
    seq: int = 0
    bucket: int = 0
    partition: int = 0
    dtype: int = DType.FLOAT32
    fec_index: int = 0
    fec_k: int = 0
    fec_m: int = 0
    fec_group: int = 0
    crc32c: int = 0
    magic: int = field(default=MAGIC)
    version: int = field(default=VERSION)

    def with_(self, **changes: int) -> Header:
        return replace(self, **changes)

    @property
    def payload_len(self) -> int:
        return self.count * DTYPE_SIZE[DType(self.dtype)]


def crc(payload: bytes | bytearray | memoryview) -> int:
    """CRC32C of a payload, the checksum carried in the header."""
    return _crc32c.crc32c(payload)


def pack_header(h: Header) -> bytes:
    return STRUCT.pack(*(getattr(h, f.name) for f in FIELDS))


def encode(h: Header, payload: bytes | bytearray | memoryview = b"") -> bytes:
    """Header plus payload, with ``count`` checked and the CRC32C computed here."""
    if h.payload_len != len(payload):
        raise WireError(
            f"payload is {len(payload)} bytes but count={h.count} of {DType(h.dtype).name} "
            f"needs {h.payload_len}"
        )
    return pack_header(replace(h, crc32c=crc(payload))) + bytes(payload)


def decode_header(buf: bytes | bytearray | memoryview) -> Header:
    """Parse only the header; raises WireError for anything that is not ckm v1."""
    if len(buf) < HEADER_LEN:
        raise WireError(f"datagram of {len(buf)} bytes is shorter than the ckm header")
    values = STRUCT.unpack_from(buf, 0)
    h = Header(**{f.name: v for f, v in zip(FIELDS, values, strict=True)})
    if h.magic != MAGIC:
        raise WireError(f"bad magic 0x{h.magic:04x}")
    if h.version != VERSION:
        raise WireError(f"unsupported ckm version {h.version}")
    if h.dtype not in DTYPE_SIZE:
        raise WireError(f"unknown dtype {h.dtype}")
    return h


def decode(
    buf: bytes | bytearray | memoryview, *, verify: bool = True
) -> tuple[Header, memoryview]:
    """Header and payload view; checks length and (unless ``verify`` is False) the CRC32C."""
    h = decode_header(buf)
    payload = memoryview(buf)[HEADER_LEN:]
    if len(payload) != h.payload_len:
        raise WireError(f"payload is {len(payload)} bytes, header says {h.payload_len}")
    if verify and crc(payload) != h.crc32c:
        raise WireError("payload CRC32C mismatch")
    return h, payload


def is_ckm_port(port: int) -> bool:
    return CKM_PORT_BASE <= port < CKM_PORT_BASE + CKM_PORT_COUNT
