"""The state digest: what a shadow holds, checked against the trainers (issue 35).

Why: a shadow's state is meant to equal, bit for bit, what the trainers hold after the same
iteration, and nothing else checks that while a job runs; a shadow that applied a wrong
control message or a corrupted gradient, or whose memory flipped a bit, would serve a wrong
checkpoint without a word. Every ``verify_every`` iterations each trainer hashes its share
of every partition's state (``share_bounds``: the cut it seeds with, so no rank hashes more
than its share) as the shadows lay it out -- every slot of the spec (parameters, then the
optimizer's slots) over the share's elements, their bytes as stored -- and rank 0 sends the
ranks' digests in the control message; the shadow hashes the same shares of what it
committed for that iteration and compares (checkmate.shadow.state).

The digest is BLAKE2b-128 keyed from the run's control key (checkmate.protocol.datamac), so
a host on the path without the run secret cannot make a changed state hash alike (a CRC32C,
which the datagrams carry, it can). It is a function of the bytes only: a GPU's state is
copied to the host and hashed there, so CPU and CUDA trainers give the same value.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Sequence

import numpy as np

_LABEL = b"checkmate state digest v1"
#: Bytes of a digest (hex in the control message: twice as many characters).
DIGEST_BYTES = 16
_HEX = re.compile(r"[0-9a-f]{32}")
#: Most ranks (rows) and partitions (per row) a control message may carry digests for.
MAX_ROWS = 4096
MAX_PARTITIONS = 4096


def digest_key(control_key: bytes | None) -> bytes:
    """The digest's key for a run whose control key is ``control_key`` (None: a job
    without a secret, whose digest is unkeyed: it still finds faults, not attacks)."""
    if control_key is None:
        return b""
    return hmac.new(control_key, _LABEL, hashlib.sha256).digest()


def digest(key: bytes, slots: Sequence[np.ndarray]) -> str:
    """Hex BLAKE2b-128 over the bytes of ``slots`` (one share of each slot, spec order), as
    the shadow stores them: float32."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES, key=key)
    for a in slots:
        h.update(memoryview(np.ascontiguousarray(a, dtype=np.float32)).cast("B"))
    return h.hexdigest()


def valid_rows(rows: object) -> bool:
    """Whether ``rows`` has the form of a control message's ``digests``: one list per rank
    of one hex digest per partition."""
    return (isinstance(rows, list) and 0 < len(rows) <= MAX_ROWS
            and all(isinstance(r, list) and 0 < len(r) <= MAX_PARTITIONS
                    and len(r) == len(rows[0])
                    and all(isinstance(d, str) and _HEX.fullmatch(d) for d in r)
                    for r in rows))
