"""Compiled ingest: one call validates a whole receive batch, one call per run places it.

The shadow's receive paths (UDP recvmmsg, the verbs ring) hand ``scan`` a batch: a byte
buffer, each datagram's offset and length, and the session (``params``). In one compiled
pass it does every per-datagram check of the receiver (checkmate.shadow.receiver, in the
order its docstring gives): header, data MAC (checkmate.protocol.datamac), session, length,
CRC32C, readiness, dtype, partition, range; drops are counted by reason into ``counts``. What
survives comes back as *events*: a run (datagrams of one iteration whose element ranges
follow each other, dropped datagrams between them skipped), or, one datagram each, a control
fragment, a trainer's "gone" answer, or a float16 piece. Python then works per event, and
``scatter`` copies a run's payloads into the staging buffer in one compiled call. Python per
datagram is left to the rare cases: control fragments, "gone", float16, and a run that
overlaps what already arrived (duplicates: the assembler's own per-datagram path decides).

Both release the GIL (the optimizer and persistence threads run meanwhile); callers hold the
receiver's lock, so the arrays they touch have one user at a time.

CRC32C: the crc32c package's C function (hardware, ~20 GB/s here) called through its address
from compiled code; where that package is missing or its function does not agree with
``crc32c.crc32c`` on test data, a compiled slicing-by-8 table (~1 GB/s), with one log line.
"""

from __future__ import annotations

import ctypes
import logging
import threading

import numpy as np
from llvmlite import ir
from numba import njit
from numba.core import cgutils, types
from numba.extending import intrinsic

from checkmate.protocol.datamac import good

log = logging.getLogger("checkmate.shadow")

#: Drop reasons counted here, in the order the receiver checks them (``counts`` indices).
REASONS = ("short", "magic", "version", "flags", "mac", "job", "epoch", "token", "length",
           "crc", "not_ready", "dtype", "partition", "range")
#: ``counts`` slots after the reasons: all drops, repair answers and their payload bytes.
TOTAL, ANSWERS, ANSWER_BYTES = len(REASONS), len(REASONS) + 1, len(REASONS) + 2
NCOUNTS = len(REASONS) + 3
#: ``params`` slots (uint64).
(P_JOB, P_EPOCH, P_TOKEN, P_PART, P_DTYPE, P_START, P_END, P_READY, P_MAC, P_K0, P_K1,
 P_CRC) = range(12)
NPARAMS = 12
#: Event kinds (column 0 of ``events``): (kind, i0, i1, iteration, a, b, c, m).
#: RUN: the m datagrams among i0..i1-1 with ``ok``, elements [a, b) of dtype c.
#: CTRL: datagram i0, control bytes [a, a+b) of a message of c bytes. GONE: datagram i0.
#: ONE: datagram i0, elements [a, a+b) of dtype c, placed by the assembler (float16).
RUN, CTRL, GONE, ONE = 1, 2, 3, 4

_HL = 56
_MAGIC, _VERSION = 0xC4EC, 1
_F_PARITY, _F_CONTROL, _F_ACK, _F_NACK = 0x02, 0x04, 0x10, 0x20
_F_BAD = 0x40 | 0x80  # HANDSHAKE | SEED
_BF16, _BYTES = 1, 3


# ----- CRC32C --------------------------------------------------------------------------
def _table() -> np.ndarray:
    t = np.zeros((8, 256), np.uint32)
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        t[0, i] = c
    for k in range(1, 8):
        for i in range(256):
            p = int(t[k - 1, i])
            t[k, i] = (p >> 8) ^ int(t[0, p & 0xFF])
    return t


_T = _table()


