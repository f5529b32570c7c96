"""The shadow service's frames: a 4-byte length, a JSON header, a raw payload.

Both ends use them: the shadow's TCP service (checkmate.shadow.service) and the
trainers' client (checkmate.train.shadow_client)."""

from __future__ import annotations

import json
import socket
import struct
import time
from collections.abc import Mapping
from typing import Any

from checkmate.errors import CheckmateError

_LEN = struct.Struct("!I")
#: Largest JSON header either side accepts (a spec of a very large model fits).
MAX_HEADER = 64 << 20
#: Bytes a single ``seed`` request may carry; bigger shares are split.
SEED_CHUNK = 64 << 20

Addr = tuple[str, int]


class ShadowError(CheckmateError):
    """A shadow refused a request or could not be reached; the message says which and why."""


# ----- framing (shared with the server in checkmate.shadow.service) -----------------------
def send_frame(sock: socket.socket, header: Mapping[str, Any], payload: Any = b"") -> None:
    """One frame; ``payload`` is bytes-like or a list of bytes-like parts (no joining)."""
    parts = payload if isinstance(payload, (list, tuple)) else [payload]
    views = [memoryview(p).cast("B") for p in parts]
    head = dict(header)
    head["nbytes"] = sum(v.nbytes for v in views)
    text = json.dumps(head, separators=(",", ":")).encode()
    sock.sendall(_LEN.pack(len(text)) + text)
    for v in views:
        if v.nbytes:
            sock.sendall(v)


#: The first buffer of a read; it doubles as bytes arrive, up to what was asked for.
_FIRST_BUFFER = 1 << 20


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> memoryview:
    """Exactly ``n`` bytes; ConnectionError on early EOF, TimeoutError past ``deadline``
    (a time.monotonic() value: a peer that trickles bytes cannot hold the reader forever).
    The buffer grows with what arrives (doubling from 1 MiB), so a peer that announces a
    large frame and stalls pins about what it sent, not what it announced; callers still
    check ``n`` against their limits first."""
    buf = bytearray(min(n, _FIRST_BUFFER))
    got = 0
    while got < n:
        if got == len(buf):  # full, more to come: grow (no view of buf is alive here)
            buf.extend(bytes(min(len(buf), n - len(buf))))
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"frame not complete in time ({got} of {n} bytes)")
            sock.settimeout(left)
        with memoryview(buf) as view:
            k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError(f"peer closed the connection after {got} of {n} bytes")
        got += k
    return memoryview(buf)


def recv_frame(sock: socket.socket, max_payload: Any = None, max_header: int = MAX_HEADER,
               deadline: float | None = None) -> tuple[dict, memoryview]:
    """(header, payload) of one frame; ConnectionError on EOF, TimeoutError past
    ``deadline``, ShadowError if malformed or too big. ``max_payload``: a byte limit, or a
    function of the header giving one (checked before any payload byte is read)."""
    (n,) = _LEN.unpack(recv_exact(sock, 4, deadline))
    if n > max_header:
        raise ShadowError(f"frame header of {n} bytes exceeds the {max_header} byte limit")
    try:
        header = json.loads(bytes(recv_exact(sock, n, deadline)))
    except RecursionError:
        raise ShadowError("frame header is nested too deeply") from None
    except ValueError:
        raise ShadowError("frame header is not JSON") from None
    if not isinstance(header, dict):
        raise ShadowError("frame header is not a JSON object")
    nbytes = header.get("nbytes", 0)
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
        raise ShadowError(f"frame nbytes must be a non-negative integer, got {nbytes!r}")
    limit = max_payload(header) if callable(max_payload) else max_payload
    if limit is not None and nbytes > limit:
        raise ShadowError(f"frame payload of {nbytes} bytes exceeds the {limit} byte limit "
                          f"for {str(header.get('op'))[:40]!r}")
    payload = recv_exact(sock, nbytes, deadline) if nbytes else memoryview(b"")
    return header, payload
