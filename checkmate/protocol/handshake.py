"""Shadow <-> controller handshake messages (docs/protocol.md, "Handshake").

Handshake datagrams are ckm datagrams with the HANDSHAKE flag, sent to the controller's UDP
port (config.CONTROLLER_PORT) on the switch's address. The payload is a JSON object followed
by a 32-byte MAC over the header (all but its CRC) and the JSON (checkmate.protocol.auth): requests
carry ``seq`` in the header and ``nonce`` and ``ts`` (Unix milliseconds) in the JSON, and
the reply echoes ``seq`` with ACK (accepted) or
NACK (refused, ``{"op": "error", "reason": ...}``). A reply's MAC binds it to the request's
nonce. A refusal of a request that did not verify cannot prove anything: its MAC is 32 zero
bytes and its reason is only "not authenticated".

Operations (both need a valid MAC):
- ``register`` (shadow → controller): ``{"op", "job", "partition", "host", "ip", "mac",
  "port"}``. ``host`` must be one of the config's shadows for ``partition`` (each replica
  registers for itself), ``ip`` its configured address and the datagram must come from
  that address. The controller installs the entries that steer that shadow's copies to
  ``ip:port`` (replacing an earlier registration of that host) and answers ``{"op":
  "registered", "job", "partition", "epoch", "token"}``. Every registration gets a new,
  larger epoch and a fresh random token.
- ``session`` (trainer → controller): ``{"op", "job"}`` → ``{"op": "session", "job",
  "partitions": {"<p>": {"epoch", "token", "ip", "port", "host"}}, "replicas": {"<p>":
  [{..., "replica"}]}}``, the current registrations: per partition its first registered
  shadow, and every registered shadow with its replica number.
- ``attempt`` (a launcher's rank 0 → controller): ``{"op", "job", "attempt", "ranks"}`` (or
  ``"rings"``, one per data-parallel group), and, for a config of co-located shadows
  (``colocated: true``, which do not register), ``"shadows": [["IP:PORT", ...], ...]``:
  per partition, every replica's UDP address on its trainer node. The controller programs
  the ring hops (and the copies to those addresses) under one new epoch and answers the
  sessions as ``session`` does (a co-located replica's entry adds its ``"node"``).

On the switch path the copy of a REPLICATE datagram gets the owning shadow's epoch and token
written into its header by the switch, so trainers never need to know them.
"""

from __future__ import annotations

import hmac
import json
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from checkmate.protocol import auth, jsonbound, wire

#: A refusal's MAC when the request could not be verified.
NO_MAC = bytes(auth.MAC_BYTES)


@dataclass
class Message:
    """A parsed handshake datagram: header, JSON body, the JSON's bytes and the MAC."""

    header: wire.Header
    body: dict[str, Any]
    raw: bytes
    mac: bytes


def request(key: bytes, job_id: int, seq: int, body: dict[str, Any],
            partition: int = 0) -> tuple[bytes, str]:
    """An authenticated request and its nonce (which the reply's MAC must bind)."""
    nonce = auth.new_nonce()
    raw = json.dumps({**body, "nonce": nonce, "ts": auth.now_ms()}, sort_keys=True).encode()
    return _datagram(wire.Flags.HANDSHAKE, job_id, seq, partition, raw,
                     lambda head: auth.request_mac(key, head, raw)), nonce


def reply(key: bytes, req: Message, body: dict[str, Any], ok: bool = True) -> bytes:
    """The answer to a verified request, bound to its nonce."""
    raw = json.dumps(body, sort_keys=True).encode()
    h = req.header
    flags = wire.Flags.HANDSHAKE | (wire.Flags.ACK if ok else wire.Flags.NACK)
    nonce = str(req.body.get("nonce"))
    return _datagram(flags, h.job_id, h.seq, h.partition, raw,
                     lambda head: auth.reply_mac(key, head, nonce, raw),
                     int(body.get("epoch", 0)), int(body.get("token", 0)))


def refusal(req: wire.Header, reason: str = "not authenticated") -> bytes:
    """A NACK that proves nothing (zero MAC): only for requests that did not verify."""
    raw = json.dumps({"op": "error", "reason": reason}, sort_keys=True).encode()
    return _datagram(wire.Flags.HANDSHAKE | wire.Flags.NACK, 0, req.seq, 0, raw,
                     lambda head: NO_MAC)


def _datagram(flags: int, job: int, seq: int, partition: int, raw: bytes,
              mac_of: Callable[[bytes], bytes], epoch: int = 0, token: int = 0) -> bytes:
    """The datagram; ``mac_of`` gets the header bytes the MAC covers (all but the CRC)."""
    h = wire.Header(flags=flags, job_id=job, seq=seq, partition=partition, epoch=epoch,
                    token=token, dtype=wire.DType.BYTES, count=len(raw) + auth.MAC_BYTES)
    return wire.encode(h, raw + mac_of(wire.pack_header(h)))


def parse(buf: bytes) -> Message:
    """Header, JSON body and MAC of a handshake datagram; WireError for anything else."""
    h, payload = wire.decode(buf)
    if not h.flags & wire.Flags.HANDSHAKE:
        raise wire.WireError("not a handshake datagram")
    payload = bytes(payload)
    if len(payload) <= auth.MAC_BYTES:
        raise wire.WireError("handshake payload too short for its MAC")
    raw, mac = payload[:-auth.MAC_BYTES], payload[-auth.MAC_BYTES:]
    try:
        body = jsonbound.loads(raw, len(raw))  # depth-bounded: a datagram is short anyway
    except jsonbound.JsonBoundError:
        raise wire.WireError("handshake payload is not JSON of at most "
                             f"{jsonbound.MAX_DEPTH} levels") from None
    if not isinstance(body, dict) or "op" not in body:
        raise wire.WireError("handshake payload has no 'op'")
    return Message(h, body, raw, mac)


def verify_request(key: bytes, m: Message, guard: auth.ReplayGuard) -> None:
    """AuthError unless ``m`` is a fresh request made with ``key``."""
    want = auth.request_mac(key, wire.pack_header(m.header), m.raw)
    if not hmac.compare_digest(want, m.mac):
        raise auth.AuthError("bad MAC")
    guard.check(m.body.get("nonce"), m.body.get("ts"))


def verify_reply(key: bytes, m: Message, nonce: str) -> bool:
    """True if ``m`` answers the request that carried ``nonce`` and was made with ``key``."""
    return hmac.compare_digest(auth.reply_mac(key, wire.pack_header(m.header), nonce, m.raw),
                               m.mac)


def await_reply(sock: socket.socket, seq: int, key: bytes, nonces: list[str],
                timeout: float) -> Message | None:
    """The reply to request ``seq`` (made with one of ``nonces``) within ``timeout``, or
    None. Other datagrams, and replies without a MAC bound to one of the nonces, are
    ignored, except a refusal of an unverifiable request: that is final, and comes back as
    a NACK whose reason says the job secrets differ."""
    end = time.monotonic() + timeout
    while (left := end - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            data = sock.recv(65536)
        except (TimeoutError, BlockingIOError):
            return None
        except OSError:
            # e.g. ECONNREFUSED from an ICMP port-unreachable: nobody listens yet
            time.sleep(min(left, 0.05))
            continue
        try:
            m = parse(data)
        except wire.WireError:
            continue
        if m.header.seq != seq:
            continue
        if any(verify_reply(key, m, n) for n in nonces):
            return m
        if m.header.flags & wire.Flags.NACK and m.mac == NO_MAC:
            m.body = {"op": "error", "reason": "not authenticated (is the job secret the "
                                               "same on both sides?)"}
            return m
    return None