@njit(cache=True)
def _crc_table(buf, at, n):  # noqa: ANN001, ANN202
    """CRC32C of ``buf[at:at+n]``, slicing-by-8 (the fallback)."""
    t = _T
    c = np.uint32(0xFFFFFFFF)
    i, end = at, at + n
    while i + 8 <= end:
        lo = c ^ (np.uint32(buf[i]) | (np.uint32(buf[i + 1]) << np.uint32(8))
                  | (np.uint32(buf[i + 2]) << np.uint32(16))
                  | (np.uint32(buf[i + 3]) << np.uint32(24)))
        c = (t[7, lo & 0xFF] ^ t[6, (lo >> 8) & 0xFF] ^ t[5, (lo >> 16) & 0xFF]
             ^ t[4, lo >> 24] ^ t[3, buf[i + 4]] ^ t[2, buf[i + 5]] ^ t[1, buf[i + 6]]
             ^ t[0, buf[i + 7]])
        i += 8
    while i < end:
        c = t[0, (c ^ np.uint32(buf[i])) & 0xFF] ^ (c >> np.uint32(8))
        i += 1
    return c ^ np.uint32(0xFFFFFFFF)


@intrinsic
def _call_crc(typingctx, fn, crc, ptr, n):  # noqa: ANN001, ANN202, ARG001
    """``uint32 fn(uint32 crc, const uint8 *ptr, size_t n)`` at address ``fn``."""
    sig = types.uint32(types.uint64, types.uint32, types.uint64, types.uint64)

    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202, ARG001
        f, c, p, ln = args
        i8p = ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(ir.IntType(32), [ir.IntType(32), i8p, ir.IntType(64)])
        return builder.call(builder.inttoptr(f, fnty.as_pointer()),
                            [c, builder.inttoptr(p, i8p), ln])

    return sig, codegen


@intrinsic
def _memcpy(typingctx, dst, src, n):  # noqa: ANN001, ANN202, ARG001
    """memcpy(dst, src, n) on addresses (llvm.memcpy: the platform's fastest copy)."""
    sig = types.void(types.uint64, types.uint64, types.uint64)

    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202, ARG001
        d, s, ln = args
        i8p = ir.IntType(8).as_pointer()
        cgutils.raw_memcpy(builder, builder.inttoptr(d, i8p), builder.inttoptr(s, i8p), ln, 1)
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, inline="always")
def _crc(fn, buf, at, n):  # noqa: ANN001, ANN202
    if fn == 0:
        return _crc_table(buf, at, n)
    c = _call_crc(fn, np.uint32(0xFFFFFFFF), np.uint64(buf.ctypes.data + at), np.uint64(n))
    return c ^ np.uint32(0xFFFFFFFF)


@njit(cache=True)
def crc_of(fn, buf):  # noqa: ANN001, ANN201
    """CRC32C of the uint8 array ``buf`` with the function at ``fn`` (0: the table)."""
    return _crc(np.uint64(fn), buf, 0, buf.shape[0])


_CRC_FN: int | None = None


def crc_function(force_table: bool = False) -> int:
    """Address of the crc32c package's C CRC32C (``uint32 f(uint32, const uint8*, size_t)``,
    pre- and post-inverted by the caller, as the package's own wrapper does), checked
    against ``crc32c.crc32c`` on random data; 0 (the compiled table) where it is missing or
    disagrees, said in one log line."""
    global _CRC_FN
    if force_table:
        return 0
    if _CRC_FN is not None:
        return _CRC_FN
    try:
        import crc32c
        from crc32c import _crc32c

        lib = ctypes.CDLL(_crc32c.__file__)  # the loaded module: its init already ran
        name = "_crc32c_hw_adler" if crc32c.hardware_based else "_crc32c_sw_slicing_by_8"
        addr = ctypes.cast(getattr(lib, name), ctypes.c_void_p).value or 0
        rng = np.random.default_rng()
        for n in (0, 1, 7, 8, 63, 64, 1000, 8916):
            data = rng.integers(0, 256, n, dtype=np.uint8)
            if int(crc_of(addr, data)) != crc32c.crc32c(data.tobytes()):
                raise ValueError(f"{name} disagrees with crc32c.crc32c on {n} bytes")
        _CRC_FN = addr
    except Exception as e:  # noqa: BLE001 - any failure: the table, said once
        log.warning("CRC32C: the crc32c package's C function is not usable (%s: %s); "
                    "using the compiled table (~1 GB/s)", type(e).__name__, e)
        _CRC_FN = 0
    return _CRC_FN


