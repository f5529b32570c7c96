"""The state digest: what a shadow holds, checked against the trainers (issue 35).

Why: a shadow's state is meant to equal, bit for bit, what the trainers hold after the same
iteration, and nothing else checks that while a job runs; a shadow that applied a wrong
control message or a corrupted gradient, or whose memory flipped a bit, would serve a wrong
checkpoint without a word. Every ``verify_every`` iterations each trainer hashes its share
of every partition's state (``share_bounds``: the cut it seeds with, so no rank hashes more
than its share) as the shadows lay it out -- every slot of the spec (parameters, then the
optimizer's slots) over the share's elements, float32 as stored -- and rank 0 sends the
ranks' digests in the control message; the shadow hashes the same shares of what it
committed for that iteration and compares (shadow/state_check.py). The data-parallel
ranks' replica agreement (checkmate/train/replica_check.py) hashes their tensors with the
same function.

The function, built to run at memory speed where the state lives and to be keyed:

1. The bytes are read as a stream of 16-bit words ``u[q]`` (little-endian; a piece of the
   stream may start anywhere, so a trainer hashes its tensors where they are, one piece at
   a time, without first gathering them into one array).
2. Blocks of ``BLOCK`` words, per lane ``l``: ``v[b, l] = sum_j K[l, j] * u[b*BLOCK + j]
   mod P`` with ``P = 2**31 - 1`` and secret coefficients ``K`` from the key. This is a
   multilinear universal hash: two blocks that differ collide with probability ``1/P`` per
   lane, ``2**-62`` over both, whatever the difference. Every product and every block sum
   is exact in 64-bit integers, so the CPU kernel (Numba) and the device one (torch ops, on
   CUDA where the tensors are) give the same ``v``; it is linear in ``u``, so pieces add.
3. The digest is BLAKE2b-128, keyed, over the stream's length and ``v`` (4 bytes per block
   and lane: 1/1024 of the data). BLAKE2b is a pseudo-random function, so the digest
   reveals nothing of ``K``, and a host on the path without the run secret can neither
   learn the coefficients nor make a changed state hash alike (a CRC32C, which the
   datagrams carry, it can).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import re
import struct
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from numba import njit

_LABEL = b"checkmate state digest v2"
#: Bytes of a digest (hex in the control message: twice as many characters).
DIGEST_BYTES = 16
_HEX = re.compile(r"[0-9a-f]{32}")
#: Most ranks (rows) and partitions (per row) a control message may carry digests for.
MAX_ROWS = 4096
MAX_PARTITIONS = 4096
#: The field of the block hash (a Mersenne prime: products of a 16-bit word and a
#: coefficient stay under 2**47, a block's sum under 2**58).
P = (1 << 31) - 1
#: 16-bit words per block (4 KiB of data).
BLOCK = 2048
#: Independent coefficient sets: each block collides with probability 1/P per lane.
LANES = 2
#: Device work is done this many blocks at a time (bounds its int64 temporaries: 64 MiB).
_DEVICE_ROWS = 4096
#: A CPU piece of at least this many words is hashed by several threads (the kernel runs
#: without the GIL; whole blocks each, so no two write one block sum).
_PARALLEL_WORDS = 1 << 22
THREADS = max(1, min(8, os.cpu_count() or 1))


def digest_key(control_key: bytes | None) -> bytes:
    """The digest's key for a run whose control key is ``control_key`` (None: a job
    without a secret, whose digest is unkeyed: it still finds faults, not attacks)."""
    if control_key is None:
        return b""
    return hmac.new(control_key, _LABEL, hashlib.sha256).digest()


@functools.lru_cache(maxsize=8)
def coefficients(key: bytes) -> np.ndarray:
    """The block hash's coefficients ``K`` (LANES x BLOCK, each in [1, P)) for ``key``: a
    stream of SHAKE-256 over the key, so both sides derive the same ones."""
    raw = hashlib.shake_256(_LABEL + b" coefficients" + key).digest(LANES * BLOCK * 8)
    k = np.frombuffer(raw, dtype="<u8").reshape(LANES, BLOCK) % np.uint64(P - 1) + 1
    k = k.astype(np.int64)
    k.flags.writeable = False
    return k


@njit(cache=True, nogil=True, error_model="numpy")
def _add_words(u: np.ndarray, pos: int, k: np.ndarray, v: np.ndarray) -> None:
    """Add the words ``u`` (starting at stream word ``pos``) into the block sums ``v``."""
    n = u.size
    i = 0
    while i < n:
        q = pos + i
        b = q // BLOCK
        j0 = q - b * BLOCK
        m = min(BLOCK - j0, n - i)
        s0 = np.int64(0)
        s1 = np.int64(0)
        for j in range(m):
            x = np.int64(u[i + j])
            s0 += x * k[0, j0 + j]
            s1 += x * k[1, j0 + j]
        v[b, 0] = (v[b, 0] + s0 % P) % P
        v[b, 1] = (v[b, 1] + s1 % P) % P
        i += m


@functools.lru_cache(maxsize=1)
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(THREADS, thread_name_prefix="ckm-digest")


def _words(a: np.ndarray) -> np.ndarray:
    """``a``'s bytes as 16-bit words (a trailing odd byte padded with a zero)."""
    raw = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    if raw.size % 2:
        raw = np.concatenate([raw, np.zeros(1, np.uint8)])
    return raw.view("<u2")


