"""Shadow <-> controller handshake messages (docs/protocol.md, "Handshake").

Handshake datagrams are ckm datagrams with the HANDSHAKE flag and a JSON payload
(dtype BYTES), sent to the controller's UDP port (config.CONTROLLER_PORT) on the switch's
address. Requests carry ``seq``; the reply echoes it with ACK (accepted) or NACK (refused,
payload ``{"op": "error", "reason": ...}``).

Operations:
- ``register`` (shadow → controller): ``{"op", "job", "partition", "host", "ip", "mac",
  "port"}``. The controller installs the entries that steer the partition's replicas to
  ``ip:port`` (replacing an earlier registration of that partition) and answers
  ``{"op": "registered", "job", "partition", "epoch", "token"}``. Every registration of a
  partition gets a new, larger epoch and a fresh random token.
- ``session`` (anyone → controller): ``{"op", "job"}`` → ``{"op": "session", "job",
  "partitions": {"<p>": {"epoch", "token", "ip", "port"}}}``, the current registrations.
  Trainers in host-replication mode use it to address and stamp their copies.

On the switch path the copy of a REPLICATE datagram gets the owning shadow's epoch and token
written into its header by the switch, so trainers never need to know them.
"""

from __future__ import annotations

import json
from typing import Any

from checkmate import wire


def request(job_id: int, seq: int, body: dict[str, Any], partition: int = 0) -> bytes:
    payload = json.dumps(body, sort_keys=True).encode()
    h = wire.Header(
        flags=wire.Flags.HANDSHAKE,
        job_id=job_id,
        seq=seq,
        partition=partition,
        dtype=wire.DType.BYTES,
        count=len(payload),
    )
    return wire.encode(h, payload)


def reply(req: wire.Header, body: dict[str, Any], ok: bool = True) -> bytes:
    payload = json.dumps(body, sort_keys=True).encode()
    flags = wire.Flags.HANDSHAKE | (wire.Flags.ACK if ok else wire.Flags.NACK)
    h = wire.Header(
        flags=flags,
        job_id=req.job_id,
        seq=req.seq,
        partition=req.partition,
        epoch=int(body.get("epoch", 0)),
        token=int(body.get("token", 0)),
        dtype=wire.DType.BYTES,
        count=len(payload),
    )
    return wire.encode(h, payload)


def parse(buf: bytes) -> tuple[wire.Header, dict[str, Any]]:
    """Header and JSON body of a handshake datagram; WireError for anything else."""
    h, payload = wire.decode(buf)
    if not h.flags & wire.Flags.HANDSHAKE:
        raise wire.WireError("not a handshake datagram")
    try:
        body = json.loads(bytes(payload))
    except ValueError:
        raise wire.WireError("handshake payload is not JSON") from None
    if not isinstance(body, dict) or "op" not in body:
        raise wire.WireError("handshake payload has no 'op'")
    return h, body
