"""Shadow side of the handshake: register with the controller, get the session epoch/token.

The controller may be starting at the same time as the shadow, or slow under load, so
requests are retried with exponential backoff (bounded by ``max_wait``) until a deadline.
Every try carries the same ``instance`` (this registration's random id) and ``seq`` and a
fresh nonce (the controller refuses replays): the controller answers a repeat of the
instance it registered with that same session, and a reply to any earlier try is accepted,
so retries converge on one registration instead of minting an epoch each. A NACK is a
definite refusal and is not retried. Replies must carry the MAC bound
to the request's nonce; a refusal without one can only say "not authenticated" (the
controller could not verify the request: a different job secret) and is reported as such.
"""

from __future__ import annotations

import logging
import secrets
import socket
import time

from checkmate.control.pfc import mark_ckm
from checkmate.errors import CheckmateError
from checkmate.protocol import auth, handshake, wire

log = logging.getLogger("checkmate.shadow")


def register(
    secret: bytes,
    controller: tuple[str, int],
    job: int,
    partition: int,
    host: str,
    ip: str,
    mac: str,
    port: int,
    deadline_s: float = 30.0,
    first_wait: float = 0.2,
    max_wait: float = 2.0,
) -> tuple[int, int]:
    """(epoch, token) of a new registration of ``partition``; CheckmateError on failure."""
    body = {"op": "register", "job": job, "partition": partition, "host": host, "ip": ip,
            "mac": mac, "port": port, "instance": secrets.token_hex(8)}
    key = auth.handshake_key(secret)
    end = time.monotonic() + deadline_s
    wait, seq, tries = first_wait, secrets.randbits(31), 0
    nonces: list[str] = []
    with mark_ckm(socket.socket(socket.AF_INET, socket.SOCK_DGRAM)) as s:
        while True:
            tries += 1
            req, nonce = handshake.request(key, job, seq, body, partition)
            nonces.append(nonce)
            try:
                s.sendto(req, controller)
            except OSError as e:
                log.warning("register: cannot send to %s:%d: %s", *controller, e)
            reply = handshake.await_reply(s, seq, key, nonces,
                                          min(wait, max(end - time.monotonic(), 0.01)))
            if reply is not None:
                h, rb = reply.header, reply.body
                if h.flags & wire.Flags.NACK:
                    raise CheckmateError(f"controller {controller[0]}:{controller[1]} refused "
                                         f"registration: {rb.get('reason', rb)}")
                if rb.get("op") == "registered" and isinstance(rb.get("epoch"), int) \
                        and isinstance(rb.get("token"), int):
                    log.info("registered partition %d: epoch %d", partition, rb["epoch"])
                    return rb["epoch"], rb["token"]
                raise CheckmateError(f"controller answered register with {rb!r}")
            if time.monotonic() >= end:
                raise CheckmateError(f"controller {controller[0]}:{controller[1]} did not "
                                     f"answer {tries} register attempts in {deadline_s:.0f}s")
            wait = min(wait * 2, max_wait)
