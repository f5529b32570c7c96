"""Build and send one iteration's datagrams to a shadow, as a trainer would.

Used by the loopback tests, the ingest bench and anyone driving a shadow without a switch.
The datagram layout follows docs/protocol.md: gradient chunks with REPLICATE split at the
partition boundary, and the control message fragmented as BYTES with CONTROL.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np

from checkmate.protocol import auth, datamac, wire

_DT = {"float32": wire.DType.FLOAT32, "bfloat16": wire.DType.BFLOAT16,
       "float16": wire.DType.FLOAT16}


def encode_grad(values: np.ndarray, dtype: str) -> bytes:
    """Wire bytes (little-endian) of fp32 values in ``dtype`` (bf16 truncates to 16 bits
    after round-to-nearest-even, as torch's .to(bfloat16) does)."""
    v = np.ascontiguousarray(values, dtype=np.float32)
    if dtype == "float32":
        return v.astype("<f4").tobytes()
    if dtype == "float16":
        return v.astype("<f2").tobytes()
    import torch

    return torch.from_numpy(v).to(torch.bfloat16).view(torch.int16).numpy().astype(
        "<i2").tobytes()


def _secret(secret: bytes | None) -> bytes:
    return secret if secret is not None else auth.load_secret()


def grad_datagrams(job: int, it: int, partition: int, start: int, grad: np.ndarray,
                   chunk: int = 2048, dtype: str = "float32", epoch: int = 0,
                   token: int = 0, secret: bytes | None = None,
                   mac: bool = True, run: str = "") -> Iterator[bytes]:
    """Datagrams carrying ``grad`` (the partition's values, global offset ``start``), each
    with its checkmate.protocol.datamac tag (``secret``: default $CHECKMATE_SECRET_FILE's; ``mac``
    False sends none, only to measure what checking them costs)."""
    key = datamac.data_key(datamac.run_secret(_secret(secret), run)) if mac else None
    flags = int(wire.Flags.REPLICATE)
    for a in range(0, len(grad), chunk):
        part = grad[a:a + chunk]
        payload = encode_grad(part, dtype)
        tag = (0, 0, 0, 0) if key is None else datamac.data_tag(
            key, job, flags, it, start + a, len(part), partition, _DT[dtype], wire.crc(payload))
        h = wire.Header(flags=flags, job_id=job, epoch=epoch, token=token, iteration=it,
                        offset=start + a, count=len(part), partition=partition,
                        dtype=_DT[dtype], seq=a // chunk, fec_index=tag[0], fec_k=tag[1],
                        fec_m=tag[2], fec_group=tag[3])
        yield wire.encode(h, payload)


def control_body(it: int, lrs: list[float], clip_coef: float | None = None,
                 skip: bool = False, buffers: dict | None = None,
                 extra: dict | None = None) -> bytes:
    return json.dumps({"iteration": it, "lrs": lrs, "clip_coef": clip_coef, "skip": skip,
                       "buffers": buffers or {}, "extra": extra or {}}).encode()


def control_datagrams(job: int, it: int, body: bytes, frag: int = 1024, epoch: int = 0,
                      token: int = 0, partition: int = 0, secret: bytes | None = None,
                      mac: bool = True, run: str = "") -> Iterator[bytes]:
    """The control message ``body`` of ``it``, ending with its MAC, in fragments, each
    tagged; the keys are run ``run``'s ("" : the job secret's own)."""
    key = None
    if mac:
        rs = datamac.run_secret(_secret(secret), run)
        body = body + datamac.control_mac(datamac.control_key(rs), job, it, body)
        key = datamac.data_key(rs)
    for a in range(0, len(body), frag):
        part = body[a:a + frag]
        h = wire.Header(flags=wire.Flags.CONTROL, job_id=job, epoch=epoch, token=token,
                        iteration=it, offset=a, count=len(part), dtype=wire.DType.BYTES,
                        fec_group=len(body), partition=partition, crc32c=wire.crc(part))
        if key is not None:  # each fragment's own tag (checkmate.protocol.datamac)
            h = replace(h, seq=datamac.control_tag(key, wire.pack_header(h)))
        yield wire.encode(h, part)


def send_iteration(sock: socket.socket, addr: tuple[str, int], job: int, it: int,
                   partition: int, start: int, grad: np.ndarray, control: bytes,
                   **kw: Any) -> int:
    """Send a whole iteration (gradient then control); returns datagrams sent."""
    n = 0
    ctrl_kw = {k: kw[k] for k in ("epoch", "token", "secret", "mac", "run") if k in kw}
    for d in grad_datagrams(job, it, partition, start, grad, **kw):
        sock.sendto(d, addr)
        n += 1
    for d in control_datagrams(job, it, control, partition=partition, **ctrl_kw):
        sock.sendto(d, addr)
        n += 1
    return n