def word_count(a: Any) -> int:
    """How many 16-bit words ``a`` (an array or a tensor) takes in the stream."""
    nbytes = a.numel() * a.element_size() if hasattr(a, "element_size") else a.nbytes
    return (nbytes + 1) // 2


def _device_sums(t: Any, pos: int, k: np.ndarray) -> tuple[int, np.ndarray]:
    """The block sums of a tensor not on the CPU, computed where it is: (first block,
    sums mod P, one row per block)."""
    import torch

    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if raw.numel() % 2:
        raw = torch.cat([raw, raw.new_zeros(1)])
    u = raw.view(torch.int16).to(torch.int64) & 0xFFFF
    j0 = pos % BLOCK
    n = u.numel()
    rows = -(-(j0 + n) // BLOCK)
    u = torch.nn.functional.pad(u, (j0, rows * BLOCK - j0 - n)).view(rows, BLOCK)
    kt = torch.from_numpy(k.copy()).to(u.device)
    out = []
    for r in range(0, rows, _DEVICE_ROWS):
        chunk = u[r:r + _DEVICE_ROWS]
        out.append(torch.stack([(chunk * kt[lane]).sum(1) % P for lane in range(LANES)], 1))
    return pos // BLOCK, torch.cat(out).cpu().numpy()


class StreamDigest:
    """The digest of a stream of ``words`` 16-bit words, added to a piece at a time."""

    def __init__(self, key: bytes, words: int) -> None:
        self.key, self.words = key, words
        self.k = coefficients(key)
        self.v = np.zeros((max(1, -(-words // BLOCK)), LANES), dtype=np.int64)

    def add(self, pos: int, data: Any) -> None:
        """Add ``data`` (a NumPy array, or a tensor on any device), whose first word is
        word ``pos`` of the stream."""
        if pos < 0 or pos + word_count(data) > self.words:
            raise ValueError(f"a piece of {word_count(data)} words at {pos} is outside the "
                             f"stream of {self.words}")
        if hasattr(data, "detach") and data.device.type != "cpu":
            b, sums = _device_sums(data, pos, self.k)
            self.v[b:b + len(sums)] = (self.v[b:b + len(sums)] + sums) % P
            return
        if hasattr(data, "detach"):
            data = data.detach().numpy()
        u = _words(data)
        if u.size < _PARALLEL_WORDS or THREADS < 2:
            _add_words(u, pos, self.k, self.v)
            return
        # cut at block edges of the stream: each thread's words fill blocks of their own
        per = -(-u.size // THREADS // BLOCK) * BLOCK
        first = (BLOCK - pos % BLOCK) % BLOCK
        cuts = [0] + [min(u.size, first + i * per) for i in range(THREADS)] + [u.size]
        spans = sorted({(a, b) for a, b in zip(cuts, cuts[1:], strict=False) if a < b})
        list(_pool().map(lambda s: _add_words(u[s[0]:s[1]], pos + s[0], self.k, self.v),
                         spans))

    def hexdigest(self) -> str:
        h = hashlib.blake2b(digest_size=DIGEST_BYTES, key=self.key)
        h.update(_LABEL + struct.pack("<Q", self.words))
        h.update(self.v.astype("<u4").tobytes())
        return h.hexdigest()


def digest(key: bytes, slots: Sequence[Any]) -> str:
    """The digest of ``slots`` one after the other (one share of each slot, spec order),
    float32 as the shadows store them."""
    return digest_pieces(key, [s.float() if hasattr(s, "float") else
                               np.asarray(s, dtype=np.float32) for s in slots])


def digest_pieces(key: bytes, pieces: Iterable[Any]) -> str:
    """The digest of ``pieces`` (arrays or tensors, any device) one after the other."""
    pieces = list(pieces)
    d = StreamDigest(key, sum(word_count(p) for p in pieces))
    pos = 0
    for p in pieces:
        d.add(pos, p)
        pos += word_count(p)
    return d.hexdigest()


def valid_rows(rows: object) -> bool:
    """Whether ``rows`` has the form of a control message's ``digests``: one list per rank
    of one hex digest per partition."""
    return (isinstance(rows, list) and 0 < len(rows) <= MAX_ROWS
            and all(isinstance(r, list) and 0 < len(r) <= MAX_PARTITIONS
                    and len(r) == len(rows[0])
                    and all(isinstance(d, str) and _HEX.fullmatch(d) for d in r)
                    for r in rows))