# ----- the batch scan ------------------------------------------------------------------
@njit(cache=True)
def _be(buf, at, size):  # noqa: ANN001, ANN202
    x = np.uint64(0)
    for i in range(size):
        x = (x << np.uint64(8)) | np.uint64(buf[at + i])
    return x


@njit(cache=True, nogil=True)
def scan(buf, bases, lens, params, counts, ok, offs, events):  # noqa: ANN001, ANN201
    """Check datagrams i = 0..len(lens)-1 (``lens[i]`` bytes at ``buf[bases[i]:]``) as
    the receiver does; count drops into ``counts`` (zeroed first); ``ok[i]`` = 1 and
    ``offs[i]`` = its first element for gradient pieces that passed; fill ``events`` (at
    least len(lens) rows) in datagram order and return how many."""
    counts[:] = 0
    job, epoch, token = params[P_JOB], params[P_EPOCH], params[P_TOKEN]
    part, gdt = params[P_PART], params[P_DTYPE]
    start, end = params[P_START], params[P_END]
    ready, mac = params[P_READY] != 0, params[P_MAC] != 0
    k0, k1, fn = params[P_K0], params[P_K1], params[P_CRC]
    msg = np.zeros(40, np.uint8)
    ne = 0
    run = -1  # the open RUN event, or -1
    for i in range(lens.shape[0]):
        ok[i] = 0
        base, n = np.int64(bases[i]), np.int64(lens[i])
        if n < _HL:
            counts[0] += 1
            continue
        if _be(buf, base, 2) != _MAGIC:
            counts[1] += 1
            continue
        if buf[base + 2] != _VERSION:
            counts[2] += 1
            continue
        flags = buf[base + 3]
        if flags & _F_BAD:
            counts[3] += 1
            continue
        if mac and not good(k0, k1, buf, base, n, msg):
            counts[4] += 1  # not made with the job secret (or changed on the way)
            continue
        count = _be(buf, base + 32, 4)
        djob = _be(buf, base + 4, 4)
        depoch, dtoken = _be(buf, base + 8, 4), _be(buf, base + 12, 4)
        it = _be(buf, base + 16, 8)
        if flags & _F_NACK:
            # Only a trainer's "gone" answer may carry NACK here.
            if not flags & _F_ACK or count != 0 or n != _HL:
                counts[3] += 1
                continue
        # The session, checked once for every kind: the first of job, epoch, token that
        # differs (its ``counts`` index), 0 when it is the current session's.
        bad = 5 if djob != job else 6 if depoch != epoch else 7 if dtoken != token else 0
        if flags & _F_NACK:  # a trainer's "gone" answer (ACK | NACK, checked above)
            if bad == 0:
                events[ne, 0], events[ne, 1], events[ne, 3] = GONE, i, it
                ne += 1
                run = -1
                continue
        elif flags & _F_ACK and bad != 5:  # a repair answer of this job
            counts[ANSWERS] += 1
            counts[ANSWER_BYTES] += n - _HL
        if bad:
            counts[bad] += 1
            continue
        dtype = buf[base + 44]
        size = 4 if dtype == 0 else 2 if dtype == 1 or dtype == 2 else 1 if dtype == 3 else 0
        if size == 0 or np.int64(count) * size != n - _HL:
            counts[8] += 1
            continue
        if np.uint64(_crc(fn, buf, base + _HL, n - _HL)) != _be(buf, base + 52, 4):
            counts[9] += 1
            continue
        if not ready:
            counts[10] += 1
            continue
        offset = _be(buf, base + 24, 8)
        if flags & _F_CONTROL:
            if dtype != _BYTES:
                counts[11] += 1
                continue
            if _be(buf, base + 42, 2) != part:  # another shadow's copy: nothing of it used
                counts[12] += 1
                continue
            events[ne, 0], events[ne, 1], events[ne, 3] = CTRL, i, it
            events[ne, 4], events[ne, 5] = offset, count
            events[ne, 6] = _be(buf, base + 48, 4)
            ne += 1
            run = -1
            continue
        if flags & _F_PARITY:
            counts[3] += 1
            continue
        if dtype != gdt:
            counts[11] += 1
            continue
        if _be(buf, base + 42, 2) != part:
            counts[12] += 1
            continue
        if offset < start or offset > end or count > end - offset or count == 0:
            counts[13] += 1
            continue
        if dtype == 0 or dtype == _BF16:
            ok[i], offs[i] = 1, offset
            if run >= 0 and events[run, 3] == it and events[run, 5] == offset:
                events[run, 2] = i + 1
                events[run, 5] = offset + count
                events[run, 7] += 1
                continue
            run = ne
            events[ne, 0], events[ne, 1], events[ne, 2], events[ne, 3] = RUN, i, i + 1, it
            events[ne, 4], events[ne, 5], events[ne, 6] = offset, offset + count, dtype
            events[ne, 7] = 1
            ne += 1
            continue
        events[ne, 0], events[ne, 1], events[ne, 3] = ONE, i, it
        events[ne, 4], events[ne, 5], events[ne, 6] = offset, count, dtype
        ne += 1
        run = -1
    total = 0
    for r in range(len(REASONS)):
        total += counts[r]
    counts[TOTAL] = total
    return ne


@njit(cache=True, nogil=True)
def scatter(buf, bases, lens, ok, offs, i0, i1, dst, start, dtype):  # noqa: ANN001, ANN201
    """Copy the payloads of datagrams i0..i1-1 that passed (``ok``) into the fp32 staging
    bytes ``dst`` at element ``offs[i] - start``: float32 as is, bfloat16 widened."""
    for i in range(i0, i1):
        if not ok[i]:
            continue
        src = np.int64(bases[i]) + _HL
        n = np.int64(lens[i]) - _HL
        at = 4 * np.int64(offs[i] - start)
        if dtype == 0:
            if at < 0 or at + n > dst.shape[0] or src + n > buf.shape[0]:
                raise IndexError("scatter: a piece outside its buffers")
            _memcpy(np.uint64(dst.ctypes.data + at), np.uint64(buf.ctypes.data + src),
                    np.uint64(n))
        else:
            for j in range(n // 2):
                d = at + 4 * j
                dst[d] = 0
                dst[d + 1] = 0
                dst[d + 2] = buf[src + 2 * j]
                dst[d + 3] = buf[src + 2 * j + 1]


class Batch:
    """The arrays ``scan`` fills, sized for batches of up to ``size`` datagrams."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.params = np.zeros(NPARAMS, np.uint64)
        self.counts = np.zeros(NCOUNTS, np.int64)
        self.ok = np.zeros(size, np.uint8)
        self.offs = np.zeros(size, np.uint64)
        self.events = np.zeros((size, 8), np.uint64)

    def fit(self, k: int) -> None:
        """Grow to take a batch of ``k`` datagrams (the verbs ring may hand more)."""
        if k > self.size:
            self.__init__(max(k, 2 * self.size))  # type: ignore[misc]


_WARMED = False
#: One thread compiles; the others (a receive thread, the node's warm-up) wait for it.
_WARM_LOCK = threading.Lock()


def warm() -> None:
    """Compile (or load from Numba's cache) both functions for the array types the receivers
    pass -- UDP: lengths read in place from the mmsghdr array (strided uint32); verbs: int64
    arrays -- so a shadow's first batch does not wait for the compiler. Once per process;
    a second caller waits for the first one's compile."""
    global _WARMED
    with _WARM_LOCK:
        if not _WARMED:
            _warm()
            _WARMED = True


def _warm() -> None:
    b = Batch(1)
    b.params[P_CRC] = crc_function()
    buf = np.zeros(_HL, np.uint8)
    bases = np.zeros(1, np.int64)
    for lens in (np.zeros(2, np.uint32)[::2], np.zeros(1, np.int64)):
        scan(buf, bases, lens, b.params, b.counts, b.ok, b.offs, b.events)
        scatter(buf, bases, lens, b.ok, b.offs, 0, 0, np.zeros(4, np.uint8), np.uint64(0), 0)
